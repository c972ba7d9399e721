"""ZB-H1, zero-bubble 1F1B at 1F1B's memory (Qi et al., "Zero Bubble Pipeline Parallelism"),
flushed every step.

The backward is split: BACKWARD_INPUT (I) makes the input gradient, which the stage before
waits for, and BACKWARD_WEIGHT (W) the weight gradient, which nobody waits for. Each replica
runs 1F1B with I in place of B, so input gradients race back through the pipeline, and puts
off each W by d microbatches, where d = NOAM_0 - NOAM of the stage (0 where a replicated first
stage has the smaller NOAM): the stages that 1F1B leaves with few microbatches in flight keep
more, up to stage 0's NOAM, so no stage stashes more than the first one does under 1F1B. The
held-back W's fill what would be idle time, and the last ones run at the end of the step,
before the update. With equal forward, input-gradient and weight-gradient costs the bubble is
a third of 1F1B's (tests/test_schedules.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pipedream_fast.ir import Action, Schedule
from pipedream_fast.schedules.common import Config, Program, build
from pipedream_fast.schedules.registry import ScheduleKind, flush_options, register


def zb_order(mbs: Sequence[int], warmup: int, delay: int) -> Iterator[tuple[str, int]]:
    """('F'|'I'|'W', mb): `warmup` forwards, then for each microbatch its I, the W held back
    `delay` microbatches, and the next forward; the held-back W's drain at the end."""
    warmup = max(1, min(warmup, len(mbs)))
    for m in mbs[:warmup]:
        yield "F", m
    for i, m in enumerate(mbs):
        yield "I", m
        if i - delay >= 0:
            yield "W", mbs[i - delay]
        if warmup + i < len(mbs):
            yield "F", mbs[warmup + i]
    for m in mbs[max(0, len(mbs) - delay):]:
        yield "W", m


def generate(config: Config, name: str = "zb-h1") -> Schedule:
    layout = config.layout

    def compute(rank: int) -> Iterator[Action]:
        s, i = layout.only_stage(rank, name)
        r, noam, p = layout.replicas(s), layout.noam(s), Program(s)
        delay = max(0, layout.noam(0) - noam)
        for g in range(config.num_groups()):
            group = config.group(g)
            for kind, m in zb_order(group[(i - group.start) % r::r], noam, delay):
                if kind == "F":
                    yield p.forward(m)
                else:
                    yield p.backward_input(m) if kind == "I" else p.backward_weight(m)
            yield from p.step(group, replicated=r > 1)

    ranks = range(layout.num_ranks)
    inflight = {}
    for rank in ranks:
        s, i = layout.only_stage(rank, name)
        inflight[rank] = min(max(layout.noam(0), layout.noam(s)), config.most_local(s, i))
    return build(name, config, compute, dict.fromkeys(ranks, 1), inflight)


register(ScheduleKind(
    name="zb-h1", order=8, generate=generate, options=flush_options, synchronous=True,
    automatic=True,
    summary="zero-bubble H1: 1F1B with the weight gradients put off into the bubbles",
    plans_as="1f1b", split_backward=True, weight_versions=lambda noam: 1,
    stashed=lambda noam, microbatches: min(noam, microbatches)))
