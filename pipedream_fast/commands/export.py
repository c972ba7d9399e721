"""`pipedream-fast export CKPT --out model.pt`: a checkpoint as one plain state dict.

The stage files of a Pipeline checkpoint (verified against its manifest, read without running
code) are merged under the original model's keys, so `model.load_state_dict(torch.load(
"model.pt"))` works on the plain `nn.Module`. CKPT may be a checkpoint or a `checkpoint_dir`
(its newest complete checkpoint). In Python: `pipedream_fast.checkpoint.export(CKPT)`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from pipedream_fast.cli import UsageError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("export", help="write a checkpoint as one plain state dict",
                                   description=__doc__.split("\n\n")[1])
    parser.add_argument("checkpoint", help="checkpoint directory (or a checkpoint_dir)")
    parser.add_argument("--out", required=True, help="the state dict file to write (torch.save)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipedream_fast.checkpoint import CheckpointError, export, resolve

    try:
        folder, notes = resolve(Path(args.checkpoint))
        for note in notes:
            print(f"note: {note}")
        state = export(folder)
    except CheckpointError as err:
        raise UsageError(str(err)) from err
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out)
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"wrote {out}: {len(state)} tensors, {size / 1e6:.1f} MB, from {folder}")
    return 0
