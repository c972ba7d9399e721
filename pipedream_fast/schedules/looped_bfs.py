"""Looped breadth-first pipeline (Lamy-Poirier, "Breadth-First Pipeline Parallelism"),
flushed every step.

Placement: the looped one of interleaved 1F1B, p ranks holding v stages each, stage g on rank
g mod p (`make_schedule(..., stages_per_rank=v)`). Breadth first: each rank forwards all the
step's microbatches through its first stage, then all of them through its next stage, and so
on; then it runs the backwards the same way, its last stage first. Each stage then steps once
on the averaged gradients (the result of gradient accumulation). Every rank stashes the
whole step on each of its stages, as GPipe does, and in return a step holds any number of
microbatches (no rounds of p, unlike interleaved 1F1B) and each stage's weights are used
for a whole run of microbatches in a row.

With a forward and a backward of one unit per stage, m microbatches per step and m >= p, the
looped pipeline idles 2(p - 1) units per step: the same fill and drain as GPipe on p stages
of one unit, so v times less than GPipe with the model cut into p stages of v units (the
paper's bubble, (p - 1) / (v m) of the step's work). With m < p a rank waits, before each of
its next stages, for its first microbatch to come round the loop (p units after it left):
a step then takes 2((v - 1) p + m + p - 1) (tests/test_new_schedules.py derives both).

On any other placement (one stage per rank, replicated stages) the same rule applies: each
rank forwards its microbatches stage by stage in stage order, and backwards in reverse; on a
plain pipeline that is GPipe.
"""

from __future__ import annotations

from collections.abc import Iterator

from pipedream_fast.ir import Action, Schedule
from pipedream_fast.schedules.common import Config, Program, build
from pipedream_fast.schedules.registry import ScheduleKind, flush_options, register

NAME = "looped-bfs"


def generate(config: Config) -> Schedule:
    layout = config.layout

    def compute(rank: int) -> Iterator[Action]:
        stages = layout.stages_of(rank)
        programs = {s: Program(s) for s in stages}
        mine = {s: layout.stage_ranks[s].index(rank) for s in stages}
        for g in range(config.num_groups()):
            group = config.group(g)
            share = {s: group[(mine[s] - group.start) % layout.replicas(s)::layout.replicas(s)]
                     for s in stages}  # a replica's microbatches, round-robin
            for s in stages:  # breadth first: a whole stage's microbatches, then the next
                yield from (programs[s].forward(mb) for mb in share[s])
            for s in reversed(stages):
                yield from (programs[s].backward(mb) for mb in share[s])
            for s in reversed(stages):
                yield from programs[s].step(group, replicated=layout.replicas(s) > 1)

    ranks = range(layout.num_ranks)
    inflight = {}
    for rank in ranks:
        stages = layout.stages_of(rank)
        inflight[rank] = sum(config.most_local(s, layout.stage_ranks[s].index(rank))
                             for s in stages)
    return build(NAME, config, compute, {r: len(layout.stages_of(r)) for r in ranks}, inflight,
                 early_inputs=True)


register(ScheduleKind(
    name=NAME, order=10, generate=generate, options=flush_options, synchronous=True,
    summary="looped breadth-first: v looped stages per rank, each run over the whole step "
            "in turn, bubble / v, flushed every step",
    plans_as="gpipe", planning={"stages_per_rank": 2}, weight_versions=lambda noam: 1,
    stashed=lambda noam, microbatches: microbatches))
