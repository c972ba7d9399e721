"""Checkpoints that are safe to load and whole, or refused with the file and the fault named.

A checkpoint is a directory:

    stage0.pt, stage1.pt, ...   one file per stage, written by the stage's first rank: its
                                weights and buffers under the model's original names, its
                                optimizer's and LR scheduler's state (localsgd: also
                                "copies", the stage's other model replicas' weights under
                                the stage module's names, with their optimizer and
                                scheduler state; export takes copy 0, the model's own)
    manifest.json               written last, by rank 0, once every stage file is on disk:
                                format, step, epoch, schedule, plan, and each file's size and
                                SHA-256; it is what makes the set a checkpoint

Every file goes to a temporary name, is fsynced and renamed, and the directory is fsynced, so
a crash leaves either the old state or the new one, never half a file. A save into an existing
checkpoint is staged in `<dir>.partial` and swapped in; a crash mid-swap leaves `<dir>.old`,
which `resolve` uses. Loading verifies the manifest and the checksums before reading a byte
of tensors, and reads with `torch.load(weights_only=True)`, which builds tensors and plain
containers only: a file cannot run code. A `checkpoint_dir` of a Pipeline holds `step-N`
checkpoints; `resolve` takes the newest complete one and reports newer incomplete ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

FORMAT = "pipedream_fast.checkpoint/3"  # /3: manifest, checksums, original names, weights_only
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or not a checkpoint; names file and fault."""


def stage_file(stage: int) -> str:
    return f"stage{stage}.pt"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_stage(folder: Path, stage: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Writes one stage's file durably; returns its manifest entry."""
    final = folder / stage_file(stage)
    tmp = final.with_name(final.name + ".tmp")
    torch.save(payload, tmp)
    _commit(tmp, final)
    return {"file": final.name, "bytes": final.stat().st_size, "sha256": sha256(final)}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    final = folder / MANIFEST
    tmp = final.with_name(final.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _commit(tmp, final)


def staging(path: Path) -> Path:
    """Where a save into `path` writes before it is swapped in."""
    return path.with_name(path.name + ".partial")


def swap_in(path: Path) -> None:
    """Replaces the checkpoint at `path` with its completed staging directory."""
    partial, old = staging(path), path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(partial, path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a checkpoint directory (it does not exist)")
    if not path.exists():
        raise CheckpointError(f"{folder} has no {MANIFEST}: the save that wrote it did not "
                              f"finish (a rank died or was stopped), so its stage files may be "
                              f"from different steps; use an earlier checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable manifest: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path} is not a {FORMAT} manifest (format {found!r})")
    for key in ("step", "epoch", "schedule", "plan", "files"):
        if key not in manifest:
            raise CheckpointError(f"{path} lacks {key!r}")
    return manifest


def load_stage(folder: Path, manifest: dict[str, Any], stage: int) -> dict[str, Any]:
    """One stage's payload, after checking it is the file the manifest committed."""
    entry = manifest["files"].get(str(stage))
    if entry is None:
        raise CheckpointError(f"{folder / MANIFEST} lists no file for stage {stage} (it has "
                              f"stages {sorted(int(s) for s in manifest['files'])})")
    path = folder / entry["file"]
    if not path.exists():
        raise CheckpointError(f"{path} is missing (the manifest lists it)")
    size = path.stat().st_size
    if size != entry["bytes"] or sha256(path) != entry["sha256"]:
        raise CheckpointError(f"{path} is not the file the manifest committed ({size} bytes, "
                              f"expected {entry['bytes']}; checksum mismatch): it was "
                              f"truncated, overwritten or corrupted")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a file that passed the checksum but not the safe unpickler
        raise CheckpointError(f"{path} holds something other than tensors and plain "
                              f"containers, refused without running it: {err}") from err
    if not isinstance(payload, dict) or "model" not in payload:
        raise CheckpointError(f"{path} is not a stage file (no 'model' entry)")
    return payload


def step_dirs(root: Path) -> list[Path]:
    """The `step-N` checkpoints under a checkpoint directory, oldest first."""
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def resolve(path: Path) -> tuple[Path, list[str]]:
    """The checkpoint to load from `path` and notes on what was skipped: `path` itself, its
    `.old` copy if a swap was cut short, or the newest complete `step-N` below it."""
    notes: list[str] = []
    if (path / MANIFEST).exists():
        return path, notes
    old = path.with_name(path.name + ".old")
    if (old / MANIFEST).exists():
        notes.append(f"{path} is incomplete (a save was cut short); loading {old}")
        return old, notes
    steps = step_dirs(path) if path.is_dir() else []
    for candidate in reversed(steps):
        if (candidate / MANIFEST).exists():
            return candidate, notes
        notes.append(f"{candidate} is incomplete (no manifest): skipped")
    read_manifest(path)  # raises the specific error
    return path, notes


def prune(root: Path, keep: int) -> None:
    """Removes all but the newest `keep` complete checkpoints, and incomplete older ones."""
    complete = [p for p in step_dirs(root) if (p / MANIFEST).exists()]
    kept = set(complete[-keep:]) if keep > 0 else set(complete)
    newest = complete[-1] if complete else None
    for p in step_dirs(root):
        stale_partial = newest is not None and int(p.name[5:]) < int(newest.name[5:])
        if p not in kept and ((p / MANIFEST).exists() or stale_partial):
            shutil.rmtree(p, ignore_errors=True)


def export(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The whole model's parameters and buffers under the original model's keys, from a
    checkpoint (every stage file verified); loadable with `model.load_state_dict`."""
    folder, _ = resolve(Path(path))
    manifest = read_manifest(folder)
    state: dict[str, torch.Tensor] = {}
    for stage in sorted(int(s) for s in manifest["files"]):
        state.update(load_stage(folder, manifest, stage)["model"])
    return state


def manifest_for(step: int, epoch: int, schedule: str, plan: dict[str, Any],
                 entries: Iterable[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    return {"format": FORMAT, "step": step, "epoch": epoch, "schedule": schedule,
            "plan": plan, "files": {str(stage): entry for stage, entry in entries}}
