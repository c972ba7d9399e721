"""Checkpoints that are safe to load and whole, or refused with the file and the fault named.

One module per concept, every name re-exported here (`from pipedream_fast import checkpoint
as ckpt; ckpt.resolve(...)`):

    files       one checkpoint folder on disk: stage files and the manifest written durably
                (the manifest last), checksums, the untrusted manifest's schema checked, stage
                files read with `weights_only`; the format versions
    folders     where checkpoints go: the folder a save may write (`prepare_save`, `swap_in`),
                a `checkpoint_dir`'s run (`claim_run`, `resuming`), `prune`, `resolve`
    restoring   a stage file's tensors copied into a stage module by their keys in the
                original model; the keys of a tied weight sharing one tensor
    exporting   a checkpoint as the plain model's state dict, written as torch or safetensors
"""

from __future__ import annotations

from pipedream_fast.checkpoint import exporting, files, folders, restoring
from pipedream_fast.checkpoint.exporting import (EXPORT_FORMATS, check_export_target, export,
                                                 export_format, safetensors_state,
                                                 write_export)
from pipedream_fast.checkpoint.files import (FORMAT, LEGACY, MANIFEST, CheckpointError, DiskFull,
                                             load_stage, manifest_for, read_manifest, sha256,
                                             stage_file, write_manifest, write_stage)
from pipedream_fast.checkpoint.files import _commit as _commit
from pipedream_fast.checkpoint.folders import (claim_run, holds_checkpoint, prepare_save, prune,
                                               resolve, resuming, staging, step_dirs, swap_in)
from pipedream_fast.checkpoint.folders import _RESUMING as _RESUMING
from pipedream_fast.checkpoint.restoring import restore, share_aliases

__all__ = [
    "exporting", "files", "folders", "restoring",
    "EXPORT_FORMATS", "FORMAT", "LEGACY", "MANIFEST", "CheckpointError", "DiskFull", "check_export_target",
    "claim_run", "export", "export_format", "holds_checkpoint", "load_stage", "manifest_for", "prepare_save",
    "prune", "read_manifest", "resolve", "restore", "resuming", "safetensors_state", "sha256",
    "share_aliases", "stage_file", "staging", "step_dirs", "swap_in", "write_export",
    "write_manifest", "write_stage",
]
