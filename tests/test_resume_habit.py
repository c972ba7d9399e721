"""`resume=True` and `pipedream-fast run --max-restarts`: the restart habit. One script, run
again after its job died, continues the run in its `checkpoint_dir` from the newest complete
checkpoint, and starts afresh where the folder holds none (issue 35, item 1).

2 processes, gloo, 1f1b: the script trains `STEPS` steps, saving every `EVERY`; its first
attempt dies (rank 1 is SIGKILLed after step `CRASH_AT`, rank 0 fails on the dead
peer), the second attempt of the very same script resumes from step-4 and ends bit-equal to
an uninterrupted run's weights. Under rank threads the same, with a break for the crash. And
as an operator runs it: a script file under `pipedream-fast run --nproc 2 --max-restarts 2`
whose first attempt dies ends bit-equal to the same script run without a crash.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.launch import LaunchError, launch
from pipedream_fast.options import OptionError
from pipedream_fast.pipeline import Pipeline

BATCH, CHUNKS, STEPS, EVERY, CRASH_AT, TIMEOUT = 8, 2, 8, 2, 5, 10


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def script(folder: str | None, crash: bool, **options: Any) -> tuple[int, dict[str, Any]]:
    """The user's script: continue the run in `folder` if it holds one, train to STEPS."""
    pipe = Pipeline(model(), nn.functional.cross_entropy, sgd, schedule="1f1b", chunks=CHUNKS,
                    balance=[2, 1], timeout=TIMEOUT, checkpoint_dir=folder,
                    checkpoint_every=EVERY if folder else None, resume=folder is not None,
                    **options)
    began = pipe.steps_done
    for step, _ in enumerate(pipe.train(batches(), steps=STEPS - began), start=began + 1):
        if crash and step == CRASH_AT:
            if pipe.options.ranks == "threads":
                break  # the job dies here
            if pipe.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a lost node
    state = pipe.state_dict()
    pipe.close()
    return began, state


def process_job(rank: int, world: int, folder: str | None, crash: bool) -> tuple[int, Any]:
    return script(folder, crash)


def test_a_restarted_job_continues_its_run_bit_equal_on_processes(tmp_path):
    _, want = launch(process_job, 2, None, False, timeout=120)[0]
    folder = str(tmp_path / "ck")
    with pytest.raises(LaunchError):
        launch(process_job, 2, folder, True, timeout=120)  # the first attempt dies
    assert ckpt.holds_checkpoint(Path(folder))
    began, got = launch(process_job, 2, folder, False, timeout=120)[0]
    assert began == 4  # the newest complete checkpoint before the crash at step 5
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_a_restarted_job_continues_its_run_bit_equal_on_threads(tmp_path):
    _, want = script(None, False, ranks="threads", workers=2)
    folder = str(tmp_path / "ck")
    first, _ = script(folder, True, ranks="threads", workers=2)
    assert first == 0  # nothing to continue: started afresh
    began, got = script(folder, False, ranks="threads", workers=2)
    assert began == 4
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_resume_needs_the_folder_it_continues_from():
    with pytest.raises(OptionError, match="resume=True continues the run in checkpoint_dir"):
        Pipeline(model(), nn.functional.cross_entropy, sgd, resume=True, ranks="threads",
                 workers=1)


SCRIPT = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from test_resume_habit import script
    folder, crash_marker, out = sys.argv[1:4]
    crash = not os.path.exists(crash_marker)  # the first attempt dies, the next does not
    if crash and int(os.environ["RANK"]) == 1:
        open(crash_marker, "w").close()
    began, state = script(folder, crash)
    if int(os.environ["RANK"]) == 0:
        torch.save({{"began": began, "state": state}}, out)
""")


RUN = [sys.executable, "-m", "pipedream_fast.cli", "run", "--nproc", "2"]
# FAULTS.md's recipe: without the variable torchrun's restarted ranks find the store of the
# attempt that died and fail in init_process_group
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2"]


def run_job(tmp_path: Path, name: str, *flags: str, crash: bool,
            launcher: list[str] = RUN) -> tuple[Any, str]:
    job = tmp_path / "job.py"
    job.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    marker = tmp_path / f"{name}.crashed"
    if not crash:
        marker.touch()
    out = tmp_path / f"{name}.pt"
    result = subprocess.run([*launcher, *flags, str(job), str(tmp_path / name), str(marker),
                             str(out)], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out), result.stderr


def test_run_max_restarts_continues_a_failed_job_from_its_checkpoint(tmp_path):
    want, _ = run_job(tmp_path, "quiet", crash=False)
    got, log = run_job(tmp_path, "restarted", "--max-restarts", "2", crash=True)
    assert "restarting the job (restart 1 of 2)" in log, log[-3000:]
    assert want["began"] == 0 and got["began"] == 4
    for name, value in want["state"].items():
        assert torch.equal(got["state"][name], value), name


def test_torchrun_with_the_documented_recipe_continues_a_failed_job(tmp_path):
    want, _ = run_job(tmp_path, "quiet", crash=False)
    got, _ = run_job(tmp_path, "restarted", "--max-restarts", "2", crash=True,
                     launcher=TORCHRUN)
    assert got["began"] == 4
    for name, value in want["state"].items():
        assert torch.equal(got["state"][name], value), name


def test_a_job_that_keeps_failing_stops_after_its_restarts(tmp_path):
    job = tmp_path / "fail.py"
    job.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    result = subprocess.run([sys.executable, "-m", "pipedream_fast.cli", "run", "--nproc", "2",
                             "--max-restarts", "1", str(job)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 3
    assert result.stderr.count("restarting the job") == 1
    assert "the job failed 2 times; no restart left (--max-restarts 1)" in result.stderr
