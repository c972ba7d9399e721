"""Which ranks run which stage, and which microbatches each stage replica takes.

A rank may hold several stages (interleaved placements); a stage may be replicated on
several ranks, whose replicas take its microbatches round-robin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Stage -> ranks; microbatch m goes to replica m mod r of every stage."""

    num_stages: int
    num_microbatches: int
    stage_ranks: tuple[tuple[int, ...], ...]

    @property
    def num_ranks(self) -> int:
        return len({r for ranks in self.stage_ranks for r in ranks})

    def replicas(self, stage: int) -> int:
        return len(self.stage_ranks[stage])

    def rank_of(self, stage: int, mb: int) -> int:
        return self.stage_ranks[stage][mb % self.replicas(stage)]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, ranks in enumerate(self.stage_ranks) if rank in ranks)

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
