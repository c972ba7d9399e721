"""Time to a target test accuracy: pipedream_fast against DDP on an emulated slow 2-machine cluster.

The PipeDream paper's measure: a pipeline that moves fewer bytes per step must also converge
in about as many steps. Two ranks on bench/netcluster.py's cluster (links shaped to each
--rates value), one torch thread each, gloo: DDP (16 samples per rank, global batch 32) and
Pipeline "pipedream" (2 stages, chunks=1), one after the other. Task: scikit-learn's 8x8 digits
flattened to 64 features, on a wide MLP whose parameters are large against its compute:
fc1 64-2048 | fc2 2048-2048 || fc3 2048-2048 | fc4 2048-10, the pipeline cut before fc3
(256 KiB of activation per step against DDP's 34.2 MB of gradients). Both: SGD (TUNED below),
seed 0, one stream of global batches.

Clock: training time on rank 0 in segments of --eval-every steps, test accuracy evaluated
outside the clock; a contender stops at the target or at --cap-s. One that misses is
*projected*: the single-process reference's steps to target x its seconds per step.

    python bench/time_to_accuracy.py [--rates 1gbit,100mbit] [--target 0.95] [--cap-s 330]
                                     [--eval-every 10] [--quick] [--tune]
                                     [--out bench/results/time_to_accuracy.md]

Writes --out, and .json and .png beside it; exits 2 where netcluster cannot run.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Scripts next to this file (bench/ is on sys.path when this file runs as a script).
import harness
import netcluster
from harness import DISTURBED
from vs_ddp import Snapshot, link_check, two_stage_plan

BATCH = 32
WORLD = 2
WIDTH = 2048
SPLIT = 2            # stage 1 starts at block 2 (fc3)
SEED = 0
LR = 0.1         # chosen with --tune: see TUNED
MOMENTUM = 0.0
DEFAULT_TARGET = 0.95
DEFAULT_RATES = ("1gbit", "100mbit")
# DDP at 100mbit takes ~3 s a step, ~250 s to 95%: the full cap lets it get there (~7 min in
# all); --quick's does not (it is projected): ~3 min.
DEFAULT_CAP_S = 330.0
QUICK_CAP_S = 90.0
EVAL_EVERY = 10      # training steps between evaluations
TEST_BATCH = 90      # 360 test images = 4 batches
REFERENCE_MAX_STEPS = 3000
CONTENDERS = ("ddp", "pipedream")
LABELS = {"ddp": "DDP (gloo), 16 per rank", "pipedream": "pipedream_fast pipedream, 2 stages"}
MODEL_NAME = "wide_mlp"

# `python bench/time_to_accuracy.py --tune --target 0.95` (2026-12-01; steps are
# deterministic). Each setting trained as the reference for 300 steps, evaluated every 10:
TUNED = """\
lr 0.01 momentum 0: 95% first at step -, settled at -, accuracy 0.908 at step 300
lr 0.03 momentum 0: 95% first at step 220, settled at 220, accuracy 0.950 at step 300
lr 0.1 momentum 0: 95% first at step 80, settled at 110, accuracy 0.975 at step 300
lr 0.3 momentum 0: 95% first at step 80, settled at 80, accuracy 0.978 at step 300
lr 1 momentum 0: 95% first at step -, settled at -, accuracy 0.100 at step 300
lr 0.01 momentum 0.9: 95% first at step 100, settled at 180, accuracy 0.972 at step 300
lr 0.03 momentum 0.9: 95% first at step 70, settled at 150, accuracy 0.978 at step 300
lr 0.1 momentum 0.9: 95% first at step 50, settled at -, accuracy 0.944 at step 300
lr 0.3 momentum 0.9: 95% first at step -, settled at -, accuracy 0.100 at step 300
lr 1 momentum 0.9: 95% first at step -, settled at -, accuracy 0.100 at step 300
chosen: lr 0.1 momentum 0
"""
# "settled": reaches the target and stays within 1 point of it. The fastest to settle sit next
# to divergence (lr 0.3; lr 0.03 with momentum): the rule keeps a setting whose next larger lr
# still settles, since tuning synchronous SGD at its edge of stability would handicap
# pipedream, whose stage 0 applies gradients one update stale.


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
    params = sum(p.numel() for p in model.parameters())
    stage_params = [sum(p.numel() for b in list(model)[lo:hi] for p in b.parameters())
                    for lo, hi in ((0, SPLIT), (SPLIT, len(model)))]
    macs = sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, nn.Linear))
    return {"parameters": params, "parameter_bytes": params * 4,
            "stage_parameters": stage_params, "activation_bytes": BATCH * WIDTH * 4,
            "gflop_per_step": 3 * 2 * macs * BATCH / 1e9}


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """digits as (train_x [1437, 64], train_y, test_x [360, 64], test_y), normalised."""
    from pipedream_fast.datasets import digits

    train, test = digits()
    (train_x, train_y), (test_x, test_y) = train.tensors, test.tensors
    return train_x.reshape(len(train_x), -1), train_y, test_x.reshape(len(test_x), -1), test_y


def global_batches(x: torch.Tensor, y: torch.Tensor, seed: int = SEED
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of BATCH, forever: epoch e is a permutation seeded seed + e, its last
    partial batch dropped. Every contender reads this one stream."""
    for epoch in range(10**9):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            index = order[start:start + BATCH]
            yield x[index], y[index]
    raise AssertionError("unreachable")


class Counted:
    """An iterator that counts what was taken: the pipeline's first stage must read exactly
    the steps it trains from the shared stream."""

    def __init__(self, source: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.source, self.taken = source, 0

    def __iter__(self) -> Counted:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        item = next(self.source)
        self.taken += 1
        return item


@torch.no_grad()
def test_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    correct = int((model(x).argmax(-1) == y).sum())
    model.train(was_training)
    return correct / len(y)


def make_optimizer(lr: float, momentum: float) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def reference(target: float, lr: float = LR, momentum: float = MOMENTUM,
              eval_every: int = EVAL_EVERY, max_steps: int = REFERENCE_MAX_STEPS
              ) -> dict[str, Any]:
    """The model trained in this process (one thread, no network) on the contenders' stream,
    evaluated every `eval_every` steps, until `target` or `max_steps`: its curve [(step,
    training seconds, accuracy)], steps and seconds to the target (None) and s/step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        model = build_model()
        opt = make_optimizer(lr, momentum)(model.parameters())
        train_x, train_y, test_x, test_y = load_data()
        batches = global_batches(train_x, train_y)
        points = [(0, 0.0, test_accuracy(model, test_x, test_y))]
        reached: tuple[int, float] | None = None
        steps, seconds = 0, 0.0
        while reached is None and steps < max_steps:
            began = time.perf_counter()
            for _ in range(eval_every):
                x, y = next(batches)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            seconds += time.perf_counter() - began
            steps += eval_every
            accuracy = test_accuracy(model, test_x, test_y)
            points.append((steps, seconds, accuracy))
            if not math.isfinite(float(loss.detach())):
                break
            if accuracy >= target:
                reached = (steps, seconds)
    finally:
        torch.set_num_threads(threads)
    return {"lr": lr, "momentum": momentum, "points": points,
            "reached_step": reached[0] if reached else None,
            "reached_s": reached[1] if reached else None,
            "s_per_step": seconds / max(steps, 1), "steps": steps,
            "final_accuracy": points[-1][2]}


def settled_step(points: Sequence[Sequence[float]], target: float,
                 slack: float = 0.01) -> int | None:
    """The first evaluation at or above `target` after which none falls below target - slack."""
    for i, (step, _, accuracy) in enumerate(points):
        if accuracy >= target and all(p[2] >= target - slack for p in points[i:]):
            return int(step)
    return None


def tune(target: float, lrs: Sequence[float] = (0.01, 0.03, 0.1, 0.3, 1.0),
         momenta: Sequence[float] = (0.0, 0.9), horizon: int = 300) -> None:
    """How LR and MOMENTUM were picked (see TUNED): the grid trained as the reference for
    `horizon` steps; kept: the fewest steps to a target that stays reached, among the settings
    whose next larger lr (same momentum) also settles, if any."""
    rows: list[dict[str, Any]] = []
    for momentum in momenta:
        for lr in lrs:
            ref = reference(2.0, lr, momentum, max_steps=horizon)  # never stops early
            first = next((int(p[0]) for p in ref["points"] if p[2] >= target), None)
            rows.append({"lr": lr, "momentum": momentum, "first_step": first,
                         "settled_step": settled_step(ref["points"], target)})
            print(f"lr {lr:g} momentum {momentum:g}: {target:.0%} first at step "
                  f"{harness.fmt(first, 'd')}, settled at "
                  f"{harness.fmt(rows[-1]['settled_step'], 'd')}"
                  f", accuracy {ref['final_accuracy']:.3f} at step {horizon}")
    settled = [r for r in rows if r["settled_step"] is not None]
    robust = [r for r in settled if any(
        o["lr"] == min((x for x in lrs if x > r["lr"]), default=None)
        and o["momentum"] == r["momentum"] and o["settled_step"] is not None for o in rows)]
    pool = robust or settled
    best = min(pool, key=lambda r: (r["settled_step"], r["first_step"])) if pool else None
    print(f"chosen: lr {best['lr']:g} momentum {best['momentum']:g}" if best
          else f"no setting of the grid settles at {target:.0%} within {horizon} steps")


# ---- ranks (run inside the namespaces) -----------------------------------------------------

def next_segment(steps: int, train_s: float, reached: bool, cap_s: float, eval_every: int,
                 max_steps: int) -> int:
    """Rank 0's decision: how many steps to train next (0: stop). First one step, to learn the
    pace; then up to the next multiple of `eval_every`, the last segment before the cap cut to
    the steps the pace says fit (at least one), so the cap is overrun by less than a step."""
    if reached or train_s >= cap_s or steps >= max_steps:
        return 0
    if steps == 0:
        return 1
    n = min(eval_every - steps % eval_every, max_steps - steps)
    return min(n, max(1, math.ceil((cap_s - train_s) / (train_s / steps))))


def drive(train_segment: Callable[[int], None], evaluate: Callable[[], float],
          args: argparse.Namespace) -> dict[str, Any]:
    """The loop both contenders share: rank 0 decides the next segment and broadcasts it,
    every rank trains it (timed on its clock), then all evaluate. Collective."""
    rank = dist.get_rank()
    points = [(0, 0.0, evaluate())]
    steps, train_s, tx, busy, cpu = 0, 0.0, 0, 0.0, 0.0
    reached: tuple[int, float] | None = None
    decision = torch.zeros(1, dtype=torch.int64)
    while True:
        if rank == 0:
            decision[0] = next_segment(steps, train_s, reached is not None, args.cap_s,
                                       args.eval_every, args.max_steps)
        dist.broadcast(decision, src=0)
        n = int(decision[0])
        if n == 0:
            break
        before = Snapshot.now()
        train_segment(n)
        after = Snapshot.now()
        train_s += after.time_s - before.time_s
        tx += after.tx_bytes - before.tx_bytes
        busy += after.busy_s - before.busy_s
        cpu += after.cpu_s - before.cpu_s
        steps += n
        accuracy = evaluate()
        points.append((steps, train_s, accuracy))
        if reached is None and accuracy >= args.target:
            reached = (steps, train_s)
        if rank == 0:
            harness.say(f"step {steps}: accuracy {accuracy:.3f}, training {train_s:.1f} s")
    return {"rank": rank, "points": points, "steps": steps, "train_s": train_s,
            "reached_step": reached[0] if reached else None,
            "reached_s": reached[1] if reached else None,
            "tx_bytes": tx, "busy_s": busy, "cpu_s": cpu}


def ddp_rank(args: argparse.Namespace) -> dict[str, Any]:
    """DistributedDataParallel: this rank's 16 samples of every global batch."""
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    model = DistributedDataParallel(build_model())
    opt = make_optimizer(args.lr, args.momentum)(model.parameters())
    train_x, train_y, test_x, test_y = load_data()
    batches = global_batches(train_x, train_y)
    mine = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)

    def segment(n: int) -> None:
        for _ in range(n):
            x, y = next(batches)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()

    dist.barrier()
    result = drive(segment, lambda: test_accuracy(model.module, test_x, test_y), args)
    dist.destroy_process_group()
    return result


def pipedream_rank(args: argparse.Namespace) -> dict[str, Any]:
    """pipedream_fast's Pipeline, schedule pipedream, two stages cut before fc3."""
    from pipedream_fast.models import accuracy
    from pipedream_fast.pipeline import Pipeline

    model = build_model()
    pipe = Pipeline(model, nn.functional.cross_entropy, make_optimizer(args.lr, args.momentum),
                    plan=two_stage_plan(MODEL_NAME, SPLIT, len(model), "pipedream"),
                    schedule="pipedream", chunks=1, seed=SEED, timeout=600.0)
    reads = 0 in pipe.stage_indices  # only the first stage reads the data
    train_x, train_y, test_x, test_y = load_data()
    batches = Counted(global_batches(train_x, train_y)) if reads else None
    tests = ([(test_x[i:i + TEST_BATCH], test_y[i:i + TEST_BATCH])
              for i in range(0, len(test_x), TEST_BATCH)] if reads else None)
    trained = [0]

    def segment(n: int) -> None:
        for _ in pipe.train(batches, steps=n):
            pass
        trained[0] += n
        if batches is not None and batches.taken != trained[0]:
            raise RuntimeError(f"the pipeline read {batches.taken} batches for {trained[0]} "
                               f"steps: the data order would differ from DDP's")

    dist.barrier()
    result = drive(segment, lambda: float(pipe.evaluate(tests, metrics={
        "accuracy": accuracy})["accuracy"]), args)
    pipe.close()
    return result


# ---- the harness ---------------------------------------------------------------------------

def run_contender(cluster: netcluster.Cluster, contender: str, rate: str,
                  args: argparse.Namespace, ref: dict[str, Any]) -> dict[str, Any]:
    """One contender at one rate: its rank 0's curve and clock, both ranks' bytes."""
    argv = [sys.executable, os.path.abspath(__file__), "--worker", contender,
            "--target", repr(args.target), "--cap-s", repr(args.cap_s),
            "--eval-every", str(args.eval_every), "--lr", repr(args.lr),
            "--momentum", repr(args.momentum), "--max-steps", str(REFERENCE_MAX_STEPS)]
    began = time.monotonic()
    # Evaluations and set-up run outside the clock: allow for them generously.
    ranks = harness.cluster_results(cluster, argv, args.cap_s * 3 + 300)
    lead = ranks[0]
    steps, train_s = lead["steps"], lead["train_s"]
    s_per_step = train_s / max(steps, 1)
    row = {"rate": rate, "contender": contender, "label": LABELS[contender],
           "points": lead["points"], "steps": steps, "train_s": train_s,
           "s_per_step": s_per_step, "samples_per_s": BATCH / s_per_step,
           "reached_step": lead["reached_step"], "reached_s": lead["reached_s"],
           "final_accuracy": lead["points"][-1][2],
           "bytes_per_step": sum(r["tx_bytes"] for r in ranks) / max(steps, 1),
           "other_cores": harness.other_cores(ranks, train_s),
           "wall_s": time.monotonic() - began, "projected_s": None}
    if row["reached_s"] is None and ref["reached_step"] is not None:
        row["projected_s"] = ref["reached_step"] * s_per_step
    return row


def run(rates: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """The reference, then each contender at each rate, as a JSON-able dict; {"skipped": why,
    ...} where no emulated cluster can be built here."""
    began = time.monotonic()
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "rates": list(rates),
        "target": args.target, "cap_s": args.cap_s, "eval_every": args.eval_every,
        "lr": args.lr, "momentum": args.momentum, "batch": BATCH, "world": WORLD,
        "model": model_facts(), "split": SPLIT, "machine": harness.machine_info(),
        "skipped": None, "reference": None, "links": {}, "rows": []}
    ok, why = netcluster.available()
    if not ok:
        result["skipped"] = f"cannot emulate a cluster here: {why}"
        return result
    ref = result["reference"] = reference(args.target, args.lr, args.momentum, args.eval_every)
    harness.say("reference (one process, one thread): " + reached_text(ref, args.target)
                + f", {ref['s_per_step'] * 1e3:.0f} ms/step")
    for rate in rates:
        with netcluster.Cluster(world=WORLD, rate=rate) as cluster:
            result["links"][rate] = link_check(cluster)
            harness.say(f"[{rate}] link check: one TCP stream carries "
                        f"{result['links'][rate]:.1f} MB/s")
            for contender in CONTENDERS:
                row = run_contender(cluster, contender, rate, args, ref)
                result["rows"].append(row)
                harness.say(f"[{rate}] {row['label']:36s} {row['samples_per_s']:7.1f} "
                            f"samples/s, {describe_time(row)}, final accuracy "
                            f"{row['final_accuracy']:.3f} ({row['steps']} steps, "
                            f"{row['wall_s']:.0f} s wall)")
    result["total_s"] = time.monotonic() - began
    return result


# ---- the report ----------------------------------------------------------------------------

def reached_text(ref: dict[str, Any], target: float, bold: str = "") -> str:
    return (f"{target:.0%} after {bold}{ref['reached_step']} steps{bold} "
            f"({ref['reached_s']:.1f} s)" if ref["reached_step"]
            else f"{target:.0%} not reached in {ref['steps']} steps")


def describe_time(row: dict[str, Any]) -> str:
    if row["reached_s"] is not None:
        return f"{row['reached_s']:.1f} s to target"
    projected = (f" (projected {row['projected_s']:.0f} s)"
                 if row["projected_s"] is not None else "")
    return f"not reached within {row['train_s']:.0f} s{projected}"


def speedup_text(rows: list[dict[str, Any]], rate: str) -> str:
    here = {r["contender"]: r for r in rows if r["rate"] == rate}
    if not {"ddp", "pipedream"} <= set(here):
        return "-"
    times = [r["reached_s"] if r["reached_s"] is not None else r["projected_s"]
             for r in (here["ddp"], here["pipedream"])]
    if None in times:
        return "-"
    projected = any(here[c]["reached_s"] is None for c in CONTENDERS)
    return f"{times[0] / times[1]:.1f}x" + (" (projected)" if projected else "")


def markdown(result: dict[str, Any]) -> str:
    title = "# Time to accuracy: pipedream_fast vs DDP on an emulated 2-machine cluster"
    if result.get("skipped"):
        return f"{title}\n\nSkipped: {result['skipped']}.\n"
    facts, ref, target = result["model"], result["reference"], result["target"]
    rows: list[dict[str, Any]] = result["rows"]
    lines = [title, ""] + ([f"Command: `{result['command']}`", ""] if result.get("command")
                           else [])
    lines += [
        harness.machine_line(result["machine"], result.get("total_s", 0.0)), "",
        f"- Task: scikit-learn digits (1437 train / 360 test images, 8x8 flattened to 64), "
        f"target **{target:.0%} test accuracy** on all 360 test images.",
        f"- Model: MLP 64-{WIDTH}-{WIDTH}-{WIDTH}-10, {facts['parameters'] / 1e6:.2f} M "
        f"parameters ({facts['parameter_bytes'] / 1e6:.1f} MB: DDP all-reduces this every "
        f"step); pipeline cut before fc3 (stages of {facts['stage_parameters'][0] / 1e6:.2f} M "
        f"and {facts['stage_parameters'][1] / 1e6:.2f} M parameters), "
        f"{facts['activation_bytes'] / 1024:.0f} KiB of activation forward and as much "
        f"gradient back per step; {facts['gflop_per_step']:.2f} GFLOP per step.",
        f"- Same for both: global batch {BATCH} (DDP: {BATCH // WORLD} per rank; pipedream: "
        f"one {BATCH}-sample microbatch, chunks=1), SGD lr {result['lr']:g} momentum "
        f"{result['momentum']:g}, initial weights (seed {SEED}), one stream of batches "
        f"(a seeded permutation per epoch). pipedream updates stage 0 with gradients one "
        f"update stale (weight stashing) and drains at each evaluation.",
        f"- Clock: training wall time on rank 0 only; test accuracy is evaluated every "
        f"{result['eval_every']} steps outside the clock. Cap: {result['cap_s']:g} s of "
        f"training per contender. Not reached within the cap: *projected* = the "
        f"single-process reference's steps to target x the contender's measured s/step.",
        "- Cluster: 2 ranks, each in a network namespace, veth links through a bridge shaped "
        "with `tc tbf` both ways (bench/netcluster.py); one torch thread per rank, gloo. Link "
        "check, one TCP stream: " + ", ".join(f"{rate} {mbs:.1f} MB/s"
                                             for rate, mbs in result["links"].items()) + ".",
        "- Reference (one process, one thread, no network; same data and hyperparameters): "
        + reached_text(ref, target, "**") + f", {ref['s_per_step'] * 1e3:.0f} ms/step.", ""]
    table = []
    for rate in result["rates"]:
        for index, row in enumerate(r for r in rows if r["rate"] == rate):
            if row["reached_s"] is not None:
                when, steps = f"**{row['reached_s']:.1f}**", str(row["reached_step"])
            elif row["projected_s"] is not None:
                when = f"not within {row['train_s']:.0f}; projected {row['projected_s']:.0f}"
                steps = f"({ref['reached_step']}, reference)"
            else:
                when, steps = f"not within {row['train_s']:.0f}", "-"
            table.append([rate if index == 0 else "", row["label"],
                          f"{row['samples_per_s']:.1f}", when, steps,
                          f"{row['final_accuracy']:.3f} ({row['steps']})",
                          f"{row['bytes_per_step'] / 1e6:.2f}", f"{row['other_cores']:.2f}",
                          speedup_text(rows, rate) if index == 0 else ""])
    lines += harness.markdown_table(
        ["link", "contender", "samples/s", "time to target (s)", "steps to target",
         "final accuracy (steps)", "MB/step on the wire", "others (cores)",
         "pipedream speedup"], table, left=2)
    lines += ["", "Samples/s: all training steps over the training clock, warm-up, the "
              "pipeline's fill and drain at every evaluation included. MB/step: both ranks' "
              "veth tx_bytes during training. Others: CPU other processes took during "
              "training (the machine's user+system time less the ranks' own), in cores."]
    disturbed = [r for r in rows if r["other_cores"] > DISTURBED]
    if disturbed:
        lines += ["", f"**Disturbed**: in {len(disturbed)} of {len(rows)} runs other processes "
                  f"took more than {DISTURBED} cores while they trained; their times are not "
                  f"representative (run again on a quiet machine)."]
    return "\n".join(lines) + "\n\n"


def plot(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Accuracy against training wall time, one line per contender and rate (and the
    reference, dashed)."""
    if result.get("skipped") or not result.get("rows"):
        return
    colors = {"ddp": "tab:blue", "pipedream": "tab:orange"}
    dashes = ["-", "--", "-.", ":"]
    rates = list(result["rates"])
    projected = False
    with harness.figure(path, dpi=120) as (_, axes):
        ax = axes[0][0]
        for row in result["rows"]:
            color = colors[row["contender"]]
            ax.plot([p[1] for p in row["points"]], [p[2] for p in row["points"]],
                    dashes[rates.index(row["rate"]) % len(dashes)], color=color,
                    marker="o" if row["contender"] == "pipedream" else "s", markersize=3,
                    label=f"{row['label']}, {row['rate']}")
            if row["reached_s"] is None and row["projected_s"] is not None:
                ax.plot([row["projected_s"]], [result["target"]], "x", color=color,
                        markersize=8, label="_nolegend_" if projected
                        else "x: projected time to target")
                projected = True
        ref = result.get("reference")
        if ref:
            ax.plot([p[1] for p in ref["points"]], [p[2] for p in ref["points"]], ":",
                    color="grey", linewidth=1, label="single process (1 thread, no network)")
        ax.axhline(result["target"], color="black", linewidth=0.8, linestyle=":")
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlim(left=0)
        ax.set_ylim(0, 1)
        harness.axes_text(ax, f"Time to {result['target']:.0%} test accuracy, 2 ranks on "
                          "emulated links", "training wall time on rank 0 (s, evaluation "
                          "excluded)", "test accuracy (digits)",
                          {"fontsize": 8, "loc": "lower right"})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default=",".join(DEFAULT_RATES),
                        help=f"comma-separated link rates (default {','.join(DEFAULT_RATES)})")
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET,
                        help=f"test accuracy to reach, 0-1 (default {DEFAULT_TARGET})")
    parser.add_argument("--cap-s", type=float, default=None,
                        help=f"training seconds per contender before giving up (default "
                             f"{DEFAULT_CAP_S:g}, {QUICK_CAP_S:g} with --quick)")
    parser.add_argument("--eval-every", type=harness.positive, default=EVAL_EVERY,
                        help=f"training steps between evaluations (default {EVAL_EVERY})")
    parser.add_argument("--quick", action="store_true",
                        help=f"a shorter cap ({QUICK_CAP_S:g} s): the bench in ~4 min")
    parser.add_argument("--tune", action="store_true",
                        help="only run the single-process grid of lr x momentum to --target "
                             "(how LR and MOMENTUM were chosen) and exit")
    parser.add_argument("--lr", type=float, default=LR, help=argparse.SUPPRESS)
    parser.add_argument("--momentum", type=float, default=MOMENTUM, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None,
                        help="write the markdown here, the .json and .png beside it")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--max-steps", type=int, default=REFERENCE_MAX_STEPS,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.target <= 1:
        parser.error(f"--target must be an accuracy in (0, 1], got {args.target}")
    if args.cap_s is None:
        args.cap_s = QUICK_CAP_S if args.quick else DEFAULT_CAP_S
    if not (args.cap_s > 0 and math.isfinite(args.cap_s)):
        parser.error(f"--cap-s must be a positive number of seconds, got {args.cap_s}")
    if args.worker:
        torch.set_num_threads(1)
        torch.manual_seed(SEED)  # the same initial weights in every rank and the reference
        harness.print_result((ddp_rank if args.worker == "ddp" else pipedream_rank)(args))
        return 0
    if args.tune:
        tune(args.target)
        return 0
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in rates:
        try:
            netcluster.parse_rate(rate)
        except ValueError as err:
            parser.error(str(err))
    result = run(rates, args)
    if result["skipped"]:
        print(f"time_to_accuracy: skipped: {result['skipped']}", file=sys.stderr)
        return 2
    result["command"] = harness.command()
    harness.emit(args.out, markdown(result), result)
    if args.out:
        plot(result, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
