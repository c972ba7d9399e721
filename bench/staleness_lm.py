"""Staleness corrections on a real model: the char LM at 4 stages, training loss against samples.

    python bench/staleness_lm.py [--steps 160] [--quick] [--out bench/results/staleness_lm.md]

`build_charlm(layers=2, dropout=0.0)` (blocks embed, block1, block2, head) is cut into 4 stages
of one block each, one rank thread per stage (`Pipeline(ranks="threads")` with an explicit
plan), and trained on the `text` corpus (`char_corpus()`: windows of 64 characters) by

  - 1f1b (synchronous): one update per step, on the mean gradient of its `chunks` microbatches;
  - pipedream, uncorrected, and with `staleness=` predict, nesterov and lr-scale: one update
    per microbatch, each stage's gradient applied to weights d = 3, 2, 1, 0 of its own updates
    newer than its forward read (stages 0..3).

A *step* is one minibatch of `chunks` x `microbatch` windows; every method sees the same
minibatches in the same order (epochs of one seeded permutation of the training windows) from
the same initial weights, so the x axis, samples seen = steps x chunks x microbatch, is the
same for all. 1f1b makes one update per step on the whole minibatch; pipedream makes `chunks`
updates per step on a microbatch each (that is its point: no flush).

Optimizers: SGD with momentum 0.9 and Adam, each method with the same optimizer. Each
(optimizer, method) trains at each learning rate of a small grid (4 rates a factor 1.5 or 2
apart, one step higher for the methods that want larger rates: 1f1b, whose update averages 4
microbatches, and lr-scale with SGD, which divides the rate by up to 4); the tuned rate is the one
with the lowest final training loss (mean step loss over the last 10% of steps; a run that
diverges counts as infinite); then each method trains at its tuned rate with 2 more seeds
(another data order and initialisation, the same for all methods). One rate per optimizer is
also reported for all methods (the fixed rate, seed 0). Held-out loss: `Pipeline.evaluate`
over the whole test split at the end. Wall time: the training loop only (set-up and
evaluation excluded); the rank threads share the machine's cores, so it measures the cost of a
correction, not a pipeline's speed.

Writes the markdown table, the plot (same name, .png) and the raw figures (.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pipedream_fast.datasets import char_corpus
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.models import build_charlm, loss_fn
from pipedream_fast.pipeline import NonFiniteLoss, Pipeline

import harness  # noqa: E402 - a sibling

STAGES = 4  # one block per stage: embed, block1, block2, head
METHODS: tuple[tuple[str, str, str | None], ...] = (
    # label, schedule, staleness
    ("1f1b", "1f1b", None),
    ("pipedream", "pipedream", None),
    ("pipedream+predict", "pipedream", "predict"),
    ("pipedream+nesterov", "pipedream", "nesterov"),
    ("pipedream+lr-scale", "pipedream", "lr-scale"),
)
# Learning-rate grids, per optimizer and (where a method wants larger rates) per method; found
# by earlier runs of this script: with SGD + momentum pipedream diverges at 0.6, predict and
# nesterov at 0.45, 1f1b at 1.0; with Adam, 1f1b is best near 1.6e-2, pipedream near 4e-3.
GRIDS: dict[str, tuple[float, ...]] = {
    "sgd": (0.1, 0.2, 0.3, 0.45),        # SGD, momentum 0.9
    "adam": (2e-3, 4e-3, 8e-3, 1.6e-2),  # Adam, betas (0.9, 0.999)
}
METHOD_GRIDS: dict[tuple[str, str], tuple[float, ...]] = {
    ("sgd", "1f1b"): (0.2, 0.3, 0.45, 0.7),
    ("sgd", "pipedream+lr-scale"): (0.2, 0.3, 0.45, 0.7),
    ("adam", "1f1b"): (4e-3, 8e-3, 1.6e-2, 3.2e-2),
}
FIXED = {"sgd": 0.3, "adam": 4e-3}  # the one rate shown for every method (in every grid)


def grid_for(opt: str, label: str, quick: bool = False) -> tuple[float, ...]:
    return (FIXED[opt],) if quick else METHOD_GRIDS.get((opt, label), GRIDS[opt])
OPTIMIZER_NAMES = {"sgd": "SGD, momentum 0.9", "adam": "Adam"}
TIE = 0.01  # final losses within 1% of each other are a tie (one seed: no finer claim)


def optimizer_factory(name: str, lr: float) -> Any:
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}")


def make_data(train: Any, test: Any, steps: int, batch: int, seed: int
              ) -> tuple[list[Any], list[Any]]:
    """`steps` minibatches of `batch` training windows (epochs of a seeded permutation) and
    the test split in minibatches of `batch` (the last one short)."""
    n = len(train)  # type: ignore[arg-type]  # CharWindows has a length
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps * batch:
        order.extend(torch.randperm(n, generator=g).tolist())
    data = []
    for s in range(steps):
        xs, ys = zip(*(train[i] for i in order[s * batch:(s + 1) * batch]))
        data.append((torch.stack(xs), torch.stack(ys)))
    held = []
    m = len(test)  # type: ignore[arg-type]
    for start in range(0, m, batch):
        xs, ys = zip(*(test[i] for i in range(start, min(m, start + batch))))
        held.append((torch.stack(xs), torch.stack(ys)))
    return data, held


def run(schedule: str, staleness: str | None, opt: str, lr: float, data: list[Any],
        held: list[Any], microbatch: int, chunks: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = build_charlm(layers=2, dropout=0.0)
    plan = Plan(model="charlm", batch_size=microbatch * chunks, workers=STAGES,
                schedule=schedule,
                stages=[StagePlan(i, i + 1, 1, (i,), 1.0) for i in range(STAGES)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    extra: dict[str, Any] = {} if staleness is None else {"staleness": staleness}
    began = time.perf_counter()
    pipe = Pipeline(model, loss_fn, optimizer_factory(opt, lr), plan=plan, schedule=schedule,
                    chunks=chunks, ranks="threads", timeout=300, **extra)
    setup = time.perf_counter() - began
    losses: list[float] = []
    error = None
    began = time.perf_counter()
    try:
        for v in pipe.train(data, len(data)):
            losses.append(float("nan") if v is None else float(v))
    except NonFiniteLoss as err:  # a diverged run is a result, not a crash
        after = re.search(r"stopped after step (\d+)", str(err))
        error = f"NaN loss, stopped after step {after.group(1) if after else '?'}"
    except Exception as err:  # reported with the run, and the benchmark goes on
        error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    wall = time.perf_counter() - began
    held_loss = math.inf
    if error is None:
        try:
            held_loss = float(pipe.evaluate(held)["loss"])
        except Exception as err:
            error = f"evaluate: {type(err).__name__}: {err}"
    pipe.close()
    steps = len(data)
    tail = losses[-max(1, steps // 10):]
    finite = len(losses) == steps and all(map(math.isfinite, losses))
    final = sum(tail) / len(tail) if finite else math.inf
    if not math.isfinite(held_loss):
        held_loss = math.inf
    return {"losses": losses, "final": final, "held_out": held_loss, "wall_s": wall,
            "setup_s": setup, "error": error}


def finite_json(x: Any) -> Any:
    """`x` with every non-finite float as None (JSON has no infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


def rounded(x: Any) -> Any:
    """`x` with every run's step losses to 4 decimals (the JSON's size)."""
    if isinstance(x, dict):
        return {k: ([round(v, 4) for v in val] if k == "losses" else rounded(val))
                for k, val in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1):i + 1]
        out.append(sum(part) / len(part))
    return out


def fmt(x: float) -> str:
    return "diverged" if not math.isfinite(x) else f"{x:.3f}"


def fmt_lr(x: float) -> str:
    return f"{x:g}"


def mean(xs: list[float]) -> float:
    """The mean of the finite values (inf if none)."""
    ok = [x for x in xs if math.isfinite(x)]
    return sum(ok) / len(ok) if ok else math.inf


def rel(a: float, b: float) -> float:
    """(a - b) / b, both finite; -inf: only b diverged; +inf: only a; nan: both."""
    if math.isfinite(a) and math.isfinite(b):
        return (a - b) / b
    if math.isfinite(a):
        return -math.inf
    return math.inf if math.isfinite(b) else math.nan


def summarise(grid_runs: dict[str, Any], repeats: dict[str, Any],
              grids: dict[str, dict[str, tuple[float, ...]]]) -> dict[str, Any]:
    """Per optimizer and method: the tuned rate (seed 0), its runs over every seed, the fixed
    rate's run, and the final losses relative to uncorrected pipedream's, seed by seed."""
    out: dict[str, Any] = {}
    for opt, by_method in grid_runs.items():
        fixed = FIXED[opt]
        rows: dict[str, Any] = {}
        for label, by_lr in by_method.items():
            grid = grids[opt][label]
            tuned = min(grid, key=lambda g: (by_lr[str(g)]["final"], g))
            runs = [by_lr[str(tuned)], *repeats[opt][label]]
            finals = [r["final"] for r in runs]
            rows[label] = {"tuned_lr": tuned, "fixed_lr": fixed, "grid": grid,
                           "diverged_at": [g for g in grid
                                           if not math.isfinite(by_lr[str(g)]["final"])],
                           "edge": len(grid) > 1 and tuned in (grid[0], grid[-1]),
                           "runs": runs, "fixed": by_lr[str(fixed)], "finals": finals,
                           "diverged_seeds": [i for i, f in enumerate(finals)
                                              if not math.isfinite(f)],
                           "final": mean(finals),  # over the seeds that did not diverge
                           "held_out": mean([r["held_out"] for r in runs]),
                           "wall_s": sum(r["wall_s"] for r in runs) / len(runs)}
        base = rows["pipedream"]
        for row in rows.values():
            row["paired"] = [rel(a, b) for a, b in zip(row["finals"], base["finals"])]
            both = [d for d in row["paired"] if math.isfinite(d)]
            row["vs_pd"] = sum(both) / len(both) if both else math.nan
            held = [rel(a["held_out"], b["held_out"]) for a, b in zip(row["runs"], base["runs"])]
            held = [d for d in held if math.isfinite(d)]
            row["held_vs_pd"] = sum(held) / len(held) if held else math.nan
        out[opt] = rows
    return out


def fmt_rel(d: float) -> str:
    if math.isnan(d):
        return "both diverged"
    if d == math.inf:
        return "diverged"
    if d == -math.inf:
        return "PD diverged"
    return f"{d:+.1%}"


def per_seed(xs: list[float], pct: bool = False) -> str:
    return " / ".join(fmt_rel(x) if pct else fmt(x) for x in xs)


def fmt_mean(row: dict[str, Any], key: str) -> str:
    n, k = len(row["finals"]), len(row["diverged_seeds"])
    if k == n:
        return "diverged"
    return fmt(row[key]) + (f" ({n - k} of {n} seeds)" if k else "")


def judge(row: dict[str, Any]) -> str:
    """helps / hurts / negligible / trade-off / inconsistent / diverged, seed by seed against
    uncorrected pipedream (each at its tuned rate): a seed where only one of them diverged
    counts for the other."""
    paired = row["paired"]
    if len(row["diverged_seeds"]) == len(paired):
        return "diverged"
    worse, better = paired.count(math.inf), paired.count(-math.inf)
    both = [d for d in paired if math.isfinite(d)]
    mean_both = sum(both) / len(both) if both else 0.0
    if worse and not better:
        return "hurts"
    if better and not worse:
        return "helps" if mean_both <= TIE else "trade-off"
    if worse and better:
        return "inconsistent"
    if all(d < 0 for d in both):
        return "helps" if mean_both < -TIE else "negligible"
    if all(d > 0 for d in both):
        return "hurts" if mean_both > TIE else "negligible"
    return "inconsistent"


WORDS = {"helps": "helps", "hurts": "hurts",
         "negligible": f"makes a difference below {TIE:.1%} (negligible)",
         "inconsistent": "makes no consistent difference (the sign changes with the seed)",
         "trade-off": "is a trade-off: more stable (it trained on a seed where uncorrected "
                      "pipedream diverged) but higher loss on the seeds where both trained",
         "diverged": "diverged on every seed"}


def verdict(opt: str, rows: dict[str, Any], chunks: int, seeds: int) -> list[str]:
    """Plain-words reading of one optimizer's table (tuned rates, against uncorrected PD)."""
    base, sync = rows["pipedream"], rows["1f1b"]
    corrections = [k for k in rows if k.startswith("pipedream+")]
    lines = []
    if base["diverged_seeds"]:
        lines.append(f"- Uncorrected pipedream at its tuned lr {fmt_lr(base['tuned_lr'])} "
                     f"(the best on seed 0) diverged (NaN loss) on seed(s) "
                     f"{', '.join(map(str, base['diverged_seeds']))}: that rate is at the "
                     f"edge of its stability.")
    for k in corrections:
        r = rows[k]
        name = k.split("+", 1)[1]
        lines.append(f"- {name} {WORDS[judge(r)]}: final training loss {fmt_mean(r, 'final')} "
                     f"against {fmt_mean(base, 'final')} uncorrected; seed by seed "
                     f"{per_seed(r['paired'], pct=True)} (mean over the seeds where both "
                     f"trained: {fmt_rel(r['vs_pd'])}); held-out {fmt_rel(r['held_vs_pd'])}. "
                     f"Tuned lr {fmt_lr(r['tuned_lr'])} (uncorrected: "
                     f"{fmt_lr(base['tuned_lr'])}). At the fixed lr {fmt_lr(r['fixed_lr'])} "
                     f"(seed 0): {fmt(r['fixed']['final'])} against "
                     f"{fmt(base['fixed']['final'])} "
                     f"({fmt_rel(rel(r['fixed']['final'], base['fixed']['final']))}).")
        seeds_saved = [i for i, d in enumerate(r["paired"]) if d == -math.inf]
        if seeds_saved:
            lines.append(f"  It trained on seed(s) {', '.join(map(str, seeds_saved))} where "
                         f"uncorrected pipedream diverged at its tuned rate.")
        worse = [g for g in r["diverged_at"]
                 if g in base["grid"] and g not in base["diverged_at"]]
        if worse:
            lines.append(f"  On seed 0 it diverged at lr {', '.join(map(fmt_lr, worse))}, where "
                         f"uncorrected pipedream did not.")
        gained = [g for g in base["diverged_at"] if g in r["grid"] and g not in r["diverged_at"]]
        if gained:
            lines.append(f"  On seed 0 it trained at lr {', '.join(map(fmt_lr, gained))}, where "
                         f"uncorrected pipedream diverged.")
        if name == "lr-scale" and r["tuned_lr"] > base["tuned_lr"]:
            lr = r["tuned_lr"]
            steps = ", ".join(f"{lr / (1 + d):.3g}" for d in (3, 2, 1, 0))
            lines.append(f"  Its tuned rate is {lr / base['tuned_lr']:.2g}x uncorrected's: "
                         f"stages 0..3 then step at {steps} against "
                         f"{fmt_lr(base['tuned_lr'])} for all, i.e. it acts as smaller rates "
                         f"for the stale stages and a larger one for the last.")
    helping = [k for k in corrections if judge(rows[k]) == "helps"]
    if helping:
        best = min(helping, key=lambda k: (len(rows[k]["diverged_seeds"]), rows[k]["vs_pd"]))
        lines.append(f"- **Best correction for pipedream with {OPTIMIZER_NAMES[opt]}: "
                     f"{best.split('+', 1)[1]}** ({fmt_mean(rows[best], 'final')} against "
                     f"{fmt_mean(base, 'final')} uncorrected; seed by seed "
                     f"{per_seed(rows[best]['paired'], pct=True)}).")
    else:
        best = min(corrections, key=lambda k: (len(rows[k]["diverged_seeds"]),
                                               rows[k]["vs_pd"]))
        lines.append(f"- **No correction helps pipedream with {OPTIMIZER_NAMES[opt]}** "
                     f"consistently (on every seed) and by more than {TIE:.1%} (closest: "
                     f"{best.split('+', 1)[1]}, {fmt_rel(rows[best]['vs_pd'])}).")
    d_sync = [rel(a, b) for a, b in zip(base["finals"], sync["finals"])]
    lines.append(f"- Against synchronous 1f1b (tuned: {fmt_mean(sync, 'final')} training, "
                 f"{fmt(sync['held_out'])} held-out), uncorrected pipedream's final training "
                 f"loss is {per_seed(d_sync, pct=True).replace('PD diverged', '1f1b diverged')}"
                 f" seed by seed at equal samples (it makes {chunks}x the updates, each on "
                 f"1/{chunks} of the samples).")
    edges = [k for k in rows if rows[k]["edge"]]
    if edges:
        lines.append(f"- Tuned at the edge of the grid (the best rate may lie outside it): "
                     f"{', '.join(edges)}.")
    return lines


def overall(summary: dict[str, Any]) -> list[str]:
    """The verdict in a few lines: per optimizer, the best correction, and each one's word."""
    lines = ["## Verdict", ""]
    for opt, rows in summary.items():
        corrections = [k for k in rows if k.startswith("pipedream+")]
        helping = [k for k in corrections if judge(rows[k]) == "helps"]
        parts = [f"{k.split('+', 1)[1]}: {judge(rows[k])}, {fmt_rel(rows[k]['vs_pd'])}"
                 + (f" ({per_seed(rows[k]['paired'], pct=True)})"
                    if len(rows[k]['paired']) > 1 else "") for k in corrections]
        if helping:
            best = min(helping, key=lambda k: (len(rows[k]["diverged_seeds"]),
                                               rows[k]["vs_pd"]))
            head = f"the best correction for pipedream is **{best.split('+', 1)[1]}**"
        else:
            head = "**no correction helps pipedream**"
        lines.append(f"- {OPTIMIZER_NAMES[opt]}: {head}. Final training loss against "
                     f"uncorrected pipedream, each at its tuned lr, mean over the seeds where "
                     f"both trained (seed by seed): {'; '.join(parts)}.")
    lines += ["", "Caveats: a small model and short runs (the loss is still falling at the end) "
              "with small delays (at most 3 updates); the rates are tuned on seed 0 only, on "
              "grids a factor 1.5 (SGD) or 2 (Adam) apart, so a correction that moves the best "
              "rate (lr-scale) is compared with uncorrected pipedream at a grid point, not at "
              "its exact optimum; three seeds, so differences of a few percent that change sign "
              "with the seed are noise. The corpus is the package's docstrings, so the data "
              "(and the figures) change a little with the source tree. Details below.", ""]
    return lines


def report(args: argparse.Namespace, summary: dict[str, Any], grid_runs: dict[str, Any],
           grids: dict[str, dict[str, tuple[float, ...]]]) -> str:
    samples = args.steps * args.chunks * args.microbatch
    seeds = args.seeds
    lines = [
        "# Staleness corrections on the char LM (4 stages): loss against samples",
        "",
        f"`{args.command}` ({args.total_s / 60:.1f} min in all, {args.date}). Figures from one "
        f"run of this command on a shared 2-core host (other jobs running; {args.host}): wall "
        f"times are noisy.",
        "",
        f"Model: `build_charlm(layers=2, dropout=0.0)`, 4 stages of one block (embed, block1, "
        f"block2, head), one rank thread each (`ranks=\"threads\"`). Data: `char_corpus()` "
        f"(the package's docstrings, {args.source}: {args.train_windows} training and "
        f"{args.test_windows} test windows of 64 characters), {args.steps} minibatches of "
        f"{args.chunks} x {args.microbatch} windows ({samples} samples, "
        f"{samples / args.train_windows:.1f} epochs of the training split); for a given "
        f"seed every method sees the same minibatches in the same order from the same "
        f"initial weights. **Step** = one minibatch; the x axis is "
        f"samples seen = steps x {args.chunks * args.microbatch}, identical across methods. "
        f"1f1b updates once per step (gradient averaged over its {args.chunks} microbatches); "
        f"pipedream updates once per microbatch ({args.chunks} updates per step), stage s "
        f"reading weights 3 - s of its own updates old.",
        "",
        f"Learning rates: every method at each rate of the grid with seed 0; tuned lr = the "
        f"rate with the lowest final loss there. Each method then trains at its tuned lr with "
        f"seeds 1..{seeds - 1} too (another data order and initialisation; the same for all "
        f"methods). Final = mean step training loss over the last 10% of steps (a run whose "
        f"loss turns NaN stops there: diverged; means are over the seeds that did not "
        f"diverge); held-out = `Pipeline.evaluate` over the whole test split at the end; wall "
        f"= the training loop alone (4 rank threads on 2 shared cores). \"vs pipedream\": "
        f"the final loss relative to uncorrected pipedream's, seed by seed, each at its tuned "
        f"lr (\"PD diverged\": only uncorrected pipedream diverged on that seed). Words: a "
        f"correction *helps* when its final loss is lower on every seed and by more than "
        f"{TIE:.0%} on average, or when it trained on a seed where uncorrected pipedream "
        f"diverged and is at most {TIE:.0%} worse on average on the others; *hurts*: the "
        f"mirror case; *trade-off*: it trained where pipedream diverged but is more than "
        f"{TIE:.0%} worse on the others; *negligible*: the same sign on every seed but under "
        f"{TIE:.0%} on average; *inconsistent*: the sign changes with the seed."
        if seeds > 1 else
        "Learning rates: every method at each rate of the grid (one seed); tuned lr = the "
        "rate with the lowest final loss. Final = mean step training loss over the last 10% "
        "of steps; held-out = `Pipeline.evaluate` over the whole test split at the end; "
        "wall = the training loop alone.",
        "",
    ]
    lines += overall(summary)
    for opt, rows in summary.items():
        grid = sorted({g for label in rows for g in grids[opt][label]})
        fixed = FIXED[opt]
        wider = [label for label in rows if grids[opt][label] != GRIDS[opt]]
        lines += [f"## {OPTIMIZER_NAMES[opt]}", "",
                  f"Grid: {', '.join(fmt_lr(g) for g in GRIDS[opt])}"
                  + "".join(f"; {label}: {', '.join(fmt_lr(g) for g in grids[opt][label])}"
                            for label in wider)
                  + f". Fixed lr {fmt_lr(fixed)}.", "",
                  f"| method | tuned lr | final, mean | final per seed | "
                  f"vs pipedream per seed | held-out, mean | wall s | "
                  f"final @ {fmt_lr(fixed)} | held-out @ {fmt_lr(fixed)} |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for label, r in rows.items():
            f = r["fixed"]
            vs = "-" if label == "pipedream" else per_seed(r["paired"], pct=True)
            lines.append(f"| {label} | {fmt_lr(r['tuned_lr'])}{' (edge)' if r['edge'] else ''} | "
                         f"{fmt_mean(r, 'final')} | {per_seed(r['finals'])} | {vs} | "
                         f"{fmt_mean(r, 'held_out')} | {r['wall_s']:.1f} | "
                         f"{fmt(f['final'])} | {fmt(f['held_out'])} |")
        lines += ["", "Final training loss at every rate of the grid (seed 0):", "",
                  "| method | " + " | ".join(f"lr {fmt_lr(g)}" for g in grid) + " |",
                  "|---|" + "---:|" * len(grid)]
        for label, by_lr in grid_runs[opt].items():
            lines.append(f"| {label} | " + " | ".join(
                fmt(by_lr[str(g)]["final"]) if str(g) in by_lr else "-" for g in grid) + " |")
        errors = [f"{label} lr {g}: {by_lr[str(g)]['error']}"
                  for label, by_lr in grid_runs[opt].items() for g in grid
                  if str(g) in by_lr and by_lr[str(g)]["error"]]
        errors += [f"{label} lr {r['tuned_lr']} seed {i}: {run['error']}"
                   for label, r in rows.items() for i, run in enumerate(r["runs"])
                   if i and run["error"]]
        if errors:
            lines += ["", "Runs that stopped: " + "; ".join(errors) + "."]
        lines += ["", "Reading (tuned rates, against uncorrected pipedream):", ""]
        lines += verdict(opt, rows, args.chunks, seeds)
        lines.append("")
    lines += ["What the corrections do here (pipedream, 4 stages, delays d = 3, 2, 1, 0 on "
              "stages 0..3; `pipedream_fast/runtime/staleness_correction.py`): predict moves "
              "the weights a forward reads d velocities ahead (the velocity: a bias-corrected "
              "moving average, beta 0.9, of the stage's own updates), nesterov "
              "0.9 + .. + 0.9^d of them (0.9, 1.71, 2.44), and lr-scale divides each update's "
              "learning rate by 1 + d: stages 0..3 step at 1/4, 1/3, 1/2 and 1 of the rate. "
              "The last stage (d = 0) is never corrected, so under lr-scale it keeps the full "
              "rate and still bounds the stable rate.", "",
              f"Plot: `{Path(args.out).with_suffix('.png').name}` (smoothed training loss, "
              f"trailing mean over {max(1, args.steps // 20)} steps, against samples seen; "
              "left: each method at its tuned lr, mean over the seeds on which every method "
              "trained to the end; middle: the same, "
              "last half zoomed; right: every method at the fixed lr, seed 0). Raw figures: "
              f"`{Path(args.out).with_suffix('.json').name}`.", ""]
    return "\n".join(lines)


def source_tree() -> str:
    """The commit the package comes from, and whether it had uncommitted changes: the corpus
    is its docstrings."""
    head, dirty = harness.git("rev-parse", "--short", "HEAD"), harness.git(
        "status", "--porcelain", "--", "pipedream_fast")
    if head is None:
        return "not a git checkout"
    return f"commit {head}" + (" with uncommitted changes in pipedream_fast/" if dirty else "")


def plot(args: argparse.Namespace, summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_step = args.chunks * args.microbatch
    window = max(1, args.steps // 20)
    colours = {"1f1b": "black", "pipedream": "tab:red", "pipedream+predict": "tab:blue",
               "pipedream+nesterov": "tab:green", "pipedream+lr-scale": "tab:orange"}
    styles = {"1f1b": "--"}
    opts = list(summary)
    fig, axes = plt.subplots(len(opts), 3, figsize=(17, 4.8 * len(opts)), squeeze=False)

    def complete(run: dict[str, Any]) -> bool:
        return len(run["losses"]) == args.steps and all(map(math.isfinite, run["losses"]))

    for row, opt in enumerate(opts):
        rows = summary[opt]
        # the tuned curves: mean over the seeds on which every method trained to the end
        common = [i for i in range(args.seeds) if all(complete(r["runs"][i]) for r in rows.values())]
        which = (f"mean of seeds {', '.join(map(str, common))}" if len(common) > 1
                 else f"seed {common[0]}" if common else "no seed where all trained")
        panels = (("tuned", f"tuned lr, {which}"), ("tuned", "tuned lr, last half"),
                  ("fixed", "fixed lr, seed 0"))
        for col, (key, title) in enumerate(panels):
            ax = axes[row][col]
            lo, hi = math.inf, -math.inf
            for label, r in rows.items():
                runs = [r["runs"][i] for i in common] if key == "tuned" else [r["fixed"]]
                whole = [x["losses"] for x in runs if complete(x)]
                lr = r["tuned_lr"] if key == "tuned" else r["fixed_lr"]
                if not whole:
                    ax.plot([], [], styles.get(label, "-"), color=colours[label],
                            label=f"{label} (lr {fmt_lr(lr)}): diverged")
                    continue
                losses = [sum(v) / len(v) for v in zip(*whole)]
                s = smooth(losses, window)
                x = [(i + 1) * per_step for i in range(len(s))]
                first = len(s) // 2 if col == 1 else 0
                ax.plot(x[first:], s[first:], styles.get(label, "-"), color=colours[label],
                        linewidth=1.4, label=f"{label} (lr {fmt_lr(lr)})")
                lo = min(lo, min(s[first:]))
                hi = max(hi, s[first] if col == 1 else s[len(s) // 10])
            if math.isfinite(lo) and math.isfinite(hi) and hi > lo:
                pad = 0.05 * (hi - lo)
                ax.set_ylim(lo - pad, hi + pad)
            ax.set_title(f"{OPTIMIZER_NAMES[opt]}: {title}", fontsize=11)
            ax.set_xlabel(f"samples seen (steps x {per_step} windows of 64 chars)")
            ax.set_ylabel("training loss (smoothed)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"char LM, 4 stages on rank threads: {args.steps} steps of "
                 f"{args.chunks} x {args.microbatch} windows", fontsize=12)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=90)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=harness.positive, default=None,
                        help="minibatches per run (default 160; 12 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a check that it runs: 12 steps, the fixed lr only, SGD only, "
                             "2 seeds; writes to /tmp unless --out")
    parser.add_argument("--optimizers", default=None,
                        help="comma-separated among sgd, adam (default both; sgd with --quick)")
    parser.add_argument("--seeds", type=harness.positive, default=None,
                        help="seeds at the tuned lr, the grid's seed 0 included (default 3; "
                             "2 with --quick)")
    parser.add_argument("--microbatch", type=int, default=16, help="windows per microbatch")
    parser.add_argument("--chunks", type=int, default=4, help="microbatches per step")
    parser.add_argument("--out", default=None,
                        help="markdown to write (default bench/results/staleness_lm.md; "
                             "/tmp/staleness_lm_quick.md with --quick); .png and .json beside it")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 12 if args.quick else 160
    if args.seeds is None:
        args.seeds = 2 if args.quick else 3
    if args.out is None:
        args.out = "/tmp/staleness_lm_quick.md" if args.quick else "bench/results/staleness_lm.md"
    opts = (args.optimizers or ("sgd" if args.quick else "sgd,adam")).split(",")
    unknown = [o for o in opts if o not in GRIDS]
    if unknown:
        parser.error(f"--optimizers: unknown {', '.join(unknown)}; choose among "
                     f"{', '.join(GRIDS)}")
    grids = {o: {label: grid_for(o, label, args.quick) for label, _, _ in METHODS}
             for o in opts}
    batch = args.chunks * args.microbatch
    # The corpus is the package's docstrings, read from the working tree: read it once.
    train, test, _ = char_corpus()
    args.train_windows, args.test_windows = len(train), len(test)  # type: ignore[arg-type]
    args.source = source_tree()
    args.host = f"{os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}"
    args.date = time.strftime("%Y-%m-%d")
    args.command = harness.command()
    data = {seed: make_data(train, test, args.steps, batch, seed) for seed in range(args.seeds)}
    held = data[0][1]
    total_runs = sum(len(g) for by in grids.values() for g in by.values()) \
        + len(opts) * (args.seeds - 1) * len(METHODS)
    print(f"{total_runs} runs of {args.steps} steps ({args.chunks} x {args.microbatch} windows "
          f"each); held-out: {sum(len(x) for x, _ in held)} test windows", flush=True)
    began = time.perf_counter()
    done = 0

    def one(opt: str, lr: float, label: str, schedule: str, staleness: str | None,
            seed: int) -> dict[str, Any]:
        nonlocal done
        r = run(schedule, staleness, opt, lr, data[seed][0], held, args.microbatch,
                args.chunks, seed)
        done += 1
        print(f"[{done}/{total_runs} {(time.perf_counter() - began) / 60:4.1f} min] {opt} "
              f"lr={fmt_lr(lr)} seed {seed} {label:19s} final {fmt(r['final'])} held-out "
              f"{fmt(r['held_out'])} wall {r['wall_s']:.1f} s"
              + (f"  ({r['error']})" if r["error"] else ""), flush=True)
        return r

    grid_runs: dict[str, Any] = {}
    repeats: dict[str, Any] = {}
    for opt in opts:
        grid_runs[opt] = {label: {} for label, _, _ in METHODS}
        for lr in sorted({g for grid in grids[opt].values() for g in grid}):
            for label, schedule, staleness in METHODS:
                if lr in grids[opt][label]:
                    grid_runs[opt][label][str(lr)] = one(opt, lr, label, schedule, staleness, 0)
        repeats[opt] = {label: [] for label, _, _ in METHODS}
        for seed in range(1, args.seeds):
            for label, schedule, staleness in METHODS:
                by_lr = grid_runs[opt][label]
                tuned = min(grids[opt][label], key=lambda g: (by_lr[str(g)]["final"], g))
                repeats[opt][label].append(one(opt, tuned, label, schedule, staleness, seed))
    args.total_s = time.perf_counter() - began
    meta = {k: getattr(args, k) for k in META}
    return write(meta, grid_runs, repeats, grids, Path(args.out))


META = ("command", "date", "host", "source", "total_s", "steps", "chunks", "microbatch", "seeds",
        "train_windows", "test_windows", "out")


def write(meta: dict[str, Any], grid_runs: dict[str, Any], repeats: dict[str, Any],
          grids: dict[str, dict[str, tuple[float, ...]]], out: Path) -> int:
    """The markdown, the plot and the JSON from the runs."""
    args = argparse.Namespace(**{**meta, "out": str(out)})
    summary = summarise(grid_runs, repeats, grids)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(args, summary, grid_runs, grids))
    plot(args, summary, out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps(finite_json({
        "meta": meta,
        "grids": {o: {label: list(g) for label, g in by.items()} for o, by in grids.items()},
        "summary": {o: {label: {k: r[k] for k in ("tuned_lr", "fixed_lr", "edge", "finals",
                                                  "final", "held_out", "wall_s", "vs_pd",
                                                  "held_vs_pd", "diverged_seeds")}
                        | {"paired": [fmt_rel(d) for d in r["paired"]],
                           "verdict": judge(r), "fixed_final": r["fixed"]["final"],
                           "fixed_held_out": r["fixed"]["held_out"]}
                        for label, r in rows.items()} for o, rows in summary.items()},
        "grid_runs": rounded(grid_runs), "repeats": rounded(repeats)}), indent=1) + "\n")
    print(f"wrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.json')} "
          f"({args.total_s / 60:.1f} min of runs)")
    for opt, rows in summary.items():
        print(f"\n{OPTIMIZER_NAMES[opt]}:")
        print("\n".join(verdict(opt, rows, args.chunks, args.seeds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
