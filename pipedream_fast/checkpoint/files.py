"""One checkpoint folder on disk: its stage files and manifest, written durably and read safely.

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
a crash leaves either the old state or the new one, never half a file.

The manifest is untrusted input: its fields are checked (one line per fault), its files must
be plain names inside the folder, one per stage, each tagged with its stage. Loading verifies
the checksums before reading a byte of tensors, and reads with `torch.load(weights_only=True)`,
which builds tensors and plain containers only: a file cannot run code.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipedream_fast.checkpoint.progress import announce, touch

FORMAT = "pipedream_fast.checkpoint/4"  # /4: run id, tied keys, stage-tagged files
LEGACY = "pipedream_fast.checkpoint/3"  # still read: no run id, a tied weight under one key
MANIFEST = "manifest.json"
# All a save writes into a checkpoint folder: a folder holding anything else is not ours.
_OWN_FILE = re.compile(r"(stage\d+\.pt|manifest\.json)(\.tmp)?")
_STAGE_INDEX = re.compile(r"0|[1-9][0-9]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or not a checkpoint; names file and fault."""


STAGE_REMEDY = ("other ranks writing their parts at the same time count too; free some space or "
                "give a checkpoint folder on a larger disk (nothing of this checkpoint is kept; "
                "the checkpoints saved before are intact)")


class DiskFull(CheckpointError):
    """A checkpoint file did not fit on its disk; the message says where and by how much."""

    def __init__(self, path: Path, needed: int, free: int, remedy: str = STAGE_REMEDY) -> None:
        super().__init__(f"no space left for {path}: it needs about {_mib(needed)}, and "
                         f"{_mib(free)} were free on that disk when it began; {remedy}")
        self.path, self.needed, self.free, self.remedy = path, needed, free, remedy

    def __reduce__(self) -> tuple[Any, ...]:  # crosses processes in a rank's report
        return DiskFull, (self.path, self.needed, self.free, self.remedy)


def check_room(path: Path, needed: int, remedy: str = STAGE_REMEDY) -> int:
    """The free bytes of `path`'s disk; `DiskFull` if `needed` bytes do not fit there."""
    free = shutil.disk_usage(path.parent).free
    if needed > free:
        raise DiskFull(path, needed, free, remedy)
    return free


def ran_out_of_room(err: BaseException, folder: Path, needed: int) -> bool:
    """Whether a write into `folder` of `needed` bytes failed with `err` for lack of room.
    torch.save reports a full disk as a stream error without errno: call it before the
    partial file is removed, while the disk is still (nearly) full."""
    return (_is_enospc(err) or shutil.disk_usage(folder).free < _NEARLY_FULL
            or needed > shutil.disk_usage(folder).free)


_NEARLY_FULL = 1 << 20  # bytes: a write that failed with less than this free failed for room


def _mib(count: int) -> str:
    return f"{count / 2 ** 20:.1f} MiB"


def _is_enospc(err: BaseException) -> bool:
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return False


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


def payload_bytes(payload: Any) -> int:
    """The bytes of the tensors in `payload` (a stage file is about this large)."""
    return sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves(payload)
               if isinstance(t, torch.Tensor))


def write_stage(folder: Path, stage: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Writes one stage's file durably, tagged with its stage; returns its manifest entry.
    A file that does not fit the disk is refused before it is written, or, if the disk fills
    while it is, removed: `DiskFull` says how much it needs and how much is free."""
    final = folder / stage_file(stage)
    tmp = final.with_name(final.name + ".tmp")
    needed = payload_bytes(payload)
    free = check_room(final, needed)
    try:
        with announce(tmp, needed):  # a stop's grace waits while this grows
            torch.save({**payload, "stage": stage}, tmp)
            touch()  # written; the fsync next shows no growth
            _commit(tmp, final)
    except BaseException as err:
        full = isinstance(err, Exception) and ran_out_of_room(err, folder, needed)
        tmp.unlink(missing_ok=True)  # a partial file would keep the disk full
        if full:
            raise DiskFull(final, needed, free) from err
        raise
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
