"""A stop that outlasts the grace period is not cut while it progresses (issue 35, item 4).

SIGTERM to `pipedream-fast run --grace 1`: the ranks first finish the steps up to the one
they agree to stop at (slow steps here: 0.8 s each), then save (a slow disk here: each
stage file written in six pieces over 3 s). Both take far longer than the 1 s grace. The
launcher waits while the ranks report progress (a step after the request, a file growing)
and says how long the stop took; the checkpoint is complete. A 1 GiB-per-stage model on 2
cores (4 s a step, 18 s to the agreed step, 4.5 s to save both files) was measured the same
way by hand: stopped whole in 20.9 s under the default 5 s grace, where it was SIGKILLed
before its save began."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from pipedream_fast import checkpoint as ckpt

ROOT = Path(__file__).resolve().parent.parent

JOB = """\
import itertools, os, sys, time, torch
from torch import nn
from pipedream_fast import Pipeline
real_save = torch.save

def slow_disk_save(obj, path):  # a disk that takes 3 s for a small file
    real_save(obj, path)
    data = Path(path).read_bytes()
    with open(path, "wb") as f:
        for i in range(6):
            f.write(data[i * len(data) // 6:(i + 1) * len(data) // 6])
            f.flush()
            time.sleep(0.5)

from pathlib import Path
torch.save = slow_disk_save

def slow_loss(out, target):
    time.sleep(0.4)
    return nn.functional.cross_entropy(out, target)

torch.manual_seed(0)
pipe = Pipeline(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), slow_loss,
                lambda ps: torch.optim.SGD(ps, lr=0.1), schedule="1f1b", chunks=2,
                balance=[2, 1], timeout=60, checkpoint_dir=sys.argv[1],
                checkpoint_every=10**6)
data = ((torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in itertools.count())
for step, _ in enumerate(pipe.train(data, steps=10**6)):
    print(f"step {step}", flush=True)
"""


def test_a_slow_stop_and_save_outlast_the_grace_and_the_checkpoint_is_whole(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    folder = tmp_path / "ck"
    launcher = subprocess.Popen([sys.executable, "-m", "pipedream_fast.cli", "run", "--nproc",
                                 "2", "--grace", "1", str(job), str(folder)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:  # training has begun
            if line.startswith("step 1"):
                break
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 143, stderr
    assert "SIGKILL" not in stderr, stderr
    assert "were still stopping (finishing the agreed step, saving their checkpoint) when the " \
           "1 s grace ran out; waited while they progressed: the stop took" in stderr, stderr
    saved, notes = ckpt.resolve(folder)
    assert notes == [] and sorted(ckpt.read_manifest(saved)["files"]) == ["0", "1"]
    assert ckpt.export(saved)  # every file whole: checksums verified on the way
