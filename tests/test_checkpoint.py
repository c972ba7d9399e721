"""Checkpoints: periodic saves that keep the last K, a save cut short by a failing rank or by
kill -9 that leaves the directory consistent (the newest complete checkpoint is used), files that are
truncated, garbage or malicious refused by name without running anything, a resumed 1f1b run
equal to an uninterrupted one, and export to a plain model's state dict (CLI and Python)."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from runtime_reference import train_reference

CHUNKS, BATCH, TIMEOUT = 2, 8, 8


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(steps)]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def pipeline(**kwargs: Any) -> Pipeline:
    return Pipeline(model(), nn.functional.cross_entropy, sgd, schedule="1f1b", chunks=CHUNKS,
                    balance=[2, 3], timeout=TIMEOUT, **kwargs)


def save_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """Six steps saved every two (keep two), then a save of step 8 that rank 1 fails."""
    pipe = pipeline(checkpoint_dir=root, checkpoint_every=2, checkpoint_keep=2)
    list(pipe.train(batches(6), steps=6))
    list(pipe.train(batches(8)[6:], steps=2))  # steps 7-8: saved as step-8, completely
    out: dict[str, Any] = {}
    if rank == 1:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise OSError("disk full")
        ckpt.write_stage = broken  # type: ignore[assignment]  # this rank's save fails
    try:
        pipe.save(Path(root) / "step-10")
    except Exception as err:  # noqa: BLE001 - the outcome is what the test checks
        out["error"] = f"{type(err).__name__}: {err}"
    return out


def resume_job(rank: int, world: int, root: str) -> dict[str, Any]:
    pipe = Pipeline.load(root, model(), nn.functional.cross_entropy, sgd, schedule="1f1b",
                         chunks=CHUNKS, timeout=TIMEOUT)
    step = pipe._progress.step
    list(pipe.train(batches(10)[step:], steps=10 - step))
    state = pipe.state_dict()
    pipe.close()
    return {"resumed_at": step, "state": state}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, launch(save_job, 2, str(root), timeout=120)


def test_periodic_saves_keep_the_last_ones_and_a_failed_save_leaves_no_manifest(saved):
    root, outcomes = saved
    assert "disk full" in outcomes[1]["error"]  # the failing rank says why
    # and its peer is told by it at once, rather than waiting out the timeout
    assert "rank 1 could not save its part of" in outcomes[0]["error"]
    names = sorted(p.name for p in root.iterdir())
    # step-2, step-4 pruned (keep 2); the failed step-10 removed whole (never committed)
    assert names == ["step-6", "step-8"], names
    folder, notes = ckpt.resolve(root)
    assert folder == root / "step-8" and not notes
    manifest = ckpt.read_manifest(folder)
    assert manifest["step"] == 8 and sorted(manifest["files"]) == ["0", "1"]


def test_a_resumed_run_equals_an_uninterrupted_one(saved):
    root, _ = saved
    results = launch(resume_job, 2, str(root), timeout=120)
    assert results[0]["resumed_at"] == 8
    want = train_reference(model(), batches(10), CHUNKS, nn.functional.cross_entropy, sgd)
    got = results[0]["state"]
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)


def test_export_gives_the_plain_models_state_dict(saved, tmp_path):
    root, _ = saved
    out = tmp_path / "model.pt"
    result = subprocess.run([sys.executable, "-m", "pipedream_fast.cli", "export", str(root),
                             "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "step-10" not in result.stdout  # the failed save left nothing to skip
    plain = model()
    plain.load_state_dict(torch.load(out, weights_only=True))  # every key, original names
    state = ckpt.export(root / "step-8")
    assert set(state) == set(plain.state_dict())
    for key, value in state.items():
        assert torch.equal(plain.state_dict()[key], value)


def copy_of(saved: tuple[Path, Any], tmp_path: Path) -> Path:
    folder = tmp_path / "c"
    shutil.copytree(saved[0] / "step-8", folder)
    return folder


def test_a_truncated_stage_file_is_refused_by_name(saved, tmp_path):
    folder = copy_of(saved, tmp_path)
    data = (folder / "stage1.pt").read_bytes()
    (folder / "stage1.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match=r"stage1\.pt is not the file the manifest"):
        ckpt.export(folder)


def test_a_garbage_stage_file_is_refused_by_name(saved, tmp_path):
    folder = copy_of(saved, tmp_path)
    size = (folder / "stage0.pt").stat().st_size
    (folder / "stage0.pt").write_bytes(b"\x00garbage" * (size // 8 + 1))
    with pytest.raises(ckpt.CheckpointError, match=r"stage0\.pt"):
        ckpt.export(folder)


class Payload:
    """Unpickling this runs a shell command: what a malicious checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (subprocess.call, (["touch", str(self.marker)],))


def test_a_malicious_stage_file_is_refused_without_running_it(saved, tmp_path):
    """The attacker also rewrites the manifest's checksum: the safe loader still refuses."""
    folder = copy_of(saved, tmp_path)
    marker = tmp_path / "pwned"
    evil = folder / "stage0.pt"
    torch.save({"model": {}, "optimizer": None, "payload": Payload(marker)}, evil,
               pickle_protocol=pickle.HIGHEST_PROTOCOL)
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())
    manifest["files"]["0"].update(bytes=evil.stat().st_size, sha256=ckpt.sha256(evil))
    (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match=r"stage0\.pt holds something other"):
        ckpt.export(folder)
    assert not marker.exists()  # nothing ran


def test_a_directory_without_manifest_is_refused_with_the_reason(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "stage0.pt").write_bytes(b"x")
    with pytest.raises(ckpt.CheckpointError, match="did not finish"):
        ckpt.export(tmp_path / "half")
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.export(tmp_path / "nowhere")


# --- kill -9 during a save ------------------------------------------------------------------

def stall_here(root: str) -> None:
    """Says where this rank is (its pid in root/stalled) and waits to be killed."""
    import os
    import time
    marker = Path(root) / "stalled"
    marker.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(marker.with_suffix(".tmp"), marker)
    time.sleep(120)


def killed_save_job(rank: int, world: int, root: str, case: str) -> None:
    """Saves a complete checkpoint of step 2, then is killed during the save of step 4:
    rank 1 while its stage file is on a temporary name, rank 0 while writing the manifest,
    or rank 0 between the two renames that swap a save into an existing checkpoint."""
    import os
    import types
    if case == "swap":
        pipe = pipeline()
        list(pipe.train(batches(2), steps=2))
        pipe.save(Path(root) / "ckpt")
    else:
        pipe = pipeline(checkpoint_dir=root, checkpoint_every=2)
        list(pipe.train(batches(2), steps=2))
    commit, replace = ckpt.files._commit, os.replace
    if case == "stage file" and rank == 1:
        ckpt.files._commit = lambda tmp, final: stall_here(root)  # type: ignore[assignment]
    if case == "manifest" and rank == 0:
        ckpt.files._commit = lambda tmp, final: (  # type: ignore[assignment]
            stall_here(root) if final.name == ckpt.MANIFEST else commit(tmp, final))

    def replace_then_stall(src: Any, dst: Any) -> None:
        replace(src, dst)
        if str(dst).endswith(".old"):
            stall_here(root)

    if case == "swap" and rank == 0:  # the module's own `os`, so nothing else is touched
        ckpt.folders.os = types.SimpleNamespace(**{**vars(os), "replace": replace_then_stall})  # type: ignore[assignment]
    list(pipe.train(batches(4)[2:], steps=2))
    if case == "swap":
        pipe.save(Path(root) / "ckpt")


@pytest.mark.parametrize("case, victim", [("stage file", 1), ("manifest", 0), ("swap", 0)])
def test_a_rank_killed_during_a_save_leaves_the_last_complete_checkpoint(tmp_path, case,
                                                                         victim):
    import os
    import signal
    import threading
    import time
    from pipedream_fast.launch import LaunchError

    def kill_when_stalled() -> None:
        deadline = time.monotonic() + 180
        while not (tmp_path / "stalled").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(int((tmp_path / "stalled").read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_when_stalled, daemon=True)
    killer.start()
    with pytest.raises(LaunchError, match=f"rank {victim} of 2 was killed by SIGKILL"):
        launch(killed_save_job, 2, str(tmp_path), case, timeout=120)
    killer.join(5)
    path = tmp_path / "ckpt" if case == "swap" else tmp_path
    folder, notes = ckpt.resolve(path)
    if case == "swap":  # cut between the renames: the previous checkpoint, kept as .old
        assert folder == tmp_path / "ckpt.old" and "cut short" in notes[0]
    else:
        assert folder == tmp_path / "step-2"
        assert notes == [f"{tmp_path / 'step-4'} is incomplete (no manifest): skipped"]
        assert not (tmp_path / "step-4" / ckpt.MANIFEST).exists()
    assert ckpt.read_manifest(folder)["step"] == 2
    want = train_reference(model(), batches(2), CHUNKS, nn.functional.cross_entropy, sgd)
    got = ckpt.export(path)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)
