"""The study (research/study, outside the library): its RPD replay follows the IR's stale
reads exactly, reads the split-backward kinds (the weight gradient lands at BACKWARD_WEIGHT)
and refuses the kinds it does not model; its command line writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # research/ is not installed: it is imported from the checkout
    sys.path.insert(0, str(ROOT))

from pipedream_fast.ir import KIND_SPECS, ActionKind  # noqa: E402
from pipedream_fast.schedules import make_schedule  # noqa: E402
from research import study  # noqa: E402
from research.study.cli import main  # noqa: E402

K = ActionKind


class Tiny:
    """f(x) = 1/2 x^T A x + c_m . x per microbatch m: a coupled 2-block quadratic whose
    microbatch gradients differ (A x + c_m), so stale reads show in the result."""

    name = "tiny"
    smoothness = 1.0

    def __init__(self, dim: int = 2) -> None:
        rng = np.random.default_rng(3)
        m = rng.standard_normal((dim, dim))
        self.dim = dim
        self.a = m @ m.T / dim + np.eye(dim)
        self.c = rng.standard_normal((64, dim))

    def x0(self) -> np.ndarray:
        return np.arange(1.0, self.dim + 1.0)

    def loss(self, x: np.ndarray) -> float:
        return float(0.5 * x @ self.a @ x)

    def grad(self, x: np.ndarray, mb: int) -> np.ndarray:
        return self.a @ x + self.c[mb]


def replay(method: study.Method, stages: int, n: int, obj: Tiny, gamma: float) -> np.ndarray:
    records, copies = study.timeline(method, stages, n)
    curve = study.replay(records, copies, obj, stages, gamma, staleness=method.staleness)
    assert curve.params is not None
    return curve.params


def test_pipedream_replay_is_the_hand_computed_stale_update() -> None:
    """S = 2, 4 microbatches. Stage 0 (1F1B, warm-up 2) forwards m = 0, 1 on version 0, then
    m = 2 on version 1 and m = 3 on version 2; stage 1 forwards m on version m. Block j's
    update for m uses the gradient at (stage 0's read, stage 1's read) of m."""
    obj, gamma = Tiny(), 0.1
    u, w = [obj.x0()[0]], [obj.x0()[1]]  # versions of block 0 and block 1
    reads = {0: (0, 0), 1: (0, 1), 2: (1, 2), 3: (2, 3)}  # m -> (stage 0's, stage 1's version)
    for m in range(4):
        vu, vw = reads[m]
        g = obj.grad(np.array([u[vu], w[vw]]), m)
        w.append(w[-1] - gamma * g[1])
        u.append(u[-1] - gamma * g[0])
    got = replay(study.Method("pipedream"), 2, 4, obj, gamma)
    np.testing.assert_allclose(got, [u[-1], w[-1]], rtol=0, atol=1e-12)
    # ...and it is not plain SGD: the stale reads change the result.
    x = obj.x0()
    for m in range(4):
        x = x - gamma * obj.grad(x, m)
    assert not np.allclose(got, x)


def _hand_corrected_pipedream(obj: Tiny, stages: int, n: int, gamma: float,
                              staleness: str) -> np.ndarray:
    """PipeDream (1F1B, weight stashing, one update per microbatch and stage) with a
    staleness correction, step by step from its definition. Stage s's forward of m reads
    version k = max(0, m - (S - 1 - s)), the newest one then (k updates done), and its update
    for m makes version m + 1 on top of version m: delay d = m - k. v is the moving average
    (0.9) of the stage's update deltas, v_hat = v / (1 - 0.9^t) after t updates (0 before);
    predict reads x_k + d v_hat, nesterov x_k + (0.9 + ... + 0.9^d) v_hat; lr-scale steps
    with gamma / (1 + d). The gradient of m is taken at the blocks m read."""
    beta = 0.9
    cuts = np.array_split(np.arange(obj.dim), stages)
    versions = [[obj.x0()[cut]] for cut in cuts]  # versions[s][k]
    velocity = [[np.zeros(len(cut))] for cut in cuts]  # velocity[s][t]: v after t updates
    for m in range(n):
        read, delay = [], []
        for s in range(stages):
            k = max(0, m - (stages - 1 - s))
            d = m - k
            shift = {"predict": float(d), "nesterov": sum(beta ** i for i in range(1, d + 1)),
                     "lr-scale": 0.0}[staleness]
            v_hat = velocity[s][k] / (1 - beta ** k) if k else np.zeros(len(cuts[s]))
            read.append(versions[s][k] + shift * v_hat)
            delay.append(d)
        g = obj.grad(np.concatenate(read), m)
        for s, cut in enumerate(cuts):
            step = gamma / (1 + delay[s]) if staleness == "lr-scale" else gamma
            new = versions[s][-1] - step * g[cut]
            velocity[s].append(beta * velocity[s][-1] + 0.1 * (new - versions[s][-1]))
            versions[s].append(new)
    return np.concatenate([v[-1] for v in versions])


@pytest.mark.parametrize("staleness", ["predict", "nesterov", "lr-scale"])
@pytest.mark.parametrize("stages", [2, 3])
def test_corrected_pipedream_replay_is_the_hand_computed_correction(stages: int,
                                                                    staleness: str) -> None:
    obj, gamma, n = Tiny(dim=5), 0.1, 9
    method = study.Method("pipedream", staleness=staleness)
    assert method.label == f"pd+{staleness}"
    got = replay(method, stages, n, obj, gamma)
    want = _hand_corrected_pipedream(obj, stages, n, gamma, staleness)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("stages", [2, 3])
def test_each_correction_changes_the_trajectory(stages: int) -> None:
    """No correction is a no-op: each ends elsewhere than plain PD, and than each other, and
    its loss curve differs from PD's."""
    obj, gamma, n = Tiny(dim=5), 0.1, 9
    plain = replay(study.Method("pipedream"), stages, n, obj, gamma)
    ends = {None: plain}
    for staleness in ("predict", "nesterov", "lr-scale"):
        ends[staleness] = replay(study.Method("pipedream", staleness=staleness), stages, n,
                                 obj, gamma)
    for a in ends:
        for b in ends:
            if a != b:
                assert np.abs(ends[a] - ends[b]).max() > 1e-4, (a, b)
    records, copies = study.timeline(study.Method("pipedream"), stages, n)
    times = [float(t) for t in range(1, 2 * n + 2 * stages)]
    base = study.replay(records, copies, obj, stages, gamma, times).losses
    for staleness in ("predict", "nesterov", "lr-scale"):
        curve = study.replay(records, copies, obj, stages, gamma, times, staleness=staleness)
        assert curve.losses != base, staleness


def test_corrections_are_refused_where_they_do_not_apply() -> None:
    with pytest.raises(ValueError, match="staleness"):
        study.Method("sync", staleness="predict").schedule(2, 4)
    with pytest.raises(ValueError, match="staleness"):
        study.Method("localsgd", 1, staleness="lr-scale").schedule(2, 4)
    records, copies = study.timeline(study.Method("pipedream"), 2, 4)
    with pytest.raises(ValueError, match="staleness must be one of"):
        study.replay(records, copies, Tiny(), 2, 0.1, staleness="momentum")
    # a corrected method shares the plain method's timeline (the correction changes no action)
    assert study.timeline(study.Method("pipedream", staleness="predict"), 2, 4)[0] is records


def test_gap_verdicts() -> None:
    from research.study.rpd import closes

    inf = float("inf")
    assert closes(1.0, 0.05) == "closes" and closes(1.0, -0.05) == "closes"
    assert closes(1.0, 0.5) == "narrows" and closes(1.0, -0.3) == "narrows"
    assert closes(1.0, 1.05) == "no change" and closes(1.0, 2.0) == "widens"
    assert closes(1.0, inf) == "diverges" and closes(inf, 0.1) == "stable (PD diverges)"
    assert closes(inf, inf) == "both diverge"
    assert closes(-0.1, 0.005) == "closes (PD below sync)"
    assert closes(-0.1, -0.5) == "widens (PD below sync)"


def test_lm_run_passes_the_correction_to_the_runtime() -> None:
    """`lm_run(..., staleness=...)` trains through Pipeline(staleness=...): a short run at a
    large step size ends with other losses than plain PD's. A run whose loss turns NaN (the
    runtime stops it) is a diverged result, not an error."""
    plain = study.lm_run("pipedream", 2, 1.0, 16, 4)
    predict = study.lm_run("pipedream", 2, 1.0, 16, 4, staleness="predict")
    assert plain["staleness"] is None and predict["staleness"] == "predict"
    assert predict["final"] is not None and predict["final"] != plain["final"]
    assert plain["stopped"] is None
    # The corpus is the package's own docstrings, so the data change with them: a step size
    # that diverges whatever they say (3.0 did or did not within 16 steps, by the docs).
    diverged = study.lm_run("pipedream", 2, 10.0, 16, 16)
    assert diverged["final"] is None and "nan" in diverged["stopped"]


def test_sync_baseline_is_plain_sgd() -> None:
    obj, gamma = Tiny(dim=5), 0.05
    x = obj.x0()
    for m in range(7):
        x = x - gamma * obj.grad(x, m)
    np.testing.assert_allclose(replay(study.Method("sync"), 3, 7, obj, gamma), x, atol=1e-12)


@pytest.mark.parametrize("stages,local_steps,n", [(2, 2, 10), (3, 1, 8)])
def test_localsgd_replay_is_averaged_sgd_copies(stages: int, local_steps: int, n: int) -> None:
    """R = S copies; copy c trains on the microbatches m = c mod R with plain SGD; every
    R * H microbatches the copies are averaged (a trailing partial round is not)."""
    obj, gamma, r = Tiny(dim=6), 0.07, stages
    copies = [obj.x0() for _ in range(r)]
    for m in range(n):
        c = m % r
        copies[c] = copies[c] - gamma * obj.grad(copies[c], m)
        if (m + 1) % (r * local_steps) == 0:
            mean = np.mean(copies, axis=0)
            copies = [mean.copy() for _ in range(r)]
    got = replay(study.Method("localsgd", local_steps), stages, n, obj, gamma)
    np.testing.assert_allclose(got, np.mean(copies, axis=0), atol=1e-12)


@pytest.mark.parametrize("stages", [2, 3])
def test_zb_h1_replay_is_1f1b_minibatch_sgd(stages: int) -> None:
    """zb-h1 splits each backward into I and W and puts W's off; it updates the weights in
    the same order as 1F1B with flush (one update per 4 microbatches, every read on the step's
    version), so both replay to minibatch SGD: the gradient lands once, at W, never at I."""
    obj, gamma, n, chunks = Tiny(dim=7), 0.1, 12, 4
    x = obj.x0()
    for step in range(n // chunks):
        mbs = range(step * chunks, (step + 1) * chunks)
        x = x - gamma * np.mean([obj.grad(x, m) for m in mbs], axis=0)
    zb = replay(study.Method("zb-h1", chunks=chunks), stages, n, obj, gamma)
    one_f_one_b = replay(study.Method("1f1b", chunks=chunks), stages, n, obj, gamma)
    np.testing.assert_allclose(zb, x, rtol=0, atol=1e-12)
    np.testing.assert_allclose(one_f_one_b, x, rtol=0, atol=1e-12)
    # The replayed timeline holds the W's (the weight gradients), not the I's.
    records, _ = study.timeline(study.Method("zb-h1", chunks=chunks), stages, n)
    kinds = {r.action.kind for r in records}
    assert K.BACKWARD_WEIGHT in kinds and not kinds & {K.BACKWARD, K.BACKWARD_INPUT}
    weights = [r for r in records if r.action.kind is K.BACKWARD_WEIGHT]
    assert len(weights) == stages * n
    # Without its W's, the same timeline leaves the weights where they started.
    no_w = [r for r in records if r.action.kind is not K.BACKWARD_WEIGHT]
    curve = study.replay(no_w, 1, obj, stages, gamma)
    assert curve.params is not None
    np.testing.assert_array_equal(curve.params, obj.x0())


def test_replay_effects_follow_the_kind_specs() -> None:
    """Exactly the compute kinds that end a microbatch (add its weight gradient) apply a
    gradient in the replay; every other kind the replay knows leaves the gradients alone."""
    for kind, effect in study.EFFECTS.items():
        spec = KIND_SPECS[kind]
        assert (effect == "gradient") == (spec.compute and spec.ends_microbatch), kind
        assert (effect == "read") == (kind is K.FORWARD), kind


def test_replay_refuses_what_it_does_not_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replicated stage's ALLREDUCE, or a kind the replay has no effect for, is refused with
    the schedule's name and the reason, never skipped."""
    replicated = make_schedule("1f1b", 2, 4, replicas=[2, 1])
    with pytest.raises(study.ReplayError, match=r"schedule '1f1b' cannot be replayed.*"
                                                r"ALLREDUCE: replicated stages"):
        study.check_replayable(replicated)
    monkeypatch.delitem(study.EFFECTS, K.BACKWARD_WEIGHT)
    with pytest.raises(study.ReplayError, match=r"'zb-h1'.*BACKWARD_WEIGHT"):
        study.check_replayable(make_schedule("zb-h1", 2, 4))
    study.check_replayable(make_schedule("1f1b", 2, 4))  # B, not W: still replayable


def test_cli_quick_quadratic_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "study.json"
    md = tmp_path / "study.md"
    assert main(["--objective", "quadratic", "--stages", "2", "--local-steps", "1,2",
                 "--quick", "--json", str(out), "--out", str(md)]) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"settings", "costs", "objectives"}
    res = data["objectives"]["quadratic"]
    assert set(res) >= {"runs", "table", "gap_check", "budget", "smoothness"}
    assert set(res["runs"]["2"]) == {"pipedream", "localsgd-H1", "localsgd-H2", "sync",
                                     "pd+predict", "pd+nesterov", "pd+lr-scale"}
    row = res["table"][0]
    assert row["stages"] == 2 and row["winner_tuned"] in ("pipedream", "localsgd", "tie")
    assert row["winner_corrected_tuned"] in ("pipedream", "localsgd", "tie")
    assert set(row["corrected"]) == {"pd+predict", "pd+nesterov", "pd+lr-scale"}
    gap_row = res["gap_check"]["rows"][0]
    assert {"gap", "gap_over_gamma2_s4", "gamma", "stages"} <= set(gap_row)
    assert set(gap_row["corrected"]) == {"predict", "nesterov", "lr-scale"}
    text = md.read_text()
    assert "| S |" in text and "python -m research.study --objective quadratic" in text
    assert "Staleness corrections" in text and "gap pd+predict" in text
    assert "quadratic" in capsys.readouterr().out


def test_cli_bad_input_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["--objective", "quadratic", "--stages", "2,x"]) == 2
    assert "--stages must be comma-separated integers" in capsys.readouterr().err
    assert main(["--objective", "lm", "--stages", "3"]) == 2
    assert "the LM has 4 blocks" in capsys.readouterr().err
    assert main(["--objective", "quadratic", "--staleness", "predict,momentum"]) == 2
    assert "--staleness takes predict, nesterov, lr-scale" in capsys.readouterr().err


def test_study_runs_as_a_module_and_left_the_library() -> None:
    """`python -m research.study` from the repository root; `pipedream-fast study` is gone."""
    from pipedream_fast import cli

    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-m", "research.study", "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: python -m research.study" in done.stdout and "--quick" in done.stdout
    assert "study" not in cli.COMMAND_MODULES
    with pytest.raises(SystemExit):
        cli.main(["study", "--quick"])
