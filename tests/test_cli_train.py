"""`pipedream-fast train` (the main job: real data, run directory, summary), its datasets and
built-in models, `pipedream-fast run`, and a plain torchrun script, end to end.

Every training here is a few steps of tiny minibatches; the full default run (digits to over
90% test accuracy in about a minute) is checked by hand, not in the suite."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipedream_fast.cli import main
from pipedream_fast.formats import Plan, Profile, StagePlan
from pipedream_fast.schedules import SCHEDULE_NAMES, kind

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torchrun_train.py"
# localsgd trains one microbatch per step (no --chunks 4): its own tests below.
TRAINABLE = [s for s in SCHEDULE_NAMES if s not in ("localsgd", "data-parallel")]
# Interleaved 1F1B needs a looped placement without replicas: not the 2+1 layout.
REPLICABLE = [s for s in TRAINABLE if s != "interleaved-1f1b"]
MLP_BLOCKS = 4
try:
    import matplotlib  # noqa: F401
    HAVE_MATPLOTLIB = True
except ImportError:  # pragma: no cover - CI installs the plot extra
    HAVE_MATPLOTLIB = False


def write_plan(path: Path, layout: str, model: str = "mlp", blocks: int = MLP_BLOCKS) -> Path:
    """A model as 2 stages, or as 2+1 (the first stage replicated)."""
    first = (0, 1) if layout == "2+1" else (0,)
    cut = blocks // 2
    plan = Plan(model=model, batch_size=8, workers=len(first) + 1, schedule="1f1b",
                stages=[StagePlan(0, cut, len(first), first, 1.0),
                        StagePlan(cut, blocks, 1, (len(first),), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    plan.save(path)
    return path


def pipedream_fast(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """The installed console script (what users run), in a fresh process."""
    script = shutil.which("pipedream-fast", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "pipedream_fast.cli"]
    return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def check_run_dir(run_dir: Path, ranks: set[int], checkpoint: list[str]) -> dict:
    """Every file of a run directory is there and parses; returns the summary."""
    profile = Profile.load(run_dir / "profile.json")
    plan = Plan.load(run_dir / "plan.json")
    assert plan.stages[-1].stop == len(profile.blocks)
    rows = metrics(run_dir)
    assert rows and {"step", "epoch", "samples", "loss", "test_accuracy", "samples_per_s",
                     "elapsed_s"} <= set(rows[0])
    assert any(r["loss"] for r in rows) and any(r["test_accuracy"] for r in rows)
    from pipedream_fast.trace import read_chrome_trace
    events = read_chrome_trace(run_dir / "run_trace.json")
    assert {e.rank for e in events} == ranks
    assert {e.kind for e in events} >= {"forward", "backward"}
    assert {e.kind for e in read_chrome_trace(run_dir / "sim_trace.json")} >= {"forward",
                                                                               "backward"}
    if HAVE_MATPLOTLIB:
        for png in ("timeline.png", "loss_accuracy.png"):
            assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == sorted(checkpoint)
    assert "samples/s" in (run_dir / "summary.txt").read_text()
    data = summary(run_dir)
    assert set(data["files"]) >= {"profile.json", "plan.json", "run_trace.json",
                                  "sim_trace.json", "metrics.csv", "checkpoint/"}
    return data


# --- the main job ---------------------------------------------------------------------------

def test_default_job_for_one_epoch_trains_digits_on_two_processes(tmp_path):
    """`pipedream-fast train` with its defaults (digits, convnet, 2 processes, pipedream),
    one epoch: a plan of 2 stages, a test accuracy well above chance, every file."""
    result = pipedream_fast("train", "--epochs", "1", "--out", str(tmp_path / "run"),
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for phase in ("profiling", "planning", "simulated", "training", "writing"):
        assert phase in out, out
    # The traced steps' messages, each link's share hidden by compute (from the trace written).
    assert "transfers in the traced steps" in out and "act rank 0 > 1" in out, out
    data = check_run_dir(tmp_path / "run", {0, 1}, ["manifest.json", "stage0.pt", "stage1.pt"])
    run = data["runs"][0]
    assert (data["model"], data["data"], run["schedule"], run["chunks"]) == \
        ("convnet", "digits", "pipedream", 1)
    assert [s["ranks"] for s in run["plan"]["stages"]] == [[0], [1]]
    assert run["steps"] == 1437 // 32 and run["epochs"] == 1
    assert run["test_accuracy"] > 0.5  # one epoch reaches about 80%; chance is 10%
    assert run["samples_per_s"] > 0 and run["simulated_samples_per_s"] > 0
    assert "test accuracy" in out and "wall time" in out


def test_threads_run_writes_every_file_and_a_bounded_trace(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--threads", "2", "--steps", "6", "--batch-size", "16",
                 "--trace-steps", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = check_run_dir(out, {0, 1}, ["manifest.json", "stage0.pt", "stage1.pt"])
    assert data["ranks_as"] == "threads" and data["runs"][0]["steps"] == 6
    from pipedream_fast.trace import read_chrome_trace
    microbatches = {e.microbatch for e in read_chrome_trace(out / "run_trace.json")
                    if e.kind == "forward"}
    assert microbatches == {0, 1}  # only the traced window of 2 steps
    assert len(re.findall(r"loss \d+\.\d+", printed)) >= 1
    # the processes' checkpoint format: exported, the whole model under its own names
    from pipedream_fast.checkpoint import export
    from pipedream_fast.models import build_convnet
    build_convnet().load_state_dict(export(out / "checkpoint"), strict=True)


def test_without_matplotlib_the_job_runs_and_skips_the_plots(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    out = tmp_path / "run"
    assert main(["train", "--model", "mlp", "--threads", "2", "--steps", "2", "--batch-size",
                 "8", "--out", str(out)]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not list(out.glob("*.png")) and (out / "metrics.csv").exists()


def test_target_accuracy_stops_early_and_sets_the_exit_code(tmp_path, capsys):
    args = ["train", "--threads", "2", "--batch-size", "16", "--trace-steps", "0"]
    assert main([*args, "--epochs", "3", "--target-accuracy", "5", "--out",
                 str(tmp_path / "a")]) == 0  # 5%: reached at the first evaluation
    data = summary(tmp_path / "a")
    assert data["runs"][0]["epochs"] == 1 and data["runs"][0]["time_to_target_s"] > 0
    assert main([*args, "--steps", "2", "--target-accuracy", "0.999", "--out",
                 str(tmp_path / "b")]) == 1
    assert "not reached" in capsys.readouterr().out


def test_compare_data_parallel_trains_both_on_the_same_data(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--threads", "2", "--steps", "3", "--batch-size", "16",
                 "--compare", "data-parallel", "--trace-steps", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    runs = summary(out)["runs"]
    assert [r["name"] for r in runs] == ["pipedream", "data-parallel"]
    assert [len(r["plan"]["stages"]) for r in runs] == [2, 1]
    assert runs[1]["plan"]["stages"][0]["ranks"] == [0, 1] and runs[1]["chunks"] == 2
    assert all(r["steps"] == 3 and r["test_accuracy"] is not None for r in runs)
    assert {r["run"] for r in metrics(out)} == {"pipedream", "data-parallel"}
    assert (out / "plan-data-parallel.json").exists()
    assert "training data-parallel" in printed
    table = (out / "summary.txt").read_text()
    assert "pipedream" in table and "data-parallel" in table and "samples/s simulated" in table


def test_charlm_learns_characters_of_the_package_docstrings(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--model", "charlm", "--threads", "2", "--steps", "2",
                 "--batch-size", "8", "--trace-steps", "1", "--out", str(out)]) == 0
    data = summary(out)
    assert data["data"] == "text"
    run = data["runs"][0]
    assert 0 <= run["test_accuracy"] <= 1 and run["test_loss"] < 5.0  # ln(97) = 4.57
    assert "per character" in (out / "summary.txt").read_text()


@pytest.mark.parametrize("layout, schedule", [("2-stage", s) for s in TRAINABLE] +
                         [("2+1", s) for s in REPLICABLE])
def test_every_schedule_trains_synthetic_data_with_threads(tmp_path, capsys, layout, schedule):
    plan = write_plan(tmp_path / "plan.json", layout)
    assert main(["train", "--model", "mlp", "--plan", str(plan), "--threads",
                 "3" if layout == "2+1" else "2", "--schedule", schedule, "--steps", "2",
                 "--batch-size", "8", "--chunks", "4", "--trace-steps", "0",
                 "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "synthetic data" in out  # mlp has no built-in dataset
    losses = [float(x) for x in re.findall(r"step \d/2  loss (\d+\.\d+)", out)]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), out


@pytest.mark.parametrize("workers", ["--threads", "--nproc"])
def test_localsgd_trains_with_local_steps_and_model_replicas(tmp_path, capsys, workers):
    plan = write_plan(tmp_path / "plan.json", "2-stage")
    out_dir = tmp_path / "run"
    assert main(["train", "--model", "mlp", "--plan", str(plan), workers, "2",
                 "--schedule", "localsgd", "--local-steps", "2", "--model-replicas", "3",
                 "--steps", "7", "--batch-size", "8", "--trace-steps", "0",
                 "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"step \d/7  loss (\d+\.\d+)", out)]
    assert len(losses) == 7 and all(0 < x < 10 for x in losses), out
    run = summary(out_dir)["runs"][0]
    assert (run["schedule"], run["chunks"], run["local_steps"], run["model_replicas"]) == \
        ("localsgd", 1, 2, 3)


@pytest.mark.parametrize("args, message", [
    (["--schedule", "1f1b", "--local-steps", "2"], "--local-steps: local_steps is an option "
                                                   "of localsgd, not of '1f1b'"),
    (["--schedule", "localsgd", "--chunks", "4"], "--chunks: localsgd trains each minibatch of "
                                                  "the loader as one microbatch"),
    (["--schedule", "localsgd", "--model-replicas", "0"], "--model-replicas: localsgd: "
                                                          "model_replicas must be an integer >= 1"),
])
def test_localsgd_options_fail_with_a_clear_message(tmp_path, capsys, args, message):
    assert main(["train", "--threads", "2", "--out", str(tmp_path / "run"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_interleaved_plans_stages_looped_over_the_ranks(tmp_path):
    assert main(["train", "--model", "mlp", "--threads", "2", "--schedule", "interleaved-1f1b",
                 "--steps", "2", "--batch-size", "8", "--chunks", "2", "--trace-steps", "0",
                 "--out", str(tmp_path)]) == 0
    stages = summary(tmp_path)["runs"][0]["plan"]["stages"]
    assert [s["ranks"] for s in stages] == [[0], [1], [0], [1]]


def test_user_model_and_data_factories(tmp_path, monkeypatch):
    (tmp_path / "mystuff.py").write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "def data():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    x = torch.randn(96, 6, generator=g)\n"
        "    y = (x.sum(1) > 0).long()\n"
        "    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])\n"
        "def model(batch_size):\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(),\n"
        "                              torch.nn.Linear(16, 2))\n"
        "    return net, torch.randn(batch_size, 6)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "--model", "mystuff:model", "--data", "mystuff:data", "--threads",
                 "2", "--epochs", "2", "--batch-size", "8", "--trace-steps", "0",
                 "--out", "run"]) == 0
    run = summary(tmp_path / "run")["runs"][0]
    assert run["steps"] == 16 and run["epochs"] == 2


@pytest.mark.parametrize("args, message", [
    (["--data", "imagenet"], "built-in datasets are digits, text, synthetic"),
    (["--model", "mlp", "--data", "nosuchmodule:load"], "cannot import 'nosuchmodule'"),
    (["--model", "resnet9000"], "built-in models are"),
    (["--model", "mlp", "--data", "digits"], "model 'mlp' does not fit data 'digits'"),
    (["--model", "charlm", "--data", "digits"], "does not fit data 'digits'"),
    (["--target-accuracy", "150"], "--target-accuracy"),
    (["--batch-size", "30", "--schedule", "1f1b", "--chunks", "4"], "does not split into 4"),
    (["--epochs", "0"], "--epochs must be a positive integer"),
    (["--lr", "nan"], "--lr must be a positive, finite learning rate, got nan"),
    (["--timeout", "nan"], "--timeout: timeout must be positive, finite seconds, got nan"),
])
def test_bad_options_fail_with_a_clear_message(tmp_path, capsys, args, message):
    assert main(["train", "--threads", "2", "--out", str(tmp_path / "run"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing is written before the checks pass


def test_train_rejects_a_plan_for_another_model_before_starting_ranks(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.json", "2-stage", model="cnn", blocks=9)  # the cnn's
    assert main(["train", "--plan", str(plan), "--model", "mlp", "--data", "synthetic",
                 "--nproc", "2", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--plan does not fit model 'mlp'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_train_rejects_a_plan_for_another_worker_count(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.json", "2+1")
    assert main(["train", "--plan", str(plan), "--nproc", "2"]) == 2
    assert "3 workers" in capsys.readouterr().err


def test_progress_bar_on_a_terminal(tmp_path):
    """The live bar (what a terminal shows) goes through the same events."""
    from rich.console import Console

    from pipedream_fast.run_report import RunRecorder, plot_curves, write_metrics_csv
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    with RunRecorder(console, target=0.5) as recorder:
        assert recorder.live
        recorder.handle({"event": "start", "run": "r", "steps": 4, "epochs": 2,
                         "steps_per_epoch": 2, "batch_size": 8})
        for step in (1, 2, 3, 4):
            recorder.handle({"event": "step", "run": "r", "step": step,
                             "epoch": (step - 1) // 2, "samples": 8 * step, "loss": 1.0 / step,
                             "train_s": 0.1 * step, "first_step_s": 0.1,
                             "elapsed_s": 0.2 * step})
            if step % 2 == 0:
                recorder.handle({"event": "eval", "run": "r", "step": step,
                                 "epoch": step // 2 - 1, "samples": 8 * step, "loss": 0.5,
                                 "accuracy": 0.3 * step, "train_s": 0.1 * step,
                                 "first_step_s": 0.1, "elapsed_s": 0.2 * step,
                                 "epoch_samples_per_s": 80.0})
    run = recorder.runs["r"]
    assert run.samples_per_s == pytest.approx(24 / 0.3)  # steps 2-4
    assert run.target_reached_step == 2 and "target 50.0% reached" in buffer.getvalue()
    assert write_metrics_csv(tmp_path / "m.csv", [run]) == 6
    if HAVE_MATPLOTLIB:
        assert plot_curves(tmp_path / "c.png", [run])


# --- datasets and built-in models -------------------------------------------------------------

def test_digits_split_and_scaling():
    from pipedream_fast.datasets import digits
    train, test = digits()
    assert (len(train), len(test)) == (1437, 360)
    x, y = train.tensors
    assert x.shape == (1437, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-4
    assert torch.bincount(test.tensors[1]).min() >= 35  # stratified: every class in the test
    assert torch.equal(digits()[1].tensors[0], test.tensors[0])  # a fixed split


def test_char_corpus_windows_are_shifted_by_one():
    from pipedream_fast.datasets import VOCAB_SIZE, char_corpus, decode, package_docstrings
    train, test, vocab = char_corpus(seq_len=32)
    assert vocab == VOCAB_SIZE and len(train) >= 8 * len(test) > 0  # 90/10 by position
    x, y = train[3]
    assert x.shape == y.shape == (32,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    assert decode(x) in package_docstrings()
    assert int(torch.cat([train[len(train) - 1][1], test[0][0]]).max()) < vocab


def test_resolve_data_names_the_choices():
    from pipedream_fast.datasets import DataSpecError, resolve_data
    with pytest.raises(DataSpecError, match="digits, text"):
        resolve_data("mnist")
    with pytest.raises(DataSpecError, match="no attribute 'nope'"):
        resolve_data("pipedream_fast.datasets:nope")


@pytest.mark.parametrize("name, blocks", [("convnet", 5), ("charlm", 4)])
def test_builtin_models_are_sequential_blocks(name, blocks):
    from pipedream_fast.models import build_model, loss_fn
    from pipedream_fast.tracing import trace
    model, example = build_model(name, 3)
    assert len(trace(model)) == blocks
    out = model(example)
    targets = (torch.randint(0, out.shape[-1], out.shape[:-1]))
    loss_fn(out, targets).backward()
    with torch.device("meta"):
        build_model(name, 3)  # no memory needed to build it


# --- pipedream-fast run and torchrun ---------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipedream_fast.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert launcher is not None, "torchrun comes with torch"
    # A rank that dies of a native fault prints its Python stacks (torchrun's ranks do not
    # otherwise): what a failure in CI has to go on.
    return subprocess.run([launcher, "--standalone", "--nproc-per-node", str(nproc), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})


def weight_norms(output: str) -> dict[str, str]:
    return dict(re.findall(r"(\S+): trained \d+ tensors, weight norm (\d+\.\d+)", output))


# On the script's one stage per rank, a schedule planned for two stages per rank runs
# another's order (zb-v, dualpipe-v and interleaved-zb zb-h1's): those are trained through
# their own placements in test_new_schedules.py, so this end-to-end job leaves them out.
ONE_STAGE_PER_RANK = [s for s in TRAINABLE
                      if s == "interleaved-1f1b" or kind(s).planning.get("stages_per_rank") != 2]


@pytest.mark.parametrize("layout", ["2-stage", "2+1"])
def test_a_plain_torchrun_script_trains_the_cnn_with_every_schedule(layout):
    nproc, extra = (3, ["--replicate-first"]) if layout == "2+1" else (2, [])
    schedules = [s for s in (REPLICABLE if layout == "2+1" else TRAINABLE)
                 if s in ONE_STAGE_PER_RANK]
    result = torchrun(nproc, str(EXAMPLE), "--model", "cnn", "--schedule", ",".join(schedules),
                      "--steps", "2", "--batch-size", "8", *extra)
    # stdout's end too: which schedule a rank was in, should one fail
    assert result.returncode == 0, result.stderr + "\n--- stdout (end):\n" + result.stdout[-3000:]
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


def test_every_pipeline_option_flag_reaches_the_ranks_options_unchanged():
    """The flags of PipelineOptions come from its fields, and the options a run hands its
    ranks carry each given value: an option with its flag needs no edit of the command."""
    import dataclasses

    from pipedream_fast.cli import build_parser
    from pipedream_fast.commands.train import RunSetup, _run_options, settings
    from pipedream_fast.options import PipelineOptions, flag_name

    flagged = [f for f in dataclasses.fields(PipelineOptions) if f.metadata.get("flag")]
    assert {"clip_grad_norm", "precision", "seed", "on_nan", "timeout"} <= {f.name for f in flagged}
    given = {"clip_grad_norm": "0.25", "precision": "bf16", "seed": "7", "on_nan": "skip",
             "timeout": "12.5"}
    argv = ["train", "--threads", "2", "--schedule", "1f1b"]
    for name, value in given.items():
        argv += [flag_name(name), value]
    args = build_parser().parse_args(argv)
    s = settings(args)
    setup = RunSetup(name="1f1b", schedule="1f1b", plan=None, chunks=2, profile=None,  # type: ignore[arg-type]
                     simulated_samples_per_s=None, sim_window=None)
    options = _run_options(s, setup)
    assert (options.clip_grad_norm, options.precision, options.seed, options.on_nan,
            options.timeout) == (0.25, "bf16", 7, "skip", 12.5)
    assert (options.schedule, options.chunks) == ("1f1b", 2)


def test_the_summarys_calibrated_prediction_is_one_line_a_row():
    """The calibrated rate's cell (it wrapped over three lines, issue 32): the prediction and
    the measured rate on one line, what it was calibrated on and the prediction from the same
    epochs' own speed in rows of their own, in summary.txt's width."""
    from pipedream_fast import run_report as rr
    from pipedream_fast.commands.train_report import calibrated_text, calibration_rows

    c = {"warmup_epochs": 1, "calibrated_epochs": 2, "predicted_epochs": 7,
         "predicted_samples_per_s": 18512.3, "measured_samples_per_s": 16634.2,
         "error_pct": 11.3, "same_window_samples_per_s": 16700.1,
         "same_window_error_pct": 0.4}
    rows = [("samples/s simulated, calibrated", [calibrated_text(c)]),
            *calibration_rows([c])]
    assert [label for label, _ in rows] == ["samples/s simulated, calibrated", "calibrated on",
                                            "samples/s simulated, own speed"]
    text = rr.render_text(rr.summary_table("t", ["pipedream"], rows))
    body = [line for line in text.splitlines() if line.startswith("│")]
    assert len(body) == 3, text  # a line each
    assert "18,512.3 for epochs 4-10; measured 16,634.2 (+11.3%)" in body[0]
    assert "epochs 2-3 (epoch 1 warms up)" in body[1]
    assert "16,700.1 (+0.4%)" in body[2]
    assert calibration_rows([None]) == []
    assert "needs 2 epochs" in calibrated_text(None)


@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
def test_train_profiles_and_plans_once_per_run(tmp_path, capsys, monkeypatch, schedule):
    """The command profiles and plans (it reports the plan and the prediction); the ranks
    take its plan and neither profile nor plan again (issue 33, item 2)."""
    import pipedream_fast.planner.choose as choose
    import pipedream_fast.profiler as profiler
    from pipedream_fast.rank.cutting import Stages

    calls = {"profile": 0, "plan": 0, "ranks plan": 0}
    inside: set[str] = set()  # a planning that plans its candidates counts once

    def counted(owner: object, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            if key in inside:
                return original(*args, **kwargs)
            calls[key] += 1
            inside.add(key)
            try:
                return original(*args, **kwargs)
            finally:
                inside.discard(key)
        monkeypatch.setattr(owner, name, wrapper)

    counted(profiler, "profile_model", "profile")
    counted(choose, "plan_for", "plan")
    counted(choose, "choose_schedule", "plan")
    counted(Stages, "plan_from", "ranks plan")
    assert main(["train", "--threads", "2", "--steps", "4", "--batch-size", "16",
                 "--schedule", schedule, "--out", str(tmp_path / "run")]) == 0
    assert calls == {"profile": 1, "plan": 1, "ranks plan": 0}, calls
