"""From a tree of nested stages to the flat stage list of a Plan, and what each stage costs.

Rank assignment (contiguous, so replicas of an inner pipeline stay on fast links):

    outermost stages in order, each taking r units x g workers of consecutive ranks;
    unit u of a stage starting at rank b owns ranks [b + u g, b + (u+1) g), i.e. exactly one
    group of the level below (topology ranks are numbered so groups are contiguous), and
    lays out its own inner pipeline inside that range the same way.

    e.g. 2 servers x 4 GPUs, outer stage 0 = both servers, inner pipeline [s0 x1, s1 x3]:
        flat stage A (inner s0): ranks 0, 4        flat stage B (inner s1): ranks 1-3, 5-7

A flat stage keeps its `chain`: its (start, stop, replicas) on every level, innermost first.
Two cost evaluations are offered:

* `nested_times` - PipeDream's hierarchical model, the one the dynamic program optimises. A
  stage's time is built up level by level with `costs.stage_ms`: V0 = stage_ms(compute,
  allreduce_0, update) / r0 and Vk = stage_ms(V(k-1), allreduce_k(whole level-k stage range,
  rk), 0) / rk (the level-k all-reduce carries all parameters of the level-k stage through the
  group's uplink); a cut between two stages that first part at level d costs
  comm_d / (replicas of the enclosing stages above d).
* `flat_times` - for plans without a tree (baselines): stage time stage_ms(compute, allreduce
  over the slowest link between any two of its ranks, update) / r, cut = comm over the slowest
  link between any rank of one stage and any of the next (`Topology.slowest_bandwidth`,
  `Topology.bandwidth_between`; an inner level may be the slower one). For a one-level
  topology both give the flat model. It is also the model of heterogeneous topologies
  (`hetero.py`): compute and update divided by the slowest speed among the stage's ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipedream_fast.planner.costs import Costs, MemoryModel, comm_ms, noam, stage_ms, sync_ms
from pipedream_fast.planner.dp import StageNode
from pipedream_fast.topology import Topology


@dataclass(frozen=True)
class FlatStage:
    start: int
    stop: int
    ranks: tuple[int, ...]
    chain: tuple[tuple[int, int, int], ...] = ()  # per level (start, stop, replicas), innermost first
    recompute: bool = False  # its activations are made again in the backward

    @property
    def replicas(self) -> int:
        return len(self.ranks)


def flatten(stages: Sequence[StageNode], topology: Topology, base: int = 0) -> list[FlatStage]:
    """Flat stages, in pipeline order, with ranks assigned as described above."""
    out: list[FlatStage] = []
    for node in stages:
        here = (node.start, node.stop, node.replicas)
        if node.level == 0:
            out.append(FlatStage(node.start, node.stop,
                                 tuple(range(base, base + node.replicas)), (here,)))
            base += node.replicas
            continue
        group = topology.group_size(node.level - 1)
        for inner in flatten(node.inner, topology, 0):
            ranks = sorted(base + u * group + rank for u in range(node.replicas) for rank in inner.ranks)
            out.append(FlatStage(inner.start, inner.stop, tuple(ranks), inner.chain + (here,)))
        base += node.replicas * group
    return out


def choose_recompute(stages: Sequence[FlatStage], costs: Costs,
                     memory: MemoryModel) -> list[FlatStage]:
    """`stages` with each one's recomputation as the memory model chooses it at the stage's
    NOAM (as the dynamic program costed it)."""
    out, workers_after = [], sum(s.replicas for s in stages)
    for stage in stages:
        n = noam(workers_after, stage.replicas)
        workers_after -= stage.replicas
        recomputed = bool(memory.recomputes(costs, n)[stage.start, stage.stop])
        out.append(dataclasses.replace(stage, recompute=recomputed))
    return out


def compute_ms(costs: Costs, stage: FlatStage) -> float:
    """A replica's forward and backward over the stage, and the re-run if it recomputes."""
    extra = _required_forward(costs)[stage.start, stage.stop] if stage.recompute else 0.0
    return float(costs.compute[stage.start, stage.stop] + extra)


def _required_forward(costs: Costs) -> Any:
    assert costs.forward is not None
    return costs.forward


def _stage_ms(costs: Costs, memory: MemoryModel, unit: float, start: int, stop: int,
              replicas: int, bandwidth: float, updates: bool, speed: float = 1.0) -> float:
    """`speed` (the slowest replica's, relative to the profile) scales compute and update."""
    reduce, update = sync_ms(costs, memory, replicas, bandwidth, updates)
    return float(stage_ms(costs, unit / speed, reduce[start, stop], update[start, stop] / speed,
                          replicas))


def nested_times(stages: Sequence[FlatStage], costs: Costs, topology: Topology,
                 memory: MemoryModel) -> tuple[list[float], list[float]]:
    """(per-stage time, per-cut time) under the hierarchical model; see the module docstring."""
    times = []
    for stage in stages:
        start, stop, r = stage.chain[0]
        value = _stage_ms(costs, memory, compute_ms(costs, stage), start, stop, r,
                          topology.levels[0].bandwidth, updates=True)
        for level, (start, stop, r) in enumerate(stage.chain[1:], start=1):
            value = _stage_ms(costs, memory, value, start, stop, r,
                              topology.levels[level].bandwidth, updates=False)
        times.append(value)
    cuts = []
    for left, right in zip(stages, stages[1:]):
        depth = max(k for k in range(len(left.chain)) if left.chain[k] != right.chain[k])
        scale = 1
        for _, _, r in left.chain[depth + 1:]:
            scale *= r
        cuts.append(float(comm_ms(costs.cut_bytes[left.stop], topology.levels[depth].bandwidth)) / scale)
    return times, cuts


def flat_times(stages: Sequence[FlatStage], costs: Costs, topology: Topology,
               memory: MemoryModel) -> tuple[list[float], list[float]]:
    """(per-stage time, per-cut time) with every transfer on the slowest link it crosses; on a
    heterogeneous topology a stage computes at the speed of its slowest rank."""
    times = []
    for stage in stages:
        speed = min(topology.speed_of(r) for r in stage.ranks)
        times.append(_stage_ms(costs, memory, compute_ms(costs, stage), stage.start,
                               stage.stop, stage.replicas,
                               topology.slowest_bandwidth(stage.ranks), updates=True, speed=speed))
    cuts = []
    for left, right in zip(stages, stages[1:]):
        slowest = min(topology.bandwidth_between(a, b) for a in left.ranks for b in right.ranks)
        cuts.append(float(comm_ms(costs.cut_bytes[left.stop], slowest)))
    return times, cuts


@dataclass(frozen=True)
class StageMemory:
    noam: int
    versions: int
    in_flight: int
    bytes: int
    recompute: bool = False
    parts: dict[str, float] = field(default_factory=dict)  # where the bytes go, by kind


def stage_memory(stages: Sequence[FlatStage], costs: Costs, memory: MemoryModel) -> list[StageMemory]:
    """Per stage: NOAM, weight versions, microbatches in flight and bytes per replica."""
    out = []
    workers_after = sum(s.replicas for s in stages)
    for stage in stages:
        n = noam(workers_after, stage.replicas)
        workers_after -= stage.replicas
        out.append(StageMemory(n, memory.versions(n), memory.in_flight(n),
                               memory.replica_bytes(costs, stage.start, stage.stop, n,
                                                    stage.recompute),
                               stage.recompute,
                               memory.parts(costs, stage.start, stage.stop, n, stage.recompute)))
    return out
