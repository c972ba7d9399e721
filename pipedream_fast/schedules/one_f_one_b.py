"""1F1B with a flush (PipeDream-Flush / Megatron's schedule): per minibatch, each replica
warms up with min(NOAM, its microbatches) forwards, alternates backward/forward, drains, and
the stage steps once with the averaged gradients. Same weights and result as GPipe, but only
NOAM microbatches stashed instead of the whole minibatch."""

from __future__ import annotations

from collections.abc import Iterator

from pipedream_fast.ir import Action, Schedule
from pipedream_fast.schedules.common import Config, Program, build, one_f_one_b
from pipedream_fast.schedules.registry import ScheduleKind, flush_options, register


def generate(config: Config, name: str = "1f1b") -> Schedule:
    layout = config.layout

    def compute(rank: int) -> Iterator[Action]:
        s, i = layout.only_stage(rank, name)
        r, noam, p = layout.replicas(s), layout.noam(s), Program(s)
        for g in range(config.num_groups()):
            group = config.group(g)
            for kind, m in one_f_one_b(group[(i - group.start) % r::r], noam):
                yield p.forward(m) if kind == "F" else p.backward(m)
            yield from p.step(group, replicated=r > 1)

    ranks = range(layout.num_ranks)
    inflight = {}
    for rank in ranks:
        s, i = layout.only_stage(rank, name)
        inflight[rank] = min(layout.noam(s), config.most_local(s, i))
    return build(name, config, compute, dict.fromkeys(ranks, 1), inflight)


register(ScheduleKind(
    name="1f1b", order=1, generate=generate, options=flush_options, synchronous=True,
    automatic=True,
    summary="one forward, one backward, flushed: one update per step (PipeDream-Flush)",
    weight_versions=lambda noam: 1, stashed=lambda noam, microbatches: min(noam, microbatches)))
