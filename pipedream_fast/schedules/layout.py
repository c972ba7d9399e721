"""Which ranks run which stage, and which microbatches each stage replica takes.

A rank may hold several stages (interleaved placements); a stage may be replicated on
several ranks, whose replicas take its microbatches round-robin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipedream_fast.ir.placement import Placement


@dataclass(frozen=True)
class Layout(Placement):
    """Stage -> ranks; microbatch m goes to replica m mod r of every stage (`rank_of`,
    `stages_of` and `num_ranks` come from `pipedream_fast.ir.placement`)."""

    num_stages: int
    num_microbatches: int
    stage_ranks: tuple[tuple[int, ...], ...]

    def replicas(self, stage: int) -> int:
        return len(self.stage_ranks[stage])

    def local_mbs(self, stage: int, replica: int) -> range:
        return range(replica, self.num_microbatches, self.replicas(stage))

    def only_stage(self, rank: int, schedule: str) -> tuple[int, int]:
        """(stage, replica index) of a rank that holds exactly one stage."""
        stages = self.stages_of(rank)
        if len(stages) != 1:
            raise ValueError(f"{schedule} runs one stage per rank, but rank {rank} holds stages "
                             f"{list(stages)}; use interleaved-1f1b for several stages per rank")
        return stages[0], self.stage_ranks[stages[0]].index(rank)

    def noam(self, stage: int) -> int:
        """PipeDream's NUM_OPT_ACTIVE_MINIBATCHES: ceil(workers from this stage on / replicas)."""
        behind = sum(self.replicas(s) for s in range(stage, self.num_stages))
        return math.ceil(behind / self.replicas(stage))
