"""Staleness corrections on a real model: the char LM at 4 stages, training loss against samples.

`build_charlm(layers=2, dropout=0.0)` in 4 stages of one block on rank threads, trained on
`char_corpus()` by 1f1b (one update a step) and by pipedream (one update a microbatch, stage s
reading weights 3 - s updates old), uncorrected and with `staleness=` predict, nesterov and
lr-scale; every method sees the same minibatches from the same weights. With SGD + momentum 0.9
and with Adam, each method trains at each rate of a grid (seed 0); the rate with the lowest
final loss is then trained with more seeds. Held-out: `Pipeline.evaluate` on the test split.

    python bench/staleness_lm.py [--steps 160] [--quick] [--out bench/results/staleness_lm.md]

Writes the markdown, the plot (same name, .png) and the raw figures (.json).
"""

from __future__ import annotations

import argparse
import math
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
MICROBATCH = 16  # windows of 64 characters
CHUNKS = 4  # microbatches per step
METHODS: tuple[tuple[str, str, str | None], ...] = (  # label, schedule, staleness
    ("1f1b", "1f1b", None),
    ("pipedream", "pipedream", None),
    ("pipedream+predict", "pipedream", "predict"),
    ("pipedream+nesterov", "pipedream", "nesterov"),
    ("pipedream+lr-scale", "pipedream", "lr-scale"),
)
# Learning-rate grids from earlier runs: with SGD + momentum pipedream diverges at 0.6,
# predict and nesterov at 0.45, 1f1b at 1.0; with Adam 1f1b is best near 1.6e-2, pipedream
# near 4e-3. FIXED: the one rate shown for every method.
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
            [stack(range(i, min(len(test), i + batch)), test)
             for i in range(0, len(test), batch)])


def run(schedule: str, staleness: str | None, opt: str, lr: float, data: list[Any],
        held: list[Any], seed: int) -> dict[str, Any]:
    """One training run; final: the mean loss over the last 10% of steps (inf: diverged)."""
    torch.manual_seed(seed)
    plan = Plan("charlm", MICROBATCH * CHUNKS, STAGES, schedule,
                [StagePlan(i, i + 1, 1, (i,), 1.0) for i in range(STAGES)], 1.0, 1.0)
    optimizer = ((lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9)) if opt == "sgd"
                 else (lambda ps: torch.optim.Adam(ps, lr=lr)))
    extra: dict[str, Any] = {} if staleness is None else {"staleness": staleness}
    began = time.perf_counter()
    pipe = Pipeline(build_charlm(layers=2, dropout=0.0), loss_fn, optimizer, plan=plan,
                    schedule=schedule, chunks=CHUNKS, ranks="threads", timeout=300, **extra)
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
    return {"losses": [round(v, 4) for v in losses],  # 4 decimals: the JSON's size
            "final": sum(tail) / len(tail) if finite else math.inf,
            "held_out": held_loss if math.isfinite(held_loss) else math.inf, "wall_s": wall,
            "setup_s": setup, "error": error}


def fmt(x: float) -> str:
    return "diverged" if not math.isfinite(x) else f"{x:.3f}"


def mean(xs: list[float], none: float = math.inf) -> float:
    """The mean of the finite values (`none` if none)."""
    ok = [x for x in xs if math.isfinite(x)]
    return sum(ok) / len(ok) if ok else none


def rel(a: float, b: float) -> float:
    """(a - b) / b, both finite; -inf: only b diverged; +inf: only a; nan: both."""
    if math.isfinite(a) and math.isfinite(b):
        return (a - b) / b
    if math.isfinite(a):
        return -math.inf
    return math.inf if math.isfinite(b) else math.nan


def fmt_rel(d: float) -> str:
    if math.isnan(d):
        return "both diverged"
    return {math.inf: "diverged", -math.inf: "PD diverged"}.get(d, f"{d:+.1%}")


def per_seed(xs: list[float], pct: bool = False) -> str:
    return " / ".join(fmt_rel(x) if pct else fmt(x) for x in xs)


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


def best_correction(rows: dict[str, Any]) -> tuple[str, bool]:
    """The best correction (among those that help, if any) and whether it helps."""
    corrections = [k for k in rows if k.startswith("pipedream+")]
    helping = [k for k in corrections if judge(rows[k]) == "helps"]
    best = min(helping or corrections,
               key=lambda k: (len(rows[k]["diverged_seeds"]), rows[k]["vs_pd"]))
    return best.split("+", 1)[1], bool(helping)


def verdict(rows: dict[str, Any]) -> list[str]:
    """One optimizer's corrections and 1f1b against uncorrected pipedream, in words."""
    base, sync = rows["pipedream"], rows["1f1b"]
    lines = []
    for k, r in ((k, r) for k, r in rows.items() if k.startswith("pipedream+")):
        lines.append(f"- {k.split('+', 1)[1]} {judge(r)}: final {fmt_mean(r, 'final')} against "
                     f"{fmt_mean(base, 'final')} uncorrected (seed by seed "
                     f"{per_seed(r['paired'], pct=True)}; mean where both trained "
                     f"{fmt_rel(r['vs_pd'])}); held-out {fmt_rel(r['held_vs_pd'])}. At the fixed "
                     f"lr {r['fixed_lr']:g}: "
                     f"{fmt_rel(rel(r['fixed']['final'], base['fixed']['final']))}.")
        for ours, theirs, what in ((r, base, "diverged at lr {}, where uncorrected pipedream "
                                               "did not"),
                                   (base, r, "trained at lr {}, where uncorrected pipedream "
                                             "diverged")):
            rates = [g for g in ours["diverged_at"]
                     if g in theirs["grid"] and g not in theirs["diverged_at"]]
            if rates:
                lines.append(f"  On seed 0 it {what.format(', '.join(f'{g:g}' for g in rates))}.")
    d_sync = per_seed([rel(a, b) for a, b in zip(base["finals"], sync["finals"])], pct=True)
    lines.append(f"- Against 1f1b (tuned: {fmt_mean(sync, 'final')} training, "
                 f"{fmt(sync['held_out'])} held-out), uncorrected pipedream's final loss is "
                 f"{d_sync.replace('PD diverged', '1f1b diverged')} seed by seed at equal "
                 f"samples ({CHUNKS}x the updates, each on 1/{CHUNKS} of the samples).")
    return lines


def report(meta: dict[str, Any], summary: dict[str, Any], grid_runs: dict[str, Any],
           grids: dict[str, dict[str, tuple[float, ...]]], out: Path) -> str:
    samples = meta["steps"] * CHUNKS * MICROBATCH
    lines = [
        "# Staleness corrections on the char LM (4 stages): loss against samples", "",
        f"Command: `{meta['command']}` ({meta['total_s'] / 60:.1f} min in all; a shared host: "
        f"wall times are noisy).", "", f"Machine: {meta['host']}.", "",
        f"Model: `build_charlm(layers=2, dropout=0.0)`, one block a stage on rank threads. "
        f"Data: `char_corpus()` (the package's docstrings, {meta['source']}: "
        f"{meta['train_windows']} training and {meta['test_windows']} test windows), "
        f"{meta['steps']} minibatches of {CHUNKS} x {MICROBATCH} windows ({samples} samples, "
        f"{samples / meta['train_windows']:.1f} epochs). Tuned lr: the grid's rate with the "
        f"lowest final loss on seed 0; then seeds 1..{meta['seeds'] - 1} at it. Final: mean "
        f"training loss over the last 10% of steps (means over the seeds that did not "
        f"diverge); held-out: `Pipeline.evaluate` on the test split; wall: the training loop. "
        f"\"vs pipedream\": relative to uncorrected pipedream, seed by seed (\"PD diverged\": "
        f"only it did). *helps*: lower on "
        f"every seed and by more than {TIE:.0%} on average (or trained where pipedream "
        f"diverged, at most {TIE:.0%} worse elsewhere); *hurts*: the mirror case; *trade-off*: "
        f"trained where pipedream diverged but more than {TIE:.0%} worse elsewhere; "
        f"*negligible*: one sign, under {TIE:.0%}; *inconsistent*: the sign changes with the "
        f"seed.", "", "## Verdict", ""]
    for opt, rows in summary.items():
        best, helps = best_correction(rows)
        parts = [f"{k.split('+', 1)[1]}: {judge(r)}, {fmt_rel(r['vs_pd'])}"
                 + (f" ({per_seed(r['paired'], pct=True)})" if len(r["paired"]) > 1 else "")
                 for k, r in rows.items() if k.startswith("pipedream+")]
        lines.append(f"- {OPTIMIZER_NAMES[opt]}: "
                     + (f"the best correction is **{best}**" if helps
                        else "**no correction helps pipedream**")
                     + f". Final loss against uncorrected pipedream: {'; '.join(parts)}.")
    lines += ["", "Caveats: a small model, short runs, delays of at most 3 updates; rates tuned "
              "on seed 0; differences of a few percent that change sign with the seed are "
              "noise; the corpus changes with the source tree.", ""]
    for opt, rows in summary.items():
        grid = sorted({g for label in rows for g in grids[opt][label]})
        fixed = f"{FIXED[opt]:g}"
        lines += [f"## {OPTIMIZER_NAMES[opt]}", "", *harness.markdown_table(
            ["method", "tuned lr", "final, mean", "final per seed", "vs pipedream per seed",
             "held-out, mean", "wall s", f"final @ {fixed}", f"held-out @ {fixed}"],
            [[label, f"{r['tuned_lr']:g}" + (" (edge)" if r["edge"] else ""),
              fmt_mean(r, "final"), per_seed(r["finals"]),
              "-" if label == "pipedream" else per_seed(r["paired"], pct=True),
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
        if errors:
            lines += ["", "Runs that stopped: " + "; ".join(errors) + "."]
        lines += ["", "Reading (tuned rates):", "", *verdict(rows), ""]
    lines += ["The corrections (`pipedream_fast/runtime/staleness_correction.py`), delays d = 3, "
              "2, 1, 0 on stages 0..3: predict moves the weights a forward reads d velocities "
              "ahead (a bias-corrected moving average, beta 0.9, of the stage's updates), "
              "nesterov 0.9 + .. + 0.9^d of them, lr-scale divides the rate by 1 + d (the last "
              "stage keeps the full rate and still bounds the stable rate).", "",
              f"Plot: `{out.with_suffix('.png').name}` (training loss, trailing mean over "
              f"{max(1, meta['steps'] // 20)} steps, against samples; left: tuned lr, mean "
              f"over the seeds where every method trained to the end; middle: its last half; "
              f"right: the fixed lr, seed 0). Raw figures: `{out.with_suffix('.json').name}`.",
              ""]
    return "\n".join(lines)


def plot(steps: int, seeds: int, summary: dict[str, Any], path: Path) -> None:
    per_step = CHUNKS * MICROBATCH
    window = max(1, steps // 20)

    def complete(run: dict[str, Any]) -> bool:
        return len(run["losses"]) == steps and all(map(math.isfinite, run["losses"]))

    with harness.figure(path, len(summary), 3, (17, 4.8 * len(summary)), dpi=90) as (fig, axes):
        for row, (opt, rows) in enumerate(summary.items()):
            # the tuned curves: mean over the seeds on which every method trained to the end
            common = [i for i in range(seeds)
                      if all(complete(r["runs"][i]) for r in rows.values())]
            which = (f"mean of seeds {', '.join(map(str, common))}" if len(common) > 1
                     else f"seed {common[0]}" if common else "no seed where all trained")
            for col, title in enumerate((f"tuned lr, {which}", "tuned lr, last half",
                                         "fixed lr, seed 0")):
                ax = axes[row][col]
                lo, hi = math.inf, -math.inf
                for label, r in rows.items():
                    runs = [r["runs"][i] for i in common] if col < 2 else [r["fixed"]]
                    whole = [x["losses"] for x in runs if complete(x)]
                    lr = f"{r['tuned_lr'] if col < 2 else r['fixed_lr']:g}"
                    style = "--" if label == "1f1b" else "-"
                    if not whole:
                        ax.plot([], [], style, color=COLOURS[label],
                                label=f"{label} (lr {lr}): diverged")
                        continue
                    losses = [sum(v) / len(v) for v in zip(*whole)]
                    s = [sum(losses[max(0, i - window + 1):i + 1])
                         / len(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
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
    parser.add_argument("--steps", type=harness.positive, default=None,
                        help="minibatches per run (default 160; 12 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a check that it runs: 12 steps, SGD at the fixed lr only, 2 "
                             "seeds; writes to /tmp unless --out")
    parser.add_argument("--out", default=None,
                        help="markdown to write (default bench/results/staleness_lm.md; "
                             "/tmp/staleness_lm_quick.md with --quick); .png and .json beside it")
    args = parser.parse_args()
    steps = args.steps or (12 if args.quick else 160)
    seeds = 2 if args.quick else 3
    out = Path(args.out or ("/tmp/staleness_lm_quick.md" if args.quick
                            else "bench/results/staleness_lm.md"))
    grids = {o: {label: (FIXED[o],) if args.quick else METHOD_GRIDS.get((o, label), GRIDS[o])
                 for label, _, _ in METHODS} for o in (["sgd"] if args.quick else GRIDS)}
    # The corpus is the package's docstrings, read from the working tree: once.
    train, test, _ = char_corpus()
    head = harness.git("rev-parse", "--short", "HEAD")
    dirty = harness.git("status", "--porcelain", "--", "pipedream_fast")
    meta = {"command": harness.command(), "host": harness.machine(), "steps": steps,
            "chunks": CHUNKS, "microbatch": MICROBATCH, "seeds": seeds,
            "train_windows": len(train), "test_windows": len(test), "out": str(out),
            "source": "not a git checkout" if head is None else f"commit {head}"
            + (" with uncommitted changes in pipedream_fast/" if dirty else "")}
    data = {seed: make_data(train, test, steps, CHUNKS * MICROBATCH, seed)
            for seed in range(seeds)}
    held = data[0][1]
    total = sum(len(g) for by in grids.values() for g in by.values()) \
        + len(grids) * (seeds - 1) * len(METHODS)
    harness.say(f"{total} runs of {steps} steps ({CHUNKS} x {MICROBATCH} windows each); "
                f"held-out: {sum(len(x) for x, _ in held)} test windows")
    began = time.perf_counter()
    done = 0
    grid_runs: dict[str, Any] = {}
    repeats: dict[str, Any] = {}

    def one(opt: str, lr: float, label: str, schedule: str, staleness: str | None,
            seed: int) -> dict[str, Any]:
        nonlocal done
        r = run(schedule, staleness, opt, lr, data[seed][0], held, seed)
        done += 1
        harness.say(f"[{done}/{total} {(time.perf_counter() - began) / 60:4.1f} min] {opt} "
                    f"lr={lr:g} seed {seed} {label:19s} final {fmt(r['final'])} held-out "
                    f"{fmt(r['held_out'])} wall {r['wall_s']:.1f} s"
                    + (f"  ({r['error']})" if r["error"] else ""))
        return r

    for opt in grids:
        grid_runs[opt] = {label: {} for label, _, _ in METHODS}
        for lr in sorted({g for grid in grids[opt].values() for g in grid}):
            for label, schedule, staleness in METHODS:
                if lr in grids[opt][label]:
                    grid_runs[opt][label][str(lr)] = one(opt, lr, label, schedule, staleness, 0)
        repeats[opt] = {label: [] for label, _, _ in METHODS}
        for seed in range(1, seeds):
            for label, schedule, staleness in METHODS:
                tuned = tuned_lr(grids[opt][label], grid_runs[opt][label])
                repeats[opt][label].append(one(opt, tuned, label, schedule, staleness, seed))
    meta["total_s"] = time.perf_counter() - began
    summary = summarise(grid_runs, repeats, grids)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(meta, summary, grid_runs, grids, out))
    plot(steps, seeds, summary, out.with_suffix(".png"))
    keep = ("tuned_lr", "fixed_lr", "edge", "finals", "final", "held_out", "wall_s", "vs_pd",
            "held_vs_pd", "diverged_seeds")
    harness.write_json(out.with_suffix(".json"), {
        "meta": meta, "grids": grids, "grid_runs": grid_runs, "repeats": repeats,
        "summary": {o: {label: {**{k: r[k] for k in keep},
                                "paired": [fmt_rel(d) for d in r["paired"]],
                                "verdict": judge(r), "fixed_final": r["fixed"]["final"],
                                "fixed_held_out": r["fixed"]["held_out"]}
                        for label, r in rows.items()} for o, rows in summary.items()}})
    harness.say(f"wrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.json')}")
    for opt, rows in summary.items():
        harness.say(f"\n{OPTIMIZER_NAMES[opt]}:\n" + "\n".join(verdict(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
