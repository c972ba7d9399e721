"""PipeDream's steady-state weight delay against the number of stages S (unit costs), against
the paper's S^2 - S/2 + O(1) and `pipedream_fast.staleness`'s closed form: a table and a plot.

    python bench/delay_law.py [--max-s 64] [--out bench/results/delay_law.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipedream_fast.schedules import make_schedule
from pipedream_fast.sim import UnitCosts, simulate
from pipedream_fast.staleness import pipedream_unit_law

import harness  # noqa: E402 - a sibling


def measure(max_s: int) -> list[dict[str, float]]:
    rows = []
    for s in range(2, max_s + 1):
        d = simulate(make_schedule("pipedream", s, 2 * s + 2), UnitCosts()).delays
        assert d.max_delay is not None and d.mean_delay is not None
        law_max, law_mean = pipedream_unit_law(s)
        rows.append({"S": s, "max": d.max_delay, "mean": d.mean_delay,
                     "paper": s * s - s / 2, "law_max": law_max, "law_mean": float(law_mean)})
    return rows


def table(rows: list[dict[str, float]], seconds: float, exact: bool) -> str:
    return "\n".join([
        "# PipeDream's weight delay against the number of stages (unit costs)", "",
        f"`python bench/delay_law.py --max-s {int(rows[-1]['S'])}` ({seconds:.0f} s of CPU). "
        "Schedule `pipedream` (1F1B with weight stashing, one stage per rank), forward = "
        "backward = 1, updates and transfers 0, N = 2S + 2 microbatches; delays over the "
        "steady state S <= m < N - S as `staleness.weight_delays` counts them (updates in one "
        "global order, seen by every forward that starts at or after their end).", "",
        "Closed form (derived in `pipedream_fast/staleness.py`): max = S^2 - ceil(S/2), i.e. "
        "the paper's S^2 - S/2 for even S and S^2 - S/2 - 1/2 for odd S; mean over the S x S "
        "(update stage, read stage) pairs = S^2/2 + S/4 - 1/2 - (S mod 2)/(4S). "
        + ("Every row below matches both exactly."
           if exact else "**Some rows do not match the closed form.**"), "",
        *harness.markdown_table(
            ["S", "max delay", "mean delay", "S^2 - S/2", "max - (S^2 - S/2)"],
            [(int(r["S"]), int(r["max"]), f"{r['mean']:.4f}", f"{r['paper']:g}",
              f"{r['max'] - r['paper']:+g}") for r in rows], left=0)]) + "\n"


def plot(rows: list[dict[str, float]], path: Path) -> None:
    s = [r["S"] for r in rows]
    with harness.figure(path, 1, 2, (11, 4), dpi=100) as (fig, axes):
        left, right = axes[0]
        left.plot(s, [r["max"] for r in rows], "o", markersize=3, label="max delay (simulated)")
        left.plot(s, [r["mean"] for r in rows], "s", markersize=3, label="mean delay (simulated)")
        left.plot(s, [r["paper"] for r in rows], "-", linewidth=1, label="S² − S/2 (paper)")
        left.plot(s, [r["law_mean"] for r in rows], "--", linewidth=1,
                  label="S²/2 + S/4 − 1/2 − (S mod 2)/(4S)")
        harness.axes_text(left, None, "stages S", "steady-state delay (updates)",
                          {"fontsize": 8})
        right.plot(s, [r["max"] - r["paper"] for r in rows], "o", markersize=3)
        right.set_ylim(-1, 0.5)
        harness.axes_text(right, None, "stages S", "max delay − (S² − S/2)")
        fig.suptitle("PipeDream, unit costs: steady-state weight delay against depth")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-s", type=int, default=64)
    parser.add_argument("--out", default="bench/results/delay_law.md")
    args = parser.parse_args()
    if args.max_s < 2:
        parser.error("--max-s must be >= 2")
    began = time.process_time()
    rows = measure(args.max_s)
    seconds = time.process_time() - began
    bad = [int(r["S"]) for r in rows
           if r["max"] != r["law_max"] or abs(r["mean"] - r["law_mean"]) > 1e-9]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table(rows, seconds, not bad))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} ({seconds:.1f} s of CPU)"
          + (f"; S = {bad} depart from the closed form" if bad else "; all match the closed form"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
