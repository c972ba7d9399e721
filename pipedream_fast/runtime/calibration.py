"""Measured speed, in the ranks: a running estimate of what each action costs on this rank.

The executor hands every action it performs to its rank's `Calibration` (`record`: the
action, when it started and ended, and how long it waited for a message inside), a few
float adds per action and no trace. From those the calibration keeps, per rank:

- the **own time** of every action kind per stage: forwards and backwards without their wait
  for a message (and, on the first stage, without the data feed), updates without their
  wait for the gradient all-reduce (kept apart: `allreduce_wait`), sends, receive posts,
  snapshots and releases as the executor spends them;
- the **overhead between actions**: the gap from the end of one action to the start of the
  next on the same rank (the executor's loop, the run loop's step bookkeeping, the stop
  vote, the caller's loop body at each step). For a model whose actions take a millisecond
  or less this is a large part of a step, and the up-front profile knows nothing of it;
- the **data feed** per microbatch on the first stage (reading and splitting the loader's
  minibatch, `timed_feed`);
- each **link's transfer time**, from the sender starting its SEND (or the receiver posting
  its RECV, if later: the engine receives only into a posted receive) to the receiver's
  tensor being ready. Neither end knows all the instants, so the sender keeps its send times
  and the receiver, by microbatch, when it posted the receive, when it asked for the tensor
  and how long it waited; `pair_transfers` matches them when the ranks' snapshots are
  brought together, and takes the constant time under which the receiver would have waited
  as long in all as it did (`transfer_time`: a message that was there already shows only an
  upper bound of its transfer). Times are `time.perf_counter()`, the system's monotonic
  clock: comparable between the threads and processes of one machine (ranks on several
  machines would need a clock offset);
- the **run overhead**: the time of a `train()` call outside its executor runs (agreeing on
  the data, building and validating the schedule, setting up the stages, the last votes).

The executor hands each action over as it ends (`later`) and the recording itself waits
(`catch_up`) until the rank would wait for a message that has not come, where it costs the
pipeline nothing; every reader catches up first, so what is read is the same.

Every estimate is a **windowed mean** over the rank's last `window` to 2 x `window` actions
(default 1024): each kept as two buckets of sums, the one being filled and the last full one,
and every bucket of the rank turned over at once when `window` actions have been recorded, so
all the estimates of a rank cover the same stretch of time (a per-kind count would let the
gap, sampled at every action, follow a later moment than the update, sampled once a step).
Not an exponential moving average, because what the simulator needs is each cost's mean, and
the samples are periodic rather than noisy around one value: the gap after the last action of
a step carries the step's bookkeeping, the first actions of a run their warm-up. An EMA read
right after such a sample jumps by `alpha` times it, so its value depends on where in the
period it is read; a mean over many whole periods does not. The window still forgets: after
2 x `window` actions the old speed is gone, which is what a drifting machine needs. Samples of
each kind's first action in every run are left out (`skip_first`): they carry one-off costs
(first calls, first messages of a link, allocations) that the steady state does not pay, and
that the runs' measured rate leaves out as well; so is the first `train()` call's overhead (it
cuts the model, makes the stages and opens the links). A rank's first steps are slower for
longer than one action (the links' receive pools fill, first messages, first calls): a caller
that wants the steady state calls `reset()` after them, as `pipedream-fast train` does after
its first epoch and `bench/sim_accuracy.py` after its warm-up steps.

Microbatch size is fixed within a run (the links keep the shapes of their first message), so
the estimates are per microbatch of the run's size, with no scaling.

`snapshot()` freezes the estimates (a `CalibrationSnapshot`, picklable, JSON-able with
`to_dict`); `sim.MeasuredCosts.from_calibration` turns the snapshots of every rank into the
simulator's cost model. `Pipeline.calibration` is the rank's (with ranks="threads", every
rank's, by rank); `snapshots(pipe)` reads them in both cases.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipedream_fast.ir import KIND_SPECS, Action, ActionKind

K = ActionKind
_VALUES = {kind: kind.value for kind in ActionKind}  # an Enum's .value is a slow property
_GAP: tuple[str, int | None] = ("gap", None)

# (tensor "act" | "grad", receiving stage, sending rank, receiving rank)
Link = tuple[str, int, int, int]

WINDOW = 1024  # actions per bucket: estimates cover the rank's last 1024 to 2048 actions
MAX_PENDING = 4096  # actions `Calibration.later` keeps before it records them anyway


class WindowedMean:
    """A mean over two buckets of samples: the one being filled and the last full one
    (`rotate` starts a new bucket, forgetting the oldest); O(1) per sample."""

    __slots__ = ("_sum", "_n", "_old_sum", "_old_n")

    def __init__(self) -> None:
        self._sum, self._n = 0.0, 0
        self._old_sum, self._old_n = 0.0, 0

    def add(self, value: float) -> None:
        self._sum += value
        self._n += 1

    def rotate(self) -> None:
        self._old_sum, self._old_n = self._sum, self._n
        self._sum, self._n = 0.0, 0

    @property
    def count(self) -> int:
        return self._n + self._old_n

    @property
    def mean(self) -> float | None:
        n = self.count
        return (self._sum + self._old_sum) / n if n else None

    def estimate(self) -> Estimate | None:
        mean = self.mean
        return None if mean is None else Estimate(mean, self.count)


class _Stamps:
    """Times by microbatch for one link, in two buckets as `WindowedMean`'s."""

    __slots__ = ("_new", "_old")

    def __init__(self) -> None:
        self._new: dict[int, Any] = {}
        self._old: dict[int, Any] = {}

    def put(self, microbatch: int, value: Any) -> None:
        self._new[microbatch] = value

    def rotate(self) -> None:
        self._old, self._new = self._new, {}

    def items(self) -> dict[int, Any]:
        return {**self._old, **self._new}


@dataclass(frozen=True)
class Estimate:
    """A windowed mean (seconds) and how many samples it holds."""

    mean_s: float
    count: int

    @property
    def ms(self) -> float:
        return self.mean_s * 1e3


@dataclass(frozen=True)
class CalibrationSnapshot:
    """One rank's estimates at one moment (seconds). `actions`: own time per (kind, stage)
    (stage None for kinds without one); `sent`/`ready`: per link, by microbatch, when the
    sender started the send, and (`ready`) when the receiver asked for the tensor, how long
    it waited for it and when it had posted the receive."""

    rank: int
    actions: dict[tuple[str, int | None], Estimate] = field(default_factory=dict)
    gap: Estimate | None = None
    feed: Estimate | None = None
    allreduce_wait: dict[int, Estimate] = field(default_factory=dict)
    run_overhead: Estimate | None = None
    sent: dict[Link, dict[int, float]] = field(default_factory=dict)
    ready: dict[Link, dict[int, tuple[float, float, float]]] = field(default_factory=dict)

    def action_ms(self, kind: ActionKind | str, stage: int | None) -> float | None:
        found = self.actions.get((ActionKind(kind).value, stage))
        return None if found is None else found.ms

    def to_dict(self) -> dict[str, Any]:
        """The estimates in ms, for JSON (the per-message stamps left out)."""
        def ms(e: Estimate | None) -> float | None:
            return None if e is None else e.ms

        return {"rank": self.rank,
                "actions_ms": {f"{k}" + ("" if s is None else f"@{s}"): e.ms
                               for (k, s), e in sorted(self.actions.items(), key=str)},
                "overhead_ms": ms(self.gap), "feed_ms": ms(self.feed),
                "allreduce_wait_ms": {str(s): e.ms for s, e in self.allreduce_wait.items()},
                "run_overhead_ms": ms(self.run_overhead),
                "samples": {f"{k}" + ("" if s is None else f"@{s}"): e.count
                            for (k, s), e in sorted(self.actions.items(), key=str)}}


class Calibration:
    """One rank's running estimates (see the module's docstring). Not thread-safe: one
    rank's executor feeds it, and it is read between runs."""

    def __init__(self, rank: int, window: int = WINDOW, skip_first: int = 1) -> None:
        self.rank = rank
        self.window = window
        self.skip_first = skip_first
        self._trains = 0  # train() calls ended, in the rank's life (the first warms up)
        # Where the run in progress is (kept by `reset`, which forgets only the estimates).
        # (tensor, stage, mb) -> (peer, when the receive was posted)
        self._posted: dict[tuple[str, int, int], tuple[int, float]] = {}
        self._seen: dict[tuple[str, int | None], int] = {}  # this run's samples per key
        self._last_end: float | None = None
        self._feed_pending = 0.0
        self._train_began: float | None = None
        self._spans = 0.0  # executor time of the train() call in progress
        self._run_first: float | None = None
        # Actions performed and not recorded yet (`later`): (action, start, end, waited, feed)
        self.pending: list[tuple[Action, float, float, float, float]] = []
        self.reset(window)

    def reset(self, window: int | None = None) -> None:
        """Forgets every estimate: a new window starts here (of `window` actions per bucket,
        if given). May be called mid-run (between two steps): the run goes on being
        recorded, its warm-up already left out."""
        self.catch_up()
        if window is not None:
            if window < 1:
                raise ValueError(f"window must be >= 1 action, got {window}")
            self.window = window
        self._actions: dict[tuple[str, int | None], WindowedMean] = {}
        self._gap = WindowedMean()
        self._feed = WindowedMean()
        self._allreduce_wait: dict[int, WindowedMean] = {}
        self._run_overhead = WindowedMean()
        self._sent: dict[Link, _Stamps] = {}
        self._ready: dict[Link, _Stamps] = {}
        self._recorded = 0  # actions recorded into the current buckets

    def _rotate(self) -> None:
        """Every estimate starts a new bucket and forgets its oldest."""
        self._recorded = 0
        for mean in (self._gap, self._feed, self._run_overhead, *self._actions.values(),
                     *self._allreduce_wait.values()):
            mean.rotate()
        for stamps in (*self._sent.values(), *self._ready.values()):
            stamps.rotate()

    # --- fed by the run loop and the executor --------------------------------------------------
    def begin_train(self) -> None:
        """A `train()` call starts (its overhead is measured from here)."""
        self.catch_up()
        self._close_run()
        self._train_began, self._spans = time.perf_counter(), 0.0

    def end_train(self) -> None:
        """A `train()` call ended normally: its time outside the executor is one sample."""
        self.catch_up()
        self._close_run()
        if self._train_began is not None:
            if self._trains >= self.skip_first:  # the first call also sets everything up
                self._run_overhead.add(max(0.0, time.perf_counter() - self._train_began
                                           - self._spans))
            self._trains += 1
        self._train_began = None

    def begin_run(self) -> None:
        """An executor run starts: no gap before its first action, kinds warm up again."""
        self.catch_up()
        self._close_run()
        self._seen.clear()
        self._posted.clear()
        self._feed_pending = 0.0

    def _close_run(self) -> None:
        if self._run_first is not None and self._last_end is not None:
            self._spans += self._last_end - self._run_first
        self._run_first, self._last_end = None, None

    def timed_feed(self, inputs: Callable[[int], Any]) -> Callable[[int], Any]:
        """The first stage's input source, timed: its time is taken off the forward that
        calls it and counted as the feed's."""
        def timed(mb: int) -> Any:
            began = time.perf_counter()
            try:
                return inputs(mb)
            finally:
                self.note_feed(time.perf_counter() - began)
        return timed

    def note_feed(self, seconds: float) -> None:
        """Time the data feed took inside the action being performed (a first-stage forward):
        the feed's, not the action's own."""
        self._feed_pending += seconds

    def later(self, action: Action, start: float, end: float, waited: float) -> None:
        """`record`, deferred: the action is kept (with the feed's time inside it) until
        `catch_up`, which the executor calls while it waits for a message that has not come
        (so the bookkeeping costs the pipeline nothing) and every reader calls first. Past
        `MAX_PENDING` actions it records them at once (bounded memory)."""
        pending = self.pending
        pending.append((action, start, end, waited, self._feed_pending))
        self._feed_pending = 0.0
        if len(pending) >= MAX_PENDING:
            self.catch_up()

    def catch_up(self) -> None:
        """Records every action `later` kept, in order."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        noted = self._feed_pending  # the feed of the action in progress, if any
        record = self.record
        for action, start, end, waited, feed in pending:
            self._feed_pending = feed
            record(action, start, end, waited)
        self._feed_pending = noted

    def record(self, action: Action, start: float, end: float, waited: float) -> None:
        """One action the executor performed: `start`/`end` (perf_counter seconds) and the
        part of it spent waiting for a message or a gradient all-reduce. Called for every
        action, so it keeps to dictionary lookups and float adds."""
        self._recorded += 1
        if self._recorded >= self.window:
            self._rotate()
        seen, skip = self._seen, self.skip_first
        if self._run_first is None:
            self._run_first = start
        elif self._last_end is not None and (seen.get(_GAP, 0) >= skip or self._warm(_GAP)):
            gap = self._gap  # WindowedMean.add, inline: a call fewer per action
            gap._sum += start - self._last_end
            gap._n += 1
        self._last_end = end
        kind = action.kind
        spec = KIND_SPECS[kind]
        key = (_VALUES[kind], action.stage)
        warm = seen.get(key, 0) >= skip or self._warm(key)
        if spec.sends:
            assert action.peer is not None and action.microbatch is not None
            stage = action.stage + (1 if spec.tensor == "act" else -1)
            link = (spec.tensor or "", stage, self.rank, action.peer)
            stamps = self._sent.get(link) or self._stamps(self._sent, link)
            stamps._new[action.microbatch] = start  # _Stamps.put, inline
        elif spec.timing == "post":
            assert action.peer is not None and action.microbatch is not None
            self._posted[(spec.tensor or "", action.stage, action.microbatch)] = (action.peer,
                                                                                  end)
        elif spec.compute and action.microbatch is not None and (kind is K.FORWARD
                                                                or spec.needs_output_grad):
            # the message it took from a RECV: (tensor, receiving stage, microbatch)
            tensor = "act" if kind is K.FORWARD else "grad"
            posted = self._posted.pop((tensor, action.stage, action.microbatch), None)
            if posted is not None:
                link = (tensor, action.stage, posted[0], self.rank)
                stamps = self._ready.get(link) or self._stamps(self._ready, link)
                stamps._new[action.microbatch] = (start, waited, posted[1])
        feed, self._feed_pending = self._feed_pending, 0.0
        if not warm:
            return
        own = end - start - waited
        if feed:
            own -= feed
            self._feed.add(feed)
        mean = self._actions.get(key)
        if mean is None:
            mean = self._actions[key] = WindowedMean()
        mean._sum += own  # as above
        mean._n += 1
        if kind is K.OPTIMIZER_STEP:
            wait = self._allreduce_wait.get(action.stage)
            if wait is None:
                wait = self._allreduce_wait[action.stage] = WindowedMean()
            wait.add(waited)

    def _warm(self, key: tuple[str, int | None]) -> bool:
        """Whether this run has seen `skip_first` samples of `key` already (counts this one)."""
        seen = self._seen.get(key, 0)
        if seen >= self.skip_first:
            return True
        self._seen[key] = seen + 1
        return False

    @staticmethod
    def _stamps(table: dict[Link, _Stamps], link: Link) -> _Stamps:
        found = table.get(link)
        if found is None:
            found = table[link] = _Stamps()
        return found

    # --- read ----------------------------------------------------------------------------------
    def snapshot(self) -> CalibrationSnapshot:
        """The estimates now, frozen."""
        self.catch_up()
        def est(m: WindowedMean) -> Estimate | None:
            return m.estimate()

        return CalibrationSnapshot(
            rank=self.rank,
            actions={k: e for k, m in self._actions.items() if (e := est(m)) is not None},
            gap=est(self._gap), feed=est(self._feed),
            allreduce_wait={s: e for s, m in self._allreduce_wait.items()
                            if (e := est(m)) is not None},
            run_overhead=est(self._run_overhead),
            sent={link: s.items() for link, s in self._sent.items()},
            ready={link: s.items() for link, s in self._ready.items()})


def pair_transfers(snapshots: Iterable[CalibrationSnapshot]) -> dict[Link, Estimate]:
    """Each link's transfer time T, from the sender's send times and the receiver's stamps
    of the same microbatches (see `transfer_time`)."""
    snaps = list(snapshots)
    sent: dict[Link, dict[int, float]] = {}
    for snap in snaps:
        for link, stamps in snap.sent.items():
            sent.setdefault(link, {}).update(stamps)
    out: dict[Link, Estimate] = {}
    for snap in snaps:
        for link, ready in snap.ready.items():
            sends = sent.get(link, {})
            # a message leaves once sent and its receive posted (the engine receives only
            # into a posted receive): the receiver's slack is from then to when it asked
            found = [(asked - max(sends[mb], posted), waited)
                     for mb, (asked, waited, posted) in ready.items() if mb in sends]
            if found:
                out[link] = Estimate(transfer_time([x for x, _ in found],
                                                   sum(w for _, w in found)), len(found))
    return out


def transfer_time(slacks: list[float], waited: float) -> float:
    """The constant transfer time T under which the receiver waits as long in all as it did:
    sum(max(0, T - slack)) = `waited`, where a message's slack is the time from its leaving
    (sent and its receive posted) to the receiver asking for it.

    Only a message the receiver waited for shows its transfer (slack + wait); one that was
    there already shows only that it took less than its slack. The mean over the messages
    waited for would be biased to the slow ones where the receiver is mostly late (a rank
    that rarely waits for its gradients waits for the ones that were slow); matching the
    total wait is not, and it is what the simulator's timing of the receiver needs. If the
    receiver never waited, T is the smallest slack (the largest T with no wait)."""
    xs = sorted(slacks)
    if not xs:
        return 0.0
    total = 0.0
    for k, x in enumerate(xs, start=1):  # T in [x_k, x_k+1]: k * T - (x_1 + .. + x_k) = waited
        total += x
        t = (waited + total) / k
        if k == len(xs) or t <= xs[k]:
            return max(0.0, t)
    return max(0.0, xs[0])  # not reached


def calibrations(pipe: Any) -> list[Calibration]:
    """The calibrations of every rank this process holds: a process rank's own, or with
    ranks="threads" every rank thread's (`Pipeline.calibration` is then by rank)."""
    found = pipe.calibration
    if isinstance(found, Mapping):
        return [found[r] for r in sorted(found)]
    return [found]


def snapshots(pipe: Any) -> dict[int, CalibrationSnapshot]:
    """Every rank's snapshot this process holds (see `calibrations`), by rank."""
    return {c.rank: c.snapshot() for c in calibrations(pipe)}


def summary(snaps: Mapping[int, CalibrationSnapshot]) -> dict[str, Any]:
    """The figures the issue names, in ms, from every rank's snapshot: per stage its forward
    and backward per microbatch and its update, per rank the overhead between actions and
    the feed, per link its transfer, per train() call the run overhead."""
    per_stage: dict[str, dict[str, float]] = {}
    for snap in snaps.values():
        for (kind, stage), e in snap.actions.items():
            if stage is None or kind not in ("forward", "backward", "backward_input",
                                             "backward_weight", "optimizer_step"):
                continue
            name = "update" if kind == "optimizer_step" else kind
            per_stage.setdefault(str(stage), {})[f"{name}_ms"] = e.ms
        for stage, e in snap.allreduce_wait.items():
            if e.mean_s > 0:  # a replicated stage's update waits for its gradients
                per_stage.setdefault(str(stage), {})["allreduce_wait_ms"] = e.ms
    return {"stages": per_stage,
            "overhead_ms": {str(r): s.gap.ms for r, s in snaps.items() if s.gap},
            "feed_ms": {str(r): s.feed.ms for r, s in snaps.items() if s.feed},
            "transfer_ms": {f"{t} to stage {st}, rank {a}->{b}": e.ms
                            for (t, st, a, b), e in pair_transfers(snaps.values()).items()},
            "run_overhead_ms": {str(r): s.run_overhead.ms for r, s in snaps.items()
                                if s.run_overhead}}
