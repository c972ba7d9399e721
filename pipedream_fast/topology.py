"""Hierarchical cluster topology, innermost level first (PipeDream §3.1).

`4x12.5e9,4x1.25e9` reads: groups of 4 workers joined at 12.5 GB/s (a server), and 4 such
groups joined at 1.25 GB/s (the cluster): 16 workers. Ranks are numbered so that the
innermost groups are contiguous: ranks 0-3 share a server, 4-7 the next, and so on.

Heterogeneous workers: options after `@` give one value per worker, in rank order.
`2x1e9@speeds=1,0.5@memory=8e9,4e9` reads: 2 workers at 1 GB/s, rank 1 computes at half the
profiled speed (takes twice as long) and holds 4 GB, rank 0 holds 8 GB. A speed is relative to
the profile (1.0 = as profiled); a worker's memory limit is the smaller of its own and
`memory_per_worker` (the CLI's --memory-per-worker) where both are given.
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
    speeds: tuple[float, ...] | None = None    # per rank, relative to the profile; None = all 1
    memories: tuple[int, ...] | None = None    # per rank, bytes; None = memory_per_worker

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
        for name, values in (("speeds", self.speeds), ("memory", self.memories)):
            if values is None:
                continue
            if len(values) != self.workers:
                raise TopologyError(f"topology {name}: expected one value per worker ("
                                    f"{self.workers}), got {len(values)}: {list(values)}")
            for rank, value in enumerate(values):
                if isinstance(value, bool) or not (isinstance(value, (int, float))
                                                   and math.isfinite(value) and value > 0):
                    raise TopologyError(f"topology {name}: the value of rank {rank} must be a "
                                        f"positive number, got {value!r}")

    @property
    def heterogeneous(self) -> bool:
        """Whether workers differ (or run at other than the profiled speed): such topologies
        are planned by `planner.hetero`, identical workers by the hierarchical DP."""
        return (any(s != 1.0 for s in self.speeds or ()) or
                len({self.memory_of(r) for r in range(self.workers)}) > 1)

    def speed_of(self, rank: int) -> float:
        return 1.0 if self.speeds is None else float(self.speeds[rank])

    def memory_of(self, rank: int) -> int | None:
        """Rank's memory limit in bytes (None: unlimited): the smaller of its own and
        `memory_per_worker`."""
        own = None if self.memories is None else int(self.memories[rank])
        limits = [m for m in (own, self.memory_per_worker) if m is not None]
        return min(limits) if limits else None

    @property
    def uniform_memory(self) -> int | None:
        """Every worker's memory limit when they are all the same (what the DP plans with)."""
        limits = {self.memory_of(r) for r in range(self.workers)}
        if len(limits) != 1:
            raise TopologyError(f"the workers of {self} have different memory limits")
        return limits.pop()

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
        """The bandwidth of the narrowest link between any two of `ranks` (inf for one rank):
        what the planner's slowest-link model runs an all-reduce among them at.

        A level's link joins two ranks that share a group of that level but not of the level
        below, so the level counts when some group of it holds ranks from two of its
        subgroups. The level of the rank pair that spans the most is not enough when an inner
        level is slower than an outer one (`2x1e9,2x4e9`: ranks 1, 2, 3 cross 2-3 at 1 GB/s,
        though 1-2 and 1-3 run at 4 GB/s)."""
        ranks = sorted(set(ranks))
        for rank in ranks:
            if not 0 <= rank < self.workers:
                raise TopologyError(f"rank {rank} is outside the topology's {self.workers} workers")
        slowest, inner = math.inf, 1  # inner: the size of the groups of the level below
        for depth, level in enumerate(self.levels):
            size = self.group_size(depth)
            first_subgroup: dict[int, int] = {}
            for rank in ranks:
                if first_subgroup.setdefault(rank // size, rank // inner) != rank // inner:
                    slowest = min(slowest, float(level.bandwidth))
                    break
            inner = size
        return slowest

    @classmethod
    def parse(cls, text: str, memory_per_worker: int | None = None) -> Topology:
        """Parse the CLI shorthand `COUNTxBANDWIDTH[,COUNTxBANDWIDTH...]`, innermost first,
        then optionally `@speeds=S0,S1,...` and `@memory=M0,M1,...` (one value per rank)."""
        levels_text, *options = text.split("@")
        per_rank: dict[str, tuple[float, ...]] = {}
        for option in options:
            key, sep, values_text = option.strip().partition("=")
            key = key.strip().lower()
            if not sep or key not in ("speeds", "memory"):
                raise TopologyError(
                    f"cannot read topology option {option.strip()!r} in {text!r}: expected "
                    f"'speeds=S0,S1,...' or 'memory=BYTES0,BYTES1,...', one value per worker")
            if key in per_rank:
                raise TopologyError(f"topology option {key!r} is given twice in {text!r}")
            values = []
            for rank, value in enumerate(values_text.split(",")):
                try:
                    values.append(float(value))
                except ValueError:
                    raise TopologyError(
                        f"cannot read value {value.strip()!r} (rank {rank}) of topology option "
                        f"{key!r} in {text!r}: expected a number such as 0.5 or 8e9") from None
            per_rank[key] = tuple(values)
        memories = per_rank.get("memory")
        if memories is not None and not all(math.isfinite(m) and m == int(m) for m in memories):
            raise TopologyError(f"topology memory: expected whole bytes per worker, got "
                                f"{list(memories)} in {text!r}")
        levels = []
        for part in levels_text.split(","):
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
        return cls(tuple(levels), memory_per_worker, per_rank.get("speeds"),
                   None if memories is None else tuple(int(m) for m in memories))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"levels": [{"workers": level.count, "bandwidth": level.bandwidth}
                                          for level in self.levels]}
        if self.memory_per_worker is not None:
            out["memory_per_worker"] = self.memory_per_worker
        if self.speeds is not None:
            out["speeds"] = list(self.speeds)
        if self.memories is not None:
            out["worker_memory"] = list(self.memories)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Topology:
        try:
            levels = tuple(Level(int(level["workers"]), float(level["bandwidth"]))
                           for level in data["levels"])
            memory = data.get("memory_per_worker")
            speeds = data.get("speeds")
            speeds = None if speeds is None else tuple(float(s) for s in speeds)
            memories = data.get("worker_memory")
            memories = None if memories is None else tuple(int(m) for m in memories)
        except (KeyError, TypeError, ValueError) as err:
            raise TopologyError(f"malformed topology object {data!r}: expected "
                                f"{{'levels': [{{'workers': int, 'bandwidth': float}}, ...]}}, "
                                f"optionally 'speeds' and 'worker_memory' lists") from err
        return cls(levels, None if memory is None else int(memory), speeds, memories)

    def __str__(self) -> str:
        out = ",".join(f"{level.count}x{level.bandwidth:g}" for level in self.levels)
        if self.speeds is not None:
            out += "@speeds=" + ",".join(repr(float(s)) for s in self.speeds)
        if self.memories is not None:
            out += "@memory=" + ",".join(str(int(m)) for m in self.memories)
        return out
