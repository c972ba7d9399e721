"""PipeDream's steady-state weight delay against the number of stages S (unit costs), against
the paper's S^2 - S/2 + O(1) and `pipedream_fast.staleness`'s closed form, as a table.

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
    harness.write_results(out, "PipeDream's weight delay against stages S (unit costs)", [
        f"Simulated in {seconds:.1f} s of CPU. Schedule `pipedream` (1F1B with weight stashing, "
        "one stage per rank), forward = backward = 1, updates and transfers 0, N = 2S + 2 "
        "microbatches; delays over the steady state S <= m < N - S as `staleness.weight_delays` "
        "counts them (updates in one global order, seen by every forward that starts at or after "
        "their end).", "",
        "Closed form (derived in `pipedream_fast/staleness.py`): max = S^2 - ceil(S/2), i.e. "
        "the paper's S^2 - S/2 for even S and S^2 - S/2 - 1/2 for odd S; mean over the S x S "
        "(update stage, read stage) pairs = S^2/2 + S/4 - 1/2 - (S mod 2)/(4S). "
        + ("**Some rows do not match the closed form.**" if bad else
           "Every row below matches both exactly.")],
        ["S", "max delay", "mean delay", "S^2 - S/2", "max - (S^2 - S/2)"],
        [(int(r["S"]), int(r["max"]), f"{r['mean']:.4f}", f"{r['paper']:g}",
          f"{r['max'] - r['paper']:+g}") for r in rows])
    print(f"wrote {out} ({seconds:.1f} s of CPU)"
          + (f"; S = {bad} depart from the closed form" if bad else "; all match the closed form"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
