"""Planning for heterogeneous workers: per-rank speeds and memory limits (`Topology.speeds`,
`Topology.memories`).

PipeDream's DP (`dp.py`) assumes identical workers, so that only *how many* workers a stage gets
matters. With workers that differ, *which* ones matters too. This planner searches, exactly,
the space of **straight-order pipelines over the ranks in topology order**:

    stage k takes the next r_k >= 1 consecutive ranks [w_k, w_k + r_k), w_0 = 0; the stages
    tile the blocks [0, L) in order; ranks [e, N) after the last stage may stay idle
    (r_k = 1 for every stage when `straight`).

Every such plan is costed with the slowest-link model of `flatten.flat_times`, extended by speed
(bw(a, b) is `Topology.bandwidth_between`, the link of the innermost level that holds both):

    stage  = stage_ms(compute / s, allreduce over B, update / s, r), with s the slowest speed
             among its ranks (replicas run in lockstep through the all-reduce) and B the
             slowest link between any two of its ranks (`Topology.slowest_bandwidth`)
    cut    = comm over the slowest link between any rank of one stage and any of the next
    memory = a replica's bytes at NOAM = ceil((e - w_k) / r_k) must fit the smallest memory
             limit among the stage's ranks

and the DP returns the minimum bottleneck over that whole space, and a plan that costs exactly
what it reports (tests/test_planner_hetero.py checks both against exhaustive enumeration with
its own arithmetic). It does not reorder ranks: to give a fast worker an earlier stage, number
it so. For identical workers the hierarchical DP is used instead (its plans are unchanged by
this module).

The cut term needs both neighbours' ranks, yet it splits into one half per stage. With groups
of contiguous ranks, the level of bw(a, b) for a < b is the highest level of the group
boundaries between them, so for a in [p, w) and b in [w, x) it is the higher of the levels of
bw(a, w) and bw(w - 1, b); as a = w - 1 and b = w give the lowest of both, the levels the cut
crosses are exactly those of {bw(a, w)} and {bw(w - 1, b)}, and its slowest link is

    min(min over a in [p, w) of bw(a, w),  min over b in [w, x) of bw(w - 1, b))

The left stage carries the first half (its ranks against the next stage's first rank), the
right stage the second (the previous stage's last rank against its ranks), so the DP over
(first block i, first rank w) for a fixed end rank e stays exact. Both minima range over the
whole stage: only when outer levels are never faster than inner ones do the extreme ranks
(a = p, b = x - 1) alone decide them. Cost: O(L^2 N^3) for N ranks, L blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipedream_fast.planner.costs import Costs, MemoryModel, comm_ms, stage_ms, sync_ms
from pipedream_fast.topology import Topology

INF = math.inf


@dataclass(frozen=True)
class HeteroStage:
    start: int
    stop: int
    first_rank: int
    replicas: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.first_rank, self.first_rank + self.replicas))


def group_speed(topology: Topology, ranks: tuple[int, ...] | range) -> float:
    """The speed replicas on `ranks` run at: the slowest of them."""
    return min(topology.speed_of(r) for r in ranks)


def group_memory(topology: Topology, ranks: tuple[int, ...] | range) -> int | None:
    limits = [m for m in (topology.memory_of(r) for r in ranks) if m is not None]
    return min(limits) if limits else None


class HeteroDP:
    """Solves the space described in the module docstring for one profile and topology.
    `memory.limit` is ignored: the limits are the topology's, per rank."""

    def __init__(self, costs: Costs, topology: Topology, memory: MemoryModel,
                 straight: bool = False) -> None:
        self.costs, self.topology, self.memory, self.straight = costs, topology, memory, straight
        L, N = costs.num_blocks, topology.workers
        self.L, self.N = L, N
        self._stage: dict[tuple[int, int], list[list[float]]] = {}
        self._limit: dict[tuple[int, int], float] = {}
        # Per-rank limits are the topology's, so the memory model has none: a stage recomputes
        # only where it is told to (recompute="all"), never by choice.
        compute = memory.compute_ms(costs, 1)
        for w in range(N):
            for r in range(1, N - w + 1):
                ranks = range(w, w + r)
                s = group_speed(topology, ranks)
                reduce, update = sync_ms(costs, memory, r, topology.slowest_bandwidth(ranks))
                self._stage[w, r] = stage_ms(costs, compute / s, reduce, update / s,
                                             r).tolist()
                limit = group_memory(topology, ranks)
                self._limit[w, r] = INF if limit is None else float(limit)
        self._bytes: dict[int, list[list[float]]] = {}
        # The halves of the slowest link of a cut (see the module docstring): for the stage on
        # ranks [w, w+r), the slowest link from the rank before it (w-1) to one of its ranks,
        # and from one of its ranks to the rank after it (w+r).
        self._in_bw: dict[tuple[int, int], float] = {}
        self._out_bw: dict[tuple[int, int], float] = {}
        for w in range(N):
            for r in range(1, N - w + 1):
                if w > 0:
                    self._in_bw[w, r] = min(topology.bandwidth_between(w - 1, b)
                                            for b in range(w, w + r))
                if w + r < N:
                    self._out_bw[w, r] = min(topology.bandwidth_between(a, w + r)
                                             for a in range(w, w + r))
        self._cut = [float(c) for c in costs.cut_bytes]  # bytes of the cut after block j-1

    def stage_bytes(self, noam: int) -> list[list[float]]:
        if noam not in self._bytes:
            self._bytes[noam] = self.memory.needed_bytes(self.costs, noam).tolist()
        return self._bytes[noam]

    def _terms(self, i: int, j: int, w: int, r: int, e: int) -> float:
        """The first stage [i, j) on ranks [w, w+r) of a pipeline ending at rank e: its time,
        the halves of its cuts its own ranks decide (inf where it does not fit in memory)."""
        noam = -(-(e - w) // r)
        if self._limit[w, r] < INF and self.stage_bytes(noam)[i][j] > self._limit[w, r]:
            return INF
        value = self._stage[w, r][i][j]
        if w > 0:  # the cut in: its half on the links from the previous stage's last rank
            value = max(value, float(comm_ms(self._cut[i], self._in_bw[w, r])))
        if j < self.L:  # the cut out: its half on the links to the next stage's first rank
            value = max(value, float(comm_ms(self._cut[j], self._out_bw[w, r])))
        return value

    def _table(self, e: int, bound: float | None
               ) -> dict[tuple[int, int], tuple[float, float, int, int]]:
        """Per (i, w): the best pipeline of blocks [i, L) on exactly ranks [w, e) as
        (stages, time, first cut, first replicas). `bound` None: least time (stages 0);
        otherwise the fewest stages, then least time, among those with every term <= bound."""
        L = self.L
        rmax = 1 if self.straight else e
        best: dict[tuple[int, int], tuple[float, float, int, int]] = {}
        for i in range(L - 1, -1, -1):
            for w in range(e - 1, -1, -1):
                option = (INF, INF, -1, 0)
                for r in range(1, min(rmax, e - w) + 1):
                    ends = [L] if w + r == e else range(i + 1, L)
                    for j in ends:
                        value = self._terms(i, j, w, r, e)
                        if value == INF or (bound is not None and value > bound):
                            continue
                        stages = 1.0
                        if j < L:
                            tail = best.get((j, w + r))
                            if tail is None or tail[1] == INF:
                                continue
                            stages += tail[0]
                            value = max(value, tail[1])
                        key = (stages if bound is not None else 0.0, value, j, r)
                        if key[:2] < option[:2]:
                            option = key
                best[i, w] = option
        return best

    def best_time(self) -> float:
        times = [self._table(e, None)[0, 0][1] for e in range(1, self.N + 1)]
        return min(times)

    def simplest_plan(self, margin: float) -> tuple[float, list[HeteroStage]] | None:
        """The simplest plan within `margin` of the fastest (fewest stages, then most ranks,
        then least time), as `HierarchicalDP.simplest_plan`; None when nothing fits."""
        optimum = self.best_time()
        if optimum == INF:
            return None
        bound = optimum * (1 + margin) * (1 + 1e-12)
        choices = []
        for e in range(1, self.N + 1):
            table = self._table(e, bound)
            stages, time, _, _ = table[0, 0]
            if time < INF:
                choices.append((stages, -e, time, table))
        stages, neg_e, time, table = min(choices, key=lambda c: c[:3])
        out, i, w = [], 0, 0
        while i < self.L:
            _, _, j, r = table[i, w]
            out.append(HeteroStage(i, j, w, r))
            i, w = j, w + r
        return time, out


def worker_memory_error(costs: Costs, topology: Topology, memory: MemoryModel,
                        schedule: str) -> str:
    """Why no heterogeneous plan fits: the smallest stage footprint against the largest limit."""
    valid = np.triu(np.ones_like(costs.params, dtype=bool), k=1)
    smallest = int(memory.needed_bytes(costs, 1)[valid].min())
    limits = [topology.memory_of(r) for r in range(topology.workers)]
    return (f"no plan fits the workers' memory limits {limits} (bytes, per rank) with schedule "
            f"{schedule}: every plan has a stage that needs more than the ranks it would run "
            f"on hold (the smallest one-replica stage alone needs {smallest} bytes); give "
            f"the workers more memory, add workers, or use a schedule that keeps fewer weight "
            f"versions (2bw, 1f1b, gpipe)")
