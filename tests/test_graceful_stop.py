"""SIGTERM stops every rank after the same step and saves a checkpoint (issue 10).

Two ranks train an endless stream under `pipedream-fast run`; SIGTERM goes either to the
launcher (which forwards it to every rank, as torchrun does) or to rank 1 alone (as when a
scheduler signals one process). Every rank must leave `Pipeline.train` after the same step,
the checkpoint of that step must be complete, and under 1f1b it must hold exactly the weights
of uninterrupted single-process training on those steps.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream_fast import checkpoint as ckpt
from runtime_reference import train_reference
from test_signals import START, gone, wait_for_pids

ROOT = Path(__file__).resolve().parent.parent
GRACE = 60.0  # the launcher's grace: long enough that the ranks stop on their own

JOB = """\
import itertools, json, os, sys
import torch
from torch import nn
from pipedream_fast import Pipeline
from pipedream_fast.launch import Stopped
folder, schedule = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                      nn.Linear(16, 3))
pipe = Pipeline(model, nn.functional.cross_entropy,
                lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), schedule=schedule,
                chunks=2 if schedule == "1f1b" else 1, balance=[2, 3], timeout=60,
                checkpoint_dir=os.path.join(folder, "ckpt"), checkpoint_every=10**6)
g = torch.Generator().manual_seed(4)
data = ((torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in itertools.count())
seen = 0
try:
    for step, _ in enumerate(pipe.train(data, steps=10**6)):
        seen = step + 1
        if step == 20:
            path = os.path.join(folder, f"rank{rank}.pid")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
except Stopped as stop:
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"seen": seen, "stopped_after": stop.step, "text": str(stop)}, f)
    raise
"""


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def stream(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("schedule, target", [("1f1b", "rank 1"), ("pipedream", "launcher")])
def test_sigterm_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path, schedule,
                                                                        target):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pipedream_fast.cli", "run", "--nproc", "2", "--grace",
         str(GRACE), str(job), str(tmp_path), schedule], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = wait_for_pids(tmp_path, [0, 1], timeout=START,
                             alive=lambda: launcher.poll() is None)
        sent = time.monotonic()
        if target == "launcher":
            launcher.send_signal(signal.SIGTERM)
        else:
            import os
            os.kill(pids[1], signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        launcher.kill()
    assert launcher.returncode == 143, stderr
    assert took < GRACE, "the ranks were killed, not stopped"  # they stopped by themselves
    assert all(gone(p) for p in pids)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    stopped_after = reports[0]["stopped_after"]
    assert all(r["stopped_after"] == stopped_after == r["seen"] for r in reports), reports
    saved = tmp_path / "ckpt" / f"step-{stopped_after}"
    assert f"every rank stopped after step {stopped_after}; checkpoint saved to" in stdout
    folder, notes = ckpt.resolve(tmp_path / "ckpt")
    assert folder == saved and notes == []
    assert ckpt.read_manifest(folder)["step"] == stopped_after
    state = ckpt.export(folder)
    if schedule == "1f1b":  # synchronous: exactly minibatch SGD on the steps trained
        expected = train_reference(model(), stream(stopped_after), 2,
                                   nn.functional.cross_entropy,
                                   lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
    else:
        assert all(torch.isfinite(v).all() for v in state.values())
