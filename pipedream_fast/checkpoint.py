"""Checkpoints that are safe to load and whole, or refused with the file and the fault named.

A checkpoint is a directory:

    stage0.pt, stage1.pt, ...   one file per stage, written by the stage's first rank: its
                                stage index, its tensors under every key they have in the
                                original model's `state_dict()` (a tied weight under each of
                                its keys; no non-persistent buffers), its optimizer's and LR
                                scheduler's state (localsgd: also "copies", the stage's other
                                model replicas' weights under the stage module's names, with
                                their optimizer and scheduler state; export takes copy 0, the
                                model's own)
    manifest.json               written last, by rank 0, once every stage file is on disk:
                                format, run id, step, where the loader stands (epoch,
                                batches of it trained on, seed), schedule, plan, the groups
                                of keys that name one tied weight, and each file's size and
                                SHA-256; it is what makes the set a checkpoint

Every file goes to a temporary name, is fsynced and renamed, and the directory is fsynced, so
a crash leaves either the old state or the new one, never half a file. A save into an existing
checkpoint is staged in `<dir>.partial` and swapped in; a crash mid-swap leaves `<dir>.old`,
which `resolve` uses. A save only ever replaces a folder that holds nothing but checkpoint
files (`prepare_save`): a user's folder is refused, never emptied.

The manifest is untrusted input: its fields are checked (one line per fault), its files must
be plain names inside the folder, one per stage, each tagged with its stage. Loading verifies
the checksums before reading a byte of tensors, and reads with `torch.load(weights_only=True)`,
which builds tensors and plain containers only: a file cannot run code.

A `checkpoint_dir` of a Pipeline holds the `step-N` checkpoints of one run (its id is in every
manifest; `Pipeline.load` continues a run under its id): a new run is refused there
(`claim_run`), pruning removes only the run's own checkpoints, and `resolve` takes the newest
complete one, reports newer incomplete ones and refuses to guess between runs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

FORMAT = "pipedream_fast.checkpoint/4"  # /4: run id, tied keys, stage-tagged files
LEGACY = "pipedream_fast.checkpoint/3"  # still read: no run id, a tied weight under one key
MANIFEST = "manifest.json"
EXPORT_FORMATS = ("torch", "safetensors")
# All a save writes into a checkpoint folder: a folder holding anything else is not ours.
_OWN_FILE = re.compile(r"(stage\d+\.pt|manifest\.json)(\.tmp)?")
_STAGE_INDEX = re.compile(r"0|[1-9][0-9]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


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
    """Writes one stage's file durably, tagged with its stage; returns its manifest entry."""
    final = folder / stage_file(stage)
    tmp = final.with_name(final.name + ".tmp")
    torch.save({**payload, "stage": stage}, tmp)
    _commit(tmp, final)
    return {"file": final.name, "bytes": final.stat().st_size, "sha256": sha256(final)}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    final = folder / MANIFEST
    tmp = final.with_name(final.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _commit(tmp, final)


def manifest_for(step: int, epoch: int, schedule: str, plan: dict[str, Any],
                 entries: Iterable[tuple[int, dict[str, Any]]], run: str,
                 aliases: Sequence[Sequence[str]], epoch_batches: int = 0,
                 seed: int | None = None) -> dict[str, Any]:
    """`aliases`: the groups of keys that name one tensor (tied weights), for export. Where
    the loader stands: `epoch`, `epoch_batches` of it trained on, and the Pipeline's `seed`,
    which with the epoch draws its order (absent from older manifests: an epoch's start)."""
    manifest = {"format": FORMAT, "run": run, "step": step, "epoch": epoch,
                "epoch_batches": epoch_batches, "schedule": schedule, "plan": plan,
                "aliases": [list(group) for group in aliases],
                "files": {str(stage): entry for stage, entry in entries}}
    if seed is not None:
        manifest["seed"] = seed
    return manifest


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


# --- reading: the manifest is untrusted ----------------------------------------------------

def _invalid(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a valid manifest: {what}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_plain_name(name: Any) -> bool:
    """A file directly inside the checkpoint folder: no separator, no "..", not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..", MANIFEST)
            and not any(c in name for c in "/\\\x00"))


def _check_entry(path: Path, stage: Any, entry: Any) -> None:
    if not isinstance(stage, str) or not _STAGE_INDEX.fullmatch(stage):
        raise _invalid(path, f"stage {_short(stage)} in 'files' is not a stage index")
    if not isinstance(entry, dict):
        raise _invalid(path, f"the entry of stage {stage} must be a map with 'file', 'bytes' "
                             f"and 'sha256', got {_short(entry)}")
    for key in ("file", "bytes", "sha256"):
        if key not in entry:
            raise _invalid(path, f"the entry of stage {stage} lacks {key!r}")
    if not _is_plain_name(entry["file"]):
        raise _invalid(path, f"the file of stage {stage}, {_short(entry['file'])}, is not a "
                             f"plain file name inside the checkpoint folder")
    if not _is_count(entry["bytes"]):
        raise _invalid(path, f"'bytes' of stage {stage} must be a size in bytes, got "
                             f"{_short(entry['bytes'])}")
    if not isinstance(entry["sha256"], str) or not _SHA256.fullmatch(entry["sha256"]):
        raise _invalid(path, f"'sha256' of stage {stage} must be 64 hex digits, got "
                             f"{_short(entry['sha256'])}")


def _check_files(path: Path, files: Any) -> None:
    if not isinstance(files, dict) or not files:
        raise _invalid(path, f"'files' must be a non-empty map from stage index to file "
                             f"entry, got {_short(files)}")
    owner: dict[str, str] = {}
    for stage, entry in files.items():
        _check_entry(path, stage, entry)
        if entry["file"] in owner:
            raise _invalid(path, f"{entry['file']} is listed twice (stages {owner[entry['file']]} "
                                 f"and {stage}); each stage has a file of its own")
        owner[entry["file"]] = stage
    stages = sorted(int(s) for s in files)
    if stages != list(range(len(stages))):
        raise _invalid(path, f"its stages {stages} are not 0 to {len(stages) - 1}")


def _check_aliases(path: Path, aliases: Any) -> None:
    groups_ok = isinstance(aliases, list) and all(
        isinstance(g, list) and len(g) > 1 and all(isinstance(k, str) for k in g)
        for g in aliases)
    if not groups_ok:
        raise _invalid(path, f"'aliases' must be a list of groups of two or more keys, got "
                             f"{_short(aliases)}")
    keys = [k for group in aliases for k in group]
    if len(keys) != len(set(keys)):
        raise _invalid(path, "a key is in two groups of 'aliases'")


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of the checkpoint `folder`, its schema checked."""
    path = folder / MANIFEST
    if not folder.is_dir():
        why = "a file" if folder.exists() else "it does not exist"
        raise CheckpointError(f"{folder} is not a checkpoint directory ({why})")
    if not path.exists() and not any(_OWN_FILE.fullmatch(p.name) for p in folder.iterdir()):
        raise CheckpointError(f"{folder} is not a checkpoint (it has no {MANIFEST} nor stage "
                              f"files)")
    if not path.exists():
        raise CheckpointError(f"{folder} has no {MANIFEST}: the save that wrote it did not "
                              f"finish (a rank died or was stopped), so its stage files may be "
                              f"from different steps; use an earlier checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable manifest: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, LEGACY):
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path} is not a {FORMAT} manifest (format {_short(found)})")
    current = manifest["format"] == FORMAT
    required = ("step", "epoch", "schedule", "plan", "files") + (("run", "aliases") if current
                                                                else ())
    for key in required:
        if key not in manifest:
            raise CheckpointError(f"{path} lacks {key!r}")
    for key in ("step", "epoch", "epoch_batches"):
        if key in manifest and not _is_count(manifest[key]):
            raise _invalid(path, f"{key!r} must be a whole number >= 0, got "
                                 f"{_short(manifest[key])}")
    seed = manifest.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise _invalid(path, f"'seed' must be a whole number, got {_short(seed)}")
    if not isinstance(manifest["schedule"], str) or not isinstance(manifest["plan"], dict):
        raise _invalid(path, "'schedule' must be a name and 'plan' a map")
    if current and (not isinstance(manifest["run"], str) or not manifest["run"]):
        raise _invalid(path, f"'run' must be a run id, got {_short(manifest['run'])}")
    _check_files(path, manifest["files"])
    _check_aliases(path, manifest.get("aliases", []))
    return manifest


def load_stage(folder: Path, manifest: dict[str, Any], stage: int) -> dict[str, Any]:
    """One stage's payload, after checking it is the file the manifest committed for it."""
    entry = manifest["files"].get(str(stage))
    if entry is None:
        raise CheckpointError(f"{folder / MANIFEST} lists no file for stage {stage} (it has "
                              f"stages {sorted(int(s) for s in manifest['files'])})")
    path = folder / entry["file"]
    if not path.is_file():
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
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        raise CheckpointError(f"{path} is not a stage file (no 'model' of named tensors)")
    if manifest["format"] != LEGACY and payload.get("stage") != stage:
        raise CheckpointError(f"{path} holds stage {_short(payload.get('stage'))}, but "
                              f"{folder / MANIFEST} lists it for stage {stage}: files renamed "
                              f"or mixed up")
    return payload


def restore(module: nn.Module, names: Mapping[int, tuple[str, ...]],
            saved: dict[str, torch.Tensor], where: str, exact: bool = True) -> None:
    """Copies a stage file's tensors (`where`) into the stage `module`, each from one of its
    keys in the original model (`names`, from `training.original_names`). With `exact`, the
    file must hold exactly this stage's keys."""
    expected: set[str] = set()
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        keys = names.get(id(t), ())
        if not keys:
            if isinstance(t, nn.Parameter):
                raise CheckpointError(f"parameter {name} of this stage has no key in the "
                                      f"model's state_dict(), so {where} cannot restore it")
            continue  # a non-persistent buffer: never saved, it keeps the model's value
        expected.update(keys)
        key = next((k for k in keys if k in saved), None)
        if key is None:
            raise CheckpointError(f"{where} lacks {keys[0]!r} of this stage: the checkpoint "
                                  f"of another model or another split")
        if saved[key].shape != t.shape:
            raise CheckpointError(f"{where} holds {key!r} of shape {tuple(saved[key].shape)}, "
                                  f"but the model's is {tuple(t.shape)}: another model")
        with torch.no_grad():
            t.copy_(saved[key])
    unexpected = sorted(set(saved) - expected)
    if exact and unexpected:
        raise CheckpointError(f"{where} holds {unexpected[0]!r} (and {len(unexpected) - 1} "
                              f"more keys) that this stage of the model does not have: "
                              f"another stage's file or another model's")


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


def resolve(path: Path) -> tuple[Path, list[str]]:
    """The checkpoint to load from `path` and notes on what was skipped: `path` itself, its
    `.old` copy if a swap was cut short, or the newest complete `step-N` below it (of its
    only run: a folder of several runs is refused)."""
    notes: list[str] = []
    if (path / MANIFEST).exists():
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


# --- export ------------------------------------------------------------------------------------

def share_aliases(state: dict[str, torch.Tensor],
                  groups: Iterable[Sequence[str]]) -> dict[str, torch.Tensor]:
    """`state` with each group of keys held (a tied weight) naming one tensor, as in
    `state_dict()`, so that it is saved once and stays tied."""
    for group in groups:
        held = [k for k in group if k in state]
        for key in held[1:]:
            state[key] = state[held[0]]
    return state


def _check_aliases_held(state: dict[str, torch.Tensor], groups: list[list[str]],
                        where: Path) -> None:
    for group in groups:
        for key in group:
            if key not in state:
                raise CheckpointError(f"{where} names {key!r} as a key of the tied weight "
                                      f"{group[0]!r}, but no stage file holds it")
            if not torch.equal(state[key], state[group[0]]):
                raise CheckpointError(f"{where}: {key!r} and {group[0]!r} are one tied weight "
                                      f"but the stage files hold different values")


def export(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The whole model's state under the original model's `state_dict()` keys, from a
    checkpoint (every stage file verified): a tied weight under each of its keys as one
    tensor, no non-persistent buffers; `model.load_state_dict(state, strict=True)` takes it."""
    folder, _ = resolve(Path(path))
    manifest = read_manifest(folder)
    state: dict[str, torch.Tensor] = {}
    holder: dict[str, str] = {}
    for stage in sorted(int(s) for s in manifest["files"]):
        for key, value in load_stage(folder, manifest, stage)["model"].items():
            # A weight tied across stages is in each of their files, kept equal by training.
            if key in state and not torch.equal(state[key], value):
                raise CheckpointError(f"{folder}: {holder[key]} and "
                                      f"{manifest['files'][str(stage)]['file']} both hold "
                                      f"{key!r}, with different values")
            holder.setdefault(key, manifest["files"][str(stage)]["file"])
            state.setdefault(key, value)
    aliases = manifest.get("aliases", [])
    _check_aliases_held(state, aliases, folder / MANIFEST)
    return share_aliases(state, aliases)


def export_format(out: Path, fmt: str | None) -> str:
    """`fmt`, or from the file name: `.safetensors` is safetensors, anything else torch."""
    if fmt is None:
        return "safetensors" if out.suffix == ".safetensors" else "torch"
    if fmt not in EXPORT_FORMATS:
        raise CheckpointError(f"unknown export format {fmt!r}: use {' or '.join(EXPORT_FORMATS)}")
    return fmt


def check_export_target(out: Path, source: Path) -> None:
    """Refuses to export checkpoint `source` to a directory, into a missing folder, or into
    a checkpoint folder (it would overwrite or add to the files a manifest commits)."""
    if out.is_dir():
        raise CheckpointError(f"{out} is a directory: name the file to write, e.g. "
                              f"{out / 'model.safetensors'}")
    if not out.parent.is_dir():
        why = "is not a folder" if out.parent.exists() else "does not exist"
        raise CheckpointError(f"cannot write {out}: its folder {out.parent} {why}")
    target, source = out.resolve(), source.resolve()
    inside = next((p for p in target.parents if p == source or (p / MANIFEST).exists()), None)
    if inside is not None:
        raise CheckpointError(f"refusing to write {out} inside the checkpoint folder {inside}: "
                              f"it would replace or add to the files of that checkpoint; "
                              f"write it elsewhere")


def safetensors_state(state: Mapping[str, torch.Tensor]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`state` as safetensors holds it (no two keys may share a tensor): each tensor once,
    under its first key (the embedding's, for a tied head, as transformers saves it), and
    the metadata `safetensors.torch.save_model` writes: each key left out -> the key kept
    (`safetensors.torch.load_model` reads the file back into a tied model), plus "format":
    "pt", which transformers' `from_pretrained` requires."""
    tensors: dict[str, torch.Tensor] = {}
    metadata = {"format": "pt"}
    first: dict[int, str] = {}
    for key, t in state.items():
        if id(t) in first:
            metadata[key] = first[id(t)]
        else:
            first[id(t)] = key
            tensors[key] = t.contiguous()
    return tensors, metadata


def write_export(state: Mapping[str, torch.Tensor], out: Path, fmt: str) -> None:
    """Writes `state` to `out` (`torch.save` or safetensors) through a temporary file beside
    it, removed on any failure: `out` is then the old file or the whole new one."""
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file
            with open(tmp, "xb"):  # the mode the user's umask gives (safetensors writes 0600)
                pass
            mode = tmp.stat().st_mode & 0o777
            tensors, metadata = safetensors_state(state)
            save_file(tensors, tmp, metadata=metadata)
            os.chmod(tmp, mode)
        else:
            torch.save(dict(state), tmp)
        _commit(tmp, out)
    except OSError as err:
        raise CheckpointError(f"cannot write {out}: {err.strerror or err}") from err
    finally:
        tmp.unlink(missing_ok=True)
