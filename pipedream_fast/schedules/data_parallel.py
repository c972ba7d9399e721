"""Data parallelism: a single stage (the whole model) replicated on every worker. It is 1F1B
with one stage (NOAM = 1, so each worker runs forward, backward, forward, ...) and an
all-reduce before every step; one step per minibatch of `chunks`."""

from __future__ import annotations

from pipedream_fast.ir import Schedule
from pipedream_fast.schedules import one_f_one_b
from pipedream_fast.schedules.common import Config
from pipedream_fast.schedules.registry import ScheduleKind, flush_options, register


def generate(config: Config) -> Schedule:
    if config.layout.num_stages != 1:
        raise ValueError(f"data-parallel runs the whole model as one stage on every worker; got "
                         f"{config.layout.num_stages} stages: use 1 stage and replicas=[workers] "
                         f"(CLI: --stages 1 --replicas W)")
    return one_f_one_b.generate(config, name="data-parallel")


register(ScheduleKind(
    name="data-parallel", order=6, generate=generate, options=flush_options, synchronous=True,
    automatic=True,
    summary="the whole model on every worker, gradients all-reduced every step",
    plans_as="1f1b", planning={"strategy": "data-parallel"}, weight_versions=lambda noam: 1,
    stashed=lambda noam, microbatches: 1))
