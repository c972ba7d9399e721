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
    curve = study.replay(records, copies, obj, stages, gamma)
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
    assert set(res["runs"]["2"]) == {"pipedream", "localsgd-H1", "localsgd-H2", "sync"}
    row = res["table"][0]
    assert row["stages"] == 2 and row["winner_tuned"] in ("pipedream", "localsgd", "tie")
    assert {"gap", "gap_over_gamma2_s4", "gamma", "stages"} <= set(res["gap_check"]["rows"][0])
    text = md.read_text()
    assert "| S |" in text and "python -m research.study --objective quadratic" in text
    assert "quadratic" in capsys.readouterr().out


def test_cli_bad_input_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["--objective", "quadratic", "--stages", "2,x"]) == 2
    assert "--stages must be comma-separated integers" in capsys.readouterr().err
    assert main(["--objective", "lm", "--stages", "3"]) == 2
    assert "the LM has 4 blocks" in capsys.readouterr().err


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
