"""PipeDream with vertical sync: every stage reads the weight version stage 0 used for the
microbatch (see `pipedream`)."""

from __future__ import annotations

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules import pipedream
from pipedream_fast.schedules.common import Config
from pipedream_fast.schedules.registry import STALENESS, ScheduleKind, register


def generate(config: Config) -> Schedule:
    return pipedream.generate(config, vertical_sync=True)


register(ScheduleKind(
    name="pipedream-vsync", order=3, generate=generate, options=pipedream._options,
    automatic=True, own_options=(STALENESS,),
    chunked_steps=False, plans_as="pipedream",
    summary="PipeDream where every stage reads the version stage 0 used (vertical sync)",
    weight_versions=lambda noam: noam, stashed=lambda noam, microbatches: noam))
