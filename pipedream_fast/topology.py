"""Hierarchical cluster topology, innermost level first (PipeDream §3.1).

`4x12.5e9,4x1.25e9` reads: groups of 4 workers joined at 12.5 GB/s (a server), and 4 such
groups joined at 1.25 GB/s (the cluster): 16 workers. Ranks are numbered so that the
innermost groups are contiguous: ranks 0-3 share a server, 4-7 the next, and so on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class TopologyError(ValueError):
    """A topology description is malformed or inconsistent."""


@dataclass(frozen=True)
class Level:
    """`count` units of the level below (workers, for the innermost) joined at `bandwidth` B/s."""

    count: int
    bandwidth: float


@dataclass(frozen=True)
class Topology:
    levels: tuple[Level, ...]
    memory_per_worker: int | None = None  # bytes; None = unlimited

    def __post_init__(self) -> None:
        if not self.levels:
            raise TopologyError("a topology needs at least one level, e.g. '4x12.5e9'")
        for depth, level in enumerate(self.levels):
            if isinstance(level.count, bool) or not isinstance(level.count, int) or level.count < 1:
                raise TopologyError(f"topology level {depth}: worker count must be a positive "
                                    f"integer, got {level.count!r}")
            if not (isinstance(level.bandwidth, (int, float)) and math.isfinite(level.bandwidth)
                    and level.bandwidth > 0):
                raise TopologyError(f"topology level {depth}: bandwidth must be a positive number "
                                    f"of bytes/s, got {level.bandwidth!r}")
        if self.memory_per_worker is not None and self.memory_per_worker <= 0:
            raise TopologyError(f"memory per worker must be positive bytes, got {self.memory_per_worker}")

    @property
    def workers(self) -> int:
        return math.prod(level.count for level in self.levels)

    def group_size(self, depth: int) -> int:
        """Workers inside one unit of level `depth` (all of levels 0..depth multiplied)."""
        return math.prod(level.count for level in self.levels[: depth + 1])

    def bandwidth_between(self, rank_a: int, rank_b: int) -> float:
        """Bandwidth of the innermost level whose group holds both ranks (inf for the same rank)."""
        for rank in (rank_a, rank_b):
            if not 0 <= rank < self.workers:
                raise TopologyError(f"rank {rank} is outside the topology's {self.workers} workers")
        if rank_a == rank_b:
            return math.inf
        for depth, level in enumerate(self.levels):
            size = self.group_size(depth)
            if rank_a // size == rank_b // size:
                return float(level.bandwidth)
        raise AssertionError("unreachable: the outermost level holds every rank")

    def slowest_bandwidth(self, ranks: Sequence[int]) -> float:
        """The bandwidth of the narrowest link an all-reduce among `ranks` must cross."""
        ranks = list(ranks)
        if len(ranks) < 2:
            return math.inf
        return min(self.bandwidth_between(ranks[0], r) for r in ranks[1:])

    @classmethod
    def parse(cls, text: str, memory_per_worker: int | None = None) -> Topology:
        """Parse the CLI shorthand `COUNTxBANDWIDTH[,COUNTxBANDWIDTH...]`, innermost first."""
        levels = []
        for part in text.split(","):
            count_text, sep, bandwidth_text = part.strip().lower().partition("x")
            try:
                if not sep:
                    raise ValueError
                count = int(count_text)
                bandwidth = float(bandwidth_text)
            except ValueError:
                raise TopologyError(
                    f"cannot read topology level {part.strip()!r} in {text!r}: expected "
                    f"COUNTxBANDWIDTH such as '4x12.5e9' (4 workers at 12.5 GB/s)") from None
            levels.append(Level(count, bandwidth))
        return cls(tuple(levels), memory_per_worker)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"levels": [{"workers": level.count, "bandwidth": level.bandwidth}
                                          for level in self.levels]}
        if self.memory_per_worker is not None:
            out["memory_per_worker"] = self.memory_per_worker
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Topology:
        try:
            levels = tuple(Level(int(level["workers"]), float(level["bandwidth"]))
                           for level in data["levels"])
            memory = data.get("memory_per_worker")
        except (KeyError, TypeError, ValueError) as err:
            raise TopologyError(f"malformed topology object {data!r}: expected "
                                f"{{'levels': [{{'workers': int, 'bandwidth': float}}, ...]}}") from err
        return cls(levels, None if memory is None else int(memory))

    def __str__(self) -> str:
        return ",".join(f"{level.count}x{level.bandwidth:g}" for level in self.levels)
