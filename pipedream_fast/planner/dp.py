"""PipeDream's hierarchical dynamic program (PipeDream, §3.1), with replication and memory.

Level by level, innermost first. At level k, a *unit* is one group of the level below (a single
worker at level 0), and `U(i, j)` is the bottleneck of the best pipeline of blocks [i, j) inside
one unit (plain compute at level 0). A level-k pipeline over [i, j) uses exactly m units:

    T(i, j, r)    = stage_ms(U(i, j), allreduce_k(i, j, r), update) / r   one stage, r units
    A(i, j, m)    = min( T(i, j, m),
                         min over i < s < j, 1 <= r < m of
                             max(T(i, s, r), comm_k(s), A(s, j, m - r)) )

The best level-k pipeline using all c_k units of a level-(k+1) group, A(i, j, c_k), is the unit
time U of level k+1: replicas of a level-(k+1) stage are whole level-k groups, so they all-reduce
over level k+1's bandwidth while the pipeline inside each stays on its fast links. On the
outermost level only blocks [0, L) are needed, and any m <= c_top is allowed (whole trailing
groups may stay idle when adding them cannot help). With one level this is exactly the flat
model: the planner's optimum over all plans with sum of replicas <= N. `straight` allows
r = 1 only, on every level.

Memory: how much a stage keeps depends on NOAM = ceil(workers from it to the pipeline's end /
its replicas), i.e. on what follows it, even outside its own group. Solving a pipeline inside a
unit in *context* K = ceil(workers that follow the unit in the flattened plan / how many times
the unit is replicated in total) makes this exact: a level-k stage of r units followed by q units
of g workers, itself in context K, gives its inner pipeline the context ceil((q g + K) / r), and
a single worker (level-0 unit) in context K has NOAM = 1 + K. (K may be rounded up at each step
because ceil((w + K) / r) only depends on ceil(K) when w is an integer.) Without a memory limit,
or for GPipe (constant footprint), every context is the same and one table per level is solved;
otherwise tables are solved lazily, once per distinct context.

Cost: O(L^3 c^2) numpy work per inner level and O(L^2 c^2) for the outermost. A(i, ., .)
depends only on rows s > i, so for each i the whole (m, r, s, j) block is one vectorised
min-max (chunked over m to bound memory): Python loops over i only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pipedream_fast.planner.costs import Costs, MemoryModel, comm_ms, stage_ms, sync_ms
from pipedream_fast.topology import Topology

INF = math.inf
_CHUNK_ELEMENTS = 1 << 20  # bound on one vectorised (m, r, s, j) block, to cap memory


@dataclass(frozen=True)
class StageNode:
    """A level-`level` stage over blocks [start, stop) replicated over `replicas` units.

    `inner` is the pipeline each unit runs (level - 1 stages); empty at level 0, where a unit
    is one worker.
    """

    level: int
    start: int
    stop: int
    replicas: int
    inner: tuple[StageNode, ...] = ()


@dataclass
class _LevelTable:
    best: np.ndarray   # (L+1, L+1, c+1): A(i, j, m), inf where impossible
    split: np.ndarray  # first cut s of the best pipeline, -1 for a single stage
    first: np.ndarray  # replicas of its first stage
    contexts: dict[tuple[int, int], int] = field(default_factory=dict)  # (r, q) -> inner context


class HierarchicalDP:
    """Solves and reconstructs the best plan for one profile, topology and memory model."""

    def __init__(self, costs: Costs, topology: Topology, memory: MemoryModel,
                 straight: bool = False) -> None:
        self.costs = costs
        self.topology = topology
        self.memory = memory
        self.straight = straight
        self.top = len(topology.levels) - 1
        L = costs.num_blocks
        self._valid = np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1)
        self._memo: dict[tuple[int, int], _LevelTable] = {}
        self._workers: dict[int, np.ndarray] = {}

    # ---- tables ------------------------------------------------------------------------------

    def _unit_size(self, level: int) -> int:
        return self.topology.group_size(level - 1) if level > 0 else 1

    def _context(self, level: int, outer: int, replicas: int, after_units: int) -> int:
        if not self.memory.depends_on_position:
            return 0
        return -(-(after_units * self._unit_size(level) + outer) // replicas)

    def unit_table(self, level: int, context: int) -> np.ndarray:
        """(L+1, L+1): bottleneck of one level-`level` unit over [i, j) (level -1: a worker)."""
        if level >= 0:
            return self.solve(level, context).best[:, :, self.topology.levels[level].count]
        if context not in self._workers:
            fits = self.memory.fits(self.costs, noam=1 + context) & self._valid
            self._workers[context] = np.where(fits, self.costs.compute, INF)
        return self._workers[context]

    def solve(self, level: int, context: int = 0) -> _LevelTable:
        key = (level, context)
        if key not in self._memo:
            self._memo[key] = self._solve(level, context)
        return self._memo[key]

    def _solve(self, level: int, context: int) -> _LevelTable:
        costs, L = self.costs, self.costs.num_blocks
        c = self.topology.levels[level].count
        bandwidth = self.topology.levels[level].bandwidth
        rmax = 1 if self.straight else c

        # Unit tables for every context a stage (r units, q units after it) can be in.
        contexts = {(r, q): self._context(level, context, r, q)
                    for r in range(1, c + 1) for q in range(0, c - r + 1)}
        keys = sorted(set(contexts.values()))
        units = np.stack([self.unit_table(level - 1, k) for k in keys])
        kidx = np.zeros((c + 1, c + 1), dtype=np.intp)
        for (r, q), k in contexts.items():
            kidx[r, q] = keys.index(k)
        # Per replica count r: each replica's share of the all-reduce and of the update (the
        # update is a worker's, so it is charged on level 0 only).
        syncs = [sync_ms(costs, self.memory, r, bandwidth, updates=level == 0)
                 for r in range(1, c + 1)]
        zero = np.zeros_like(costs.params)
        reduce = np.stack([zero] + [sync[0] for sync in syncs])
        update = np.stack([zero] + [sync[1] for sync in syncs])

        def stage(unit: np.ndarray, r: np.ndarray, rows: int, cols: np.ndarray) -> np.ndarray:
            return stage_ms(costs, unit, reduce[r, rows, cols], update[r, rows, cols], r)
        comm = comm_ms(costs.cut_bytes, bandwidth)

        best = np.full((L + 1, L + 1, c + 1), INF)
        split = np.full((L + 1, L + 1, c + 1), -1, dtype=np.int32)
        first = np.zeros((L + 1, L + 1, c + 1), dtype=np.int32)
        r_axis = np.arange(1, min(c - 1, rmax) + 1)  # first-stage replicas when there is a cut
        m_axis = np.arange(1, c + 1)
        for i in range(L - 1, -1, -1):
            # A(i, j, m) only needs A(s, j, q) for s > i: all m and j of this row at once.
            js = np.array([L]) if level == self.top else np.arange(i + 1, L + 1)
            ss = np.arange(i + 1, L)  # first cut; A(s, j, .) is inf unless s < j
            S, J = len(ss), len(js)
            # One stage holding all m units.
            values = stage(units[kidx[m_axis, 0][:, None], i, js[None, :]], m_axis[:, None], i,
                           js[None, :])
            values[m_axis > rmax] = INF                                      # (M, J)
            cut_at = np.full((c, J), -1, dtype=np.int32)
            first_r = np.repeat(m_axis[:, None], J, axis=1).astype(np.int32)
            chunk = max(1, _CHUNK_ELEMENTS // max(1, len(r_axis) * S * J))
            for low in range(2, c + 1, chunk) if S and len(r_axis) else ():
                ms = np.arange(low, min(c, low + chunk - 1) + 1)
                qs = ms[:, None] - r_axis[None, :]                           # (M, R) units after
                ok = qs >= 1
                qs = np.where(ok, qs, 0)  # A(., ., 0) is inf: those (m, r) never win
                head = stage(units[kidx[r_axis[None, :], qs][:, :, None], i, ss[None, None, :]],
                             r_axis[None, :, None], i, ss[None, None, :])
                head = np.maximum(head, comm[ss][None, None, :])                  # (M, R, S)
                tail = best[ss[None, None, :, None], js[None, None, None, :], qs[:, :, None, None]]
                total = np.maximum(head[..., None], tail)                    # (M, R, S, J)
                total = total.reshape(len(ms), len(r_axis) * S, J)
                arg = total.argmin(axis=1)                                   # (M, J)
                found = np.take_along_axis(total, arg[:, None, :], axis=1)[:, 0, :]
                rows = ms - 1
                better = found < values[rows]
                values[rows] = np.where(better, found, values[rows])
                cut_at[rows] = np.where(better, ss[arg % S], cut_at[rows])
                first_r[rows] = np.where(better, r_axis[arg // S], first_r[rows])
            best[i, js, 1:] = values.T
            split[i, js, 1:] = cut_at.T
            first[i, js, 1:] = first_r.T
        return _LevelTable(best, split, first, contexts)

    # ---- the answer --------------------------------------------------------------------------

    def best_time(self) -> tuple[float, int]:
        """(bottleneck, outermost units used); among equal optima the one using most units."""
        row = self.solve(self.top).best[0, self.costs.num_blocks, 1:]
        low = float(row.min())
        if not math.isfinite(low):
            return INF, 0
        ties = np.flatnonzero(row <= low * (1 + 1e-12))
        return low, int(ties[-1]) + 1

    def best_plan(self) -> tuple[float, list[StageNode]] | None:
        """The optimal outermost pipeline, or None when no plan fits the memory limit."""
        time, units = self.best_time()
        if units == 0:
            return None
        return time, self._stages(self.top, 0, 0, self.costs.num_blocks, units)

    def _stages(self, level: int, context: int, i: int, j: int, m: int) -> list[StageNode]:
        table = self.solve(level, context)
        out = []
        while True:
            cut, r = int(table.split[i, j, m]), int(table.first[i, j, m])
            stop, after = (j, 0) if cut < 0 else (cut, m - r)
            inner: tuple[StageNode, ...] = ()
            if level > 0:
                below = self.topology.levels[level - 1].count
                inner = tuple(self._stages(level - 1, table.contexts[(r, after)], i, stop, below))
            out.append(StageNode(level, i, stop, r, inner))
            if cut < 0:
                return out
            i, m = cut, m - r


def data_parallel_tree(num_blocks: int, topology: Topology) -> list[StageNode]:
    """The data-parallel plan in tree form: one stage on every level, all units replicated."""
    node: StageNode | None = None
    for level, spec in enumerate(topology.levels):
        node = StageNode(level, 0, num_blocks, spec.count, () if node is None else (node,))
    assert node is not None
    return [node]
