"""The RPD replay: stale block-SGD along a schedule's simulated timeline.

Methods are schedules of `pipedream_fast.schedules`, timed by the simulator with `UnitCosts()`
(forward 1, backward 1 (a split backward's input and weight parts 1/2 each), transfers,
updates and averages 0). The parameter vector is split into S contiguous blocks
(`numpy.array_split`); block j is stage j's weights. The simulation's records are replayed in
time order (a compute at its start, an update or average at its end; ties by rank and list
position) on per-(stage, copy) weight versions exactly as the IR names them:

  FORWARD(j, m, version v, copy c)  records the read: block j of microbatch m = version v
                                    of (j, c);
  BACKWARD(j, m), or the            adds block j of grad f_m(x_read(m)) to (j, c)'s gradient
  BACKWARD_WEIGHT(j, m) of a split  buffer, where x_read(m) is the concatenation of the
  backward                          blocks m's forwards read (computed once per m);
  BACKWARD_INPUT(j, m)              nothing: it makes only the input gradient, which the
                                    stage before waits for; the weights are untouched until
                                    the microbatch's BACKWARD_WEIGHT (the IR's contract);
  OPTIMIZER_STEP(j, version v)      newest - gamma * buffer / len(microbatches) becomes v;
  AVERAGE(j, version v)             every copy of block j becomes the mean of the copies.

Transfers, SNAPSHOT and RELEASE do not change weights (the replay keeps every version a
forward may still read). Any other kind is refused (`ReplayError`, naming the schedule): an
ALLREDUCE of replicated stages, or a kind added to the IR later, is not silently skipped.

So block j's update for m uses the gradient at the parameters every block had when m read
it: RPD's stale-read rule with exactly the schedule's delays (weight stashing makes the
backward of m use the version its forward read). The reported loss is the full objective at
the current parameters: the newest version of every block, for localsgd the mean of the R
copies' newest versions (what an averaging at that instant would produce).

Staleness corrections (`Method("pipedream", staleness=...)`: predict, nesterov, lr-scale; the
definition is `pipedream_fast.runtime.staleness_correction`'s, written out here on the
blocks). The delay of m on (j, c) is d = u - k: m's FORWARD read version k, and the
OPTIMIZER_STEP of (j, c) that lists m makes version u + 1 (the replay finds that record
among its own). (j, c) keeps v, the moving average (beta = 0.9) of its updates' changes
(delta = the new version - the one before), and t, its number of updates; v_hat = v / (1 -
beta^t), 0 before the first. predict: m's FORWARD reads version k + d v_hat; nesterov:
version k + (beta + ... + beta^d) v_hat (v_hat as it is at that FORWARD); m's gradient is
taken at the shifted blocks it read. lr-scale: the OPTIMIZER_STEP's step size is gamma / (1 +
the mean delay of its microbatches). Every update is applied to the newest version, as
without a correction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pipedream_fast.ir import ActionKind, Schedule
from pipedream_fast.schedules import make_schedule
from pipedream_fast.sim import ActionRecord, UnitCosts, simulate

from research.study.objectives import Objective

K = ActionKind

# What each action kind does to the replayed weights (`KIND_SPECS` in pipedream_fast.ir says
# what each kind is). "gradient" is exactly the compute kinds that end a microbatch
# (`ends_microbatch`: they add its weight gradient); tests/test_study.py holds the two to it.
# A kind missing here is refused, never skipped.
EFFECTS: dict[ActionKind, str] = {
    K.FORWARD: "read",
    K.BACKWARD: "gradient",
    K.BACKWARD_INPUT: "none",  # the input gradient only: no weight is touched
    K.BACKWARD_WEIGHT: "gradient",  # the split backward's weight gradient
    K.OPTIMIZER_STEP: "update",
    K.AVERAGE: "average",
    K.SEND_ACT: "none", K.RECV_ACT: "none", K.SEND_GRAD: "none", K.RECV_GRAD: "none",
    K.SNAPSHOT: "none", K.RELEASE: "none",
}
CORRECTIONS = ("predict", "nesterov", "lr-scale")  # the library's staleness corrections
BETA = 0.9  # their velocity's moving average (and nesterov's per-update decay)
_WHY_NOT = {K.ALLREDUCE: "replicated stages sum their gradient buffers across ranks, and the "
                         "replay keeps one weight history per (stage, copy)"}


class ReplayError(ValueError):
    """A schedule whose actions the RPD replay does not model."""


def check_replayable(schedule: Schedule) -> None:
    """Raise ReplayError if `schedule` has an action kind without a replay effect."""
    kinds = {a.kind for actions in schedule.actions for a in actions}
    refused = sorted((k for k in kinds if k not in EFFECTS), key=lambda k: k.value)
    if refused:
        why = "; ".join(f"{k.value.upper()}: {_WHY_NOT.get(k, 'a kind the replay does not model')}"
                        for k in refused)
        raise ReplayError(f"schedule {schedule.name!r} cannot be replayed by the study: {why}")


@dataclass(frozen=True)
class Method:
    """pipedream, localsgd (with H = local_steps, R = S), sync (gpipe, one microbatch per
    update), or any other schedule name of `pipedream_fast.schedules` (1f1b, zb-h1, ...) with
    `chunks` microbatches per update (default: the schedule's)."""

    kind: str
    local_steps: int | None = None
    chunks: int | None = None
    staleness: str | None = None  # predict, nesterov or lr-scale (asynchronous schedules)

    @property
    def label(self) -> str:
        if self.kind == "localsgd":
            return f"localsgd-H{self.local_steps}"
        base = self.kind if self.chunks is None else f"{self.kind}-c{self.chunks}"
        if self.staleness is None:
            return base
        return f"{'pd' if base == 'pipedream' else base}+{self.staleness}"

    def schedule(self, stages: int, microbatches: int) -> Schedule:
        if self.staleness is not None and self.kind in ("localsgd", "sync"):
            raise ValueError(f"staleness applies to the asynchronous schedules, not "
                             f"{self.kind!r}")
        if self.kind == "localsgd":
            return make_schedule("localsgd", stages, microbatches, local_steps=self.local_steps)
        if self.local_steps is not None:
            raise ValueError(f"local_steps applies only to localsgd, not {self.kind!r}")
        if self.kind == "sync":
            return make_schedule("gpipe", stages, microbatches, chunks=1)
        extra: dict[str, Any] = {} if self.staleness is None else {"staleness": self.staleness}
        return make_schedule(self.kind, stages, microbatches, chunks=self.chunks, **extra)


def lookahead(kind: str | None, delay: int) -> float:
    """How many velocities a FORWARD with `delay` moves its block along (0: none)."""
    if delay <= 0:
        return 0.0
    if kind == "predict":
        return float(delay)
    if kind == "nesterov":
        return sum(BETA ** i for i in range(1, delay + 1))
    return 0.0


def effect_time(r: ActionRecord) -> float:
    """When a record acts on the weights: an update at its end, a compute at its start."""
    return r.end if EFFECTS[r.action.kind] in ("update", "average") else r.start


_TIMELINES: dict[tuple[Method, int, int], tuple[list[ActionRecord], int]] = {}


def timeline(method: Method, stages: int, microbatches: int) -> tuple[list[ActionRecord], int]:
    """The unit-cost simulation of `method` on S stages and N microbatches: its records that
    act on the weights, in replay order, and its model replicas (copies). Raises ReplayError
    for a schedule the replay does not model. A staleness correction changes no action of
    its schedule (it is recorded in the schedule's params: the replay applies it, given
    `method.staleness`), so a corrected method shares the plain method's timeline."""
    if method.staleness is not None:
        method.schedule(stages, microbatches)  # refuses a correction the schedule lacks
        method = replace(method, staleness=None)
    key = (method, stages, microbatches)
    if key not in _TIMELINES:
        schedule = method.schedule(stages, microbatches)
        check_replayable(schedule)
        records = simulate(schedule, UnitCosts()).records
        kept = sorted((r for r in records if EFFECTS[r.action.kind] != "none"),
                      key=lambda r: (effect_time(r), r.rank, r.index))
        copies = int(schedule.params.get("model_replicas", 1))
        _TIMELINES[key] = (kept, copies)
    return _TIMELINES[key]


def microbatches_for(method: Method, stages: int, budget: float) -> int:
    """Microbatches whose unit-cost run lasts at least `budget` (the run is then cut there)."""
    per = 2.0 * stages if method.kind == "sync" else 2.0
    return int(math.ceil(budget / per)) + 2 * stages


@dataclass
class Curve:
    """Loss against simulated time (at `times`) and against the microbatches stage 0 has
    applied on every block (at `updates`); `diverged` if the parameters blew up (losses
    then inf)."""

    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    updates: list[int] = field(default_factory=list)
    update_losses: list[float] = field(default_factory=list)
    diverged: bool = False
    params: np.ndarray | None = None  # the parameters at the end of the replay

    def final(self, share: float = 0.1) -> float:
        """Mean loss over the last `share` of the time points (inf if diverged)."""
        if self.diverged or not self.losses:
            return math.inf
        k = max(1, int(len(self.losses) * share))
        return float(np.mean(self.losses[-k:]))

    def time_to(self, threshold: float) -> float | None:
        for t, value in zip(self.times, self.losses):
            if value <= threshold:
                return t
        return None

    def to_dict(self) -> dict[str, Any]:
        def clean(v: float) -> float | None:
            return v if math.isfinite(v) else None
        return {"times": self.times, "losses": [clean(v) for v in self.losses],
                "diverged": self.diverged}


def replay(records: Sequence[ActionRecord], copies: int, objective: Objective, stages: int,
           gamma: float, times: Sequence[float] = (), update_every: int = 0,
           max_updates: int | None = None, staleness: str | None = None) -> Curve:
    """Run RPD along a timeline (see the module docstring): gamma is the step size itself
    (not in units of 1/L). Records the loss at each of `times` (in increasing order) and,
    if `update_every` > 0 (one copy only), the loss of x_k = version k of every block for
    k = update_every, 2 update_every, ... up to `max_updates`. `staleness`: a correction
    (predict, nesterov, lr-scale; see the module docstring), None for none."""
    if staleness is not None and staleness not in CORRECTIONS:
        raise ValueError(f"staleness must be one of {', '.join(CORRECTIONS)} or None, got "
                         f"{staleness!r}")
    x0 = objective.x0()
    cuts = np.array_split(np.arange(objective.dim), stages)
    sl = [slice(int(c[0]), int(c[-1]) + 1) for c in cuts]
    versions: dict[tuple[int, int], dict[int, np.ndarray]] = {
        (j, c): {0: x0[sl[j]].copy()} for j in range(stages) for c in range(copies)}
    newest: dict[tuple[int, int], int] = {key: 0 for key in versions}
    buffers: dict[tuple[int, int], np.ndarray] = {
        key: np.zeros(sl[key[0]].stop - sl[key[0]].start) for key in versions}
    reads: dict[int, list[np.ndarray | None]] = {}
    grads: dict[int, tuple[np.ndarray, int]] = {}  # mb -> (its gradient, stages left to use it)
    curve = Curve()
    pending_times = list(times)
    applied = 0  # the largest k whose x_k has been evaluated
    snapshots: dict[int, dict[int, np.ndarray]] = {}  # k -> stage -> version k of its block
    # The staleness correction's state: the version each OPTIMIZER_STEP of (stage, copy)
    # that lists m makes, m's delay there, and each (stage, copy)'s velocity and updates.
    stepped: dict[tuple[int, int, int], int] = {}
    delays: dict[tuple[int, int, int], int] = {}
    velocity = {key: np.zeros_like(versions[key][0]) for key in versions}
    updates = {key: 0 for key in versions}
    shifts = staleness in ("predict", "nesterov")
    if staleness is not None:
        for rec in records:
            u = rec.action
            if EFFECTS[u.kind] == "update" and u.version is not None:
                for mb in u.microbatches:
                    stepped[(u.stage, u.copy, mb)] = u.version

    def current() -> np.ndarray:
        parts = []
        for j in range(stages):
            parts.append(np.mean([versions[(j, c)][newest[(j, c)]] for c in range(copies)],
                                 axis=0))
        return np.concatenate(parts)

    def record_time(t: float) -> None:
        value = objective.loss(current())
        curve.times.append(t)
        curve.losses.append(value if math.isfinite(value) else math.inf)

    def prune(key: tuple[int, int], keep_from: int) -> None:
        for v in [v for v in versions[key] if v < keep_from]:
            del versions[key][v]

    for rec in records:
        t = effect_time(rec)
        while pending_times and pending_times[0] < t:
            record_time(pending_times.pop(0))
        if curve.diverged:
            break
        a = rec.action
        key = (a.stage, a.copy)
        effect = EFFECTS[a.kind]
        if effect == "read":
            assert a.microbatch is not None and a.version is not None
            row = reads.setdefault(a.microbatch, [None] * stages)
            block = versions[key][a.version]
            if staleness is not None:
                mkey = (a.stage, a.copy, a.microbatch)
                # d = u - k: the step listing m makes u + 1 (none: no delay)
                delays[mkey] = stepped.get(mkey, a.version + 1) - 1 - a.version
                steps = lookahead(staleness, delays[mkey])
                if steps and updates[key]:
                    block = block + (steps / (1.0 - BETA ** updates[key])) * velocity[key]
            row[a.stage] = block
        elif effect == "gradient":
            assert a.microbatch is not None
            m = a.microbatch
            if m not in grads:
                row = reads.pop(m)
                assert all(b is not None for b in row), f"microbatch {m} not read by every stage"
                x_read = np.concatenate([b for b in row if b is not None])
                grads[m] = (objective.grad(x_read, m), stages)
            g, left = grads[m]
            buffers[key] += g[sl[a.stage]]
            if left == 1:
                del grads[m]
            else:
                grads[m] = (g, left - 1)
        elif effect == "update":
            assert a.version is not None
            step = gamma
            if staleness is not None:
                ds = [delays.pop((a.stage, a.copy, mb)) for mb in a.microbatches
                      if (a.stage, a.copy, mb) in delays]
                if staleness == "lr-scale" and ds:
                    step = gamma / (1.0 + sum(ds) / len(ds))
            before = versions[key][newest[key]]
            w = before - step * buffers[key] / len(a.microbatches)
            if shifts:
                velocity[key] = BETA * velocity[key] + (1.0 - BETA) * (w - before)
                updates[key] += 1
            buffers[key][:] = 0.0
            versions[key][a.version] = w
            newest[key] = a.version
            # A stage keeps at most ~S versions live (weight stashing): anything 4S older
            # than the newest is no longer read by any forward of this schedule.
            prune(key, a.version - 4 * stages - 4)
            if not np.all(np.isfinite(w)) or float(np.abs(w).max()) > 1e8:
                curve.diverged = True
            v = a.version
            if (update_every > 0 and copies == 1 and v % update_every == 0
                    and (max_updates is None or v <= max_updates)):
                snapshots.setdefault(v, {})[a.stage] = w
                if len(snapshots[v]) == stages:
                    blocks = snapshots.pop(v)
                    value = objective.loss(np.concatenate([blocks[j] for j in range(stages)]))
                    curve.updates.append(v)
                    curve.update_losses.append(value if math.isfinite(value) else math.inf)
                    applied = max(applied, v)
        elif effect == "average":
            assert a.version is not None
            keys = [(a.stage, c) for c in range(copies)]
            mean = np.mean([versions[k][newest[k]] for k in keys], axis=0)
            for k in keys:
                versions[k][a.version] = mean.copy()
                newest[k] = a.version
                prune(k, a.version - 4 * stages - 4)
        if max_updates is not None and applied >= max_updates and not pending_times:
            break
    if curve.diverged:
        while pending_times:
            curve.times.append(pending_times.pop(0))
            curve.losses.append(math.inf)
    else:
        while pending_times:
            record_time(pending_times.pop(0))
    curve.params = current()
    return curve


def run_method(objective: Objective, method: Method, stages: int, gamma: float,
               budget: float, points: int = 200) -> Curve:
    """One run of `method` for `budget` time units at step size gamma (absolute)."""
    n = microbatches_for(method, stages, budget)
    records, copies = timeline(method, stages, n)
    times = [budget * (i + 1) / points for i in range(points)]
    return replay(records, copies, objective, stages, gamma, times,
                  staleness=method.staleness)
