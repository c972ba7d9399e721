"""Discrete-event simulator: runs any validated Schedule in virtual time.

It times the engine the runtime has (see `pipedream_fast.ir.validator` for the stricter rule
it checks): a rank does one action at a time, in its list's order;

- FORWARD/BACKWARD/OPTIMIZER_STEP/AVERAGE take their cost; a forward or backward first waits
  for the arrival of the tensor its earlier RECV posted for;
- RECV only posts a buffer and takes no time;
- SEND hands the tensor to the communication engine and takes no rank time; the transfer
  starts when the sender issues it and the directed link (sender, receiver) is free (FIFO),
  and lasts bytes / bandwidth + latency;
- ALLREDUCE starts when every rank of the stage has reached it; they all leave together.

Priority of ready backwards over forwards: the order in the IR is authoritative. Generators
already put a backward first whenever 1F1B makes one ready (`schedules.common.one_f_one_b`),
and the executor walks the same list, so the simulator never reorders; reordering here would
predict a schedule the runtime does not run.

Costs come from `UnitCosts` (forward 1, backward 1, communication 0 for --unit-cost) or from
a Profile + Plan (`ProfileCosts`): stage times are the sums of their blocks' times, a transfer
moves the activation bytes of the cut, and a ring all-reduce among r replicas takes
2(r-1)/r * stage parameter bytes / slowest bandwidth + 2(r-1) latencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Sequence

from pipedream_fast.formats import FormatError, Plan, Profile
from pipedream_fast.ir import Action, ActionKind, Schedule, ScheduleError, validate
from pipedream_fast.staleness import DelayReport, weight_delays
from pipedream_fast.topology import Topology

K = ActionKind
# Kinds that occupy the rank (what "busy" counts), read off each kind's declared timing.
_COMPUTE_LIKE = tuple(k for k in K if k.spec.timing in ("compute", "update", "bookkeeping"))


class CostModel(Protocol):
    @property
    def time_unit(self) -> str: ...

    def compute(self, rank: int, action: Action) -> float: ...

    def transfer(self, action: Action, src: int, dst: int) -> float: ...

    def allreduce(self, stage: int, ranks: Sequence[int]) -> float: ...


@dataclass(frozen=True)
class UnitCosts:
    """Fixed costs per action: the textbook setting of the closed-form results."""

    forward: float = 1.0
    backward: float = 1.0
    comm: float = 0.0  # every transfer and every all-reduce
    optimizer: float = 0.0
    time_unit: str = "unit"
    backward_input: float | None = None  # split backward parts (default: half of backward)
    backward_weight: float | None = None

    def compute(self, rank: int, action: Action) -> float:
        half = self.backward / 2
        return {K.FORWARD: self.forward, K.BACKWARD: self.backward,
                K.BACKWARD_INPUT: half if self.backward_input is None else self.backward_input,
                K.BACKWARD_WEIGHT: half if self.backward_weight is None else self.backward_weight,
                K.OPTIMIZER_STEP: self.optimizer, K.AVERAGE: self.optimizer}.get(action.kind, 0.0)

    def transfer(self, action: Action, src: int, dst: int) -> float:
        return self.comm

    def allreduce(self, stage: int, ranks: Sequence[int]) -> float:
        return self.comm if len(ranks) > 1 else 0.0


@dataclass(frozen=True)
class ProfileCosts:
    """Costs of a Profile cut by a Plan; times in ms (per microbatch of the profiled size)."""

    forward_ms: tuple[float, ...]  # per stage
    backward_ms: tuple[float, ...]
    cut_bytes: tuple[int, ...]  # activation bytes crossing the cut after stage s
    parameter_bytes: tuple[int, ...]  # per stage
    bandwidth: float = 10e9  # bytes/s where the plan names no topology
    latency_ms: float = 0.0
    optimizer_ms: float = 0.0
    topology: Topology | None = None
    time_unit: str = "ms"
    # Per stage, the share of the backward that computes the input gradient (split
    # backwards); from the profile's backward_input_ms where measured, else one half.
    input_fraction: tuple[float, ...] = ()
    # Per stage, where the profile measured them (older profiles: `optimizer_ms` for every
    # update, free copies): an update (optimizer step and clearing the gradients), the pass
    # that averages gradients over several microbatches, a copy of the weights (SNAPSHOT).
    stage_optimizer_ms: tuple[float, ...] = ()
    grad_scale_ms: tuple[float, ...] = ()
    snapshot_ms: tuple[float, ...] = ()

    @classmethod
    def from_plan(cls, profile: Profile, plan: Plan, bandwidth: float = 10e9,
                  latency_ms: float = 0.0, optimizer_ms: float = 0.0) -> ProfileCosts:
        plan.check_matches(profile)
        if not (bandwidth > 0 and math.isfinite(bandwidth)) or latency_ms < 0:
            raise ValueError(f"bandwidth must be a positive number of bytes/s and latency >= 0 "
                             f"ms, got {bandwidth} and {latency_ms}")
        topo_data = plan.extra.get("topology")
        topology = Topology.from_dict(topo_data) if topo_data is not None else None
        if topology is not None and topology.workers < plan.workers:
            raise FormatError(f"the plan's topology has {topology.workers} workers but the plan "
                              f"uses {plan.workers}")
        parts = [profile.blocks[s.start:s.stop] for s in plan.stages]
        return cls(forward_ms=tuple(sum(b.forward_ms for b in p) for p in parts),
                   backward_ms=tuple(sum(b.backward_ms for b in p) for p in parts),
                   cut_bytes=tuple(p[-1].activation_bytes for p in parts),
                   parameter_bytes=tuple(sum(b.parameter_bytes for b in p) for p in parts),
                   bandwidth=bandwidth, latency_ms=latency_ms, optimizer_ms=optimizer_ms,
                   topology=topology,
                   # The first stage sends no input gradient: its split backward is all weight.
                   input_fraction=tuple(0.0 if k == 0 else _input_fraction(p)
                                        for k, p in enumerate(parts)),
                   stage_optimizer_ms=_measured_per_stage(parts, "optimizer_ms",
                                                          "grad_zero_ms"),
                   grad_scale_ms=_measured_per_stage(parts, "grad_scale_ms"),
                   snapshot_ms=_measured_per_stage(parts, "snapshot_ms"))

    def _bandwidth(self, a: int, b: int) -> float:
        return self.topology.bandwidth_between(a, b) if self.topology else self.bandwidth

    def compute(self, rank: int, action: Action) -> float:
        if action.kind is K.FORWARD:
            return self.forward_ms[action.stage]
        if action.kind is K.BACKWARD:
            return self.backward_ms[action.stage]
        share = self.input_fraction[action.stage] if self.input_fraction else 0.5
        if action.kind is K.BACKWARD_INPUT:
            return self.backward_ms[action.stage] * share
        if action.kind is K.BACKWARD_WEIGHT:
            return self.backward_ms[action.stage] * (1 - share)
        if action.kind is K.OPTIMIZER_STEP and self.stage_optimizer_ms:
            averaging = len(action.microbatches) > 1 and self.grad_scale_ms  # else no pass
            return self.stage_optimizer_ms[action.stage] + (
                self.grad_scale_ms[action.stage] if averaging else 0.0)
        if action.kind is K.SNAPSHOT:
            return self.snapshot_ms[action.stage] if self.snapshot_ms else 0.0
        return self.optimizer_ms if action.kind in (K.OPTIMIZER_STEP, K.AVERAGE) else 0.0

    def transfer(self, action: Action, src: int, dst: int) -> float:
        # An activation leaves stage s over cut s; a gradient leaves stage s over cut s - 1.
        cut = action.stage if action.kind is K.SEND_ACT else action.stage - 1
        return self.cut_bytes[cut] / self._bandwidth(src, dst) * 1e3 + self.latency_ms

    def allreduce(self, stage: int, ranks: Sequence[int]) -> float:
        r = len(ranks)
        if r < 2:
            return 0.0
        slowest = (self.topology.slowest_bandwidth(ranks) if self.topology else self.bandwidth)
        volume = 2 * (r - 1) / r * self.parameter_bytes[stage]
        return volume / slowest * 1e3 + 2 * (r - 1) * self.latency_ms


def _measured_per_stage(parts: Sequence[Sequence[Any]], *keys: str) -> tuple[float, ...]:
    """Per stage, the sum of costs every block measured; () if a block lacks one."""
    if not all(key in b.extra for p in parts for b in p for key in keys):
        return ()
    return tuple(sum(float(b.extra[key]) for b in p for key in keys) for p in parts)


def _input_fraction(blocks: Sequence[Any]) -> float:
    total = sum(b.backward_ms for b in blocks)
    if total <= 0:
        return 0.5
    split = sum(float(b.extra.get("backward_input_ms", b.backward_ms / 2)) for b in blocks)
    return min(1.0, split / total)


@dataclass(frozen=True)
class ActionRecord:
    """When one action ran. `ready` is when it could proceed (inputs there, group complete)."""

    rank: int
    index: int
    action: Action
    start: float
    ready: float
    end: float


@dataclass(frozen=True)
class RankStats:
    rank: int
    stages: tuple[int, ...]
    busy: float  # compute: forward, backward, step, average
    comm: float  # all-reduce time after the group was complete
    idle: float  # makespan - busy
    peak_versions: int
    peak_stashed: int  # stashed activations: microbatches in flight

    def to_dict(self, makespan: float) -> dict[str, Any]:
        frac = self.busy / makespan if makespan > 0 else 0.0
        return {"rank": self.rank, "stages": list(self.stages), "busy": self.busy,
                "comm": self.comm, "idle": self.idle, "busy_fraction": frac,
                "idle_fraction": 1.0 - frac if makespan > 0 else 0.0,
                "peak_versions": self.peak_versions, "peak_stashed": self.peak_stashed}


@dataclass
class SimResult:
    schedule: Schedule
    time_unit: str
    records: list[ActionRecord]
    makespan: float
    ranks: list[RankStats]
    delays: DelayReport = field(repr=False)

    @property
    def throughput(self) -> float:
        """Microbatches per time unit."""
        return self.schedule.num_microbatches / self.makespan if self.makespan > 0 else math.inf

    @property
    def idle_fraction(self) -> float:
        total = self.makespan * len(self.ranks)
        return 1.0 - sum(r.busy for r in self.ranks) / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        s = self.schedule
        return {"schedule": s.name, "stages": s.num_stages, "microbatches": s.num_microbatches,
                "replicas": list(s.replicas), "params": s.params, "time_unit": self.time_unit,
                "makespan": self.makespan, "throughput": self.throughput,
                "idle_fraction": self.idle_fraction, "max_delay": self.delays.max_delay,
                "mean_delay": self.delays.mean_delay,
                "peak_versions": [r.peak_versions for r in self.ranks],
                "peak_stashed": [r.peak_stashed for r in self.ranks],
                "per_rank": [r.to_dict(self.makespan) for r in self.ranks],
                "delays": self.delays.to_dict()}


def _tensor(rank: int, a: Action) -> tuple:
    """The tensor a send, receive or compute moves or needs: (what, receiving stage, mb, rank)."""
    spec = a.kind.spec
    if spec.sends:
        return (spec.tensor, a.stage + (1 if spec.tensor == "act" else -1), a.microbatch, a.peer)
    what = spec.tensor or ("act" if a.kind is K.FORWARD else "grad")
    return (what, a.stage, a.microbatch, rank)


def simulate(schedule: Schedule, costs: CostModel) -> SimResult:
    """Validate `schedule`, then time it under `costs`; see the module docstring."""
    report = validate(schedule)
    n = schedule.num_ranks
    pc, clock = [0] * n, [0.0] * n
    records: list[list[ActionRecord]] = [[] for _ in range(n)]
    posted: list[set[tuple]] = [set() for _ in range(n)]
    arrival: dict[tuple, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    at_allreduce: dict[int, float] = {}  # rank -> when it reached its current all-reduce

    def emit(rank: int, start: float, ready: float, end: float) -> None:
        records[rank].append(ActionRecord(rank, pc[rank], schedule.actions[rank][pc[rank]],
                                          start, ready, end))
        clock[rank] = end
        pc[rank] += 1

    def step(rank: int) -> bool:
        a, now = schedule.actions[rank][pc[rank]], clock[rank]
        timing = a.kind.spec.timing
        if timing == "post":
            posted[rank].add(_tensor(rank, a))
            emit(rank, now, now, now)
        elif timing == "send":
            assert a.peer is not None
            link = (rank, a.peer)
            begin = max(now, link_free.get(link, 0.0))
            link_free[link] = arrival[_tensor(rank, a)] = begin + costs.transfer(a, rank, a.peer)
            emit(rank, now, now, now)
        elif timing == "collective":
            at_allreduce.setdefault(rank, now)
            group = schedule.stage_ranks[a.stage]
            if any(r not in at_allreduce or schedule.actions[r][pc[r]] != a for r in group):
                return False
            ready = max(at_allreduce[r] for r in group)
            end = ready + costs.allreduce(a.stage, group)
            for r in group:
                emit(r, at_allreduce.pop(r), ready, end)
        else:
            ready = now
            if a.kind is K.FORWARD or a.kind.spec.needs_output_grad:
                key = _tensor(rank, a)
                if key in posted[rank]:
                    if key not in arrival:
                        return False
                    ready = max(now, arrival[key])
            emit(rank, ready, ready, ready + costs.compute(rank, a))
        return True

    while True:
        progressed = False
        for rank in range(n):
            while pc[rank] < len(schedule.actions[rank]) and step(rank):
                progressed = True
        if all(pc[r] == len(schedule.actions[r]) for r in range(n)):
            break
        if not progressed:  # cannot happen for a validated schedule; guard against bugs
            raise ScheduleError("simulation stalled although the schedule validated", 0, pc[0])
    flat = [rec for per_rank in records for rec in per_rank]
    makespan = max((rec.end for rec in flat), default=0.0)
    ranks = []
    for r in range(n):
        busy = sum(rec.end - rec.start for rec in records[r] if rec.action.kind in _COMPUTE_LIKE)
        comm = sum(rec.end - rec.ready for rec in records[r] if rec.action.kind is K.ALLREDUCE)
        ranks.append(RankStats(r, schedule.stages_of(r), busy, comm, makespan - busy,
                               report.peak_versions[r], report.peak_inflight[r]))
    delays = weight_delays(flat, schedule.num_stages, schedule.num_microbatches)
    return SimResult(schedule, costs.time_unit, flat, makespan, ranks, delays)
