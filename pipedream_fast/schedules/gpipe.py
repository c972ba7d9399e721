"""GPipe (fill-drain): each replica forwards all its microbatches of a minibatch, then
backwards them all, then the stage takes one step with the averaged gradients. One weight
version; every microbatch of the minibatch stays stashed until the drain."""

from __future__ import annotations

from collections.abc import Iterator

from pipedream_fast.ir import Action, Schedule
from pipedream_fast.schedules.common import Config, Program, build
from pipedream_fast.schedules.registry import ScheduleKind, flush_options, register


def generate(config: Config) -> Schedule:
    layout = config.layout

    def compute(rank: int) -> Iterator[Action]:
        s, i = layout.only_stage(rank, "gpipe")
        r, p = layout.replicas(s), Program(s)
        for g in range(config.num_groups()):
            group = config.group(g)
            local = group[(i - group.start) % r::r]
            yield from (p.forward(m) for m in local)
            yield from (p.backward(m) for m in local)
            yield from p.step(group, replicated=r > 1)

    ranks = range(layout.num_ranks)
    inflight = {rank: config.most_local(*layout.only_stage(rank, "gpipe")) for rank in ranks}
    return build("gpipe", config, compute, dict.fromkeys(ranks, 1), inflight)


register(ScheduleKind(
    name="gpipe", order=0, generate=generate, options=flush_options, synchronous=True,
    automatic=True,
    summary="fill-drain: all forwards, all backwards, one update per step (GPipe)",
    weight_versions=lambda noam: 1, stashed=lambda noam, microbatches: microbatches))
