"""Stage <-> rank placement: which ranks hold a stage, which stages a rank holds, and which
replica of a stage takes a microbatch.

`stage_ranks[s]` lists the ranks that replicate stage s; a rank may hold several stages
(interleaved placements), and the replicas of a stage take its microbatches round-robin.
`Placement` answers these questions once for every class that holds a `stage_ranks` table
(`Schedule`, the generators' `Layout` derive from it); elsewhere, `Placement(stage_ranks)`.
"""

from __future__ import annotations

from collections.abc import Iterable


class Placement:
    """Placement queries over `self.stage_ranks` (stage -> the ranks that replicate it)."""

    stage_ranks: tuple[tuple[int, ...], ...]

    def __init__(self, stage_ranks: Iterable[Iterable[int]]) -> None:
        self.stage_ranks = tuple(tuple(ranks) for ranks in stage_ranks)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, in order (several in interleaved placements)."""
        return tuple(s for s, ranks in enumerate(self.stage_ranks) if rank in ranks)

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs `microbatch` on `stage` (replicas take them round-robin)."""
        ranks = self.stage_ranks[stage]
        return ranks[microbatch % len(ranks)]

    @property
    def num_ranks(self) -> int:
        """How many ranks hold a stage."""
        return len({r for ranks in self.stage_ranks for r in ranks})
