"""Forward passes only, for evaluation and inference (not a training schedule, so it is not
registered): every rank runs its stages' forwards of each microbatch in microbatch order,
stage replicas taking microbatches round-robin as in training. Nothing is stashed and no
weights change, so there are no backwards, versions or updates; the communication pass adds
the sends and receives as for any schedule."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pipedream_fast.ir import Action, Schedule, forward
from pipedream_fast.schedules.common import Config, build
from pipedream_fast.schedules.layout import Layout

NAME = "forward-only"


def forward_only(stage_ranks: Sequence[Sequence[int]], num_microbatches: int) -> Schedule:
    """The forwards of `num_microbatches` microbatches through stages placed on `stage_ranks`."""
    layout = Layout(len(stage_ranks), num_microbatches,
                    tuple(tuple(int(r) for r in ranks) for ranks in stage_ranks))

    def compute(rank: int) -> Iterator[Action]:
        stages = layout.stages_of(rank)
        for mb in range(num_microbatches):  # (microbatch, stage) order: never waits on a later one
            for s in stages:
                if layout.rank_of(s, mb) == rank:
                    yield forward(s, mb, 0)

    ranks = range(layout.num_ranks)
    schedule = build(NAME, Config(layout), compute,
                     {r: len(layout.stages_of(r)) for r in ranks},
                     {r: num_microbatches * len(layout.stages_of(r)) for r in ranks},
                     gradients=False)
    schedule.params["forward_only"] = True  # the validator expects no backwards
    return schedule
