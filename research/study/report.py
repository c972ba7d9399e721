"""The study's report: its results as Markdown tables (`--out`) and loss-vs-time plots
(`--plot-dir`)."""

from __future__ import annotations

import math
from typing import Any

from research.study.lm import lm_final_at


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def markdown(results: dict[str, Any], command: str = "") -> str:
    """The results as Markdown tables (what `--out` writes)."""
    lines = ["# PipeDream against LocalSGD in simulated time: results", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    for name, res in results["objectives"].items():
        lines += [f"## {name}", ""]
        if name == "lm":
            lines += [f"{res['steps']} microbatches of {res['batch']} windows; LocalSGD "
                      f"trainable by the runtime: {res['localsgd_trainable']}.", "",
                      "| S | budget | PD tuned (gamma) | LocalSGD tuned (best H, gamma) | "
                      "sync tuned | PD fixed | LocalSGD fixed | winner tuned / fixed | "
                      "paper | agrees |", "|" + "---|" * 10]
            for r in res["table"]:
                lines.append(
                    f"| {r['stages']} | {fmt(r['budget'])} | {fmt(r['pipedream_tuned'])} "
                    f"({fmt(r['pipedream_gamma'])}) | {fmt(r.get('localsgd_tuned'))} "
                    f"({r.get('localsgd_best', '-')}, {fmt(r.get('localsgd_gamma'))}) | "
                    f"{fmt(r['sync_tuned'])} | {fmt(r['pipedream_fixed'])} | "
                    f"{fmt(r.get('localsgd_fixed'))} | {r['winner_tuned']} / "
                    f"{r.get('winner_fixed', '-')} | {r['paper']} | {r['agrees_tuned']} / "
                    f"{r['agrees_fixed']} |")
            edges = [f"S={r['stages']}: {', '.join(r['tuned_at_grid_edge'])}"
                     for r in res["table"] if r["tuned_at_grid_edge"]]
            if edges:
                lines += ["", "Tuned gamma at the edge of the grid: " + "; ".join(edges) + "."]
            lines += corrections_table(res["table"])
            lines.append("")
            continue
        lines += [f"Time budget {fmt(res['budget'])} unit-cost time units; gamma in units of "
                  f"1/L (L = {fmt(res['smoothness'])}).", "",
                  "| S | PD tuned (gamma) | LocalSGD tuned (best H, gamma) | sync tuned | "
                  "PD fixed | LocalSGD fixed (best H) | sync fixed | threshold | time to it "
                  "PD / LocalSGD | winner tuned / fixed | paper | agrees tuned / fixed |",
                  "|" + "---|" * 12]
        for r in res["table"]:
            lines.append(
                f"| {r['stages']} | {fmt(r['pipedream_tuned'])} ({fmt(r['pipedream_gamma'])})"
                f" | {fmt(r['localsgd_tuned'])} ({r['localsgd_best']}, "
                f"{fmt(r['localsgd_gamma'])}) | {fmt(r['sync_tuned'])} | "
                f"{fmt(r['pipedream_fixed'])} | {fmt(r['localsgd_fixed'])} "
                f"({r['localsgd_best_fixed']}) | {fmt(r['sync_fixed'])} | "
                f"{fmt(r['threshold'])} | {fmt(r['pipedream_time_to'])} / "
                f"{fmt(r['localsgd_time_to'])} | {r['winner_tuned']} / {r['winner_fixed']} | "
                f"{r['paper']} | {r['agrees_tuned']} / {r['agrees_fixed']} |")
        edges = [f"S={r['stages']}: {', '.join(r['tuned_at_grid_edge'])}" for r in res["table"]
                 if r["tuned_at_grid_edge"]]
        if edges:
            lines += ["", "Tuned gamma at the edge of the grid: " + "; ".join(edges) + "."]
        lines += corrections_table(res["table"])
        gap = res["gap_check"]
        lines += ["", f"gamma^2 S^4 check ({gap['updates']} updates, {gap['seeds']} seeds; "
                      f"{gap['definition']}):", "",
                  "| S | gamma | loss PD | loss sync | gap | gap / (gamma^2 S^4) |",
                  "|---|---|---|---|---|---|"]
        for r in gap["rows"]:
            lines.append(f"| {r['stages']} | {fmt(r['gamma'])} | {fmt(r['pipedream_loss'])} "
                         f"| {fmt(r['sync_loss'])} | {fmt(r['gap'])} | "
                         f"{fmt(r['gap_over_gamma2_s4'])} |")
        fit = gap["fit"]
        if fit:
            lines += ["", f"Fit log gap = c + a log gamma + b log S over {fit['points']} "
                          f"positive gaps: a = {fit['gamma_exponent']:.2f} (theory 2), "
                          f"b = {fit['stages_exponent']:.2f} (theory 4)."]
        lines += corrections_gap_table(gap)
        lines.append("")
    return "\n".join(lines)


def corrections_table(table: list[dict[str, Any]]) -> list[str]:
    """PD's staleness corrections next to PD, the best LocalSGD and sync (final losses at the
    tuned gamma, then at the fixed one), and the PD-vs-LocalSGD verdict with the best
    corrected PD in PD's place."""
    if not table or "corrected" not in table[0]:
        return []
    labels = list(table[0]["corrected"])
    lines = ["", "Staleness corrections (final loss, tuned gamma in brackets; the winner with "
                 "the best corrected PD in PD's place, 'pipedream' then meaning that corrected "
                 "PD):", "",
             "| S | gamma | PD | " + " | ".join(labels) + " | best LocalSGD | sync | winner "
             "PD / best corrected | verdict changed |", "|" + "---|" * (7 + len(labels))]
    for r in table:
        for which in ("tuned", "fixed"):
            def cell(loss: Any, gamma: Any, which: str = which) -> str:
                return fmt(loss) + (f" ({fmt(gamma)})" if which == "tuned" else "")
            best_lo = r.get("localsgd_best" if which == "tuned" else "localsgd_best_fixed")
            lo = fmt(r.get(f"localsgd_{which}")) + (f" ({best_lo})" if best_lo else "")
            best_c = r["corrected_best" if which == "tuned" else "corrected_best_fixed"]
            changed = r.get(f"verdict_changed_{which}")
            cells = [cell(r[f"pipedream_{which}"], r["pipedream_gamma"])]
            cells += [cell(c[which], c["gamma"]) for c in r["corrected"].values()]
            cells += [lo, fmt(r[f"sync_{which}"]),
                      f"{r.get(f'winner_{which}', '-')} / "
                      f"{r.get(f'winner_corrected_{which}', '-')} ({best_c})",
                      "-" if changed is None else "yes" if changed else "no"]
            lines.append(f"| {r['stages']} | {which} | " + " | ".join(cells) + " |")
    return lines


def corrections_gap_table(gap: dict[str, Any]) -> list[str]:
    """The gamma^2 S^4 check's gap for each corrected PD next to PD's, with the verdict of
    `research.study.rpd.closes`."""
    rows = gap["rows"]
    if not rows or "corrected" not in rows[0]:
        return []
    labels = list(rows[0]["corrected"])
    lines = ["", "The same gap for PipeDream's staleness corrections (loss_corrected - "
                 "loss_sync at equal updates, same microbatches and seeds; in brackets, "
                 "|gap_corrected| against |gap_PD|: closes = at most 10% of it left, "
                 "narrows = under 90%, no change = 90-110%, widens = more):", "",
             "| S | gamma | gap PD | " + " | ".join(f"gap pd+{c}" for c in labels) + " |",
             "|" + "---|" * (3 + len(labels))]
    for r in rows:
        cells = [f"{fmt(c['gap'])} ({c['verdict']})" for c in r["corrected"].values()]
        lines.append(f"| {r['stages']} | {fmt(r['gamma'])} | {fmt(r['gap'])} | "
                     + " | ".join(cells) + " |")
    return lines


def corrected(run: dict[str, Any]) -> bool:
    """Whether a run (a replayed one, or an LM one: gamma -> run) is a corrected PD."""
    if "staleness" in run:
        return bool(run["staleness"])
    return any(isinstance(r, dict) and r.get("staleness") for r in run.values())


def plot(results: dict[str, Any], directory: str) -> list[str]:
    """One PNG per objective: loss against simulated time, one panel per S, tuned gamma
    (solid) and fixed gamma (dashed), the corrected PDs left out (`plot_corrections` draws
    them); then `plot_corrections`' PNGs. Returns the paths written."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, res in results["objectives"].items():
        stages = list(res["runs"])
        fig, axes = plt.subplots(1, len(stages), figsize=(4.5 * len(stages), 3.6),
                                 squeeze=False)
        for ax, s in zip(axes[0], stages):
            runs = {k: v for k, v in res["runs"][s].items() if not corrected(v)}
            for i, (label, run) in enumerate(runs.items()):
                color = f"C{i}"
                if name == "lm":  # tuned (solid) and fixed (dashed) lr, up to the budget
                    budget = next(r["budget"] for r in res["table"] if str(r["stages"]) == s)
                    fixed = str(results["settings"]["lm_fixed_gamma"])
                    tuned = min(run, key=lambda g: lm_final_at(run[g], budget))
                    for g, style, which in ((tuned, "-", "tuned"), (fixed, "--", "fixed")):
                        c = run[g]["curve"]
                        ax.plot(c["times"], c["losses"], style, color=color,
                                label=f"{label} ({which} lr {g})")
                    ax.set_xlim(0, budget)
                    continue
                for which, style in (("tuned", "-"), ("fixed", "--")):
                    c = run[f"{which}_curve"]
                    ys = [math.nan if v is None else v for v in c["losses"]]
                    ax.plot(c["times"], ys, style, color=color,
                            label=f"{label} ({which} {run[f'{which}_gamma']:g}/L)")
            ax.set_yscale("log")
            ax.set_title(f"{name}, S = {s}")
            ax.set_xlabel("simulated time (unit costs)")
            ax.set_ylabel("training loss" if name == "lm" else "loss")
            ax.legend(fontsize=6)
        fig.tight_layout()
        path = os.path.join(directory, f"{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths + plot_corrections(results, directory)


def _lm_curve(run: dict[str, Any], budget: float, gamma: str | None) -> tuple[Any, str]:
    """An LM run's curve at `gamma` (None: its tuned one) and that gamma."""
    g = gamma if gamma is not None else min(run, key=lambda k: lm_final_at(run[k], budget))
    return run[g]["curve"], g


def plot_corrections(results: dict[str, Any], directory: str) -> list[str]:
    """Per objective with corrected PDs, `<objective>-staleness.png`: loss against simulated
    time, one column per S, tuned gamma (top row) and fixed gamma (bottom row), for PD, each
    corrected PD, the best LocalSGD and sync; and for the replayed objectives
    `<objective>-staleness-gap.png`: the gap to sync at equal updates against gamma, one
    panel per S, PD and each corrected PD (a run that diverged, or whose gap exceeds 1000,
    is left out). Returns the paths."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    styles = {"pipedream": ("k", "-"), "pd+predict": ("C0", "--"), "pd+nesterov": ("C2", "-."),
              "pd+lr-scale": ("C3", "-"), "localsgd": ("C1", "--"), "sync": ("C7", ":")}
    for name, res in results["objectives"].items():
        rows = {str(r["stages"]): r for r in res["table"] if "corrected" in r}
        if not rows:
            continue
        stages = [s for s in res["runs"] if s in rows]
        fig, axes = plt.subplots(2, len(stages), figsize=(4.6 * len(stages), 7.0),
                                 squeeze=False)
        for col, s in enumerate(stages):
            runs, row = res["runs"][s], rows[s]
            for line, which in enumerate(("tuned", "fixed")):
                ax = axes[line][col]
                best_lo = row.get("localsgd_best" if which == "tuned" else
                                  "localsgd_best_fixed", row.get("localsgd_best"))
                labels = ["pipedream", *row["corrected"], best_lo, "sync"]
                for label in [k for k in labels if k in runs]:
                    color, style = styles.get(label, styles["localsgd"])
                    if name == "lm":
                        fixed = str(results["settings"]["lm_fixed_gamma"])
                        c, g = _lm_curve(runs[label], row["budget"],
                                         None if which == "tuned" else fixed)
                        xs, ys, tag = c["times"], c["losses"], f"lr {g}"
                    else:
                        c = runs[label][f"{which}_curve"]
                        xs = c["times"]
                        ys = [math.nan if v is None else v for v in c["losses"]]
                        tag = f"{runs[label][f'{which}_gamma']:g}/L"
                    ax.plot(xs, ys, style, color=color, lw=1.2, label=f"{label} ({tag})")
                if name == "lm":
                    ax.set_xlim(0, row["budget"])
                else:  # the second half of the budget, where the methods separate
                    ax.set_xlim(res["budget"] * 0.25, res["budget"])
                    finals = [row["pipedream_" + which], row["sync_" + which],
                              row.get("localsgd_" + which)]
                    finals += [c[which] for c in row["corrected"].values()]
                    low = min(v for v in finals if v is not None)
                    high = max(v for v in finals if v is not None)
                    ax.set_ylim(low * 0.75, high * 1.6)
                ax.set_yscale("log")
                ax.set_title(f"{name}, S = {s}, {which} step size", fontsize=10)
                ax.set_xlabel("simulated time (unit costs)")
                ax.set_ylabel("training loss" if name == "lm" else "loss")
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(directory, f"{name}-staleness.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
        gap = res.get("gap_check")
        if not gap or not gap["rows"] or "corrected" not in gap["rows"][0]:
            continue
        gap_stages = sorted({r["stages"] for r in gap["rows"]})
        cols = min(3, len(gap_stages))
        grid = -(-len(gap_stages) // cols)
        fig, axes = plt.subplots(grid, cols, figsize=(4.6 * cols, 3.6 * grid), squeeze=False)
        for ax in list(axes.flat)[len(gap_stages):]:
            ax.set_visible(False)
        for ax, s in zip(axes.flat, gap_stages):
            rs = [r for r in gap["rows"] if r["stages"] == s]
            series = {"pipedream": [r["gap"] for r in rs]}
            for c in rs[0]["corrected"]:
                series[f"pd+{c}"] = [r["corrected"][c]["gap"] for r in rs]
            for label, gaps in series.items():
                # diverged (None), or blowing up within the K updates (|gap| > 1000): left out
                pts = [(r["gamma"], v) for r, v in zip(rs, gaps)
                       if v is not None and abs(v) <= 1e3]
                color, style = styles.get(label, ("C4", "-"))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o" + style, color=color,
                        lw=1.2, ms=3, label=label)
            ax.axhline(0.0, color="0.6", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("symlog", linthresh=1e-5)
            ax.set_title(f"{name}, S = {s}", fontsize=10)
            ax.set_xlabel("gamma (units of 1/L)")
            ax.set_ylabel("loss - loss_sync at equal updates")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(directory, f"{name}-staleness-gap.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
