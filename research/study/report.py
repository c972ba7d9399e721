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
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], directory: str) -> list[str]:
    """One PNG per objective: loss against simulated time, one panel per S, tuned gamma
    (solid) and fixed gamma (dashed). Returns the paths written."""
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
            runs = res["runs"][s]
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
    return paths
