"""PipeDream with vertical sync: every stage runs a microbatch on the weight version stage 0
used for it (see `pipedream.generate`)."""

from __future__ import annotations

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules import pipedream
from pipedream_fast.schedules.common import Config


def generate(config: Config) -> Schedule:
    return pipedream.generate(config, vertical_sync=True)
