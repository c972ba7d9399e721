"""`pipedream-fast train` and `pipedream-fast run`, and a plain torchrun script, end to end."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipedream_fast.cli import main
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.schedules import SCHEDULE_NAMES

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torchrun_train.py"
TRAINABLE = [s for s in SCHEDULE_NAMES if s not in ("localsgd", "data-parallel")]
# Interleaved 1F1B needs a looped placement without replicas: not the 2+1 layout.
REPLICABLE = [s for s in TRAINABLE if s != "interleaved-1f1b"]
CNN_BLOCKS = 9


def write_plan(path: Path, layout: str) -> Path:
    """The built-in CNN as 2 stages (convolutions | linear layers), or 2+1 replicated."""
    first = (0, 1) if layout == "2+1" else (0,)
    plan = Plan(model="cnn", batch_size=8, workers=len(first) + 1, schedule="1f1b",
                stages=[StagePlan(0, 6, len(first), first, 1.0),
                        StagePlan(6, CNN_BLOCKS, 1, (len(first),), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    plan.save(path)
    return path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipedream_fast.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("layout, schedule", [("2-stage", s) for s in TRAINABLE] +
                         [("2+1", s) for s in REPLICABLE])
def test_train_every_schedule_with_threads(tmp_path, capsys, layout, schedule):
    plan = write_plan(tmp_path / "plan.json", layout)
    assert main(["train", "--model", "cnn", "--plan", str(plan), "--threads",
                 "3" if layout == "2+1" else "2", "--schedule", schedule, "--steps", "2",
                 "--batch-size", "8", "--chunks", "4"]) == 0
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), out


def test_train_interleaved_plans_stages_looped_over_the_ranks(capsys):
    assert main(["train", "--model", "mlp", "--threads", "2", "--schedule", "interleaved-1f1b",
                 "--steps", "2", "--batch-size", "8", "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    placement = re.findall(r"on ranks \[(\d)\]", out)
    assert placement == ["0", "1", "0", "1"], out  # 2 ranks x 2 stages, stage k on rank k % 2
    assert len(re.findall(r"loss \d+\.\d+", out)) == 2


@pytest.mark.parametrize("layout,schedule", [("2-stage", "pipedream"), ("2+1", "2bw")])
def test_train_across_processes_writes_a_trace(tmp_path, layout, schedule):
    plan = write_plan(tmp_path / "plan.json", layout)
    trace = tmp_path / "run.json"
    result = cli("train", "--model", "cnn", "--plan", str(plan), "--schedule", schedule,
                 "--steps", "3", "--batch-size", "8", "--chunks", "4", "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    assert "throughput" in result.stdout
    assert len(re.findall(r"loss \d+\.\d+", result.stdout)) == 3
    from pipedream_fast.trace import read_chrome_trace
    events = read_chrome_trace(trace)
    ranks = {e.rank for e in events}
    assert ranks == ({0, 1} if layout == "2-stage" else {0, 1, 2})
    assert {e.kind for e in events} >= {"forward", "backward", "optimizer_step"}


def test_train_rejects_a_plan_for_another_worker_count(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.json", "2+1")
    assert main(["train", "--plan", str(plan), "--nproc", "2"]) == 2
    assert "3 workers" in capsys.readouterr().err


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert launcher is not None, "torchrun comes with torch"
    return subprocess.run([launcher, "--standalone", "--nproc-per-node", str(nproc), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def weight_norms(output: str) -> dict[str, str]:
    return dict(re.findall(r"(\S+): trained \d+ tensors, weight norm (\d+\.\d+)", output))


@pytest.mark.parametrize("layout", ["2-stage", "2+1"])
def test_a_plain_torchrun_script_trains_the_cnn_with_every_schedule(layout):
    nproc, extra = (3, ["--replicate-first"]) if layout == "2+1" else (2, [])
    schedules = REPLICABLE if layout == "2+1" else TRAINABLE
    result = torchrun(nproc, str(EXAMPLE), "--model", "cnn", "--schedule", ",".join(schedules),
                      "--steps", "2", "--batch-size", "8", *extra)
    assert result.returncode == 0, result.stderr
    assert set(weight_norms(result.stdout)) == set(schedules)
    for schedule in schedules:
        lines = re.findall(rf"^{schedule}: rank {nproc - 1} step \d loss", result.stdout, re.M)
        assert len(lines) == 2


def test_run_and_torchrun_train_the_same_weights():
    args = [str(EXAMPLE), "--model", "cnn", "--schedule", "pipedream", "--steps", "2",
            "--batch-size", "8"]
    ours = cli("run", "--nproc", "2", *args)
    assert ours.returncode == 0, ours.stderr
    theirs = torchrun(2, *args)
    assert theirs.returncode == 0, theirs.stderr
    assert weight_norms(ours.stdout) == weight_norms(theirs.stdout) != {}


def test_run_stops_every_rank_when_one_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(60)\n")
    result = cli("run", "--nproc", "2", str(script))
    assert result.returncode == 3
    assert "rank 1 exited with code 3" in result.stderr
