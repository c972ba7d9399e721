"""Weight delay (staleness) of a run, measured on its timeline, never taken from a formula.

The definition follows the stale block-SGD abstraction of the PipeDream theory paper
("Demystifying Pipeline Parallelism: First Theory for PipeDream"): the run's block updates
(one stage's optimizer step is an update of that stage's block) are counted in one global
order, and a microbatch's gradient for block s was computed on the blocks each stage j read
in the forward of that microbatch.

1. Events. An update (OPTIMIZER_STEP) happens at its *end*: its weights are visible from the
   instant it completes. A forward happens at its *start* (the instant it begins computing,
   after any wait for its input): it reads what is visible then. So a forward that starts at
   the very instant an update ends has seen it, whichever stages or ranks the two belong to.
   A forward never sees an update that comes after it in its own rank's list (this only
   matters for zero-length actions, where both can be at one instant).
2. Global order of updates: by the instant they end; updates that end at the same instant are
   ordered by stage index, then rank and list position, so the order is total. (In
   PipeDream's steady state the updates that tie are stage s's of microbatch m and stage
   s - 2i's of microbatch m - i, so this is also the order of the microbatches, the order of
   the sequential SGD the pipeline stands for.)
3. A forward of microbatch m on stage j records R(m, j) = the number of updates it has seen.
   The update of microbatch m on stage s, with k updates before it in the global order, has
   for every stage j the delay d[j] = k - R(m, j): the updates (of any stage) that the
   weights stage j used for m were missing when the update was applied.

An update is "of" every microbatch it lists, so a flushed step over a minibatch yields one
set of delays per microbatch. Replicas of a stage perform the same logical update (same
stage, copy and version): it counts once, at the first of them to end. Model averaging
(localsgd's AVERAGE) is not an update of a microbatch and is not counted. An update of a
microbatch m >= N (N = `num_microbatches`: a window cut from a longer run) counts in the
order but reports no delays.

Statistics cover the steady state: updates of microbatches m with S <= m < N - S.

PipeDream (1F1B, no replicas) with unit costs (forward = backward = 1, updates and transfers
0): in the steady state stage j forwards m at t_m + j and stage s's update of m ends at
t_m + 2S - s, with t_{m+1} = t_m + 2. Counting the updates in between gives
d = sum over stages s' of #{x = s' mod 2 : j < x < 2S - s} + #{s' < s : s' = s mod 2}, whose
maximum (s = j = 0) and mean over (s, j) are

    max  = S^2 - ceil(S/2)                                 (= S^2 - S/2 for even S)
    mean = S^2/2 + S/4 - 1/2 - (S mod 2) / (4S)

(`pipedream_unit_law`; checked against the simulator for S = 2..32 in tests/test_staleness.py
and up to 64 in bench/delay_law.py). This is the paper's S^2 - S/2 + O(1). Breaking a tie
between an update and a forward by stage index instead (what this module once did) gives
S^2 - 1, and ordering tied updates by descending stage does too: the S/2 term is exactly the
updates that end at the instant a forward starts.

Because the input is a list of timed actions, the runtime's trace is analysed the same way:
`records_from_events` turns `TraceEvent`s into the records `weight_delays` takes.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from pipedream_fast.ir import Action, ActionKind

if TYPE_CHECKING:
    from pipedream_fast.trace import TraceEvent


class TimedAction(Protocol):
    """What `weight_delays` reads of a record (a `sim.ActionRecord` is one)."""

    @property
    def rank(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def action(self) -> Action: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...


@dataclass(frozen=True)
class EventRecord:
    """A runtime (or read-back) trace event as `weight_delays` needs it: `start` is when the
    action began computing (the event's start plus its wait for input), `end` when it ended."""

    rank: int
    index: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Delay:
    """d[read_stage] of the update of `microbatch` on `update_stage`."""

    microbatch: int
    update_stage: int
    read_stage: int
    delay: int


class DelaySummary(TypedDict):
    """Max, mean and count of some delays; max and mean are None when there are none."""

    max: int | None
    mean: float | None
    count: int


def _summary(values: Sequence[int]) -> DelaySummary:
    if not values:
        return {"max": None, "mean": None, "count": 0}
    return {"max": max(values), "mean": sum(values) / len(values), "count": len(values)}


@dataclass
class DelayReport:
    num_stages: int
    num_microbatches: int
    delays: list[Delay] = field(default_factory=list)  # every update, steady or not

    @property
    def steady_range(self) -> tuple[int, int]:
        """Microbatches m with lo <= m < hi count as steady state (empty when N <= 2S)."""
        return self.num_stages, self.num_microbatches - self.num_stages

    @property
    def steady(self) -> list[Delay]:
        lo, hi = self.steady_range
        return [d for d in self.delays if lo <= d.microbatch < hi]

    @property
    def max_delay(self) -> int | None:
        return _summary([d.delay for d in self.steady])["max"]

    @property
    def mean_delay(self) -> float | None:
        return _summary([d.delay for d in self.steady])["mean"]

    def per_stage(self, by: str = "update_stage") -> dict[int, DelaySummary]:
        """Max/mean/count of steady delays grouped by `update_stage` or `read_stage`."""
        groups: dict[int, list[int]] = {s: [] for s in range(self.num_stages)}
        for d in self.steady:
            groups[getattr(d, by)].append(d.delay)
        return {s: _summary(v) for s, v in groups.items()}

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(d.delay for d in self.steady).items()))

    def to_dict(self) -> dict[str, Any]:
        lo, hi = self.steady_range
        return {"definition": "d[j] = k - R(m, j); updates counted at their end, forwards "
                              "at their start (an update ending then is seen); steady state "
                              "S <= m < N - S",
                "steady_microbatches": [lo, hi], "max_delay": self.max_delay,
                "mean_delay": self.mean_delay,
                "per_update_stage": {str(s): v for s, v in self.per_stage().items()},
                "per_read_stage": {str(s): v for s, v in self.per_stage("read_stage").items()},
                "histogram": {str(k): v for k, v in self.histogram().items()}}


def records_from_events(events: Iterable[TraceEvent]) -> list[EventRecord]:
    """The forwards and updates of trace events (the runtime's `Pipeline.last_events`, a
    trace read back with `read_chrome_trace`, or `events_from_simulation`'s), as records for
    `weight_delays`. The action is read from the IR text the event carries (args "token"
    from the runtime, "action" from the simulator), which names an update's microbatches;
    `index` is args "index" when present, else the event's position among its rank's events
    in time order."""
    by_rank: dict[int, list[TraceEvent]] = defaultdict(list)
    for ev in events:
        by_rank[ev.rank].append(ev)
    out = []
    for rank, evs in by_rank.items():
        for position, ev in enumerate(sorted(evs, key=lambda e: e.start_ms)):
            if ev.kind not in (ActionKind.FORWARD.value, ActionKind.OPTIMIZER_STEP.value):
                continue
            text = ev.args.get("token") or ev.args.get("action")
            if not text:
                raise ValueError(f"a {ev.kind} event of rank {rank} at {ev.start_ms} ms carries "
                                 f"no IR text (args 'token' or 'action'): cannot tell which "
                                 f"microbatches it applies")
            index = int(ev.args.get("index", position))
            start = ev.start_ms + float(ev.args.get("waited_ms", 0.0))
            out.append(EventRecord(rank, index, Action.parse(str(text)), start,
                                   ev.start_ms + ev.duration_ms))
    return out


def trace_delays(events: Iterable[TraceEvent], num_stages: int | None = None,
                 num_microbatches: int | None = None) -> DelayReport:
    """`weight_delays` of trace events; S and N default to what the forwards show (the
    highest stage and microbatch forwarded, plus one)."""
    records = records_from_events(events)
    forwards = [r.action for r in records if r.action.kind is ActionKind.FORWARD]
    if num_stages is None:
        num_stages = 1 + max((a.stage for a in forwards), default=-1)
    if num_microbatches is None:
        num_microbatches = 1 + max((a.microbatch or 0 for a in forwards), default=-1)
    return weight_delays(records, num_stages, num_microbatches)


def pipedream_unit_law(num_stages: int) -> tuple[int, Fraction]:
    """(max, mean) steady-state delay of PipeDream with S stages and unit costs, derived in
    the module docstring: S^2 - ceil(S/2) and S^2/2 + S/4 - 1/2 - (S mod 2)/(4S)."""
    s = num_stages
    return s * s - (s + 1) // 2, Fraction(2 * s ** 3 + s * s - 2 * s - s % 2, 4 * s)


def weight_delays(records: Sequence[TimedAction], num_stages: int,
                  num_microbatches: int) -> DelayReport:
    """Apply the definition above to timed actions (anything with rank, index, action, start
    and end: a `sim.ActionRecord`, or an `EventRecord` from a trace)."""
    def key(r: TimedAction) -> tuple[float, int, int, int, int]:
        if r.action.kind is ActionKind.OPTIMIZER_STEP:  # visible from the instant it ends
            return (r.end, 0, r.action.stage, r.rank, r.index)
        return (r.start, 1, r.action.stage, r.rank, r.index)  # before it: seen

    order = sorted((r for r in records
                    if r.action.kind in (ActionKind.FORWARD, ActionKind.OPTIMIZER_STEP)),
                   key=key)
    report = DelayReport(num_stages, num_microbatches)
    read: dict[int, list[int | None]] = {}  # mb -> [R(m, j) for every stage j]
    seen: set[tuple[int, int, int | None]] = set()  # (stage, copy, version) of an update
    counted: dict[int, list[int]] = defaultdict(list)  # rank -> list indices of its updates
    processed = 0
    for rec in order:
        a = rec.action
        if a.kind is ActionKind.FORWARD:
            assert a.microbatch is not None  # Action() checks that every forward names one
            mine = counted[rec.rank]  # updates at this instant later in the rank's own list
            row = read.setdefault(a.microbatch, [None] * num_stages)
            row[a.stage] = processed - len(mine) + bisect.bisect_right(mine, rec.index)
            continue
        update = (a.stage, a.copy, a.version)
        if update in seen:
            continue
        seen.add(update)
        bisect.insort(counted[rec.rank], rec.index)
        for m in a.microbatches:
            if m >= num_microbatches:
                continue
            row = read.get(m, [None] * num_stages)
            for j, seen_then in enumerate(row):
                if seen_then is None:
                    raise ValueError(f"the update {a.to_text()} on rank {rec.rank} applies "
                                     f"microbatch {m}, but the timeline has no forward of "
                                     f"microbatch {m} on stage {j} before it")
                report.delays.append(Delay(m, a.stage, j, processed - seen_then))
        processed += 1
    return report
