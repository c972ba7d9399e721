"""A full disk during a checkpoint (issue 35, item 3): every rank is told at once, in one line
that names the file, the bytes it needs and the bytes free; nothing of the failed checkpoint
is left (no temporary file keeps the disk full); the checkpoints saved before are intact and
load. The disk is made full two ways: the free space a rank sees patched to nothing for one
save (always), and a real 5 MiB tmpfs (when this process may mount one: root on Linux)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.launch import LaunchError, launch
from pipedream_fast.pipeline import Pipeline

BATCH, CHUNKS, STEPS, EVERY = 8, 2, 6, 2


def model() -> nn.Sequential:
    torch.manual_seed(0)  # about 1.5 MiB per stage with Adam's state
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                         nn.Linear(256, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 256, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(STEPS)]


def pipeline(folder: str) -> Pipeline:
    return Pipeline(model(), nn.functional.cross_entropy, lambda ps: torch.optim.Adam(ps),
                    schedule="1f1b", chunks=CHUNKS, balance=[2, 3], checkpoint_dir=folder,
                    checkpoint_every=EVERY, checkpoint_keep=5, timeout=60)


def full_at_step_4(rank: int, world: int, folder: str) -> str:
    """Rank 1's disk reports no free space for the checkpoint of step 4."""
    if rank == 1:
        real = shutil.disk_usage

        def usage(path: Any) -> Any:
            got = real(path)
            return got._replace(free=0) if "step-4" in str(path) else got
        ckpt.files.shutil.disk_usage = usage  # type: ignore[attr-defined]
    return train_on(rank, world, folder)


def train_on(rank: int, world: int, folder: str) -> str:
    """Trains STEPS steps saving every EVERY; the save's error, if one failed."""
    pipe = pipeline(folder)
    try:
        for _ in pipe.train(batches(), steps=STEPS):
            pass
    except ckpt.CheckpointError as err:
        return str(err)
    return "trained"


def loads(rank: int, world: int, folder: str) -> int:
    pipe = Pipeline.load(folder, model(), nn.functional.cross_entropy,
                         lambda ps: torch.optim.Adam(ps), timeout=60)
    return pipe.steps_done


def test_a_rank_without_room_fails_every_rank_at_once_and_keeps_the_earlier_checkpoint(
        tmp_path):
    folder = tmp_path / "ck"
    messages = launch(full_at_step_4, 2, str(folder), timeout=120)
    assert messages[1].startswith(f"no space left for {folder / 'step-4' / 'stage1.pt'}: it "
                                  f"needs about 1.5 MiB, and 0.0 MiB were free")
    # rank 0 is told by rank 1, not by a timeout
    assert messages[0] == f"rank 1 could not save its part of {folder / 'step-4'}: " + messages[1]
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]  # step-4 is gone, whole
    assert launch(loads, 2, str(folder), timeout=120) == [2, 2]


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MiB tmpfs: room for one checkpoint of `model` (3.1 MiB), not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_real_full_disk_is_named_and_nothing_of_the_failed_save_stays(small_disk):
    folder = small_disk / "ck"
    try:
        messages = launch(train_on, 2, str(folder), timeout=120)
    except LaunchError as err:  # not expected: say what happened
        pytest.fail(str(err))
    assert any(m.startswith(f"no space left for {folder / 'step-4'}") for m in messages), messages
    assert any(m.startswith(f"rank {r} could not save its part of {folder / 'step-4'}: no space")
               for r in (0, 1) for m in messages), messages
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
    assert not list(folder.rglob("*.tmp"))
    assert launch(loads, 2, str(folder), timeout=120) == [2, 2]


def test_train_keeps_its_metrics_and_summary_when_the_final_save_fails(tmp_path, capsys,
                                                                       monkeypatch):
    from pipedream_fast.cli import main

    def full(self: Pipeline, path: Any) -> None:
        raise ckpt.DiskFull(Path(path) / "stage0.pt", 3 << 20, 1 << 20)
    monkeypatch.setattr(Pipeline, "save", full)
    out = tmp_path / "run"
    assert main(["train", "--threads", "2", "--steps", "4", "--batch-size", "16",
                 "--trace-steps", "0", "--out", str(out)]) == 1
    said = capsys.readouterr()
    assert "the run's checkpoint was not saved (no space left for" in said.out + said.err
    assert (out / "summary.json").exists() and (out / "metrics.csv").exists()
    assert not (out / "checkpoint").exists()


def test_train_refuses_an_out_folder_without_room_before_training(tmp_path, capsys,
                                                                  monkeypatch):
    import re

    from pipedream_fast.cli import main
    from pipedream_fast.commands import train

    real = shutil.disk_usage
    monkeypatch.setattr(train.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 16))
    out = tmp_path / "run"
    assert main(["train", "--threads", "2", "--steps", "4", "--batch-size", "16", "--out",
                 str(out)]) == 2
    assert re.search(r"error: --out .*run: the run's checkpoint needs about [0-9.]+ MiB .* "
                     r"and 0.1 MiB are free on that disk", capsys.readouterr().err)
    assert not out.exists()  # nothing made for a run that did not start
