"""Time to 95% test accuracy: pipedream_fast against DDP on an emulated slow 2-machine cluster.

PipeDream's measure: a pipeline that moves fewer bytes per step must also converge in about as
many steps. Per link rate (bench/netcluster.py), DDP (16 samples per rank) and Pipeline
"pipedream" (2 stages) train a wide MLP on scikit-learn's digits from the same weights and
stream of batches, until the target or --cap-s of rank 0's training clock.

    python bench/time_to_accuracy.py [--rates 1gbit,100mbit] [--quick] [--cap-s 330]
                                     [--out bench/results/time_to_accuracy.md]
"""

from __future__ import annotations

import argparse
import datetime
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
from netcluster import WORLD
from vs_ddp import two_stage_plan

BATCH = 32
WIDTH = 2048
SPLIT = 2  # stage 1 starts at block 2 (fc3)
SEED = 0
# Tuned on the reference (300 steps, lr 0.01-1 x momentum 0, 0.9; 2026-12-01): lr 0.1 reaches
# 95% at step 80 and stays within a point from step 110. lr 0.3, and lr 0.03 with momentum
# 0.9, settle sooner but sit next to divergence (the next larger lr diverges): tuning
# synchronous SGD at its edge of stability would handicap pipedream, whose stage 0 applies
# gradients one update stale.
LR = 0.1
MOMENTUM = 0.0
TARGET = 0.95
# DDP at 100mbit takes ~3 s a step, ~250 s to 95%: the full cap lets it get there (~7 min in
# all); --quick's does not (it is projected): ~3 min.
DEFAULT_CAP_S = 330.0
QUICK_CAP_S = 90.0
EVAL_EVERY = 10  # training steps between evaluations
TEST_BATCH = 90  # 360 test images = 4 batches
MAX_STEPS = 3000
CONTENDERS = ("ddp", "pipedream")
LABELS = {"ddp": "DDP (gloo), 16 per rank", "pipedream": "pipedream_fast pipedream, 2 stages"}


def build_model() -> nn.Sequential:
    """64 -> 2048 -> 2048 -> 2048 -> 10, four named blocks (fc1..fc4)."""
    return nn.Sequential(OrderedDict(
        fc1=nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU()),
        fc2=nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()),
        fc3=nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()),
        fc4=nn.Linear(WIDTH, 10)))


def model_facts() -> dict[str, Any]:
    """Parameters, their bytes (what DDP all-reduces per step), the bytes that cross the cut."""
    model = build_model()
    stage_params = [sum(p.numel() for b in list(model)[lo:hi] for p in b.parameters())
                    for lo, hi in ((0, SPLIT), (SPLIT, len(model)))]
    macs = sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, nn.Linear))
    return {"parameters": sum(stage_params), "parameter_bytes": sum(stage_params) * 4,
            "stage_parameters": stage_params, "activation_bytes": BATCH * WIDTH * 4,
            "gflop_per_step": 3 * 2 * macs * BATCH / 1e9}


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """digits as (train_x [1437, 64], train_y, test_x [360, 64], test_y), normalised."""
    from pipedream_fast.datasets import digits

    (train_x, train_y), (test_x, test_y) = (split.tensors for split in digits())
    return train_x.reshape(len(train_x), -1), train_y, test_x.reshape(len(test_x), -1), test_y


def global_batches(x: torch.Tensor, y: torch.Tensor,
                   taken: list[int] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of BATCH, forever: epoch e is a permutation seeded SEED + e, its last
    partial batch dropped. Every contender reads this one stream; `taken[0]` counts them."""
    for epoch in range(10**9):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED + epoch))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            if taken is not None:
                taken[0] += 1
            yield x[order[start:start + BATCH]], y[order[start:start + BATCH]]


@torch.no_grad()
def test_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = int((model(x).argmax(-1) == y).sum())
    model.train()
    return correct / len(y)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


# ---- ranks (run inside the namespaces) -----------------------------------------------------

def next_segment(steps: int, train_s: float, reached: bool, cap_s: float) -> int:
    """Rank 0's decision: how many steps to train next (0: stop). First one step, to learn the
    pace; then up to the next multiple of EVAL_EVERY, the last segment before the cap cut to
    the steps the pace says fit (at least one), so the cap is overrun by less than a step."""
    if reached or train_s >= cap_s or steps >= MAX_STEPS:
        return 0
    if steps == 0:
        return 1
    n = min(EVAL_EVERY - steps % EVAL_EVERY, MAX_STEPS - steps)
    fit = (cap_s - train_s) / (train_s / steps)
    return n if fit >= n else max(1, math.ceil(fit))


def drive(train: Callable[[int], None], evaluate: Callable[[], float],
          cap_s: float) -> dict[str, Any]:
    """The loop every contender and the reference share: rank 0 decides the next segment and
    broadcasts it, every rank trains it (timed on its clock), then all evaluate."""
    rank = dist.get_rank() if dist.is_initialized() else None
    points = [(0, 0.0, evaluate())]
    total = dict.fromkeys(("seconds", "tx_bytes", "busy_s", "cpu_s"), 0.0)
    steps, reached = 0, None
    decision = torch.zeros(1, dtype=torch.int64)
    while True:
        decision[0] = next_segment(steps, total["seconds"], reached is not None, cap_s)
        if rank is not None:
            dist.broadcast(decision, src=0)  # rank 0's decision
        if int(decision[0]) == 0:
            break
        start = netcluster.snapshot()
        train(int(decision[0]))
        window = netcluster.since(start)
        total = {k: v + window[k] for k, v in total.items()}
        steps += int(decision[0])
        points.append((steps, total["seconds"], evaluate()))
        if reached is None and points[-1][2] >= TARGET:
            reached = steps, total["seconds"]
        if rank == 0:
            harness.say(f"step {steps}: accuracy {points[-1][2]:.3f}, training "
                        f"{total['seconds']:.1f} s")
    return {"points": points, "steps": steps, "train_s": total["seconds"],
            "reached_step": reached[0] if reached else None,
            "reached_s": reached[1] if reached else None, **total}


def worker(contender: str, cap_s: float) -> dict[str, Any]:
    """One rank of `contender` (its `drive`): DDP on its 16 samples of every global batch,
    pipedream's stage (the first reads the data), or the whole model in this process
    ("reference")."""
    from pipedream_fast.models import accuracy
    from pipedream_fast.pipeline import Pipeline
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(SEED)  # the same initial weights in every rank and the reference
    model = build_model()
    train_x, train_y, test_x, test_y = load_data()
    if contender != "pipedream":
        net, mine = model, slice(None)
        if contender == "ddp":
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
            net = DistributedDataParallel(model)
            mine = slice(dist.get_rank() * BATCH // WORLD, (dist.get_rank() + 1) * BATCH // WORLD)
            dist.barrier()
        opt = sgd(net.parameters())
        batches = global_batches(train_x, train_y)

        def train(n: int) -> None:
            for x, y in (next(batches) for _ in range(n)):
                opt.zero_grad()
                nn.functional.cross_entropy(net(x[mine]), y[mine]).backward()
                opt.step()

        return drive(train, lambda: test_accuracy(model, test_x, test_y), cap_s)
    pipe = Pipeline(model, nn.functional.cross_entropy, sgd,
                    plan=two_stage_plan("wide_mlp", SPLIT, len(model), "pipedream"),
                    schedule="pipedream", chunks=1, seed=SEED, timeout=600.0)
    reads, taken, trained = 0 in pipe.stage_indices, [0], [0]
    batches = global_batches(train_x, train_y, taken) if reads else None
    tests = ([(test_x[i:i + TEST_BATCH], test_y[i:i + TEST_BATCH])
              for i in range(0, len(test_x), TEST_BATCH)] if reads else None)

    def segment(n: int) -> None:
        for _ in pipe.train(batches, steps=n):
            pass
        trained[0] += n
        if reads and taken[0] != trained[0]:
            raise RuntimeError(f"the pipeline read {taken[0]} batches for {trained[0]} steps: "
                               f"the data order would differ from DDP's")

    dist.barrier()
    return drive(segment, lambda: float(pipe.evaluate(tests, metrics={
        "accuracy": accuracy})["accuracy"]), cap_s)


# ---- the harness ---------------------------------------------------------------------------

def run(rates: list[str], cap_s: float) -> dict[str, Any]:
    """The reference, then each contender at each rate, as a JSON-able dict."""
    began = time.monotonic()
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "rates": rates, "target": TARGET,
        "cap_s": cap_s, "eval_every": EVAL_EVERY, "lr": LR, "momentum": MOMENTUM,
        "batch": BATCH, "world": WORLD, "model": model_facts(), "split": SPLIT,
        "machine": harness.machine_info(), "skipped": None, "rows": []}
    ref = result["reference"] = worker("reference", math.inf)
    ref.update(lr=LR, momentum=MOMENTUM, s_per_step=ref["train_s"] / ref["steps"],
               final_accuracy=ref["points"][-1][2])
    harness.say(f"reference (one process, one thread): {reached_text(ref)}, "
                f"{ref['s_per_step'] * 1e3:.0f} ms/step")

    def each(cluster: netcluster.Cluster, rate: str) -> None:
        for contender in CONTENDERS:
            began = time.monotonic()
            # Evaluations and set-up run outside the clock: allow for them generously.
            ranks = netcluster.run_workers(cluster, __file__, [contender, cap_s], cap_s * 3 + 300)
            lead = ranks[0]
            s_per_step = lead["train_s"] / max(lead["steps"], 1)
            row = {"rate": rate, "contender": contender, "label": LABELS[contender],
                   **{k: lead[k] for k in ("points", "steps", "train_s", "reached_step",
                                           "reached_s")},
                   "s_per_step": s_per_step, "samples_per_s": BATCH / s_per_step,
                   "final_accuracy": lead["points"][-1][2],
                   "bytes_per_step": sum(r["tx_bytes"] for r in ranks) / max(lead["steps"], 1),
                   "other_cores": harness.other_cores(ranks, lead["train_s"]),
                   "wall_s": time.monotonic() - began, "projected_s": None}
            if row["reached_s"] is None and ref["reached_step"] is not None:
                row["projected_s"] = ref["reached_step"] * s_per_step
            result["rows"].append(row)
            harness.say(f"[{rate}] {row['label']:36s} {row['samples_per_s']:7.1f} samples/s, "
                        f"time to target {time_text(row, ref)[0]}, final accuracy "
                        f"{row['final_accuracy']:.3f} ({row['steps']} steps, "
                        f"{row['wall_s']:.0f} s wall)")

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


def speedup_text(here: dict[str, dict[str, Any]]) -> str:
    """DDP's time to target over pipedream's, at one rate."""
    times = [here[c]["reached_s"] if here[c]["reached_s"] is not None else here[c]["projected_s"]
             for c in CONTENDERS]
    if None in times:
        return "-"
    projected = any(here[c]["reached_s"] is None for c in CONTENDERS)
    return f"{times[0] / times[1]:.1f}x" + (" (projected)" if projected else "")


def markdown(result: dict[str, Any]) -> str:
    facts, ref, rows = result["model"], result["reference"], result["rows"]
    lines = ["# Time to accuracy: pipedream_fast vs DDP on an emulated 2-machine cluster", "",
             f"Command: `{result['command']}`", "",
             harness.machine_line(result["machine"], result["total_s"]), "",
             f"- Task: scikit-learn digits (1437 train / 360 test images, 8x8 flattened to 64), "
             f"target **{TARGET:.0%} test accuracy** on all 360 test images.",
             f"- Model: MLP 64-{WIDTH}-{WIDTH}-{WIDTH}-10, {facts['parameters'] / 1e6:.2f} M "
             f"parameters ({facts['parameter_bytes'] / 1e6:.1f} MB: DDP all-reduces this every "
             f"step); pipeline cut before fc3 (stages of {facts['stage_parameters'][0] / 1e6:.2f}"
             f" M and {facts['stage_parameters'][1] / 1e6:.2f} M parameters), "
             f"{facts['activation_bytes'] / 1024:.0f} KiB of activation forward and as much "
             f"gradient back per step; {facts['gflop_per_step']:.2f} GFLOP per step.",
             f"- Same for both: global batch {BATCH} (DDP: {BATCH // WORLD} per rank; pipedream: "
             f"one microbatch, chunks=1), SGD lr {LR:g} momentum {MOMENTUM:g}, initial weights "
             f"(seed {SEED}), one stream of batches (a seeded permutation per epoch). pipedream "
             f"updates stage 0 with gradients one update stale and drains at each evaluation.",
             f"- Clock: training wall time on rank 0; test accuracy is evaluated every "
             f"{EVAL_EVERY} steps outside it. Cap: {result['cap_s']:g} s of training per "
             f"contender; one that misses is *projected*: the reference's steps to target x "
             f"its own s/step.",
             netcluster.cluster_note(result["links"]),
             "- Reference (one process, one thread, no network; same data and hyperparameters): "
             f"{reached_text(ref, '**')}, {ref['s_per_step'] * 1e3:.0f} ms/step.", ""]
    table = []
    for rate in result["rates"]:
        here = {r["contender"]: r for r in rows if r["rate"] == rate}
        for index, row in enumerate(here.values()):
            table.append([rate if index == 0 else "", row["label"],
                          f"{row['samples_per_s']:.1f}", *time_text(row, ref),
                          f"{row['final_accuracy']:.3f} ({row['steps']})",
                          f"{row['bytes_per_step'] / 1e6:.2f}", f"{row['other_cores']:.2f}",
                          speedup_text(here) if index == 0 else ""])
    lines += harness.markdown_table(
        ["link", "contender", "samples/s", "time to target (s)", "steps to target",
         "final accuracy (steps)", "MB/step on the wire", "others (cores)",
         "pipedream speedup"], table, left=2)
    lines += ["", "Samples/s: all training steps over the training clock, warm-up, the "
              "pipeline's fill and drain at every evaluation included. MB/step: both ranks' "
              "veth tx_bytes during training. Others: CPU other processes took during "
              "training (the machine's user+system time less the ranks' own), in cores."]
    disturbed = sum(r["other_cores"] > harness.DISTURBED for r in rows)
    if disturbed:
        lines += ["", f"**Disturbed**: in {disturbed} of {len(rows)} runs other processes "
                  f"took more than {harness.DISTURBED} cores while they trained; their times "
                  f"are not representative (run again on a quiet machine)."]
    return "\n".join(lines) + "\n\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Accuracy against training wall time, one line per contender and rate (and the
    reference, dotted); x marks a projected time to target."""
    colors = {"ddp": "tab:blue", "pipedream": "tab:orange"}
    dashes = ["-", "--", "-.", ":"]
    with harness.figure(path, dpi=120) as (_, axes):
        ax, projected = axes[0][0], False
        for row in result["rows"]:
            color = colors[row["contender"]]
            ax.plot([p[1] for p in row["points"]], [p[2] for p in row["points"]],
                    dashes[result["rates"].index(row["rate"]) % len(dashes)], color=color,
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
        ax.set_xlim(left=0)
        ax.set_ylim(0, 1)
        harness.axes_text(ax, f"Time to {TARGET:.0%} test accuracy, 2 ranks on emulated links",
                          "training wall time on rank 0 (s, evaluation excluded)",
                          "test accuracy (digits)", {"fontsize": 8, "loc": "lower right"})


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:  # a rank: contender cap_s
        harness.print_result(worker(sys.argv[2], float(sys.argv[3])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=netcluster.rates_arg, default="1gbit,100mbit",
                        help="comma-separated link rates (default 1gbit,100mbit)")
    parser.add_argument("--cap-s", type=float, default=None,
                        help=f"training seconds per contender before giving up (default "
                             f"{DEFAULT_CAP_S:g}, {QUICK_CAP_S:g} with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a shorter cap ({QUICK_CAP_S:g} s): the bench in ~4 min")
    parser.add_argument("--out", default=None,
                        help="write the markdown here, the .json and .png beside it")
    args = parser.parse_args()
    cap_s = args.cap_s or (QUICK_CAP_S if args.quick else DEFAULT_CAP_S)
    ok, why = netcluster.available()
    if not ok:
        print(f"time_to_accuracy: skipped: cannot emulate a cluster here: {why}", file=sys.stderr)
        return 2
    result = run(args.rates, cap_s)
    result["command"] = harness.command()
    harness.emit(args.out, markdown(result), result)
    if args.out:
        plot(result, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
