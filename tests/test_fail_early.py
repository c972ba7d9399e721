"""Failures that came late and noisily, now early and in one line (issue 22): a model factory
split by the planner, `train` options that failed only once the ranks ran (a minibatch larger
than the data, an infinite learning rate, more rank processes than cores, an --out folder
holding the user's files), and run folders left behind by runs that never trained.

The CLI is driven as users drive it, in a fresh process bounded by a timeout, with settings
that keep any run that does start short."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.rank.cutting import materialize

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["--steps", "2", "--batch-size", "16", "--trace-steps", "0"]  # if a run starts at all


def pipedream_fast(*args: str, cwd: Path, timeout: float = 180
                   ) -> subprocess.CompletedProcess[str]:
    """The installed console script, in a fresh process."""
    script = shutil.which("pipedream-fast", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "pipedream_fast.cli"]
    return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not re.search(r"^training \S+ on ", result.stdout, re.M), result.stdout  # no rank


# --- a model factory, split by the planner -----------------------------------------------------

def factory() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def tied_factory() -> nn.Sequential:
    """Two layers of one stage sharing a weight (`balance=[4, 1]` keeps them together)."""
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.Tanh(),
                          nn.Linear(6, 3))
    model[2].weight = model[0].weight
    return model


def batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(steps)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def factory_job(rank: int, world: int, root: str) -> dict | None:
    common = dict(schedule="1f1b", chunks=2, timeout=60)
    out: dict = {}
    pipe = Pipeline(factory, nn.functional.cross_entropy, sgd, stages=2, **common)
    losses = list(pipe.train(batches(2), steps=2))
    out["stages"] = pipe.plan.num_stages
    out["finite"] = all(loss is None or bool(torch.isfinite(loss)) for loss in losses)
    out["state"] = pipe.state_dict()
    pipe.save(f"{root}/auto")
    pipe.close()
    restored = Pipeline.load(f"{root}/auto", factory, nn.functional.cross_entropy, sgd,
                             stages=2, **common)
    out["restored"] = restored.state_dict()
    restored.close()
    tied = Pipeline(tied_factory, nn.functional.cross_entropy, sgd, balance=[4, 1], **common)
    list(tied.train(batches(2), steps=2))
    out["tied"] = tied.state_dict()
    tied.save(f"{root}/tied")
    tied.close()
    return out if rank == 0 else None


def test_a_factory_is_planned_cut_saved_and_loaded_on_two_processes(tmp_path):
    """`Pipeline(factory, stages=2)`: rank 0 profiles a real copy of the model (was: "Cannot
    copy out of meta tensor; no data!"), each rank materialises only its stage, and
    state_dict/save/load/export know the stage's tensors (was: "has no key")."""
    out = launch(factory_job, 2, str(tmp_path), timeout=240)[0]
    assert out["stages"] == 2 and out["finite"]
    state = out["state"]
    assert list(state) == list(factory().state_dict())
    fresh = factory()
    fresh.load_state_dict(state, strict=True)
    exported = ckpt.export(tmp_path / "auto")
    assert set(exported) == set(state)
    for key, value in state.items():
        assert torch.equal(exported[key], value), key
        assert torch.equal(out["restored"][key], value), key
    tied = out["tied"]
    assert set(tied) == set(tied_factory().state_dict())
    # still one tensor after materialising the stage, trained as one (was: two tensors)
    assert torch.equal(tied["0.weight"], tied["2.weight"])
    assert set(ckpt.export(tmp_path / "tied")) == set(tied)


class Scaled(nn.Module):
    """A layer with a weight of its own that no reset_parameters() sets."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_materialising_a_stage_is_seeded_keeps_ties_and_names_what_no_reset_sets():
    """The replicas of a stage start alike (the seed is (seed, stage), not the rank's random
    state); a tensor no reset_parameters() sets starts at zero with a warning naming it
    (was: uninitialised memory, different on every replica)."""
    def materialised(stage: int) -> tuple[nn.Module, list[str]]:
        with torch.device("meta"):
            model = nn.Sequential(Scaled(), nn.Linear(4, 4), nn.Linear(4, 4))
        model[2].weight = model[1].weight
        names = {id(t): (k,) for k, t in model.state_dict(keep_vars=True).items()}
        with pytest.warns(UserWarning) as caught:
            torch.manual_seed(stage * 11)  # whatever state the rank's generator is in
            materialize(model, torch.device("cpu"), stage, seed=7, names=names, rank=0)
        return model, [str(w.message) for w in caught]

    first, warned = materialised(0)
    again, _ = materialised(0)
    other, _ = materialised(1)
    assert model_equal(first, again) and not model_equal(first, other)
    assert first[2].weight is first[1].weight  # still tied
    assert torch.equal(first[0].scale, torch.zeros(4))
    assert len(warned) == 1 and "0.scale of stage 0 start at zero" in warned[0]
    assert "0.lin.weight" not in warned[0]


def model_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values()))


# --- train: refused before any rank starts ------------------------------------------------

def test_a_minibatch_larger_than_the_data_is_refused_before_the_ranks_start(tmp_path):
    began = time.monotonic()
    result = pipedream_fast("train", "--batch-size", "100000", "--out", "run", cwd=tmp_path)
    one_line_error(result, "--batch-size 100000 is larger than the training data (1437 "
                           "samples of digits)")
    assert time.monotonic() - began < 60  # was: both ranks started, a traceback after 25 s
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("lr", ["inf", "0", "-1e-3"])
def test_a_learning_rate_that_is_not_positive_and_finite_is_refused(tmp_path, lr):
    result = pipedream_fast("train", f"--lr={lr}", *SHORT, "--out", "run", cwd=tmp_path)
    one_line_error(result, f"--lr must be a positive, finite learning rate, got {float(lr)}")
    assert not (tmp_path / "run").exists()


def test_more_rank_processes_than_cores_are_refused_unless_forced(tmp_path, monkeypatch):
    from pipedream_fast.cli import UsageError, build_parser
    from pipedream_fast.commands import train

    cores = train.usable_cores()
    result = pipedream_fast("train", "--nproc", str(max(cores, 2) + 1), "--no-straight",
                            *SHORT, "--out", "run", cwd=tmp_path)
    one_line_error(result, f"--nproc {max(cores, 2) + 1} asks for {max(cores, 2) + 1} rank "
                           f"processes, but this machine lets this process use {cores} core")
    assert "--force" in result.stderr and not (tmp_path / "run").exists()
    # --force lets them start; threads and two processes are never refused
    monkeypatch.setattr(train, "usable_cores", lambda: 1)

    def settings(*args: str) -> train.Settings:
        return train.settings(build_parser().parse_args(["train", *args]))

    with pytest.raises(UsageError, match="--nproc 3 asks for 3 rank processes"):
        settings("--nproc", "3")
    assert settings("--nproc", "3", "--force").workers == 3
    assert settings("--threads", "8").workers == 8
    assert settings("--nproc", "2").workers == settings().workers == 2


def test_an_out_folder_holding_other_files_is_refused_and_left_as_it_was(tmp_path):
    """Was: `checkpoint/notes.txt` refused only at the end of training, with a traceback;
    summary.json, metrics.csv and the plots overwritten without a word."""
    user = tmp_path / "mine"
    (user / "checkpoint").mkdir(parents=True)
    files = {user / "notes.txt": "my notes\n", user / "checkpoint" / "notes.txt": "keep\n",
             user / "summary.json": '{"mine": true}\n'}
    for path, text in files.items():
        path.write_text(text)
    result = pipedream_fast("train", "--threads", "2", *SHORT, "--out", "mine", cwd=tmp_path)
    one_line_error(result, "refusing --out mine: it holds checkpoint/, notes.txt, summary.json")
    assert sorted(p.relative_to(user).as_posix() for p in user.rglob("*")) == \
        ["checkpoint", "checkpoint/notes.txt", "notes.txt", "summary.json"]
    assert all(path.read_text() == text for path, text in files.items())


def test_an_out_folder_whose_checkpoint_is_a_file_is_refused(tmp_path):
    """Was: found only by the ranks' first save, after training."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint").write_text("not a folder\n")
    result = pipedream_fast("train", "--threads", "2", *SHORT, "--out", "run", cwd=tmp_path)
    one_line_error(result, "its checkpoint is a file")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoint"]


def test_check_out_dir_takes_new_and_empty_folders_and_refuses_the_rest(tmp_path):
    from pipedream_fast.run_report import RunDirError, check_out_dir

    check_out_dir(tmp_path / "new" / "run")  # created later, with its parents
    check_out_dir(tmp_path)  # empty
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text("{}")
    (tmp_path / "run" / "metrics.csv").write_text("run,step\n")
    with pytest.raises(RunDirError, match="nor a previous run's"):
        check_out_dir(tmp_path / "run")  # train cannot resume a run: never overwritten
    with pytest.raises(RunDirError, match="is a file, not a folder"):
        check_out_dir(tmp_path / "run" / "summary.json")


def test_trace_that_names_a_folder_is_refused_before_training(tmp_path):
    result = pipedream_fast("train", "--threads", "2", *SHORT, "--trace", str(tmp_path),
                            "--out", "run", cwd=tmp_path)
    one_line_error(result, f"--trace {tmp_path} is a folder; name the file to write")
    assert not (tmp_path / "run").exists()


# --- no run folder without a run ---------------------------------------------------------------

BROKEN_DATA = """\
import os
import torch
from torch.utils.data import TensorDataset

def load():
    if "RANK" in os.environ:  # fine for the command, broken in the ranks
        raise RuntimeError("the data server is down")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 2, (64,), generator=g)
    return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])

def model(batch_size):
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return net, torch.randn(batch_size, 6)
"""


def test_a_run_that_fails_before_its_first_step_leaves_no_run_folder(tmp_path):
    """Ranks that fail before training (here the data, in each rank) leave no runs/<time>
    folder holding only metrics.csv, nor the runs/ folder made for it."""
    (tmp_path / "brokendata.py").write_text(BROKEN_DATA)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    script = shutil.which("pipedream-fast", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "pipedream_fast.cli"]
    result = subprocess.run([*command, "train", "--model", "brokendata:model", "--data",
                             "brokendata:load", "--nproc", "2", "--batch-size", "8", "--steps",
                             "2", "--trace-steps", "0"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode != 0 and "the data server is down" in result.stderr, \
        result.stdout + result.stderr
    assert not (tmp_path / "runs").exists(), list((tmp_path / "runs").rglob("*"))


def test_only_what_a_failed_run_wrote_is_removed(tmp_path):
    """An --out folder that existed (empty) stays; a folder the run made goes only if empty."""
    from pipedream_fast.run_report import (make_run_dir, missing_dirs,
                                           remove_untrained_run_dir)

    def start(out: Path) -> tuple[Path, list[Path]]:
        created = missing_dirs(out)
        run_dir = make_run_dir(out)
        (run_dir / "metrics.csv").write_text("run,step\n")  # the header, as RunRecorder
        (run_dir / "checkpoint").mkdir()
        return run_dir, created

    empty = tmp_path / "empty"
    empty.mkdir()
    remove_untrained_run_dir(*start(empty))
    assert empty.is_dir() and not any(empty.iterdir())
    run_dir, created = start(tmp_path / "a" / "b")
    remove_untrained_run_dir(run_dir, created)
    assert not (tmp_path / "a").exists()
    run_dir, created = start(tmp_path / "c")
    (run_dir / "theirs.txt").write_text("written meanwhile")
    remove_untrained_run_dir(run_dir, created)
    assert sorted(p.name for p in run_dir.iterdir()) == ["theirs.txt"]
