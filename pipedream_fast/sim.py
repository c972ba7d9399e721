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

Costs come from `UnitCosts` (forward 1, backward 1, communication 0 for --unit-cost), from
a Profile + Plan (`ProfileCosts`): stage times are the sums of their blocks' times, a transfer
moves the activation bytes of the cut, and a ring all-reduce among r replicas takes
2(r-1)/r * stage parameter bytes / slowest bandwidth + 2(r-1) latencies; or from what the
ranks measured while training (`MeasuredCosts.from_calibration`, see
`pipedream_fast.runtime.calibration`): each action's own time on its rank, the data feed,
each link's transfer, and the executor's overhead between actions.

A cost model may also say what a rank spends besides the actions' costs: `overhead(rank,
action)`, the time between the end of the rank's previous action and the start of this one
(the executor's loop, a step's bookkeeping), and `compute(rank, action)` of a send or a
receive post, the rank time of issuing it. Both are 0 for `UnitCosts` and `ProfileCosts`, so
their timelines are the ones described above. With `transfer_after_post` (`MeasuredCosts`)
links are timed as the runtime's engine runs them: one FIFO per (sender, receiver, tensor,
receiving stage), and a transfer starts once the message is sent *and* its receive posted
(the engine receives only into a posted receive; a receive posted late, as interleaved
schedules do, delays the message), and the rank is busy issuing a send until it is issued
plus the send's own time.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Iterable, Mapping, Sequence

from pipedream_fast.formats import FormatError, Plan, Profile
from pipedream_fast.ir import Action, ActionKind, Schedule, ScheduleError, validate
from pipedream_fast.staleness import DelayReport, weight_delays
from pipedream_fast.topology import Topology
from pipedream_fast.trace import TraceEvent, write_chrome_trace

K = ActionKind
# Kinds that occupy the rank (what "busy" counts), read off each kind's declared timing.
_COMPUTE_LIKE = tuple(k for k in K if k.spec.timing in ("compute", "update", "bookkeeping"))


class CostModel(Protocol):
    @property
    def time_unit(self) -> str: ...

    def compute(self, rank: int, action: Action) -> float: ...

    def transfer(self, action: Action, src: int, dst: int) -> float: ...

    def allreduce(self, stage: int, ranks: Sequence[int]) -> float: ...


def _no_overhead(rank: int, action: Action) -> float:
    return 0.0


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
        forward = [sum(b.forward_ms for b in p) for p in parts]
        # A stage that recomputes runs its forward again inside its backward.
        rerun = [f if s.extra.get("recompute") else 0.0 for f, s in zip(forward, plan.stages)]
        return cls(forward_ms=tuple(forward),
                   backward_ms=tuple(sum(b.backward_ms for b in p) + extra
                                     for p, extra in zip(parts, rerun)),
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


@dataclass(frozen=True)
class MeasuredCosts:
    """Costs the ranks measured while training (`runtime.calibration`), in ms per microbatch
    of the run's size: `action_ms` each action's own time by (rank, kind, stage) (without
    waits for messages; a forward on the first stage without its data feed), `feed_ms` the
    feed per microbatch on a rank that reads data, `overhead_ms` the executor's time between
    two actions of a rank, `transfer_ms` per link (tensor, receiving stage, sender, receiver)
    from the start of the send (or the receive's post, if later) to the tensor ready at the
    receiver, `allreduce_ms` per
    replicated stage what its update waits for the gradients after the group met, and
    `run_overhead_ms` per rank what a `train()` call costs outside its executor runs (to add
    to a simulated run: `run_ms`). A transfer starts when its message is sent and its
    receive posted, whichever is later (`transfer_after_post`, as the runtime's engine)."""

    action_ms: Mapping[tuple[int, str, int | None], float] = field(default_factory=dict)
    feed_ms: Mapping[int, float] = field(default_factory=dict)
    overhead_ms: Mapping[int, float] = field(default_factory=dict)
    transfer_ms: Mapping[tuple[str, int, int, int], float] = field(default_factory=dict)
    allreduce_ms: Mapping[int, float] = field(default_factory=dict)
    run_overhead_ms: Mapping[int, float] = field(default_factory=dict)
    time_unit: str = "ms"
    transfer_after_post: bool = True  # the simulator times links as the engine runs them

    @classmethod
    def from_calibration(cls, snapshots: Mapping[int, Any] | Iterable[Any]) -> MeasuredCosts:
        """From every rank's `CalibrationSnapshot` (a mapping by rank, or an iterable of them):
        the ranks' own estimates, and the links' transfers paired across them."""
        from pipedream_fast.runtime.calibration import pair_transfers

        snaps = list(snapshots.values() if isinstance(snapshots, Mapping) else snapshots)
        action_ms: dict[tuple[int, str, int | None], float] = {}
        waits: dict[int, list[float]] = {}
        for snap in snaps:
            for (kind, stage), est in snap.actions.items():
                action_ms[(snap.rank, kind, stage)] = est.ms
            for stage, est in snap.allreduce_wait.items():
                waits.setdefault(stage, []).append(est.ms)
        # A replicated stage's ranks meet at its all-reduce; the last to arrive waits only for
        # the reduction itself, the others also for it: the smallest wait is the reduction's.
        allreduce = {}
        for stage, found in waits.items():
            flush = [ms for (_, kind, s), ms in action_ms.items()
                     if kind == K.ALLREDUCE.value and s == stage]
            if flush:  # a stage whose updates follow an all-reduce: replicated
                allreduce[stage] = min(found) + max(flush)
        return cls(action_ms=action_ms,
                   feed_ms={s.rank: s.feed.ms for s in snaps if s.feed is not None},
                   overhead_ms={s.rank: s.gap.ms for s in snaps if s.gap is not None},
                   transfer_ms={link: est.ms for link, est in pair_transfers(snaps).items()},
                   allreduce_ms=allreduce,
                   run_overhead_ms={s.rank: s.run_overhead.ms for s in snaps
                                     if s.run_overhead is not None})

    def _own(self, rank: int, kind: ActionKind, stage: int | None) -> float:
        found = self.action_ms.get((rank, kind.value, stage))
        if found is not None:
            return found
        others = [ms for (_, k, s), ms in self.action_ms.items()
                  if k == kind.value and s == stage]  # a replica's, where this rank has none
        return sum(others) / len(others) if others else 0.0

    def compute(self, rank: int, action: Action) -> float:
        own = self._own(rank, action.kind, action.stage)
        if action.kind is K.FORWARD and action.stage == 0:
            own += self.feed_ms.get(rank, 0.0)
        return own

    def overhead(self, rank: int, action: Action) -> float:
        return self.overhead_ms.get(rank, 0.0)

    def transfer(self, action: Action, src: int, dst: int) -> float:
        spec = action.kind.spec
        tensor = spec.tensor or ""
        stage = action.stage + (1 if tensor == "act" else -1)
        found = self.transfer_ms.get((tensor, stage, src, dst))
        if found is not None:
            return found
        alike = [ms for (t, _, _, _), ms in self.transfer_ms.items() if t == tensor]
        return sum(alike) / len(alike) if alike else 0.0

    def allreduce(self, stage: int, ranks: Sequence[int]) -> float:
        return self.allreduce_ms.get(stage, 0.0) if len(ranks) > 1 else 0.0

    def run_ms(self, rank: int | None = None) -> float:
        """What one `train()` call costs outside its executor runs: `rank`'s, or the most of
        any rank's (every rank starts and ends a run together)."""
        if rank is not None and rank in self.run_overhead_ms:
            return self.run_overhead_ms[rank]
        return max(self.run_overhead_ms.values(), default=0.0)


@dataclass(frozen=True)
class SizedCosts:
    """A run whose shapes vary, replayed: `base`'s costs (measured or profiled at one size),
    each microbatch's forward, backward and transfers scaled by its size relative to that one
    (`sizes[mb]`, 1.0 where missing; `relative_sizes` makes them from a run's
    `Pipeline.last_input_bytes`). Linear in the inputs' bytes: right for layers whose work
    grows with the tokens or pixels (linear layers, convolutions, a per-token loss); short of
    attention's quadratic part at long sequences. Updates, all-reduces and the rank's
    overheads do not depend on the data and keep `base`'s."""

    base: Any  # a CostModel
    sizes: Mapping[int, float]

    @property
    def time_unit(self) -> str:
        return str(self.base.time_unit)

    @property
    def transfer_after_post(self) -> bool:
        return bool(getattr(self.base, "transfer_after_post", False))

    def _scale(self, action: Action) -> float:
        return self.sizes.get(action.microbatch, 1.0) if action.microbatch is not None else 1.0

    def compute(self, rank: int, action: Action) -> float:
        cost = float(self.base.compute(rank, action))
        if action.kind in (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT):
            cost *= self._scale(action)
        return cost

    def transfer(self, action: Action, src: int, dst: int) -> float:
        return float(self.base.transfer(action, src, dst)) * self._scale(action)

    def allreduce(self, stage: int, ranks: Sequence[int]) -> float:
        return float(self.base.allreduce(stage, ranks))

    def overhead(self, rank: int, action: Action) -> float:
        return float(getattr(self.base, "overhead", _no_overhead)(rank, action))


def relative_sizes(input_bytes: Mapping[int, int], reference: int | None = None
                   ) -> dict[int, float]:
    """Each microbatch's size relative to `reference` bytes of inputs (default: the first
    microbatch's, the one a Pipeline plans and profiles at), for `SizedCosts`."""
    if not input_bytes:
        return {}
    base = reference if reference is not None else input_bytes[min(input_bytes)]
    if base <= 0:
        raise ValueError(f"the reference size must be positive bytes, got {base}")
    return {mb: n / base for mb, n in input_bytes.items()}


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
    link_free: dict[tuple, float] = {}
    at_allreduce: dict[int, float] = {}  # rank -> when it reached its current all-reduce
    overhead = getattr(costs, "overhead", _no_overhead)  # rank time before each action
    # Measured costs time the engine's links: one FIFO per (sender, receiver, tensor,
    # receiving stage), a transfer starting once sent and its receive posted (see below).
    after_post = bool(getattr(costs, "transfer_after_post", False))
    queued: dict[tuple, list[tuple[tuple, float, float]]] = {}  # link -> (key, sent, time)
    posted_at: dict[tuple, float] = {}

    def deliver(link: tuple) -> None:
        """after_post: the link's transfers, in order, whose receive is posted."""
        waiting = queued.get(link, [])
        while waiting and waiting[0][0] in posted_at:
            key, sent, took = waiting.pop(0)
            begin = max(sent, posted_at[key], link_free.get(link, 0.0))
            link_free[link] = arrival[key] = begin + took

    def emit(rank: int, start: float, ready: float, end: float) -> None:
        records[rank].append(ActionRecord(rank, pc[rank], schedule.actions[rank][pc[rank]],
                                          start, ready, end))
        clock[rank] = end
        pc[rank] += 1

    def step(rank: int) -> bool:
        a = schedule.actions[rank][pc[rank]]
        timing = a.kind.spec.timing
        now = clock[rank] + overhead(rank, a)  # when the rank starts this action
        if timing == "post":
            key = _tensor(rank, a)
            posted[rank].add(key)
            end = now + costs.compute(rank, a)
            if after_post:
                posted_at[key] = end
                deliver((a.peer, rank, key[0], key[1]))
            emit(rank, now, now, end)
        elif timing == "send":
            assert a.peer is not None
            key = _tensor(rank, a)
            if after_post:
                link: tuple = (rank, a.peer, key[0], key[1])
                queued.setdefault(link, []).append((key, now, costs.transfer(a, rank, a.peer)))
                deliver(link)
            else:
                link = (rank, a.peer)
                begin = max(now, link_free.get(link, 0.0))
                link_free[link] = arrival[key] = begin + costs.transfer(a, rank, a.peer)
            emit(rank, now, now, now + costs.compute(rank, a))
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


# ---- the simulation as a trace (pipedream_fast.trace's format) -------------------------

def events_from_simulation(result: SimResult) -> list[TraceEvent]:
    """The simulated actions as trace events (times in the simulation's unit, as ms)."""
    events = []
    for rec in result.records:
        a = rec.action
        args: dict[str, Any] = {"action": a.to_text(), "index": rec.index}
        if rec.ready > rec.start:
            args["waited_ms"] = rec.ready - rec.start
        if a.peer is not None:
            args["peer"] = a.peer
        if a.microbatches:
            args["microbatches"] = list(a.microbatches)
        if a.copy:
            args["copy"] = a.copy
        events.append(TraceEvent(rec.rank, a.kind.value, rec.start, rec.end - rec.start,
                                 a.stage, a.microbatch, a.version, args))
    return events


def write_simulation_trace(result: SimResult, path: str | os.PathLike[str]) -> None:
    """The simulation as a Chrome/Perfetto trace (`trace.write_chrome_trace`)."""
    s = result.schedule
    write_chrome_trace(events_from_simulation(result), path, process=f"simulated {s.name}",
                       rank_stages={r: s.stages_of(r) for r in range(s.num_ranks)},
                       metadata={"schedule": s.name, "time_unit": result.time_unit,
                                 "note": "one time unit of a unit-cost run is shown as 1 ms"})
