"""The study's RPD replay follows the IR's stale reads exactly; its CLI writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipedream_fast import study
from pipedream_fast.cli import main


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


def test_cli_quick_quadratic_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "study.json"
    md = tmp_path / "study.md"
    assert main(["study", "--objective", "quadratic", "--stages", "2", "--local-steps", "1,2",
                 "--quick", "--json", str(out), "--out", str(md)]) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"settings", "costs", "objectives"}
    res = data["objectives"]["quadratic"]
    assert set(res) >= {"runs", "table", "gap_check", "budget", "smoothness"}
    assert set(res["runs"]["2"]) == {"pipedream", "localsgd-H1", "localsgd-H2", "sync"}
    row = res["table"][0]
    assert row["stages"] == 2 and row["winner_tuned"] in ("pipedream", "localsgd", "tie")
    assert {"gap", "gap_over_gamma2_s4", "gamma", "stages"} <= set(res["gap_check"]["rows"][0])
    assert "| S |" in md.read_text() and "quadratic" in capsys.readouterr().out
