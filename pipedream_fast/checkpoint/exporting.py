"""A checkpoint as the plain model's state dict, written as one torch or safetensors file.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from pipedream_fast.checkpoint.files import (MANIFEST, CheckpointError, DiskFull, _commit,
                                             check_room, load_stage, payload_bytes,
                                             ran_out_of_room, read_manifest)
from pipedream_fast.checkpoint.folders import resolve
from pipedream_fast.checkpoint.restoring import share_aliases

EXPORT_FORMATS = ("torch", "safetensors")
EXPORT_REMEDY = "free some space or export to a larger disk (nothing was written)"


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
    needed = payload_bytes(state)
    free = check_room(out, needed, EXPORT_REMEDY)
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
    except Exception as err:
        if ran_out_of_room(err, out.parent, needed):
            raise DiskFull(out, needed, free, EXPORT_REMEDY) from err
        if isinstance(err, OSError):
            raise CheckpointError(f"cannot write {out}: {err.strerror or err}") from err
        raise
    finally:
        tmp.unlink(missing_ok=True)
