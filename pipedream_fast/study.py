"""The PipeDream-vs-LocalSGD study of the PipeDream theory paper, in simulated time.

"Demystifying Pipeline Parallelism: First Theory for PipeDream" analyses Randomized PipeDream
(RPD), a stale block-SGD abstraction, and compares PipeDream (PD) with LocalSGD in simulated
time: PD wins on a quadratic and a small language model, LocalSGD on logistic regression as
the number of stages S grows. This module reruns that comparison on this project's schedules
(`pipedream-fast study`; results and the honest comparison are in STUDY.md).

Time axis. Every method is a schedule of the IR, simulated with `UnitCosts()`: forward 1,
backward 1, transfers, updates and averages 0 (the textbook unit costs under which
`staleness.pipedream_unit_law` gives the max delay S^2 - ceil(S/2)). The clock of a run is
that simulation's: PD's fill, LocalSGD's drain before every averaging and the synchronous
baseline's fill and drain per update cost exactly what the simulator says. A run is cut at
the time budget T, the same for every method of an objective.

Methods (schedules of `pipedream_fast.schedules`):
  pipedream  `make_schedule("pipedream", S, N)`: asynchronous 1F1B, weight stashing, one
             update of every block per microbatch.
  localsgd   `make_schedule("localsgd", S, N, local_steps=H)` with R = S model replicas
             (the schedule's default): replica m mod R trains on microbatch m with plain
             SGD; every R*H microbatches the pipeline drains and each stage averages its R
             copies.
  sync       `make_schedule("gpipe", S, N, chunks=1)`: synchronous SGD, one microbatch per
             update, the pipeline filled and drained for each (2S time units per update).
             The staleness-free baseline of the gamma^2 S^4 check; in time it is the slowest.

RPD replay (quadratic and logistic). The parameter vector is split into S contiguous blocks
(`numpy.array_split`); block j is stage j's weights. The simulation's records are replayed
in time order (a compute at its start, an update or average at its end; ties by rank and
list position) on per-(stage, copy) weight versions exactly as the IR names them:
  FORWARD(j, m, version v, copy c)  records the read: block j of microbatch m = version v
                                    of (j, c);
  BACKWARD(j, m)                    adds block j of grad f_m(x_read(m)) to (j, c)'s
                                    gradient buffer, where x_read(m) is the concatenation of
                                    the blocks m's forwards read (computed once per m);
  OPTIMIZER_STEP(j, version v)      newest - gamma * buffer / len(microbatches) becomes v;
  AVERAGE(j, version v)             every copy of block j becomes the mean of the copies.
So block j's update for m uses the gradient at the parameters every block had when m read
it: RPD's stale-read rule with exactly the schedule's delays (weight stashing makes the
backward of m use the version its forward read). The reported loss is the full objective at
the current parameters: the newest version of every block, for localsgd the mean of the R
copies' newest versions (what an averaging at that instant would produce). Microbatch m's
sample (noise, or minibatch rows) depends only on (seed, m), so all methods see the same data.

Objectives.
  quadratic  f(x) = 1/2 (x - x*)^T A (x - x*), d = 64, A = Q diag(lambda) Q^T with Q a random
             rotation (blocks are coupled) and lambda log-spaced in [1/100, 1] (condition
             number 100, L = 1); stochastic gradient A (x - x*) + sigma xi_m, sigma = 0.3,
             xi_m ~ N(0, I). x0 = 0, ||x*|| = sqrt(d). Loss f(x) - f* = f(x).
  logistic   L2-regularised logistic regression (lambda = 1e-3) on scikit-learn's
             breast_cancer (569 x 30, standardised, plus a bias column: 31 parameters);
             microbatches of 16 rows drawn with replacement; blocks = feature groups.
             L = lambda_max(X^T X) / (4n) + lambda; step sizes are given in units of 1/L.
  lm         `build_charlm(layers=2)` (blocks embed, block1, block2, head: S = 2 or 4) on the
             `text` corpus through the real runtime (`LocalPipeline`, threads, plain SGD,
             one microbatch of 16 windows per step). Time: the unit-cost simulation of the
             same schedule; loss: the training loss of microbatch m (computed by the last
             stage at the weights m read), placed at the end of m's last-stage forward,
             averaged over windows of 16 microbatches. LocalSGD runs through the runtime only
             when `schedules.kind("localsgd").trainable` (never through the RPD replay).

Step sizes. "tuned": per objective, method and S, the grid gamma in {2^3, ..., 2^-8} / L
(LM: {0.1, 0.3, 1, 3}); kept is the gamma with the lowest final loss, the mean loss over the
last 10% of the time budget (diverged runs count as infinite). "fixed": one gamma for every
method and S, chosen before running as the middle of the grid, 2^-4 / L (LM: 0.3).

Table. For every objective and S: final loss at the budget (tuned and fixed), the best H of
LocalSGD, time to a threshold loss (1.1 x the larger of PD's and best LocalSGD's tuned final
loss, so that both reach it), the winner (lower final loss at tuned gamma; a tie within 2%)
and whether that agrees with the paper.

gamma^2 S^4 check. The convergence theorem's stale-read term scales as gamma^2 S^4. For the
quadratic and the logistic objective, for S in `gap_stages` and gamma in `gap_gammas`, PD and
sync run K updates on the same microbatches (loss recorded against the number of microbatches
every block has applied: the iterate x_k is version k of every block, so a stage that runs
ahead in time is not credited early) and gap = mean over the last half of the K updates of (loss_PD -
loss_sync), averaged over 3 seeds; printed next to gap / (gamma^2 S^4), which the theory
predicts to be roughly constant (it is an upper bound's scaling, not an equality).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pipedream_fast.ir import ActionKind, Schedule
from pipedream_fast.schedules import make_schedule
from pipedream_fast.sim import ActionRecord, UnitCosts, simulate

K = ActionKind
PAPER_WINNER = {"quadratic": "pipedream", "logistic": "localsgd", "lm": "pipedream"}
PAPER_CLAIM = {"quadratic": "PD wins", "logistic": "LocalSGD wins as S grows",
               "lm": "PD wins (training loss)"}
GAMMA_GRID = tuple(2.0 ** -k for k in range(-3, 9))  # in units of 1/L: 8 ... 1/256
FIXED_GAMMA = 2.0 ** -4
LM_GAMMAS = (0.1, 0.3, 1.0, 3.0)
LM_FIXED_GAMMA = 0.3
TIE = 0.02


# ---- objectives -------------------------------------------------------------------------------

class Objective(Protocol):
    name: str
    dim: int
    smoothness: float  # L: step sizes are gamma / L

    def x0(self) -> np.ndarray: ...
    def loss(self, x: np.ndarray) -> float: ...
    def grad(self, x: np.ndarray, mb: int) -> np.ndarray: ...


class Quadratic:
    """f(x) = 1/2 (x - x*)^T A (x - x*), A = Q diag(lambda) Q^T; see the module docstring."""

    name = "quadratic"

    def __init__(self, dim: int = 64, condition: float = 100.0, noise: float = 0.3,
                 seed: int = 0) -> None:
        rng = np.random.default_rng(1000 + seed)
        q, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
        eig = np.logspace(-math.log10(condition), 0.0, dim)
        self.dim, self.noise, self.seed = dim, noise, seed
        self.a = (q * eig) @ q.T
        self.x_star = rng.standard_normal(dim)
        self.x_star *= math.sqrt(dim) / np.linalg.norm(self.x_star)
        self.smoothness = float(eig.max())
        self._xi: np.ndarray = np.zeros((0, dim))

    def x0(self) -> np.ndarray:
        return np.zeros(self.dim)

    def loss(self, x: np.ndarray) -> float:
        e = x - self.x_star
        return float(0.5 * e @ self.a @ e)

    def _noise(self, mb: int) -> np.ndarray:
        if mb >= len(self._xi):  # drawn in one block, so microbatch m's noise is fixed
            rng = np.random.default_rng(self.seed)
            self._xi = rng.standard_normal((max(2 * mb + 1, 4096), self.dim))
        return self._xi[mb]

    def grad(self, x: np.ndarray, mb: int) -> np.ndarray:
        return self.a @ (x - self.x_star) + self.noise * self._noise(mb)


class Logistic:
    """L2-regularised logistic regression on scikit-learn's breast_cancer (standardised,
    bias column); microbatches of `batch` rows drawn with replacement by (seed, m)."""

    name = "logistic"

    def __init__(self, batch: int = 16, reg: float = 1e-3, seed: int = 0) -> None:
        import importlib
        sk = importlib.import_module("sklearn.datasets")
        data = sk.load_breast_cancer()
        x = np.asarray(data.data, dtype=np.float64)
        x = (x - x.mean(0)) / x.std(0)
        self.x = np.hstack([x, np.ones((len(x), 1))])
        self.y = np.asarray(data.target, dtype=np.float64) * 2 - 1  # labels +-1
        self.n, self.dim = self.x.shape
        self.batch, self.reg, self.seed = batch, reg, seed
        top = float(np.linalg.eigvalsh(self.x.T @ self.x / self.n).max())
        self.smoothness = top / 4 + reg
        self._rows: np.ndarray = np.zeros((0, batch), dtype=np.int64)

    def x0(self) -> np.ndarray:
        return np.zeros(self.dim)

    def loss(self, w: np.ndarray) -> float:
        margins = self.y * (self.x @ w)
        return float(np.logaddexp(0.0, -margins).mean() + 0.5 * self.reg * w @ w)

    def grad(self, w: np.ndarray, mb: int) -> np.ndarray:
        if mb >= len(self._rows):
            rng = np.random.default_rng(self.seed)
            self._rows = rng.integers(0, self.n, (max(2 * mb + 1, 4096), self.batch))
        rows = self._rows[mb]
        x, y = self.x[rows], self.y[rows]
        s = -y / (1.0 + np.exp(np.clip(y * (x @ w), -50, 50)))
        return x.T @ s / len(rows) + self.reg * w


OBJECTIVES: dict[str, Callable[..., Objective]] = {"quadratic": Quadratic, "logistic": Logistic}


# ---- methods and their timelines ------------------------------------------------------------

@dataclass(frozen=True)
class Method:
    """pipedream, localsgd (with H = local_steps, R = S) or sync (gpipe, one microbatch per
    update)."""

    kind: str
    local_steps: int | None = None

    @property
    def label(self) -> str:
        return f"localsgd-H{self.local_steps}" if self.kind == "localsgd" else self.kind

    def schedule(self, stages: int, microbatches: int) -> Schedule:
        if self.kind == "pipedream":
            return make_schedule("pipedream", stages, microbatches)
        if self.kind == "localsgd":
            return make_schedule("localsgd", stages, microbatches, local_steps=self.local_steps)
        if self.kind == "sync":
            return make_schedule("gpipe", stages, microbatches, chunks=1)
        raise ValueError(f"unknown method {self.kind!r}")


def _effect_time(r: ActionRecord) -> float:
    """When a record acts on the weights: an update at its end, a compute at its start."""
    return r.end if r.action.kind in (K.OPTIMIZER_STEP, K.AVERAGE) else r.start


_TIMELINES: dict[tuple[Method, int, int], tuple[list[ActionRecord], int]] = {}


def timeline(method: Method, stages: int, microbatches: int) -> tuple[list[ActionRecord], int]:
    """The unit-cost simulation of `method` on S stages and N microbatches: its forwards,
    backwards, updates and averages in replay order, and its model replicas (copies)."""
    key = (method, stages, microbatches)
    if key not in _TIMELINES:
        schedule = method.schedule(stages, microbatches)
        records = simulate(schedule, UnitCosts()).records
        wanted = (K.FORWARD, K.BACKWARD, K.OPTIMIZER_STEP, K.AVERAGE)
        kept = sorted((r for r in records if r.action.kind in wanted),
                      key=lambda r: (_effect_time(r), r.rank, r.index))
        copies = int(schedule.params.get("model_replicas", 1))
        _TIMELINES[key] = (kept, copies)
    return _TIMELINES[key]


def microbatches_for(method: Method, stages: int, budget: float) -> int:
    """Microbatches whose unit-cost run lasts at least `budget` (the run is then cut there)."""
    per = 2.0 * stages if method.kind == "sync" else 2.0
    return int(math.ceil(budget / per)) + 2 * stages


# ---- the RPD replay ------------------------------------------------------------------------

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
           max_updates: int | None = None) -> Curve:
    """Run RPD along a timeline (see the module docstring): gamma is the step size itself
    (not in units of 1/L). Records the loss at each of `times` (in increasing order) and,
    if `update_every` > 0 (one copy only), the loss of x_k = version k of every block for
    k = update_every, 2 update_every, ... up to
    `max_updates`."""
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
    # Versions still needed: (stage, copy, version) -> forwards that read it and have not
    # backwarded yet, so old versions can be dropped.
    curve = Curve()
    pending_times = list(times)
    applied = 0  # the largest k whose x_k has been evaluated
    snapshots: dict[int, dict[int, np.ndarray]] = {}  # k -> stage -> version k of its block

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
        t = _effect_time(rec)
        while pending_times and pending_times[0] < t:
            record_time(pending_times.pop(0))
        if curve.diverged:
            break
        a = rec.action
        key = (a.stage, a.copy)
        if a.kind is K.FORWARD:
            assert a.microbatch is not None and a.version is not None
            row = reads.setdefault(a.microbatch, [None] * stages)
            row[a.stage] = versions[key][a.version]
        elif a.kind is K.BACKWARD:
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
        elif a.kind is K.OPTIMIZER_STEP:
            assert a.version is not None
            w = versions[key][newest[key]] - gamma * buffers[key] / len(a.microbatches)
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
        elif a.kind is K.AVERAGE:
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
    return replay(records, copies, objective, stages, gamma, times)


# ---- the comparison ------------------------------------------------------------------------

@dataclass
class Settings:
    stages: tuple[int, ...] = (2, 4, 8)
    local_steps: tuple[int, ...] = (1, 4, 16)
    budget: float = 4000.0  # simulated time units (PD does ~budget/2 updates)
    gammas: tuple[float, ...] = GAMMA_GRID
    fixed_gamma: float = FIXED_GAMMA
    gap_stages: tuple[int, ...] = (2, 3, 4, 6, 8)
    gap_gammas: tuple[float, ...] = (2.0 ** -6, 2.0 ** -5, 2.0 ** -4, 2.0 ** -2, 1.0)
    gap_updates: int = 2000
    gap_seeds: int = 3
    # lm
    lm_steps: int = 200
    lm_batch: int = 16
    lm_gammas: tuple[float, ...] = LM_GAMMAS
    lm_fixed_gamma: float = LM_FIXED_GAMMA
    lm_stages: tuple[int, ...] = (2, 4)

    @classmethod
    def quick(cls, stages: Iterable[int], local_steps: Iterable[int]) -> Settings:
        return cls(stages=tuple(stages), local_steps=tuple(local_steps), budget=600.0,
                   gammas=(2.0 ** -2, 2.0 ** -4, 2.0 ** -6), gap_stages=(2, 3),
                   gap_gammas=(2.0 ** -5, 2.0 ** -4), gap_updates=300, gap_seeds=1,
                   lm_steps=40, lm_gammas=(0.3,), lm_stages=(2,))


Progress = Callable[[str], None]


def _methods(local_steps: Sequence[int]) -> list[Method]:
    return ([Method("pipedream")] + [Method("localsgd", h) for h in local_steps]
            + [Method("sync")])


def study_rpd(name: str, settings: Settings, progress: Progress = print) -> dict[str, Any]:
    """The comparison for the quadratic or logistic objective: every method at every gamma
    of the grid for every S, then the table rows, then the gamma^2 S^4 check."""
    objective = OBJECTIVES[name]()
    big_l = objective.smoothness
    grid = sorted(set(settings.gammas) | {settings.fixed_gamma}, reverse=True)
    per_stage: dict[str, Any] = {}
    rows = []
    for s in settings.stages:
        runs: dict[str, dict[str, Any]] = {}
        for method in _methods(settings.local_steps):
            start = time.perf_counter()
            finals: dict[float, float] = {}
            curves: dict[float, Curve] = {}
            for g in grid:
                curve = run_method(objective, method, s, g / big_l, settings.budget)
                finals[g], curves[g] = curve.final(), curve
            best = min(grid, key=lambda g: (finals[g], -g))
            runs[method.label] = {
                "method": method.kind, "local_steps": method.local_steps,
                "gamma_grid": grid, "final_by_gamma": [_finite(finals[g]) for g in grid],
                "tuned_gamma": best, "tuned_final": _finite(finals[best]),
                "fixed_gamma": settings.fixed_gamma,
                "fixed_final": _finite(finals[settings.fixed_gamma]),
                "tuned_curve": curves[best].to_dict(),
                "fixed_curve": curves[settings.fixed_gamma].to_dict()}
            progress(f"{name} S={s} {method.label}: tuned gamma {best:g}/L final "
                     f"{finals[best]:.4g}, fixed {finals[settings.fixed_gamma]:.4g} "
                     f"({time.perf_counter() - start:.1f} s)")
        per_stage[str(s)] = runs
        rows.append(_row(name, s, runs, settings))
    gap = gamma_s4_check(name, settings, progress)
    return {"objective": name, "smoothness": big_l, "budget": settings.budget,
            "runs": per_stage, "table": rows, "gap_check": gap}


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _value(v: float | None) -> float:
    return math.inf if v is None else v


def _winner(pd: float, local: float) -> str:
    if not (math.isfinite(pd) or math.isfinite(local)):
        return "neither (both diverged)"
    if abs(pd - local) <= TIE * min(pd, local):
        return "tie"
    return "pipedream" if pd < local else "localsgd"


def _row(name: str, s: int, runs: dict[str, dict[str, Any]], settings: Settings) -> dict[str, Any]:
    pd = runs["pipedream"]
    locals_ = {k: v for k, v in runs.items() if v["method"] == "localsgd"}
    best_local = min(locals_, key=lambda k: _value(locals_[k]["tuned_final"]))
    best_local_fixed = min(locals_, key=lambda k: _value(locals_[k]["fixed_final"]))
    pd_t, lo_t = _value(pd["tuned_final"]), _value(locals_[best_local]["tuned_final"])
    pd_f, lo_f = _value(pd["fixed_final"]), _value(locals_[best_local_fixed]["fixed_final"])
    threshold = 1.1 * max(pd_t, lo_t)

    def time_to(label: str) -> float | None:
        c = runs[label]["tuned_curve"]
        if not math.isfinite(threshold):
            return None
        for t, v in zip(c["times"], c["losses"]):
            if v is not None and v <= threshold:
                return float(t)
        return None

    winner, winner_fixed = _winner(pd_t, lo_t), _winner(pd_f, lo_f)
    edge = [label for label, r in runs.items() if len(r["gamma_grid"]) > 1
            and r["tuned_gamma"] in (max(r["gamma_grid"]), min(r["gamma_grid"]))]
    return {"objective": name, "stages": s, "tuned_at_grid_edge": edge,
            "pipedream_tuned": _finite(pd_t), "pipedream_gamma": pd["tuned_gamma"],
            "localsgd_tuned": _finite(lo_t), "localsgd_best": best_local,
            "localsgd_gamma": locals_[best_local]["tuned_gamma"],
            "sync_tuned": runs["sync"]["tuned_final"],
            "pipedream_fixed": _finite(pd_f), "localsgd_fixed": _finite(lo_f),
            "localsgd_best_fixed": best_local_fixed, "sync_fixed": runs["sync"]["fixed_final"],
            "threshold": _finite(threshold), "pipedream_time_to": time_to("pipedream"),
            "localsgd_time_to": time_to(best_local),
            "winner_tuned": winner, "winner_fixed": winner_fixed,
            "paper": PAPER_CLAIM[name],
            "agrees_tuned": _agrees(name, s, winner, settings),
            "agrees_fixed": _agrees(name, s, winner_fixed, settings)}


def _agrees(name: str, s: int, winner: str, settings: Settings) -> str:
    expected = PAPER_WINNER[name]
    if name == "logistic" and s == min(settings.stages):
        # The paper: LocalSGD becomes superior *as S grows*; at the smallest S either is
        # consistent with it.
        return "yes (either, small S)" if winner in ("pipedream", "tie") else (
            "yes" if winner == expected else "no")
    return "yes" if winner == expected else ("tie" if winner == "tie" else "no")


def gamma_s4_check(name: str, settings: Settings, progress: Progress = print) -> dict[str, Any]:
    """Loss gap between PD and sync at a fixed number of updates, against S and gamma."""
    rows = []
    k = settings.gap_updates
    every = max(1, k // 100)
    for s in settings.gap_stages:
        pd_records, _ = timeline(Method("pipedream"), s, k + 2 * s)
        sync_records, _ = timeline(Method("sync"), s, k + 1)
        for g in settings.gap_gammas:
            gaps = []
            pd_means, sync_means = [], []
            for seed in range(settings.gap_seeds):
                objective = OBJECTIVES[name](seed=seed)
                gamma = g / objective.smoothness
                pd = replay(pd_records, 1, objective, s, gamma, update_every=every,
                            max_updates=k)
                sy = replay(sync_records, 1, objective, s, gamma, update_every=every,
                            max_updates=k)
                half = len(pd.update_losses) // 2
                pd_mean = (math.inf if pd.diverged
                           else float(np.mean(pd.update_losses[half:])))
                sync_mean = float(np.mean(sy.update_losses[half:]))
                pd_means.append(pd_mean)
                sync_means.append(sync_mean)
                gaps.append(pd_mean - sync_mean)
            gap = float(np.mean(gaps))
            ratio = gap / (g * g * s ** 4) if math.isfinite(gap) else math.inf
            rows.append({"stages": s, "gamma": g, "gap": _finite(gap),
                         "pipedream_loss": _finite(float(np.mean(pd_means))),
                         "sync_loss": float(np.mean(sync_means)),
                         "gap_over_gamma2_s4": _finite(ratio)})
            progress(f"{name} gap S={s} gamma={g:g}/L: {gap:.4g} "
                     f"(gap / gamma^2 S^4 = {ratio:.4g})")
    fit = _fit_exponents(rows)
    return {"updates": k, "seeds": settings.gap_seeds, "rows": rows, "fit": fit,
            "definition": "mean over the last half of K updates of loss_PD - loss_sync, same "
                          "microbatches; gamma in units of 1/L"}


def _fit_exponents(rows: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Least-squares fit of log gap = c + a log gamma + b log S over rows with a positive
    finite gap (the theory's bound scales with a = 2, b = 4)."""
    pts = [(math.log(r["gamma"]), math.log(r["stages"]), math.log(r["gap"])) for r in rows
           if r["gap"] is not None and r["gap"] > 0]
    if len(pts) < 3 or len({p[0] for p in pts}) < 2 or len({p[1] for p in pts}) < 2:
        return None
    m = np.array([[1.0, p[0], p[1]] for p in pts])
    y = np.array([p[2] for p in pts])
    coef, *_ = np.linalg.lstsq(m, y, rcond=None)
    return {"log_c": float(coef[0]), "gamma_exponent": float(coef[1]),
            "stages_exponent": float(coef[2]), "points": len(pts)}


# ---- the language model through the runtime -----------------------------------------------

def lm_run(schedule: str, stages: int, gamma: float, steps: int, batch: int,
           local_steps: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Train `build_charlm(layers=2)` with LocalPipeline on `stages` stages (blocks of layers)
    for `steps` microbatches; loss of each microbatch against the unit-cost simulated time of
    its last-stage forward."""
    import torch

    from pipedream_fast.datasets import char_corpus
    from pipedream_fast.formats import Plan, StagePlan
    from pipedream_fast.local_pipeline import LocalPipeline
    from pipedream_fast.models import build_charlm, loss_fn

    torch.manual_seed(seed)
    model = build_charlm(layers=2, dropout=0.0)
    blocks = 4  # embed, block1, block2, head
    if blocks % stages:
        raise ValueError(f"the LM has {blocks} blocks: S must divide it, got {stages}")
    per = blocks // stages
    plan = Plan(model="charlm", batch_size=batch, workers=stages, schedule=schedule,
                stages=[StagePlan(i * per, (i + 1) * per, 1, (i,), 1.0) for i in range(stages)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    train, _, _ = char_corpus()
    windows = len(train)  # type: ignore[arg-type]  # a CharWindows, which has a length
    g = torch.Generator().manual_seed(seed)
    order = torch.randint(0, windows, (steps, batch), generator=g)
    data = []
    for rows in order:
        xs, ys = zip(*(train[int(i)] for i in rows))
        data.append((torch.stack(xs), torch.stack(ys)))
    kwargs: dict[str, Any] = {}
    if local_steps is not None:
        kwargs = {"local_steps": local_steps, "model_replicas": stages}
    pipe = LocalPipeline(model, loss_fn, lambda params: torch.optim.SGD(params, lr=gamma),
                         plan, schedule=schedule, chunks=1, timeout=120, **kwargs)
    start = time.perf_counter()
    losses = [float(v) for v in pipe.train(data, steps)]
    wall = time.perf_counter() - start
    method = (Method("localsgd", local_steps) if schedule == "localsgd"
              else Method("sync") if schedule == "gpipe" else Method(schedule))
    records, _ = timeline(method, stages, steps)
    when = {r.action.microbatch: r.end for r in records
            if r.action.kind is K.FORWARD and r.action.stage == stages - 1}
    window = 16
    times, smooth = [], []
    for i in range(window - 1, steps, window // 2):
        times.append(float(when[i]))
        smooth.append(float(np.mean(losses[i - window + 1:i + 1])))
    final = float(np.mean(losses[-max(1, steps // 10):])) if all(map(math.isfinite, losses)) \
        else math.inf
    return {"schedule": schedule, "stages": stages, "gamma": gamma, "local_steps": local_steps,
            "steps": steps, "wall_s": wall, "final": _finite(final),
            "makespan": float(max(r.end for r in records)),
            "curve": {"times": times, "losses": smooth}}


def study_lm(settings: Settings, progress: Progress = print) -> dict[str, Any]:
    """PD (and sync, and LocalSGD when the runtime trains it) on the LM at each gamma."""
    from pipedream_fast.schedules import kind

    localsgd_trainable = kind("localsgd").trainable
    out: dict[str, Any] = {"objective": "lm", "steps": settings.lm_steps,
                           "batch": settings.lm_batch,
                           "localsgd_trainable": localsgd_trainable, "runs": {}, "table": []}
    grid = sorted(set(settings.lm_gammas) | {settings.lm_fixed_gamma})
    for s in settings.lm_stages:
        runs: dict[str, Any] = {}
        configs: list[tuple[str, str, int | None]] = [("pipedream", "pipedream", None),
                                                      ("sync", "gpipe", None)]
        if localsgd_trainable:
            configs += [(f"localsgd-H{h}", "localsgd", h) for h in settings.local_steps]
        for label, schedule, h in configs:
            by_gamma = {}
            for g in grid:
                # Every method trains the same number of microbatches; the time axis is cut
                # at PD's makespan (the budget) when the table is made.
                try:
                    r = lm_run(schedule, s, g, settings.lm_steps, settings.lm_batch, h)
                except Exception as err:  # a runtime failure is a result to report, not hide
                    if schedule != "localsgd":
                        raise
                    out.setdefault("errors", []).append(f"S={s} {label} gamma={g}: {err}")
                    progress(f"lm S={s} {label} gamma={g:g}: FAILED: {err}")
                    continue
                by_gamma[g] = r
                progress(f"lm S={s} {label} gamma={g:g}: final {r['final']} "
                         f"(simulated makespan {r['makespan']:g}, {r['wall_s']:.1f} s wall)")
            if len(by_gamma) == len(grid):
                runs[label] = {str(g): r for g, r in by_gamma.items()}
        out["runs"][str(s)] = runs
        out["table"].append(_lm_row(s, runs, grid, settings))
    return out


def _lm_final_at(run: dict[str, Any], budget: float) -> float:
    """Mean smoothed training loss over the last 10% of the time budget."""
    c = run["curve"]
    pts = [v for t, v in zip(c["times"], c["losses"]) if 0.9 * budget <= t <= budget]
    if not pts:
        inside = [v for t, v in zip(c["times"], c["losses"]) if t <= budget]
        pts = inside[-1:]
    return float(np.mean(pts)) if pts and all(map(math.isfinite, pts)) else math.inf


def _lm_row(s: int, runs: dict[str, Any], grid: Sequence[float],
            settings: Settings) -> dict[str, Any]:
    budget = runs["pipedream"][str(grid[0])]["makespan"]
    finals = {label: {g: _lm_final_at(runs[label][str(g)], budget) for g in grid}
              for label in runs}
    tuned = {label: min(grid, key=lambda g: f[g]) for label, f in finals.items()}
    edge = [label for label, g in tuned.items()
            if len(grid) > 1 and g in (min(grid), max(grid))]
    locals_ = [label for label in runs if label.startswith("localsgd")]
    pd_t = finals["pipedream"][tuned["pipedream"]]
    row: dict[str, Any] = {"objective": "lm", "stages": s, "budget": budget,
                           "pipedream_tuned": _finite(pd_t),
                           "pipedream_gamma": tuned["pipedream"],
                           "sync_tuned": _finite(finals["sync"][tuned["sync"]]),
                           "pipedream_fixed": _finite(finals["pipedream"][settings.lm_fixed_gamma]),
                           "sync_fixed": _finite(finals["sync"][settings.lm_fixed_gamma]),
                           "paper": PAPER_CLAIM["lm"], "tuned_at_grid_edge": edge}
    if locals_:
        best = min(locals_, key=lambda k: finals[k][tuned[k]])
        lo_t = finals[best][tuned[best]]
        best_f = min(locals_, key=lambda k: finals[k][settings.lm_fixed_gamma])
        lo_f = finals[best_f][settings.lm_fixed_gamma]
        w, wf = _winner(pd_t, lo_t), _winner(finals["pipedream"][settings.lm_fixed_gamma], lo_f)
        row.update({"localsgd_tuned": _finite(lo_t), "localsgd_best": best,
                    "localsgd_gamma": tuned[best], "localsgd_fixed": _finite(lo_f),
                    "winner_tuned": w, "winner_fixed": wf,
                    "agrees_tuned": "yes" if w == "pipedream" else "no",
                    "agrees_fixed": "yes" if wf == "pipedream" else "no"})
    else:
        row.update({"localsgd_tuned": None, "winner_tuned": "n/a (LocalSGD not trainable by "
                    "the runtime yet)", "agrees_tuned": "n/a", "agrees_fixed": "n/a"})
    return row


# ---- reporting -----------------------------------------------------------------------------

def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def markdown(results: dict[str, Any], command: str = "") -> str:
    """The results as Markdown tables (what `--out` writes)."""
    lines = ["# pipedream-fast study: results", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    for name, res in results["objectives"].items():
        lines += [f"## {name}", ""]
        if name == "lm":
            lines += [f"{res['steps']} microbatches of {res['batch']} windows; LocalSGD "
                      f"trainable by the runtime: {res['localsgd_trainable']}.", "",
                      "| S | budget | PD tuned (gamma) | LocalSGD tuned (best H, gamma) | "
                      "sync tuned | PD fixed | LocalSGD fixed | winner tuned / fixed | "
                      "paper | agrees |", "|" + "---|" * 10]
            for r in res["table"]:
                lines.append(
                    f"| {r['stages']} | {_fmt(r['budget'])} | {_fmt(r['pipedream_tuned'])} "
                    f"({_fmt(r['pipedream_gamma'])}) | {_fmt(r.get('localsgd_tuned'))} "
                    f"({r.get('localsgd_best', '-')}, {_fmt(r.get('localsgd_gamma'))}) | "
                    f"{_fmt(r['sync_tuned'])} | {_fmt(r['pipedream_fixed'])} | "
                    f"{_fmt(r.get('localsgd_fixed'))} | {r['winner_tuned']} / "
                    f"{r.get('winner_fixed', '-')} | {r['paper']} | {r['agrees_tuned']} / "
                    f"{r['agrees_fixed']} |")
            edges = [f"S={r['stages']}: {', '.join(r['tuned_at_grid_edge'])}"
                     for r in res["table"] if r["tuned_at_grid_edge"]]
            if edges:
                lines += ["", "Tuned gamma at the edge of the grid: " + "; ".join(edges) + "."]
            lines.append("")
            continue
        lines += [f"Time budget {_fmt(res['budget'])} unit-cost time units; gamma in units of "
                  f"1/L (L = {_fmt(res['smoothness'])}).", "",
                  "| S | PD tuned (gamma) | LocalSGD tuned (best H, gamma) | sync tuned | "
                  "PD fixed | LocalSGD fixed (best H) | sync fixed | threshold | time to it "
                  "PD / LocalSGD | winner tuned / fixed | paper | agrees tuned / fixed |",
                  "|" + "---|" * 12]
        for r in res["table"]:
            lines.append(
                f"| {r['stages']} | {_fmt(r['pipedream_tuned'])} ({_fmt(r['pipedream_gamma'])})"
                f" | {_fmt(r['localsgd_tuned'])} ({r['localsgd_best']}, "
                f"{_fmt(r['localsgd_gamma'])}) | {_fmt(r['sync_tuned'])} | "
                f"{_fmt(r['pipedream_fixed'])} | {_fmt(r['localsgd_fixed'])} "
                f"({r['localsgd_best_fixed']}) | {_fmt(r['sync_fixed'])} | "
                f"{_fmt(r['threshold'])} | {_fmt(r['pipedream_time_to'])} / "
                f"{_fmt(r['localsgd_time_to'])} | {r['winner_tuned']} / {r['winner_fixed']} | "
                f"{r['paper']} | {r['agrees_tuned']} / {r['agrees_fixed']} |")
        edges = [f"S={r['stages']}: {', '.join(r['tuned_at_grid_edge'])}" for r in res["table"]
                 if r["tuned_at_grid_edge"]]
        if edges:
            lines += ["", "Tuned gamma at the edge of the grid: " + "; ".join(edges) + "."]
        gap = res["gap_check"]
        lines += ["", f"gamma^2 S^4 check ({gap['updates']} updates, {gap['seeds']} seeds; "
                      f"{gap['definition']}):", "",
                  "| S | gamma | loss PD | loss sync | gap | gap / (gamma^2 S^4) |",
                  "|---|---|---|---|---|---|"]
        for r in gap["rows"]:
            lines.append(f"| {r['stages']} | {_fmt(r['gamma'])} | {_fmt(r['pipedream_loss'])} "
                         f"| {_fmt(r['sync_loss'])} | {_fmt(r['gap'])} | "
                         f"{_fmt(r['gap_over_gamma2_s4'])} |")
        fit = gap["fit"]
        if fit:
            lines += ["", f"Fit log gap = c + a log gamma + b log S over {fit['points']} "
                          f"positive gaps: a = {fit['gamma_exponent']:.2f} (theory 2), "
                          f"b = {fit['stages_exponent']:.2f} (theory 4)."]
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], directory: str) -> list[str]:
    """One PNG per objective: loss against simulated time, one panel per S, tuned gamma
    (solid) and fixed gamma (dashed). Returns the paths written."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, res in results["objectives"].items():
        stages = list(res["runs"])
        fig, axes = plt.subplots(1, len(stages), figsize=(4.5 * len(stages), 3.6),
                                 squeeze=False)
        for ax, s in zip(axes[0], stages):
            runs = res["runs"][s]
            for i, (label, run) in enumerate(runs.items()):
                color = f"C{i}"
                if name == "lm":  # tuned (solid) and fixed (dashed) lr, up to the budget
                    budget = next(r["budget"] for r in res["table"] if str(r["stages"]) == s)
                    fixed = str(results["settings"]["lm_fixed_gamma"])
                    tuned = min(run, key=lambda g: _lm_final_at(run[g], budget))
                    for g, style, which in ((tuned, "-", "tuned"), (fixed, "--", "fixed")):
                        c = run[g]["curve"]
                        ax.plot(c["times"], c["losses"], style, color=color,
                                label=f"{label} ({which} lr {g})")
                    ax.set_xlim(0, budget)
                    continue
                for which, style in (("tuned", "-"), ("fixed", "--")):
                    c = run[f"{which}_curve"]
                    ys = [math.nan if v is None else v for v in c["losses"]]
                    ax.plot(c["times"], ys, style, color=color,
                            label=f"{label} ({which} {run[f'{which}_gamma']:g}/L)")
            ax.set_yscale("log")
            ax.set_title(f"{name}, S = {s}")
            ax.set_xlabel("simulated time (unit costs)")
            ax.set_ylabel("training loss" if name == "lm" else "loss")
            ax.legend(fontsize=6)
        fig.tight_layout()
        path = os.path.join(directory, f"{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def run_study(objectives: Sequence[str], settings: Settings,
              progress: Progress = print) -> dict[str, Any]:
    out: dict[str, Any] = {"settings": {k: list(v) if isinstance(v, tuple) else v
                                        for k, v in vars(settings).items()},
                           "costs": "UnitCosts(): forward 1, backward 1, communication 0",
                           "objectives": {}}
    for name in objectives:
        start = time.perf_counter()
        if name == "lm":
            out["objectives"][name] = study_lm(settings, progress)
        else:
            out["objectives"][name] = study_rpd(name, settings, progress)
        out["objectives"][name]["wall_s"] = time.perf_counter() - start
    return out
