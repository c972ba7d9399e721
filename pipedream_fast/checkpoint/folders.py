"""Where checkpoints go: the folder a save may write, and the step-N checkpoints of one run.

A save into an existing checkpoint is staged in `<dir>.partial` and swapped in; a crash
mid-swap leaves `<dir>.old`, which `resolve` uses. A save only ever replaces a folder that
holds nothing but checkpoint files (`prepare_save`): a user's folder is refused, never emptied.

A `checkpoint_dir` of a Pipeline holds the `step-N` checkpoints of one run (its id is in every
manifest; `Pipeline.load` continues a run under its id): a new run is refused there
(`claim_run`), pruning removes only the run's own checkpoints, and `resolve` takes the newest
complete one, reports newer incomplete ones and refuses to guess between runs.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedream_fast.checkpoint.files import (MANIFEST, _OWN_FILE, CheckpointError, _fsync_dir,
                                             read_manifest)

# --- where a save may write ---------------------------------------------------------------

def staging(path: Path) -> Path:
    """Where a save into an existing `path` writes before it is swapped in."""
    return path.with_name(path.name + ".partial")


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _foreign(folder: Path) -> list[str]:
    """What `folder` holds that no save wrote, sorted (a save that replaced it would lose it)."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                  if p.is_symlink() or not p.is_file() or not _OWN_FILE.fullmatch(p.name))


def _check_owned(folder: Path, final: Path) -> None:
    if not folder.exists() and not folder.is_symlink():
        return
    where = "it" if folder == final else str(folder)
    if folder.is_symlink() or not folder.is_dir():
        raise CheckpointError(f"refusing to save into {final}: {where} is a file or a link, "
                              f"not a checkpoint folder; save into a new or empty folder")
    foreign = _foreign(folder)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3
                                          else "")
        raise CheckpointError(f"refusing to save into {final}: {where} holds {shown}, so it is "
                              f"not a checkpoint of pipedream_fast, and a save replaces the "
                              f"folder whole; save into a new or empty folder, or move them")


def prepare_save(final: Path) -> Path:
    """The folder a save into `final` writes: `final` if new or empty, else its staging
    folder (an unfinished earlier one removed), for `swap_in`. Refuses, before touching
    anything, a file or a folder that holds anything but checkpoint files."""
    try:
        partial = staging(final.resolve())  # "." has no name to stage beside
        for folder in (final, partial, _old(final.resolve())):
            _check_owned(folder, final)
        if partial.exists():
            shutil.rmtree(partial)  # an earlier save that never finished
        return partial if final.exists() and any(final.iterdir()) else final
    except CheckpointError:
        raise
    except (OSError, ValueError) as err:  # raised on rank 0 only: the others must hear it
        raise CheckpointError(f"cannot save into {final}: {err}") from err


def swap_in(path: Path) -> None:
    """Replaces the checkpoint at `path` with its completed staging directory."""
    path = path.resolve()
    partial, old = staging(path), _old(path)
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(partial, path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


# --- checkpoint_dir: the step-N checkpoints of one run ---------------------------------------

def step_dirs(root: Path) -> list[Path]:
    """The `step-N` checkpoints under a checkpoint directory, oldest first."""
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _run_of(folder: Path) -> str | None:
    """The run that wrote the checkpoint `folder` (None: unreadable, or older than run ids)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    run = manifest.get("run") if isinstance(manifest, dict) else None
    return run if isinstance(run, str) else None


def _runs(root: Path) -> dict[str | None, list[Path]]:
    """The complete step-N checkpoints under `root` by the run that wrote them, oldest first."""
    runs: dict[str | None, list[Path]] = {}
    for p in step_dirs(root):
        if (p / MANIFEST).exists():
            runs.setdefault(_run_of(p), []).append(p)
    return runs


def _describe(runs: Mapping[str | None, list[Path]]) -> str:
    return "; ".join(f"run {run or '(no id: an older version)'}: "
                     f"{steps[0].name}" + (f" to {steps[-1].name}" if len(steps) > 1 else "")
                     for run, steps in runs.items())


def holds_checkpoint(path: Path) -> bool:
    """Whether `path` is, or holds, a complete checkpoint that `resolve` would load."""
    return ((path / MANIFEST).exists() or (_old(path) / MANIFEST).exists()
            or (path.is_dir() and bool(_runs(path))))


def resolve(path: Path) -> tuple[Path, list[str]]:
    """The checkpoint to load from `path` and notes on what was skipped: `path` itself, its
    `.old` copy if a swap was cut short, or the newest complete `step-N` below it (of its
    only run: a folder of several runs is refused)."""
    notes: list[str] = []
    if (path / MANIFEST).exists():
        if (staging(path) / MANIFEST).exists():  # cut between the new manifest and the swap
            notes.append(f"{staging(path)} holds a newer complete checkpoint that was never "
                         f"swapped in (the save was cut just before); loading {path}, the one "
                         f"named: pass {staging(path)} to load the newer one")
        return path, notes
    old = _old(path)
    if (old / MANIFEST).exists():
        notes.append(f"{path} is incomplete (a save was cut short); loading {old}")
        return old, notes
    runs: dict[str | None, list[Path]] = {run: steps for run, steps in _runs(path).items()
                                          if run is not None}
    if len(runs) > 1:
        newest = ", ".join(str(steps[-1]) for steps in runs.values())
        raise CheckpointError(f"{path} holds the checkpoints of {len(runs)} runs "
                              f"({_describe(runs)}); refusing to guess which: name one "
                              f"checkpoint folder ({newest})")
    for candidate in reversed(step_dirs(path)):
        if (candidate / MANIFEST).exists():
            return candidate, notes
        notes.append(f"{candidate} is incomplete (no manifest): skipped")
    read_manifest(path)  # raises the specific error
    return path, notes


def prune(root: Path, keep: int, run: str) -> None:
    """Removes run `run`'s complete checkpoints but the newest `keep`, and incomplete ones
    older than its newest; never another run's, nor a folder holding other files."""
    mine = _runs(root).get(run, [])
    kept = set(mine[-keep:]) if keep > 0 else set(mine)
    newest = int(mine[-1].name[5:]) if mine else -1
    for p in step_dirs(root):
        if (p / MANIFEST).exists():
            stale = p in mine and p not in kept
        else:
            stale = int(p.name[5:]) < newest  # a save that never finished
        if stale and not _foreign(p):
            shutil.rmtree(p, ignore_errors=True)


@dataclass(frozen=True)
class _Resumed:
    run: str | None  # None: a checkpoint written before run ids


_RESUMING: ContextVar[_Resumed | None] = ContextVar("pipedream_fast_resuming", default=None)


@contextmanager
def resuming(manifest: dict[str, Any]) -> Iterator[None]:
    """While `Pipeline.load` builds the Pipeline that continues the run of `manifest`."""
    token = _RESUMING.set(_Resumed(manifest.get("run")))
    try:
        yield
    finally:
        _RESUMING.reset(token)


def claim_run(checkpoint_dir: str | os.PathLike[str] | None) -> str:
    """The run id of a new Pipeline: the resumed run's inside `resuming`, else a new one.
    Refuses a `checkpoint_dir` that is a file or holds another run's checkpoints (the two
    runs would prune each other's and resume from each other's)."""
    resumed = _RESUMING.get()
    if checkpoint_dir is not None:
        _check_checkpoint_dir(Path(checkpoint_dir), resumed)
    if resumed is not None and resumed.run is not None:
        return resumed.run
    return uuid.uuid4().hex


def _check_checkpoint_dir(root: Path, resumed: _Resumed | None) -> None:
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint_dir {root} is a file, not a folder: give a folder "
                              f"(it will hold the run's step-N checkpoints)")
    if not root.is_dir():
        return
    # A resumed run may find its own checkpoints, and ones older than run ids it came from.
    others = {run: steps for run, steps in _runs(root).items()
              if resumed is None or (run is not None and run != resumed.run)}
    if others:
        raise CheckpointError(f"checkpoint_dir {root} already holds the checkpoints of another "
                              f"run ({_describe(others)}); to continue that run, pass the "
                              f"folder to Pipeline.load({str(root)!r}, ...), or give this run "
                              f"a new checkpoint_dir")
