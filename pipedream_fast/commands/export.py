"""`pipedream-fast export CKPT --out model.safetensors`: a checkpoint as the plain model's state.

The stage files of a Pipeline checkpoint (verified against its manifest, read without running
code) are merged under the original model's `state_dict()` keys. `--out m.safetensors` (or
`--format safetensors`) writes safetensors, which holds no two keys of one tensor: a tied
weight is stored once and its other keys are recorded in the metadata, as
`safetensors.torch.save_model` does, so `safetensors.torch.load_model(model, "m.safetensors")`
loads it strictly into the plain `nn.Module`. Any other name (or `--format torch`) writes
`torch.save`: `model.load_state_dict(torch.load("m.pt", weights_only=True))`. CKPT may be a
checkpoint or a `checkpoint_dir` (its newest complete checkpoint). The output is never written
inside a checkpoint folder, and appears whole or not at all. In Python:
`pipedream_fast.checkpoint.export(CKPT)`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipedream_fast.cli import UsageError


def register(subparsers: Any) -> None:
    from pipedream_fast.checkpoint import EXPORT_FORMATS

    parser = subparsers.add_parser("export", help="write a checkpoint as the plain model's "
                                                  "state (torch or safetensors)",
                                   description=__doc__.split("\n\n")[1])
    parser.add_argument("checkpoint", help="checkpoint directory (or a checkpoint_dir)")
    parser.add_argument("--out", required=True,
                        help="the file to write: NAME.safetensors for safetensors, any other "
                             "name for torch.save")
    parser.add_argument("--format", choices=EXPORT_FORMATS, default=None,
                        help="the file format (default: from the suffix of --out)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipedream_fast import checkpoint as ckpt

    out = Path(args.out)
    try:
        fmt = ckpt.export_format(out, args.format)
        folder, notes = ckpt.resolve(Path(args.checkpoint))
        ckpt.check_export_target(out, folder)
        for note in notes:
            print(f"note: {note}")
        state = ckpt.export(folder)
        ckpt.write_export(state, out, fmt)
    except ckpt.CheckpointError as err:
        raise UsageError(str(err)) from err
    unique = {id(t): t for t in state.values()}
    size = sum(t.numel() * t.element_size() for t in unique.values())
    tied = f" ({len(state)} keys: tied weights share one)" if len(unique) < len(state) else ""
    print(f"wrote {out} ({fmt}): {len(unique)} tensors{tied}, {size / 1e6:.1f} MB, from {folder}")
    return 0
