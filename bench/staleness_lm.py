"""Staleness corrections on a real model: the char LM at 4 stages, training loss against samples.

1f1b and pipedream, uncorrected and with each `staleness=` correction, on the same minibatches from
the same weights; with SGD + momentum and with Adam, each at every rate of a grid (seed 0), then at
its best rate with more seeds. Writes the markdown, a plot (.png) and the raw figures (.json).

    python bench/staleness_lm.py [--quick] [--out bench/results/staleness_lm.md]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
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

STAGES, MICROBATCH, CHUNKS = 4, 16, 4  # one block a stage; windows of 64 characters
# schedule[+staleness correction]
METHODS = ("1f1b", "pipedream", "pipedream+predict", "pipedream+nesterov", "pipedream+lr-scale")
# Grids from earlier runs (SGD: pipedream diverges at 0.6, 1f1b at 1.0; Adam: 1f1b is best
# near 1.6e-2, pipedream near 4e-3). FIXED: the one rate shown for every method.
GRIDS = {"sgd": (0.1, 0.2, 0.3, 0.45), "adam": (2e-3, 4e-3, 8e-3, 1.6e-2)}
METHOD_GRIDS = {("sgd", "1f1b"): (0.2, 0.3, 0.45, 0.7),
                ("sgd", "pipedream+lr-scale"): (0.2, 0.3, 0.45, 0.7),
                ("adam", "1f1b"): (4e-3, 8e-3, 1.6e-2, 3.2e-2)}
FIXED = {"sgd": 0.3, "adam": 4e-3}
OPTIMIZER_NAMES = {"sgd": "SGD, momentum 0.9", "adam": "Adam"}
TIE = 0.01  # final losses within 1% of each other are a tie
COLOURS = {"1f1b": "black", "pipedream": "tab:red", "pipedream+predict": "tab:blue",
           "pipedream+nesterov": "tab:green", "pipedream+lr-scale": "tab:orange"}


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
            [stack(range(i, min(len(test), i + batch)), test) for i in range(0, len(test), batch)])


def run(method: str, opt: str, lr: float, data: list[Any], held: list[Any], seed: int
        ) -> dict[str, Any]:
    """One training run; final: the mean loss over the last 10% of steps (inf: diverged)."""
    schedule, _, staleness = method.partition("+")
    torch.manual_seed(seed)
    plan = Plan("charlm", MICROBATCH * CHUNKS, STAGES, schedule,
                [StagePlan(i, i + 1, 1, (i,), 1.0) for i in range(STAGES)], 1.0, 1.0)
    optimizer = ((lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9)) if opt == "sgd"
                 else (lambda ps: torch.optim.Adam(ps, lr=lr)))
    began, extra = time.perf_counter(), {"staleness": staleness} if staleness else {}
    pipe = Pipeline(build_charlm(layers=2, dropout=0.0), loss_fn, optimizer, plan=plan,
                    schedule=schedule, chunks=CHUNKS, ranks="threads", timeout=300,
                    **extra)  # type: ignore[arg-type]
    setup, began = time.perf_counter() - began, time.perf_counter()
    losses: list[float] = []
    error, held_loss = None, math.inf
    try:
        losses.extend(math.nan if v is None else float(v) for v in pipe.train(data, len(data)))
    except NonFiniteLoss as err:  # a diverged run is a result, not a crash
        after = re.search(r"stopped after step (\d+)", str(err))
        error = f"NaN loss, stopped after step {after.group(1) if after else '?'}"
    except Exception as err:  # reported with the run, and the benchmark goes on
        error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    wall = time.perf_counter() - began
    if error is None:
        try:
            held_loss = float(pipe.evaluate(held)["loss"])
        except Exception as err:
            error = f"evaluate: {type(err).__name__}: {err}"
    pipe.close()
    tail = losses[-max(1, len(data) // 10):]
    finite = len(losses) == len(data) and all(map(math.isfinite, losses))
    return {"losses": [round(v, 4) for v in losses],  # 4 decimals: the JSON's size
            "final": sum(tail) / len(tail) if finite else math.inf,
            "held_out": held_loss if math.isfinite(held_loss) else math.inf, "wall_s": wall,
            "setup_s": setup, "error": error}


def fmt(x: Any, pct: bool = False) -> str:
    """A loss, or with `pct` a relative difference (`rel`); a list: seed by seed."""
    if isinstance(x, list):
        return " / ".join(fmt(v, pct) for v in x)
    if not pct:
        return f"{x:.3f}" if math.isfinite(x) else "diverged"
    return "both diverged" if math.isnan(x) else \
        {math.inf: "diverged", -math.inf: "PD diverged"}.get(x, f"{x:+.1%}")


def mean(xs: list[float], none: float = math.inf) -> float:
    """The mean of the finite values (`none` if none)."""
    ok = [x for x in xs if math.isfinite(x)]
    return sum(ok) / len(ok) if ok else none


def rel(a: float, b: float) -> float:
    """(a - b) / b, both finite; -inf: only b diverged; +inf: only a; nan: both."""
    if math.isfinite(a) and math.isfinite(b):
        return (a - b) / b
    return -math.inf if math.isfinite(a) else (math.inf if math.isfinite(b) else math.nan)


def fmt_mean(row: dict[str, Any], key: str) -> str:
    n, k = len(row["finals"]), len(row["diverged_seeds"])
    return "diverged" if k == n else fmt(row[key]) + (f" ({n - k} of {n} seeds)" if k else "")


def tuned_lr(grid: tuple[float, ...], by_lr: dict[str, Any]) -> float:
    return min(grid, key=lambda g: (by_lr[str(g)]["final"], g))


def summarise(grid_runs: dict[str, Any], repeats: dict[str, Any],
              grids: dict[str, dict[str, tuple[float, ...]]]) -> dict[str, Any]:
    """Per optimizer and method: the tuned rate (seed 0), its runs over every seed, the fixed
    rate's run, and the final losses relative to uncorrected pipedream's, seed by seed."""
    out: dict[str, Any] = {}
    for opt, by_method in grid_runs.items():
        rows: dict[str, Any] = {}
        for label, by_lr in by_method.items():
            grid = grids[opt][label]
            tuned = tuned_lr(grid, by_lr)
            runs = [by_lr[str(tuned)], *repeats[opt][label]]
            finals = [r["final"] for r in runs]
            rows[label] = {"tuned_lr": tuned, "fixed_lr": FIXED[opt],
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
            row["vs_pd"] = mean(row["paired"], math.nan)
            row["held_vs_pd"] = mean([rel(a["held_out"], b["held_out"])
                                      for a, b in zip(row["runs"], base["runs"])], math.nan)
        out[opt] = rows
    return out


def judge(row: dict[str, Any]) -> str:
    """helps / hurts / negligible / trade-off / inconsistent / diverged, seed by seed against
    uncorrected pipedream (a seed where only one of them diverged counts for the other)."""
    paired = row["paired"]
    if len(row["diverged_seeds"]) == len(paired):
        return "diverged"
    worse, better = math.inf in paired, -math.inf in paired
    both = [d for d in paired if math.isfinite(d)]
    if worse or better:
        return "inconsistent" if worse and better else "hurts" if worse else \
            "helps" if mean(both, 0.0) <= TIE else "trade-off"
    if not (all(d < 0 for d in both) or all(d > 0 for d in both)):
        return "inconsistent"
    return "negligible" if abs(mean(both, 0.0)) <= TIE else "helps" if both[0] < 0 else "hurts"


def report(meta: dict[str, Any], summary: dict[str, Any], grid_runs: dict[str, Any],
           grids: dict[str, dict[str, tuple[float, ...]]], out: Path) -> str:
    samples = meta["steps"] * CHUNKS * MICROBATCH
    lines = [
        "# Staleness corrections on the char LM (4 stages): loss against samples", "",
        f"Command: `{meta['command']}` ({meta['total_s'] / 60:.1f} min in all; a shared host: "
        f"wall times are noisy).", "", f"Machine: {meta['host']}.", "",
        f"`build_charlm(layers=2, dropout=0.0)`, a block a stage on rank threads, on "
        f"`char_corpus()` ({meta['source']}: {meta['train_windows']} training and "
        f"{meta['test_windows']} test windows), {meta['steps']} minibatches of {CHUNKS} x "
        f"{MICROBATCH} windows ({samples / meta['train_windows']:.1f} epochs). Tuned lr: the "
        f"grid's best on seed 0, then seeds 1..{meta['seeds'] - 1} at it. Final: mean training "
        f"loss over the last 10% of steps (over the seeds that did not diverge); held-out: "
        f"`Pipeline.evaluate` on the test split. \"vs pipedream\": against uncorrected "
        f"pipedream, seed by seed (\"PD diverged\": only it did). *helps*: lower on every seed "
        f"and by over {TIE:.0%} on average, or trained where pipedream diverged and at most "
        f"{TIE:.0%} worse elsewhere (else *trade-off*); *hurts*: the mirror case; *negligible*: "
        f"one sign, under {TIE:.0%}; *inconsistent*: the sign changes with the seed. Caveats: "
        f"a small model, short runs, delays of at most 3 updates, rates tuned on seed 0: a few "
        f"percent that change sign with the seed are noise.", ""]
    for opt, rows in summary.items():
        grid = sorted({g for label in rows for g in grids[opt][label]})
        fixed = f"{FIXED[opt]:g}"
        lines += [f"## {OPTIMIZER_NAMES[opt]}", "", *harness.markdown_table(
            ["method", "tuned lr", "final, mean", "final per seed",
             "vs pipedream: verdict, mean (per seed)", "held-out, mean", "wall s",
             f"final @ {fixed}", f"held-out @ {fixed}"],
            [[label, f"{r['tuned_lr']:g}" + (" (edge)" if r["edge"] else ""),
              fmt_mean(r, "final"), fmt(r["finals"]), "-" if label == "pipedream" else
              (f"**{judge(r)}**, " if "+" in label else "")
              + f"{fmt(r['vs_pd'], True)} ({fmt(r['paired'], True)})",
              fmt_mean(r, "held_out"), f"{r['wall_s']:.1f}", fmt(r["fixed"]["final"]),
              fmt(r["fixed"]["held_out"])] for label, r in rows.items()]),
            "", "Final training loss at every rate of each method's grid (seed 0):", "",
            *harness.markdown_table(["method", *(f"lr {g:g}" for g in grid)], [
                [label, *(fmt(by_lr[str(g)]["final"]) if str(g) in by_lr else "-" for g in grid)]
                for label, by_lr in grid_runs[opt].items()])]
        errors = [f"{label} lr {g}: {run['error']}" for label, by_lr in grid_runs[opt].items()
                  for g, run in by_lr.items() if run["error"]]
        errors += [f"{label} lr {r['tuned_lr']} seed {i}: {run['error']}"
                   for label, r in rows.items() for i, run in enumerate(r["runs"])
                   if i and run["error"]]
        lines += ["", "Runs that stopped: " + "; ".join(errors) + ".", ""] if errors else [""]
    lines += ["The corrections: `pipedream_fast/runtime/staleness_correction.py`.", "",
              f"Plot: `{out.with_suffix('.png').name}` (training loss, trailing mean over "
              f"{max(1, meta['steps'] // 20)} steps); raw figures: "
              f"`{out.with_suffix('.json').name}`.", ""]
    return "\n".join(lines)


def plot(steps: int, seeds: int, summary: dict[str, Any], path: Path) -> None:
    per_step, window = CHUNKS * MICROBATCH, max(1, steps // 20)

    def complete(run: dict[str, Any]) -> bool:
        return len(run["losses"]) == steps and all(map(math.isfinite, run["losses"]))

    with harness.figure(path, len(summary), 3, (17, 4.8 * len(summary)), dpi=90) as (fig, axes):
        for row, (opt, rows) in enumerate(summary.items()):
            # the tuned curves: mean over the seeds on which every method trained to the end
            common = [i for i in range(seeds) if all(complete(r["runs"][i]) for r in rows.values())]
            which = (f"mean of seeds {', '.join(map(str, common))}" if len(common) > 1
                     else f"seed {common[0]}" if common else "no seed where all trained")
            for col, title in enumerate((f"tuned lr, {which}", "tuned lr, last half",
                                         "fixed lr, seed 0")):
                ax, lo, hi = axes[row][col], math.inf, -math.inf
                for label, r in rows.items():
                    runs = [r["runs"][i] for i in common] if col < 2 else [r["fixed"]]
                    whole = [x["losses"] for x in runs if complete(x)]
                    lr = f"{r['tuned_lr'] if col < 2 else r['fixed_lr']:g}"
                    style = "--" if label == "1f1b" else "-"
                    if not whole:
                        ax.plot([], [], style, color=COLOURS[label],
                                label=f"{label} (lr {lr}): diverged")
                        continue
                    losses = [statistics.fmean(v) for v in zip(*whole)]
                    s = [statistics.fmean(losses[max(0, i - window + 1):i + 1])
                         for i in range(len(losses))]
                    first = len(s) // 2 if col == 1 else 0
                    ax.plot([(i + 1) * per_step for i in range(first, len(s))], s[first:], style,
                            color=COLOURS[label], linewidth=1.4, label=f"{label} (lr {lr})")
                    lo = min(lo, min(s[first:]))
                    hi = max(hi, s[first] if col == 1 else s[len(s) // 10])
                if math.isfinite(lo) and math.isfinite(hi) and hi > lo:
                    ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
                ax.set_title(f"{OPTIMIZER_NAMES[opt]}: {title}", fontsize=11)
                harness.axes_text(ax, None, f"samples seen (steps x {per_step} windows of 64 "
                                  "chars)", "training loss (smoothed)", {"fontsize": 8})
        fig.suptitle(f"char LM, 4 stages on rank threads: {steps} steps of "
                     f"{CHUNKS} x {MICROBATCH} windows", fontsize=12)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="12 steps, SGD at the fixed lr, 2 "
                        "seeds, to /tmp/staleness_lm_quick.md unless --out")
    parser.add_argument("--out", help="default bench/results/staleness_lm.md")
    args = parser.parse_args()
    steps, seeds = (12, 2) if args.quick else (160, 3)
    out = Path(args.out or ("/tmp/staleness_lm_quick.md" if args.quick
                            else "bench/results/staleness_lm.md"))
    grids = {o: {label: (FIXED[o],) if args.quick else METHOD_GRIDS.get((o, label), GRIDS[o])
                 for label in METHODS} for o in (["sgd"] if args.quick else GRIDS)}
    train, test, _ = char_corpus()  # the package's docstrings, read from the working tree
    head = harness.git("rev-parse", "--short", "HEAD")
    dirty = harness.git("status", "--porcelain", "--", "pipedream_fast")
    meta = {"command": harness.command(), "host": harness.machine(), "steps": steps,
            "chunks": CHUNKS, "microbatch": MICROBATCH, "seeds": seeds,
            "train_windows": len(train), "test_windows": len(test), "out": str(out),
            "source": "not a git checkout" if head is None else f"commit {head}"
            + (" with uncommitted changes in pipedream_fast/" if dirty else "")}
    data = {seed: make_data(train, test, steps, CHUNKS * MICROBATCH, seed) for seed in range(seeds)}
    held = data[0][1]
    total = sum(len(g) for by in grids.values() for g in by.values()) \
        + len(grids) * (seeds - 1) * len(METHODS)
    harness.say(f"{total} runs of {steps} steps ({CHUNKS} x {MICROBATCH} windows each); "
                f"held-out: {sum(len(x) for x, _ in held)} test windows")
    began, done = time.perf_counter(), 0
    grid_runs: dict[str, Any] = {}
    repeats: dict[str, Any] = {}

    def one(opt: str, lr: float, label: str, seed: int) -> dict[str, Any]:
        nonlocal done
        r = run(label, opt, lr, data[seed][0], held, seed)
        done += 1
        harness.say(f"[{done}/{total} {(time.perf_counter() - began) / 60:4.1f} min] {opt} "
                    f"lr={lr:g} seed {seed} {label:19s} final {fmt(r['final'])} held-out "
                    f"{fmt(r['held_out'])} wall {r['wall_s']:.1f} s"
                    + (f"  ({r['error']})" if r["error"] else ""))
        return r

    for opt in grids:
        grid_runs[opt] = {label: {} for label in METHODS}
        for lr in sorted({g for grid in grids[opt].values() for g in grid}):
            for label in METHODS:
                if lr in grids[opt][label]:
                    grid_runs[opt][label][str(lr)] = one(opt, lr, label, 0)
        repeats[opt] = {label: [] for label in METHODS}
        for seed in range(1, seeds):  # each method at its tuned rate
            for label in METHODS:
                lr = tuned_lr(grids[opt][label], grid_runs[opt][label])
                repeats[opt][label].append(one(opt, lr, label, seed))
    meta["total_s"] = time.perf_counter() - began
    summary = summarise(grid_runs, repeats, grids)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(meta, summary, grid_runs, grids, out))
    plot(steps, seeds, summary, out.with_suffix(".png"))
    harness.write_json(out.with_suffix(".json"), {
        "meta": meta, "grids": grids, "grid_runs": grid_runs, "repeats": repeats,
        "summary": {o: {label: {**{k: v for k, v in r.items() if k not in ("runs", "fixed")},
                                "paired": [fmt(d, True) for d in r["paired"]],
                                "verdict": judge(r), "fixed_final": r["fixed"]["final"],
                                "fixed_held_out": r["fixed"]["held_out"]}
                        for label, r in rows.items()} for o, rows in summary.items()}})
    harness.say(f"wrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
