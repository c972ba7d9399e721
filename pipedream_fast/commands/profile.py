"""`pipedream-fast profile`: measure a model block by block and write the Profile JSON.

    pipedream-fast profile --model cnn --batch-size 32 --out profile.json
    pipedream-fast profile --model mypkg.nets:build --batch-size 8 --input-shape 3,224,224 --out p.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipedream_fast.cli import UsageError
from pipedream_fast.models import BUILTIN_MODELS, build_model
from pipedream_fast.profiler import OPTIMIZERS, profile_model


def parse_shape(text: str) -> tuple[int, ...]:
    """`3,32,32` or `3x32x32` -> (3, 32, 32)."""
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise UsageError(f"--input-shape {text!r}: expected positive integers such as 3,32,32") from None
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(f"--input-shape {text!r}: every dimension must be a positive integer")
    return shape


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "profile", help="measure a model block by block and write a profile JSON",
        description="Trace a model into blocks, time each block's forward and backward, and "
                    "record activation, parameter and optimizer-state bytes.")
    parser.add_argument("--model", required=True, metavar="NAME_OR_MODULE:FACTORY",
                        help=f"built-in model ({', '.join(BUILTIN_MODELS)}) or an importable "
                             f"factory 'package.module:function' taking the batch size")
    parser.add_argument("--batch-size", type=int, required=True, help="samples per minibatch")
    parser.add_argument("--input-shape", type=str, default=None, metavar="C,H,W",
                        help="per-sample input shape (required when the factory returns a bare "
                             "module; overrides the built-in example input otherwise)")
    parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS),
                        help="optimizer whose state is measured (default: sgd, no state)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per block (default 2)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed runs per block; the median is kept (default 5)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="intra-op threads while measuring; give the count each rank will "
                             "train with (pipedream-fast train uses 1) so the plan and the "
                             "simulator see the times the run will have (default: torch's)")
    parser.add_argument("--leaf", action="append", default=[], metavar="MODULE_NAME",
                        help="submodule to keep whole instead of tracing into it (repeatable)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    parser.add_argument("--out", required=True, help="where to write the profile JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.batch_size <= 0:
        raise UsageError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.warmup < 0 or args.repeat < 1:
        raise UsageError(f"need --warmup >= 0 and --repeat >= 1, got {args.warmup} and {args.repeat}")
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise UsageError(f"--torch-threads must be a positive integer, got {args.torch_threads}")
        import torch
        torch.set_num_threads(args.torch_threads)
    shape = parse_shape(args.input_shape) if args.input_shape else None
    module, example = build_model(args.model, args.batch_size, shape)
    _check_runs(module, example, args)
    profile = profile_model(module, example, args.batch_size, optimizer=args.optimizer,
                            warmup=args.warmup, repeat=args.repeat, device=args.device,
                            progress=not args.quiet, model_name=args.model,
                            leaf_modules=args.leaf)
    profile.save(args.out)
    if not args.quiet:
        _print_table(profile)
    print(f"wrote {args.out}: {len(profile.blocks)} blocks of {args.model} "
          f"at batch size {args.batch_size} on {profile.device}")
    return 0


def _check_runs(module: Any, example: Any, args: argparse.Namespace) -> None:
    """One forward on the example before profiling, so that inputs the model does not take
    (a wrong --input-shape) are one line, not a traceback from inside the profiler."""
    import torch

    shape = (tuple(example.shape) if isinstance(example, torch.Tensor)
             else type(example).__name__)
    try:
        with torch.no_grad():
            module(*example) if isinstance(example, tuple) else module(example)
    except Exception as err:
        raise UsageError(f"model {args.model!r} does not run on inputs of shape {shape}"
                         f"{' (from --input-shape)' if args.input_shape else ''}: "
                         f"{type(err).__name__}: {str(err).splitlines()[0]}") from err


def _print_table(profile: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"profile of {profile.model} (batch {profile.batch_size}, {profile.device})")
    for column in ("#", "block", "forward ms", "backward ms", "activations out", "parameters",
                   "optimizer state"):
        table.add_column(column, justify="left" if column == "block" else "right")
    for index, b in enumerate(profile.blocks):
        table.add_row(str(index), b.name, f"{b.forward_ms:.3f}", f"{b.backward_ms:.3f}",
                      _human(b.activation_bytes), _human(b.parameter_bytes),
                      _human(b.optimizer_state_bytes))
    Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120).print(table)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
