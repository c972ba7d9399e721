"""Time to 95% test accuracy: pipedream_fast against DDP on an emulated slow 2-machine cluster.

PipeDream's measure: a pipeline that moves fewer bytes per step must also converge in about as
many steps. Per link rate (bench/netcluster.py), DDP (16 samples per rank) and Pipeline
"pipedream" (2 stages) train a wide MLP on scikit-learn's digits from the same weights and
stream of batches, until the target or --cap-s of rank 0's training clock.

    python bench/time_to_accuracy.py [--quick] ... [--out bench/results/time_to_accuracy.md]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Scripts next to this file (bench/ is on sys.path when this file runs as a script).
import harness
import netcluster
from netcluster import BATCH, WORLD

WIDTH = 2048
SPLIT = 2  # stage 1 starts at block 2 (fc3)
SEED = 0
# Tuned on the reference (lr 0.01-1, momentum 0 and 0.9): lr 0.1 reaches 95% by step 80. Faster
# settings sit next to divergence, which would handicap pipedream's one-update-stale stage 0.
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.0)
TARGET = 0.95
# DDP at 100mbit needs ~250 s of training to 95%: the default cap lets it get there (~7 min in
# all); --quick's projects it (~3 min).
DEFAULT_CAP_S = 330.0
QUICK_CAP_S = 90.0
EVAL_EVERY = 10  # training steps between evaluations
TEST_BATCH = 90  # 360 test images = 4 batches
MAX_STEPS = 3000
LABELS = {"ddp": "DDP (gloo), 16 per rank", "pipedream": "pipedream_fast pipedream, 2 stages"}


def build_model() -> nn.Sequential:
    """64 -> 2048 -> 2048 -> 2048 -> 10, four named blocks (fc1..fc4)."""
    blocks = {f"fc{i}": nn.Sequential(nn.Linear(width, WIDTH), nn.ReLU())
              for i, width in enumerate((64, WIDTH, WIDTH), 1)}
    return nn.Sequential(OrderedDict(blocks, fc4=nn.Linear(WIDTH, 10)))


def global_batches(x: torch.Tensor, y: torch.Tensor,
                   taken: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of BATCH, forever: epoch e is a permutation seeded SEED + e, its last
    partial batch dropped. Every contender reads this one stream; `taken[0]` counts them."""
    for epoch in range(10**9):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED + epoch))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            taken[0] += 1
            yield x[order[start:start + BATCH]], y[order[start:start + BATCH]]


# ---- ranks (run inside the namespaces) -----------------------------------------------------
def next_segment(steps: int, train_s: float, reached: bool, cap_s: float) -> int:
    """Rank 0's decision: how many steps to train next (0: stop). First one step, to learn the
    pace; then up to the next multiple of EVAL_EVERY, cut to the steps the pace says fit in the
    cap (at least one), so the cap is overrun by less than a step."""
    if reached or train_s >= cap_s or steps >= MAX_STEPS:
        return 0
    if steps == 0:
        return 1
    n = min(EVAL_EVERY - steps % EVAL_EVERY, MAX_STEPS - steps)
    fit = (cap_s - train_s) * steps / train_s  # infinite for the reference
    return n if fit >= n else max(1, math.ceil(fit))


def drive(train: Callable[[int], None], evaluate: Callable[[], float],
          cap_s: float) -> dict[str, Any]:
    """The loop every contender and the reference share: rank 0 decides the next segment and
    broadcasts it, every rank trains it (timed on its clock), then all evaluate."""
    points = [(0, 0.0, evaluate())]
    total = dict.fromkeys(("seconds", "tx_bytes", "busy_s", "cpu_s"), 0.0)
    steps, reached = 0, None
    decision = torch.zeros(1, dtype=torch.int64)
    while True:
        decision[0] = next_segment(steps, total["seconds"], reached is not None, cap_s)
        if dist.is_initialized():
            dist.broadcast(decision, src=0)  # rank 0's decision
        if int(decision[0]) == 0:
            break
        start = netcluster.snapshot()
        train(int(decision[0]))
        total = {k: v + netcluster.since(start)[k] for k, v in total.items()}
        steps += int(decision[0])
        points.append((steps, total["seconds"], evaluate()))
        if reached is None and points[-1][2] >= TARGET:
            reached = steps, total["seconds"]
    return {"points": points, "steps": steps, "train_s": total["seconds"],
            "reached_step": reached[0] if reached else None,
            "reached_s": reached[1] if reached else None, "final_accuracy": points[-1][2],
            "s_per_step": total["seconds"] / max(steps, 1), **total}


def worker(contender: str, cap_s: float) -> dict[str, Any]:
    """One rank of `contender` (its `drive`): DDP, pipedream's stage (the first reads the data),
    or the whole model in this process ("reference")."""
    from pipedream_fast.datasets import digits
    from pipedream_fast.models import accuracy
    from pipedream_fast.pipeline import Pipeline

    torch.set_num_threads(1)
    torch.manual_seed(SEED)  # the same initial weights in every rank and the reference
    model, taken = build_model(), [0]
    (train_x, train_y), (test_x, test_y) = (split.tensors for split in digits())
    batches = global_batches(train_x.flatten(1), train_y, taken)
    tests = [(test_x[i:i + TEST_BATCH].flatten(1), test_y[i:i + TEST_BATCH])
             for i in range(0, len(test_x), TEST_BATCH)]
    if contender != "pipedream":
        train = netcluster.trainer(model, contender == "ddp", SGD)

        @torch.no_grad()
        def evaluate() -> float:
            model.eval()
            correct = sum(int((model(x).argmax(-1) == y).sum()) for x, y in tests)
            model.train()
            return correct / len(test_y)

        return drive(lambda n: train(itertools.islice(batches, n)), evaluate, cap_s)
    pipe = Pipeline(model, nn.functional.cross_entropy, SGD, schedule="pipedream", chunks=1,
                    plan=netcluster.two_stage_plan("wide_mlp", SPLIT, len(model), "pipedream"),
                    seed=SEED, timeout=600.0)
    reads = 0 in pipe.stage_indices  # the first stage reads the data, the last the labels

    def segment(n: int) -> None:
        trained = taken[0] + n
        for _ in pipe.train(batches if reads else None, steps=n):
            pass
        if reads and taken[0] != trained:
            raise RuntimeError(f"the pipeline read {taken[0]} batches for {trained} steps: "
                               f"the data order would differ from DDP's")

    dist.barrier()
    return drive(segment, lambda: float(pipe.evaluate(tests if reads else None, metrics={
        "accuracy": accuracy})["accuracy"]), cap_s)


# ---- the harness ---------------------------------------------------------------------------
def run(rates: list[str], cap_s: float) -> dict[str, Any]:
    """The reference, then each contender at each rate, as a JSON-able dict."""
    began, model = time.monotonic(), build_model()
    params = [sum(p.numel() for p in part.parameters()) for part in (model[:SPLIT], model[SPLIT:])]
    macs = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    result: dict[str, Any] = {
        "rates": rates, "target": TARGET, "cap_s": cap_s, "eval_every": EVAL_EVERY,
        "lr": SGD.keywords["lr"], "momentum": SGD.keywords["momentum"], "batch": BATCH,
        "model": {"parameters": sum(params), "parameter_bytes": sum(params) * 4,
                  "stage_parameters": params, "activation_bytes": BATCH * WIDTH * 4,
                  "gflop_per_step": 3 * 2 * macs * BATCH / 1e9},
        "machine": harness.machine_info(), "command": harness.command(), "rows": []}
    ref = result["reference"] = worker("reference", math.inf)
    harness.say(f"reference (one process, one thread): {reached_text(ref)}, "
                f"{ref['s_per_step'] * 1e3:.0f} ms/step")

    def each(cluster: netcluster.Cluster, rate: str) -> None:
        for contender, label in LABELS.items():
            # Evaluations and set-up run outside the clock: allow for them generously.
            ranks = netcluster.run_workers(cluster, __file__, [contender, cap_s], cap_s * 3 + 300)
            lead, projected = ranks[0], None
            if lead["reached_s"] is None and ref["reached_step"] is not None:
                projected = ref["reached_step"] * lead["s_per_step"]
            row = {**lead, "rate": rate, "contender": contender, "label": label,
                   "samples_per_s": BATCH / lead["s_per_step"], "projected_s": projected,
                   "bytes_per_step": sum(r["tx_bytes"] for r in ranks) / max(lead["steps"], 1),
                   "other_cores": harness.other_cores(ranks, lead["train_s"])}
            result["rows"].append(row)
            harness.say(f"[{rate}] {label:36s} {row['samples_per_s']:7.1f} samples/s, time to "
                        f"target {time_text(row, ref)[0]}, final accuracy "
                        f"{row['final_accuracy']:.3f} ({row['steps']} steps)")

    result["links"] = netcluster.sweep(rates, each)
    result["total_s"] = time.monotonic() - began
    return result


# ---- the report ----------------------------------------------------------------------------
def reached_text(ref: dict[str, Any], bold: str = "") -> str:
    return (f"{TARGET:.0%} after {bold}{ref['reached_step']} steps{bold} "
            f"({ref['reached_s']:.1f} s)" if ref["reached_step"]
            else f"{TARGET:.0%} not reached in {ref['steps']} steps")


def time_text(row: dict[str, Any], ref: dict[str, Any]) -> tuple[str, str]:
    """A contender's time to target (s) and steps to target, as the table shows them."""
    if row["reached_s"] is not None:
        return f"**{row['reached_s']:.1f}**", str(row["reached_step"])
    if row["projected_s"] is not None:
        return (f"not within {row['train_s']:.0f}; projected {row['projected_s']:.0f}",
                f"({ref['reached_step']}, reference)")
    return f"not within {row['train_s']:.0f}", "-"


def speedup_text(here: list[dict[str, Any]]) -> str:
    """DDP's time to target over pipedream's, at one rate."""
    times = [r["reached_s"] if r["reached_s"] is not None else r["projected_s"] for r in here]
    if len(times) != 2 or None in times:
        return "-"
    projected = any(r["reached_s"] is None for r in here)
    return f"{times[0] / times[1]:.1f}x" + (" (projected)" if projected else "")


def markdown(result: dict[str, Any]) -> str:
    facts, ref, rows = result["model"], result["reference"], result["rows"]
    lines = [*netcluster.header("Time to accuracy: pipedream_fast vs DDP on an emulated "
                                "2-machine cluster", result["links"], result["total_s"]),
             f"- Task: scikit-learn digits (8x8 flattened to 64), **{TARGET:.0%} test accuracy** "
             f"on all 360 test images. Model: MLP 64-{WIDTH}-{WIDTH}-{WIDTH}-10, "
             f"{facts['parameters'] / 1e6:.2f} M parameters ({facts['parameter_bytes'] / 1e6:.1f}"
             f" MB, DDP's all-reduce per step), cut before fc3 (stages of "
             f"{' and '.join(f'{n / 1e6:.2f}' for n in facts['stage_parameters'])} M); "
             f"{facts['activation_bytes'] / 1024:.0f} KiB of activation forward and as much "
             f"gradient back per step; {facts['gflop_per_step']:.2f} GFLOP per step.",
             f"- Same for both: batch {BATCH} (DDP: {BATCH // WORLD} per rank; pipedream: one "
             f"microbatch), SGD lr {result['lr']:g} momentum {result['momentum']:g}, seed {SEED}, "
             f"one stream of batches; pipedream's stage 0 is one update stale and drains at each "
             f"evaluation. Clock: rank 0's training time, evaluations (every {EVAL_EVERY} steps) "
             f"outside it; cap {result['cap_s']:g} s, past it *projected*: the reference's steps "
             f"to target x its own s/step. Reference (one process, one thread, no network): "
             f"{reached_text(ref, '**')}, {ref['s_per_step'] * 1e3:.0f} ms/step.", ""]
    table = []
    for rate in result["rates"]:
        here = [r for r in rows if r["rate"] == rate]
        table += [[rate if index == 0 else "", row["label"], f"{row['samples_per_s']:.1f}",
                   *time_text(row, ref), f"{row['final_accuracy']:.3f} ({row['steps']})",
                   f"{row['bytes_per_step'] / 1e6:.2f}", f"{row['other_cores']:.2f}",
                   speedup_text(here) if index == 0 else ""] for index, row in enumerate(here)]
    return "\n".join([*lines, *harness.markdown_table(
        ["link", "contender", "samples/s", "time to target (s)", "steps to target",
         "final accuracy (steps)", "MB/step on the wire", "others (cores)",
         "pipedream speedup"], table, left=2),
        "", "Samples/s: all training steps over the training clock, warm-up and the pipeline's "
        "fill and drain at every evaluation included. MB/step: both ranks' veth tx_bytes "
        "during training. Others: the cores other processes took during training (over "
        f"{harness.DISTURBED}: rerun on a quieter machine)."]) + "\n\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Accuracy against training wall time, one line per contender and rate (and the
    reference, dotted); x marks a projected time to target."""
    with harness.figure(path, dpi=120) as (_, axes):
        ax, projected = axes[0][0], False
        for row in result["rows"]:
            color = {"ddp": "tab:blue", "pipedream": "tab:orange"}[row["contender"]]
            ax.plot([p[1] for p in row["points"]], [p[2] for p in row["points"]],
                    ["-", "--", "-.", ":"][result["rates"].index(row["rate"]) % 4], color=color,
                    marker="o" if row["contender"] == "pipedream" else "s", markersize=3,
                    label=f"{row['label']}, {row['rate']}")
            if row["reached_s"] is None and row["projected_s"] is not None:
                ax.plot([row["projected_s"]], [TARGET], "x", color=color, markersize=8,
                        label="_nolegend_" if projected else "x: projected time to target")
                projected = True
        ref = result["reference"]
        ax.plot([p[1] for p in ref["points"]], [p[2] for p in ref["points"]], ":",
                color="grey", linewidth=1, label="single process (1 thread, no network)")
        ax.axhline(TARGET, color="black", linewidth=0.8, linestyle=":")
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set(xlim=(0, None), ylim=(0, 1))
        harness.axes_text(ax, f"Time to {TARGET:.0%} test accuracy, 2 ranks on emulated links",
                          "training wall time on rank 0 (s, evaluation excluded)",
                          "test accuracy (digits)", {"fontsize": 8, "loc": "lower right"})


def measure(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    result = run(args.rates, args.cap_s or (QUICK_CAP_S if args.quick else DEFAULT_CAP_S))
    if args.out:
        plot(result, Path(args.out).with_suffix(".png"))
    return markdown(result), result


if __name__ == "__main__":
    sys.exit(netcluster.launch(__doc__, worker, "1gbit,100mbit", measure, {
        "--cap-s": dict(type=float, help=f"training seconds per contender (default "
                        f"{DEFAULT_CAP_S:g}, {QUICK_CAP_S:g} with --quick)"),
        "--quick": dict(action="store_true", help="the shorter cap: the bench in ~4 min")}))
