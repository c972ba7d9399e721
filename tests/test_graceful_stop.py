"""SIGTERM stops every rank after the same step and saves a checkpoint (issues 10 and 22).

Two ranks train an endless stream under `pipedream-fast run`; the signal goes as clusters send
it: to the launcher (which forwards it to every rank, as torchrun does), to rank 1 alone (as
when a scheduler signals one process), to the launcher's whole process group (`kill --
-PGID`, `timeout`), to every process of the job at once (SLURM's scancel and time limit: each
rank gets it directly and again forwarded), or SIGHUP (a closed terminal). Every rank must
leave `Pipeline.train` after the same step, the checkpoint of that step must be complete, and
under 1f1b it must hold exactly the weights of uninterrupted single-process training on those
steps. The same for `pipedream-fast train --threads 2` (its run's checkpoint), and a NaN stop
counts its steps as checkpoints do, from 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.commands import train_run
from pipedream_fast.launch import launch
from pipedream_fast.models import build_model, loss_fn
from pipedream_fast.pipeline import NonFiniteLoss, Pipeline
from runtime_reference import train_reference
from test_signals import START, cli_process, finish, gone, wait_for_pids

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


def send(signum: int, target: str, launcher: subprocess.Popen[str], ranks: list[int]) -> None:
    """`signum` as a cluster or an operator sends it to a job (see the module's docstring)."""
    if target == "launcher":
        launcher.send_signal(signum)
    elif target == "rank 1":
        os.kill(ranks[1], signum)
    elif target == "group":
        os.killpg(launcher.pid, signum)
    else:  # every process at once, as SLURM does
        for pid in (launcher.pid, *ranks):
            os.kill(pid, signum)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, target, signum", [
    ("1f1b", "rank 1", signal.SIGTERM), ("pipedream", "launcher", signal.SIGTERM),
    ("1f1b", "group", signal.SIGTERM), ("1f1b", "every process", signal.SIGTERM),
    ("1f1b", "launcher", signal.SIGHUP)], ids=lambda v: getattr(v, "name", v))
def test_sigterm_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path, schedule,
                                                                        target, signum):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    # SIGHUP at its default whatever this run inherited (nohup): see `cli_process`
    launcher = cli_process("run", "--nproc", "2", "--grace", str(GRACE), str(job),
                           str(tmp_path), schedule)
    try:
        pids = wait_for_pids(tmp_path, [0, 1], timeout=START,
                             alive=lambda: launcher.poll() is None)
        sent = time.monotonic()
        send(signum, target, launcher, pids)
        stdout, stderr = finish(launcher, 30, f"`pipedream-fast run` to exit after "
                                              f"{signal.Signals(signum).name} to the {target}, "
                                              f"its ranks stopping at an agreed step with a "
                                              f"checkpoint")
        took = time.monotonic() - sent
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum, stderr
    assert took < GRACE, "the ranks were killed, not stopped"  # they stopped by themselves
    assert all(gone(p) for p in pids)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    stopped_after = reports[0]["stopped_after"]
    assert all(r["stopped_after"] == stopped_after == r["seen"] for r in reports), reports
    saved = tmp_path / "ckpt" / f"step-{stopped_after}"
    name = signal.Signals(signum).name
    assert f"{name}: every rank stopped after step {stopped_after}; checkpoint saved to" in stdout
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


# --- pipedream-fast train --threads 2 -------------------------------------------------------

TRAIN = ["--model", "mlp", "--data", "synthetic", "--schedule", "1f1b", "--chunks", "2",
         "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.05", "--seed", "0",
         "--steps", "100000", "--log-every", "5", "--trace-steps", "0"]


def threads_reference(steps: int) -> dict[str, torch.Tensor]:
    """What single-process training of `TRAIN` on its first `steps` minibatches gives, built
    by the command's own functions (same initial weights, same synthetic samples)."""
    module, example = build_model("mlp", 1)
    with torch.no_grad():
        classes = int(module(example).shape[-1])
    config: dict[str, Any] = {"model": "mlp", "data": "synthetic", "batch_size": 8,
                              "eval_batch_size": 8, "seed": 0, "steps": steps,
                              "synthetic": (tuple(example.shape[1:]), classes)}
    batches = list(train_run.loaders(config)[0])[:steps]
    assert len(batches) == steps
    return train_reference(train_run.build(config), batches, 2, loss_fn,
                           train_run.optimizer_factory("sgd", 0.05))


@pytest.mark.slow
def test_sigterm_to_train_with_threads_saves_the_runs_checkpoint_at_an_agreed_step(tmp_path):
    """The threads of one process stop after the same step (`LocalPipeline`), the command
    saves its run's checkpoint there, says so, and exits with 143; the checkpoint equals
    single-process training on those steps (1f1b is synchronous)."""
    out = tmp_path / "run"
    command = cli_process("train", "--threads", "2", *TRAIN, "--out", str(out))
    try:
        deadline = time.monotonic() + START
        while not (out / "metrics.csv").exists() or \
                len((out / "metrics.csv").read_text().splitlines()) < 3:  # steps 5 and 10
            assert command.poll() is None, command.communicate()
            assert time.monotonic() < deadline, (f"training did not start: no steps 5 and "
                                                 f"10 in {out / 'metrics.csv'} after "
                                                 f"{START:g} s")
            time.sleep(0.05)
        os.killpg(command.pid, signal.SIGTERM)
        stdout, stderr = finish(command, 30, "`pipedream-fast train --threads 2` to save its "
                                             "run's checkpoint and exit after SIGTERM")
    finally:
        command.kill()
    assert command.returncode == 143, stderr
    found = re.search(r"pipedream-fast train: stopped by SIGTERM after step (\d+); the run's "
                      r"checkpoint \(step (\d+)\) saved to (.*)", stderr)
    assert found and found[1] == found[2] and Path(found[3]) == out / "checkpoint", stderr
    steps = int(found[1])
    assert steps >= 10 and f"the run's checkpoint (step {steps}) saved to" in stdout
    from pipedream_fast.checkpoint import export
    state = export(out / "checkpoint")  # the processes' format: the whole model, verified
    expected = threads_reference(steps)
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


# --- a NaN stop counts steps from 1 ----------------------------------------------------------

def nan_job(rank: int, world: int) -> dict[str, Any]:
    """Three steps train, the fourth has a NaN loss."""
    data = stream(4)
    data[3][0][0, 0] = float("nan")
    pipe = Pipeline(model(), nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=0.1), schedule="1f1b", chunks=2,
                    balance=[2, 3], timeout=30)
    try:
        for _ in pipe.train(data, steps=4):
            pass
    except NonFiniteLoss as err:
        return {"text": str(err), "trained": pipe._progress.step}
    finally:
        pipe.close()
    return {"text": "", "trained": pipe._progress.step}


@pytest.mark.slow
def test_a_nan_stop_counts_steps_from_1_as_checkpoints_and_sigterm_do():
    for report in launch(nan_job, 2, timeout=60):
        assert report["trained"] == 3, report
        assert "of step 4 is nan" in report["text"], report
        assert "training stopped after step 3 (on_nan='stop')" in report["text"], report
