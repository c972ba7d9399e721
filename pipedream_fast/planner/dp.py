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
r = 1 only, on every level. A worker's compute over [i, j) includes the forward once more
where the stage recomputes its activations (`MemoryModel.compute_ms`): under `auto`, only
where keeping them does not fit, a choice local to the stage, so the program stays exact.

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
class _LevelCosts:
    """What a stage of one level costs in one context: the unit tables of the level below for
    every context its stages can be in, and the replicas' all-reduce and update shares."""

    costs: Costs
    units: np.ndarray   # (contexts, L+1, L+1): one unit's time over [i, j)
    kidx: np.ndarray    # (c+1, c+1): (replicas r, units q after the stage) -> index in units
    reduce: np.ndarray  # (c+1, L+1, L+1): a replica's share of the all-reduce, per r
    update: np.ndarray  # (c+1, L+1, L+1): and of the update
    comm: np.ndarray    # (L+1,): the transfers across cut s
    contexts: dict[tuple[int, int], int]  # (r, q) -> the inner pipeline's context

    def stage(self, i: int, stop: np.ndarray, r: np.ndarray, q: np.ndarray | int) -> np.ndarray:
        """Time of a stage over [i, stop) on r units with q units after it (arrays broadcast)."""
        return stage_ms(self.costs, self.units[self.kidx[r, q], i, stop],
                        self.reduce[r, i, stop], self.update[r, i, stop], r)


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
            # A stage recomputes where the memory model says so (auto: where its kept
            # activations do not fit), paying its forward again.
            fits = self.memory.fits(self.costs, noam=1 + context) & self._valid
            compute = self.memory.compute_ms(self.costs, noam=1 + context)
            self._workers[context] = np.where(fits, compute, INF)
        return self._workers[context]

    def solve(self, level: int, context: int = 0) -> _LevelTable:
        key = (level, context)
        if key not in self._memo:
            self._memo[key] = self._solve(level, context)
        return self._memo[key]

    def _level_costs(self, level: int, context: int) -> _LevelCosts:
        costs, c = self.costs, self.topology.levels[level].count
        bandwidth = self.topology.levels[level].bandwidth
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
        return _LevelCosts(costs, units, kidx, np.stack([zero] + [sync[0] for sync in syncs]),
                           np.stack([zero] + [sync[1] for sync in syncs]),
                           comm_ms(costs.cut_bytes, bandwidth), contexts)

    def _solve(self, level: int, context: int) -> _LevelTable:
        L = self.costs.num_blocks
        c = self.topology.levels[level].count
        rmax = 1 if self.straight else c
        lc = self._level_costs(level, context)
        units, kidx, contexts, comm = lc.units, lc.kidx, lc.contexts, lc.comm

        def stage(unit: np.ndarray, r: np.ndarray, rows: int, cols: np.ndarray) -> np.ndarray:
            return stage_ms(lc.costs, unit, lc.reduce[r, rows, cols], lc.update[r, rows, cols], r)

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

    def simplest_plan(self, margin: float) -> tuple[float, list[StageNode]] | None:
        """The simplest plan whose bottleneck is within `margin` (a fraction) of the optimum,
        or None when no plan fits the memory limit. Profile noise of a few percent must not
        flip a choice between near-equal plans (one run planned 2 stages, the next data
        parallelism), so within the margin the order is fixed by structure, not by time:

        1. the fewest (outermost) stages: each cut adds transfers, stashed microbatches, weight
           versions and pipeline fill and drain, and estimates of them that can be off;
        2. the most units used (as `best_time` does on ties): a worker left idle is wasted,
           and a Pipeline must run a plan on every rank it has;
        3. stage by stage, the fewest replicas for the first stage, then its earliest cut:
           a fixed order, where "the fastest" would let near-equal cuts (two 2-stage plans
           0.31 and 0.315 ms apart) swap places with noise from one run to the next.

        Inner levels (pipelines inside a group of a hierarchical topology) keep their optimum.
        With margin 0 this is an optimal plan with the fewest stages among the optimal ones."""
        optimum, units = self.best_time()
        if units == 0:
            return None
        lc = self._level_costs(self.top, 0)
        count, time, cut, first = self._simplest_tables(lc, optimum * (1 + margin) * (1 + 1e-12))
        level, L, c = self.top, self.costs.num_blocks, self.topology.levels[self.top].count
        m = min(range(1, c + 1), key=lambda q: (count[0, q], -q, time[0, q]))
        bottleneck, nodes, i = float(time[0, m]), [], 0
        while True:
            s, r = int(cut[i, m]), int(first[i, m])
            stop, after = (L, 0) if s < 0 else (s, m - r)
            inner: tuple[StageNode, ...] = ()
            if level > 0:
                below = self.topology.levels[level - 1].count
                inner = tuple(self._stages(level - 1, lc.contexts[(r, after)], i, stop, below))
            nodes.append(StageNode(level, i, stop, r, inner))
            if s < 0:
                return bottleneck, nodes
            i, m = s, m - r

    def _simplest_tables(self, lc: _LevelCosts, bound: float
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per (i, m), the outermost pipeline of blocks [i, L) on m units that has the fewest
        stages, then the least time, among those whose every stage and cut is within `bound`:
        (its stages, its time, its first cut or -1, its first stage's replicas). The ranking
        key (stages, time) is kept by each suffix's best, so the recursion is exact."""
        L, c = self.costs.num_blocks, self.topology.levels[self.top].count
        rmax = 1 if self.straight else c
        count = np.full((L + 1, c + 1), INF)
        time = np.full((L + 1, c + 1), INF)
        cut = np.full((L + 1, c + 1), -1, dtype=np.intp)
        first = np.zeros((L + 1, c + 1), dtype=np.intp)
        for i in range(L - 1, -1, -1):
            ss = np.arange(i + 1, L)[None, :]  # first cut s, (1, S)
            for m in range(1, c + 1):
                options = []  # (stages, time, cut, replicas)
                if m <= rmax:
                    t = float(lc.stage(i, np.array(L), np.array(m), 0))
                    if t <= bound:
                        options.append((1.0, t, -1, m))
                rs = np.arange(1, min(m - 1, rmax) + 1)[:, None]  # first-stage replicas, (R, 1)
                if ss.size and rs.size:
                    head = np.maximum(lc.stage(i, ss, rs, m - rs), lc.comm[ss])      # (R, S)
                    n = np.where(head <= bound, 1 + count[ss, m - rs], INF)
                    t_all = np.maximum(head, time[ss, m - rs])
                    if np.isfinite(n).any():
                        # Among the fewest stages within the bound, the first in a fixed
                        # order (fewest first-stage replicas, then the earliest cut), not the
                        # fastest: near-equal cuts swap places with profile noise.
                        k = int(np.argmax(n == n.min()))
                        r, s = divmod(k, ss.shape[1])
                        options.append((float(n.flat[k]), float(t_all.flat[k]),
                                        int(ss[0, s]), int(rs[r, 0])))
                if options:
                    n_best, t_best, cut[i, m], first[i, m] = min(options)
                    count[i, m], time[i, m] = n_best, t_best
        return count, time, cut, first

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
