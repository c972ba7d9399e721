"""Weight-ring snapshot benchmark (issue 2), against its two reference points.

A stage of 100 Linear(360, 360) layers (200 tensors, 52 MB float32): `WeightRing.snapshot()`
(then `release`) against a flat `dst.copy_(src)` of the same bytes (the bandwidth limit; goal
>= 80% of it) and the original PipeDream's `state_dict` clone stash (goal: >= 3x faster),
dropped at once or with the last 4 kept; a per-tensor `copy_` into kept buffers shows the
stash without its allocations, and minor page faults per call show what decides its cost.
Variants interleaved in rounds after a warm-up; medians; bandwidth: bytes copied per second.

`python bench/ring.py` writes its section of bench/results/core.md (`--no-write`: print only).
"""

from __future__ import annotations

import argparse
import collections
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from pipedream_fast import _C

import harness  # noqa: E402 - siblings
from handoff import machine, publish

LAYERS, WIDTH = 100, 360
SNAPSHOT, FLAT = "WeightRing.snapshot()", "flat dst.copy_(src), same bytes"
STASH_DROP = "state_dict clone stash, dropped at once"
STASH_KEEP = "state_dict clone stash, last 4 kept"
COPY_KEPT = "breakdown: state_dict copy_ into 200 kept tensors"


def build_stage(layers: int = LAYERS, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fn: Callable[[], object], reps: int) -> tuple[list[float], int]:
    """Seconds per call (one sample per call) and the minor page faults of all calls."""
    samples = []
    faults = minor_faults()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples, minor_faults() - faults


def snapshot_fn(ring: _C.WeightRing) -> Callable[[], None]:
    def snapshot() -> None:
        ring.release(ring.snapshot())
    return snapshot


def flat_copy_fn(nbytes: int) -> Callable[[], None]:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def state_dict_fn(model: nn.Module, keep: int) -> Callable[[], None]:
    """The PipeDream stash; with keep > 0, the last `keep` stashes stay alive."""
    alive: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=max(keep, 1))

    def stash() -> None:
        copy = {k: v.clone() for k, v in model.state_dict().items()}
        if keep:
            alive.append(copy)
    return stash


def copy_into_kept_fn(model: nn.Module) -> Callable[[], None]:
    """The stash's work without its allocations: a per-tensor copy_ into kept tensors."""
    kept = {k: v.clone() for k, v in model.state_dict().items()}

    def copy_into() -> None:
        for k, v in model.state_dict().items():
            kept[k].copy_(v)
    return copy_into


def run(reps: int, rounds: int) -> str:
    setting = machine()
    model = build_stage()
    nbytes = param_bytes(model)
    ring = _C.WeightRing(list(model.parameters()), 4)
    variants = {
        SNAPSHOT: snapshot_fn(ring),
        FLAT: flat_copy_fn(nbytes),
        STASH_DROP: state_dict_fn(model, keep=0),
        STASH_KEEP: state_dict_fn(model, keep=4),
        COPY_KEPT: copy_into_kept_fn(model),
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    faults: dict[str, int] = dict.fromkeys(variants, 0)
    names = list(variants)
    for name in names:
        timed(variants[name], 10)  # warm-up
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times, n_faults = timed(variants[name], reps)
            samples[name] += times
            faults[name] += n_faults
        print(f"  round {r + 1}/{rounds} done", file=sys.stderr)

    median = {k: statistics.median(v) for k, v in samples.items()}
    snap = median[SNAPSHOT]
    of_flat = median[FLAT] / snap
    vs_drop, vs_keep = median[STASH_DROP] / snap, median[STASH_KEEP] / snap

    rows = []
    for name, values in samples.items():
        ordered, n = sorted(values), len(values)
        rows.append((name, f"{median[name] * 1e3:.2f}", f"{ordered[n // 10] * 1e3:.2f}",
                     f"{ordered[(9 * n) // 10] * 1e3:.2f}", f"{nbytes / median[name] / 1e9:.2f}",
                     f"{median[name] / snap:.2f}x", f"{faults[name] / n:.0f}"))
    lines = harness.markdown_table(["variant", "median ms", "p10 ms", "p90 ms", "GB/s",
                                    "vs snapshot", "page faults/call"], rows)
    goal_bw = "met" if of_flat >= 0.8 else f"MISSED by {100 * (0.8 - of_flat):.0f} points"
    met = [name for name, x in (("dropped", vs_drop), ("kept", vs_keep)) if x >= 3]
    if len(met) == 2:
        verdict = "met for both stash variants"
    elif met:
        verdict = f"met only against the {met[0]} stash"
    else:
        verdict = f"MISSED by {3 / max(vs_drop, vs_keep):.2f}x"
    goal_stash = f"{verdict} (dropped: {vs_drop:.1f}x, last 4 kept: {vs_keep:.1f}x)"
    return "\n".join([
        "## Weight-ring snapshot (bench/ring.py)",
        "",
        f"Command: `python bench/ring.py --reps {reps} --rounds {rounds}`  ",
        f"Machine: {setting}  ",
        (f"Stage: {LAYERS} x Linear({WIDTH}, {WIDTH}) = {ring.num_params} parameter tensors, "
         f"{nbytes / 1e6:.1f} MB float32 ({nbytes // 4096} pages of 4 KiB), ring of 4 slots; "
         f"{rounds * reps} timed calls per variant."),
        "",
        "\n".join(lines),
        "",
        f"Snapshot bandwidth / flat copy: **{100 * of_flat:.0f}%** (goal >= 80%): {goal_bw}.  ",
        f"Snapshot speed-up over the state_dict stash (goal >= 3x): {goal_stash}.",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=10, help="timed calls per variant per round")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    publish("ring", run(args.reps, args.rounds), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
