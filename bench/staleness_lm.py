"""Staleness corrections on a real model: the char LM at 4 stages, training loss against samples.

    python bench/staleness_lm.py [--steps 160] [--quick] [--out bench/results/staleness_lm.md]

`build_charlm(layers=2, dropout=0.0)` cut into 4 stages of one block, one rank thread each
(`Pipeline(ranks="threads")`), trained on `char_corpus()` (windows of 64 characters) by 1f1b
(one update per step on its `chunks` microbatches) and by pipedream, uncorrected and with
`staleness=` predict, nesterov and lr-scale (one update per microbatch, stage s reading weights
3 - s of its own updates old). Every method sees the same minibatches from the same weights.
With SGD + momentum 0.9 and with Adam, each method trains at each rate of a small grid (seed
0); the tuned rate has the lowest final loss (mean over the last 10% of steps; diverged:
infinite); then it trains at its tuned rate with more seeds. One fixed rate per optimizer is
reported for all methods too. Held-out: `Pipeline.evaluate` over the test split at the end.

Writes the markdown table, the plot (same name, .png) and the raw figures (.json).
"""

from __future__ import annotations

import argparse
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
METHODS: tuple[tuple[str, str, str | None], ...] = (  # label, schedule, staleness
    ("1f1b", "1f1b", None),
    ("pipedream", "pipedream", None),
    ("pipedream+predict", "pipedream", "predict"),
    ("pipedream+nesterov", "pipedream", "nesterov"),
    ("pipedream+lr-scale", "pipedream", "lr-scale"),
)
# Learning-rate grids, per optimizer and (where a method wants larger rates) per method, from
# earlier runs: with SGD + momentum pipedream diverges at 0.6, predict and nesterov at 0.45,
# 1f1b at 1.0; with Adam, 1f1b is best near 1.6e-2, pipedream near 4e-3.
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
OPTIMIZER_NAMES = {"sgd": "SGD, momentum 0.9", "adam": "Adam"}
TIE = 0.01  # final losses within 1% of each other are a tie (one seed: no finer claim)


def grid_for(opt: str, label: str, quick: bool = False) -> tuple[float, ...]:
    return (FIXED[opt],) if quick else METHOD_GRIDS.get((opt, label), GRIDS[opt])


def optimizer_factory(name: str, lr: float) -> Any:
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    return lambda params: torch.optim.Adam(params, lr=lr)


def make_data(train: Any, test: Any, steps: int, batch: int, seed: int
              ) -> tuple[list[Any], list[Any]]:
    """`steps` minibatches of `batch` training windows (epochs of a seeded permutation) and
    the test split in minibatches of `batch` (the last one short)."""
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps * batch:
        order.extend(torch.randperm(len(train), generator=g).tolist())

    def stack(indices: Any, split: Any) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(split[i] for i in indices))
        return torch.stack(xs), torch.stack(ys)

    return ([stack(order[s * batch:(s + 1) * batch], train) for s in range(steps)],
            [stack(range(i, min(len(test), i + batch)), test)
             for i in range(0, len(test), batch)])


def run(schedule: str, staleness: str | None, opt: str, lr: float, data: list[Any],
        held: list[Any], microbatch: int, chunks: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    plan = Plan(model="charlm", batch_size=microbatch * chunks, workers=STAGES,
                schedule=schedule,
                stages=[StagePlan(i, i + 1, 1, (i,), 1.0) for i in range(STAGES)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)
    extra: dict[str, Any] = {} if staleness is None else {"staleness": staleness}
    began = time.perf_counter()
    pipe = Pipeline(build_charlm(layers=2, dropout=0.0), loss_fn, optimizer_factory(opt, lr),
                    plan=plan, schedule=schedule, chunks=chunks, ranks="threads", timeout=300,
                    **extra)
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
    tail = losses[-max(1, len(data) // 10):]
    finite = len(losses) == len(data) and all(map(math.isfinite, losses))
    return {"losses": losses, "final": sum(tail) / len(tail) if finite else math.inf,
            "held_out": held_loss if math.isfinite(held_loss) else math.inf, "wall_s": wall,
            "setup_s": setup, "error": error}


def rounded(x: Any) -> Any:
    """`x` with every run's step losses to 4 decimals (the JSON's size)."""
    if isinstance(x, dict):
        return {k: ([round(v, 4) for v in val] if k == "losses" else rounded(val))
                for k, val in x.items()}
    return [rounded(v) for v in x] if isinstance(x, list) else x


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


def finite_mean(xs: list[float]) -> float:
    ok = [d for d in xs if math.isfinite(d)]
    return sum(ok) / len(ok) if ok else math.nan


def summarise(grid_runs: dict[str, Any], repeats: dict[str, Any],
              grids: dict[str, dict[str, tuple[float, ...]]]) -> dict[str, Any]:
    """Per optimizer and method: the tuned rate (seed 0), its runs over every seed, the fixed
    rate's run, and the final losses relative to uncorrected pipedream's, seed by seed."""
    out: dict[str, Any] = {}
    for opt, by_method in grid_runs.items():
        rows: dict[str, Any] = {}
        for label, by_lr in by_method.items():
            grid = grids[opt][label]
            tuned = min(grid, key=lambda g: (by_lr[str(g)]["final"], g))
            runs = [by_lr[str(tuned)], *repeats[opt][label]]
            finals = [r["final"] for r in runs]
            rows[label] = {"tuned_lr": tuned, "fixed_lr": FIXED[opt], "grid": grid,
                           "diverged_at": [g for g in grid
                                           if not math.isfinite(by_lr[str(g)]["final"])],
                           "edge": len(grid) > 1 and tuned in (grid[0], grid[-1]),
                           "runs": runs, "fixed": by_lr[str(FIXED[opt])], "finals": finals,
                           "diverged_seeds": [i for i, f in enumerate(finals)
                                              if not math.isfinite(f)],
                           "final": mean(finals),  # over the seeds that did not diverge
                           "held_out": mean([r["held_out"] for r in runs]),
                           "wall_s": sum(r["wall_s"] for r in runs) / len(runs)}
        base = rows["pipedream"]
        for row in rows.values():
            row["paired"] = [rel(a, b) for a, b in zip(row["finals"], base["finals"])]
            row["vs_pd"] = finite_mean(row["paired"])
            row["held_vs_pd"] = finite_mean([rel(a["held_out"], b["held_out"])
                                             for a, b in zip(row["runs"], base["runs"])])
        out[opt] = rows
    return out


def fmt_rel(d: float) -> str:
    if math.isnan(d):
        return "both diverged"
    return {math.inf: "diverged", -math.inf: "PD diverged"}.get(d, f"{d:+.1%}")


def per_seed(xs: list[float], pct: bool = False) -> str:
    return " / ".join(fmt_rel(x) if pct else fmt(x) for x in xs)


def fmt_mean(row: dict[str, Any], key: str) -> str:
    n, k = len(row["finals"]), len(row["diverged_seeds"])
    return "diverged" if k == n else fmt(row[key]) + (f" ({n - k} of {n} seeds)" if k else "")


def judge(row: dict[str, Any]) -> str:
    """helps / hurts / negligible / trade-off / inconsistent / diverged, seed by seed against
    uncorrected pipedream (a seed where only one of them diverged counts for the other)."""
    paired = row["paired"]
    if len(row["diverged_seeds"]) == len(paired):
        return "diverged"
    worse, better = paired.count(math.inf), paired.count(-math.inf)
    both = [d for d in paired if math.isfinite(d)]
    mean_both = sum(both) / len(both) if both else 0.0
    if worse or better:
        if worse and better:
            return "inconsistent"
        return "hurts" if worse else ("helps" if mean_both <= TIE else "trade-off")
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


def best_correction(rows: dict[str, Any]) -> tuple[str, bool]:
    """The best correction (among those that help, if any) and whether it helps."""
    corrections = [k for k in rows if k.startswith("pipedream+")]
    helping = [k for k in corrections if judge(rows[k]) == "helps"]
    best = min(helping or corrections,
               key=lambda k: (len(rows[k]["diverged_seeds"]), rows[k]["vs_pd"]))
    return best, bool(helping)


def verdict(opt: str, rows: dict[str, Any], chunks: int) -> list[str]:
    """Plain-words reading of one optimizer's table (tuned rates, against uncorrected PD)."""
    base, sync = rows["pipedream"], rows["1f1b"]
    lines = []
    if base["diverged_seeds"]:
        lines.append(f"- Uncorrected pipedream at its tuned lr {fmt_lr(base['tuned_lr'])} "
                     f"diverged (NaN loss) on seed(s) "
                     f"{', '.join(map(str, base['diverged_seeds']))}: that rate is at the "
                     f"edge of its stability.")
    for k in (k for k in rows if k.startswith("pipedream+")):
        r = rows[k]
        lines.append(f"- {k.split('+', 1)[1]} {WORDS[judge(r)]}: final training loss "
                     f"{fmt_mean(r, 'final')} against {fmt_mean(base, 'final')} uncorrected; "
                     f"seed by seed {per_seed(r['paired'], pct=True)} (mean over the seeds "
                     f"where both trained: {fmt_rel(r['vs_pd'])}); held-out "
                     f"{fmt_rel(r['held_vs_pd'])}. Tuned lr {fmt_lr(r['tuned_lr'])} "
                     f"(uncorrected: {fmt_lr(base['tuned_lr'])}). At the fixed lr "
                     f"{fmt_lr(r['fixed_lr'])} (seed 0): {fmt(r['fixed']['final'])} against "
                     f"{fmt(base['fixed']['final'])} "
                     f"({fmt_rel(rel(r['fixed']['final'], base['fixed']['final']))}).")
        worse = [g for g in r["diverged_at"] if g in base["grid"] and g not in base["diverged_at"]]
        gained = [g for g in base["diverged_at"] if g in r["grid"] and g not in r["diverged_at"]]
        for rates, what in ((worse, "diverged at lr {}, where uncorrected pipedream did not"),
                            (gained, "trained at lr {}, where uncorrected pipedream diverged")):
            if rates:
                lines.append(f"  On seed 0 it {what.format(', '.join(map(fmt_lr, rates)))}.")
    best, helps = best_correction(rows)
    name = OPTIMIZER_NAMES[opt]
    lines.append(f"- **Best correction for pipedream with {name}: {best.split('+', 1)[1]}** "
                 f"({fmt_mean(rows[best], 'final')} against {fmt_mean(base, 'final')} "
                 f"uncorrected; seed by seed {per_seed(rows[best]['paired'], pct=True)})."
                 if helps else
                 f"- **No correction helps pipedream with {name}** consistently (on every "
                 f"seed) and by more than {TIE:.1%} (closest: {best.split('+', 1)[1]}, "
                 f"{fmt_rel(rows[best]['vs_pd'])}).")
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


def report(args: argparse.Namespace, summary: dict[str, Any], grid_runs: dict[str, Any],
           grids: dict[str, dict[str, tuple[float, ...]]]) -> str:
    samples = args.steps * args.chunks * args.microbatch
    lines = [
        "# Staleness corrections on the char LM (4 stages): loss against samples", "",
        f"`{args.command}` ({args.total_s / 60:.1f} min in all, {args.date}; {args.host}; a "
        f"shared host: wall times are noisy).", "",
        f"Model: `build_charlm(layers=2, dropout=0.0)`, 4 stages of one block, one rank thread "
        f"each. Data: `char_corpus()` (the package's docstrings, {args.source}: "
        f"{args.train_windows} training and {args.test_windows} test windows of 64 "
        f"characters), {args.steps} minibatches of {args.chunks} x {args.microbatch} windows "
        f"({samples} samples, {samples / args.train_windows:.1f} epochs); for a given seed every "
        f"method sees the same minibatches from the same initial weights. 1f1b updates once per "
        f"step; pipedream once per microbatch, stage s reading weights 3 - s updates old.", "",
        f"Tuned lr: the grid's rate with the lowest final loss on seed 0; then seeds "
        f"1..{args.seeds - 1} at it. Final = mean step training loss over the last 10% of "
        f"steps (NaN: diverged; means over the seeds that did not diverge); held-out = "
        f"`Pipeline.evaluate` on the test split; wall = the training loop alone. \"vs "
        f"pipedream\": the final loss relative to uncorrected pipedream's, seed by seed (\"PD "
        f"diverged\": only it diverged). *helps*: lower on every seed by more than {TIE:.0%} on "
        f"average (or it trained where pipedream diverged, at most {TIE:.0%} worse elsewhere); "
        f"*hurts*: the mirror case; *trade-off*: trained where pipedream diverged but more "
        f"than {TIE:.0%} worse elsewhere; *negligible*: one sign, under {TIE:.0%}; "
        f"*inconsistent*: the sign changes with the seed.", "", "## Verdict", ""]
    for opt, rows in summary.items():
        best, helps = best_correction(rows)
        parts = [f"{k.split('+', 1)[1]}: {judge(r)}, {fmt_rel(r['vs_pd'])}"
                 + (f" ({per_seed(r['paired'], pct=True)})" if len(r["paired"]) > 1 else "")
                 for k, r in rows.items() if k.startswith("pipedream+")]
        head = (f"the best correction for pipedream is **{best.split('+', 1)[1]}**" if helps
                else "**no correction helps pipedream**")
        lines.append(f"- {OPTIMIZER_NAMES[opt]}: {head}. Final training loss against "
                     f"uncorrected pipedream, each at its tuned lr (seed by seed): "
                     f"{'; '.join(parts)}.")
    lines += ["", "Caveats: a small model, short runs, delays of at most 3 updates; rates tuned "
              "on seed 0 on a grid; differences of a few percent that change sign with the "
              "seed are noise; the corpus changes with the source tree.", ""]
    for opt, rows in summary.items():
        grid = sorted({g for label in rows for g in grids[opt][label]})
        fixed = fmt_lr(FIXED[opt])
        wider = [label for label in rows if grids[opt][label] != GRIDS[opt]]
        lines += [f"## {OPTIMIZER_NAMES[opt]}", "",
                  f"Grid: {', '.join(map(fmt_lr, GRIDS[opt]))}"
                  + "".join(f"; {label}: {', '.join(map(fmt_lr, grids[opt][label]))}"
                            for label in wider) + f". Fixed lr {fixed}.", ""]
        lines += harness.markdown_table(
            ["method", "tuned lr", "final, mean", "final per seed", "vs pipedream per seed",
             "held-out, mean", "wall s", f"final @ {fixed}", f"held-out @ {fixed}"],
            [[label, fmt_lr(r["tuned_lr"]) + (" (edge)" if r["edge"] else ""),
              fmt_mean(r, "final"), per_seed(r["finals"]),
              "-" if label == "pipedream" else per_seed(r["paired"], pct=True),
              fmt_mean(r, "held_out"), f"{r['wall_s']:.1f}", fmt(r["fixed"]["final"]),
              fmt(r["fixed"]["held_out"])] for label, r in rows.items()])
        lines += ["", "Final training loss at every rate of the grid (seed 0):", ""]
        lines += harness.markdown_table(
            ["method", *(f"lr {fmt_lr(g)}" for g in grid)],
            [[label, *(fmt(by_lr[str(g)]["final"]) if str(g) in by_lr else "-" for g in grid)]
             for label, by_lr in grid_runs[opt].items()])
        errors = [f"{label} lr {g}: {by_lr[str(g)]['error']}"
                  for label, by_lr in grid_runs[opt].items() for g in grid
                  if str(g) in by_lr and by_lr[str(g)]["error"]]
        errors += [f"{label} lr {r['tuned_lr']} seed {i}: {run['error']}"
                   for label, r in rows.items() for i, run in enumerate(r["runs"])
                   if i and run["error"]]
        if errors:
            lines += ["", "Runs that stopped: " + "; ".join(errors) + "."]
        lines += ["", "Reading (tuned rates, against uncorrected pipedream):", "",
                  *verdict(opt, rows, args.chunks), ""]
    lines += ["The corrections (`pipedream_fast/runtime/staleness_correction.py`), delays d = 3, "
              "2, 1, 0 on stages 0..3: predict moves the weights a forward reads d velocities "
              "ahead (a bias-corrected moving average, beta 0.9, of the stage's updates), "
              "nesterov 0.9 + .. + 0.9^d of them, lr-scale divides the rate by 1 + d (the last "
              "stage keeps the full rate and still bounds the stable rate).", "",
              f"Plot: `{Path(args.out).with_suffix('.png').name}` (training loss, trailing "
              f"mean over {max(1, args.steps // 20)} steps, against samples seen; left: tuned "
              f"lr, mean over the seeds where every method trained to the end; middle: its "
              f"last half; right: the fixed lr, seed 0). Raw figures: "
              f"`{Path(args.out).with_suffix('.json').name}`.", ""]
    return "\n".join(lines)


def source_tree() -> str:
    """The commit the package comes from, and whether it had uncommitted changes: the corpus
    is its docstrings."""
    head = harness.git("rev-parse", "--short", "HEAD")
    if head is None:
        return "not a git checkout"
    dirty = harness.git("status", "--porcelain", "--", "pipedream_fast")
    return f"commit {head}" + (" with uncommitted changes in pipedream_fast/" if dirty else "")


def plot(args: argparse.Namespace, summary: dict[str, Any], path: Path) -> None:
    per_step = args.chunks * args.microbatch
    window = max(1, args.steps // 20)
    colours = {"1f1b": "black", "pipedream": "tab:red", "pipedream+predict": "tab:blue",
               "pipedream+nesterov": "tab:green", "pipedream+lr-scale": "tab:orange"}

    def complete(run: dict[str, Any]) -> bool:
        return len(run["losses"]) == args.steps and all(map(math.isfinite, run["losses"]))

    with harness.figure(path, len(summary), 3, (17, 4.8 * len(summary)), dpi=90) as (fig, axes):
        for row, (opt, rows) in enumerate(summary.items()):
            # the tuned curves: mean over the seeds on which every method trained to the end
            common = [i for i in range(args.seeds)
                      if all(complete(r["runs"][i]) for r in rows.values())]
            which = (f"mean of seeds {', '.join(map(str, common))}" if len(common) > 1
                     else f"seed {common[0]}" if common else "no seed where all trained")
            for col, (key, title) in enumerate((("tuned", f"tuned lr, {which}"),
                                                ("tuned", "tuned lr, last half"),
                                                ("fixed", "fixed lr, seed 0"))):
                ax = axes[row][col]
                lo, hi = math.inf, -math.inf
                for label, r in rows.items():
                    runs = [r["runs"][i] for i in common] if key == "tuned" else [r["fixed"]]
                    whole = [x["losses"] for x in runs if complete(x)]
                    lr = fmt_lr(r["tuned_lr"] if key == "tuned" else r["fixed_lr"])
                    style = "--" if label == "1f1b" else "-"
                    if not whole:
                        ax.plot([], [], style, color=colours[label],
                                label=f"{label} (lr {lr}): diverged")
                        continue
                    losses = [sum(v) / len(v) for v in zip(*whole)]
                    s = [sum(losses[max(0, i - window + 1):i + 1])
                         / len(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
                    first = len(s) // 2 if col == 1 else 0
                    ax.plot([(i + 1) * per_step for i in range(first, len(s))], s[first:], style,
                            color=colours[label], linewidth=1.4, label=f"{label} (lr {lr})")
                    lo = min(lo, min(s[first:]))
                    hi = max(hi, s[first] if col == 1 else s[len(s) // 10])
                if math.isfinite(lo) and math.isfinite(hi) and hi > lo:
                    ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
                ax.set_title(f"{OPTIMIZER_NAMES[opt]}: {title}", fontsize=11)
                harness.axes_text(ax, None, f"samples seen (steps x {per_step} windows of 64 "
                                  "chars)", "training loss (smoothed)", {"fontsize": 8})
        fig.suptitle(f"char LM, 4 stages on rank threads: {args.steps} steps of "
                     f"{args.chunks} x {args.microbatch} windows", fontsize=12)


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
                        help="seeds at the tuned lr, seed 0 included (default 3; 2 with --quick)")
    parser.add_argument("--microbatch", type=int, default=16, help="windows per microbatch")
    parser.add_argument("--chunks", type=int, default=4, help="microbatches per step")
    parser.add_argument("--out", default=None,
                        help="markdown to write (default bench/results/staleness_lm.md; "
                             "/tmp/staleness_lm_quick.md with --quick); .png and .json beside it")
    args = parser.parse_args()
    args.steps = args.steps or (12 if args.quick else 160)
    args.seeds = args.seeds or (2 if args.quick else 3)
    args.out = args.out or ("/tmp/staleness_lm_quick.md" if args.quick
                            else "bench/results/staleness_lm.md")
    opts = (args.optimizers or ("sgd" if args.quick else "sgd,adam")).split(",")
    unknown = [o for o in opts if o not in GRIDS]
    if unknown:
        parser.error(f"--optimizers: unknown {', '.join(unknown)}; choose among "
                     f"{', '.join(GRIDS)}")
    grids = {o: {label: grid_for(o, label, args.quick) for label, _, _ in METHODS}
             for o in opts}
    # The corpus is the package's docstrings, read from the working tree: read it once.
    train, test, _ = char_corpus()
    args.train_windows, args.test_windows = len(train), len(test)
    args.source = source_tree()
    args.host = f"{os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}"
    args.date = time.strftime("%Y-%m-%d")
    args.command = harness.command()
    data = {seed: make_data(train, test, args.steps, args.chunks * args.microbatch, seed)
            for seed in range(args.seeds)}
    held = data[0][1]
    total_runs = sum(len(g) for by in grids.values() for g in by.values()) \
        + len(opts) * (args.seeds - 1) * len(METHODS)
    harness.say(f"{total_runs} runs of {args.steps} steps ({args.chunks} x {args.microbatch} "
                f"windows each); held-out: {sum(len(x) for x, _ in held)} test windows")
    began = time.perf_counter()
    done = 0

    def one(opt: str, lr: float, label: str, schedule: str, staleness: str | None,
            seed: int) -> dict[str, Any]:
        nonlocal done
        r = run(schedule, staleness, opt, lr, data[seed][0], held, args.microbatch,
                args.chunks, seed)
        done += 1
        harness.say(f"[{done}/{total_runs} {(time.perf_counter() - began) / 60:4.1f} min] "
                    f"{opt} lr={fmt_lr(lr)} seed {seed} {label:19s} final {fmt(r['final'])} "
                    f"held-out {fmt(r['held_out'])} wall {r['wall_s']:.1f} s"
                    + (f"  ({r['error']})" if r["error"] else ""))
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
    harness.write_json(out.with_suffix(".json"), {
        "meta": meta, "grids": grids,
        "summary": {o: {label: {k: r[k] for k in ("tuned_lr", "fixed_lr", "edge", "finals",
                                                  "final", "held_out", "wall_s", "vs_pd",
                                                  "held_vs_pd", "diverged_seeds")}
                        | {"paired": [fmt_rel(d) for d in r["paired"]],
                           "verdict": judge(r), "fixed_final": r["fixed"]["final"],
                           "fixed_held_out": r["fixed"]["held_out"]}
                        for label, r in rows.items()} for o, rows in summary.items()},
        "grid_runs": rounded(grid_runs), "repeats": rounded(repeats)})
    print(f"wrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.json')} "
          f"({args.total_s / 60:.1f} min of runs)")
    for opt, rows in summary.items():
        print(f"\n{OPTIMIZER_NAMES[opt]}:")
        print("\n".join(verdict(opt, rows, args.chunks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
