"""The benchmark suite in one command, then `bench/report.py` (plots, docs/results.md's table,
rewritten only for the default results folder). Run it on a quiet machine (about 30 minutes on
2 cores). Each benchmark runs in its own process; one that fails or cannot run here (rc 2, no
output) is reported and the suite goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DEFAULT_RESULTS = BENCH / "results"

# name (results in <name>.md): (the suite's settings, the smallest that still runs every path,
# minutes on 2 cores with the suite's settings[, bench/<script>.py when not <name>.py])
SUITE: dict[str, tuple] = {
    "overhead": ("--steps 200 --repeat 3", "--steps 10 --repeat 1", 1.0),
    "memory": ("--models cnn,charlm,bert --ranks 2,4 --cap-rounds 3",
               "--models cnn --ranks 2 --cap-rounds 1", 7.0),
    "sim_accuracy": ("--steps 20", "--steps 6 --repeats 1 --only pipedream,data-parallel", 5.0),
    "adaptive": ("", "--models convs --steps convs=30 --repeats 1 --retries 0", 11.0),
    "vs_pipelining": ("--steps 6 --repeats 2", "--quick --steps 4 --repeats 1", 3.0),
    # Set-up dominates (torch.export of each model: 2-3 s quiet, 5-20 s on a busy machine).
    "zoo_vs_pipelining": ("--set zoo", "--set zoo --quick --models nanogpt,gpt2", 2.5,
                          "vs_pipelining"),
    "transformer_pair": ("--set transformer", "--set transformer --quick", 3.0, "vs_pipelining"),
    "knobs": ("--quick", "--quick --steps 4", 3.5),
    "vs_ddp": ("--scale 0.5 --retries 0",
               "--models convs --rates 1gbit --scale 0.1 --retries 0", 6.5),
    # Full caps: DDP at 100 Mbit/s reaches the target for real instead of being projected.
    "time_to_accuracy": ("", "--quick --cap-s 20", 7.0),
    "staleness_lm": ("", "--quick", 14.0),
}


def run_one(name: str, results: Path, smoke: bool) -> dict[str, object]:
    args, smallest, minutes, *script = SUITE[name]
    out = results / f"{name}.md"
    shown = os.path.relpath(out, ROOT) if out.resolve().is_relative_to(ROOT) else str(out)
    argv = [sys.executable, f"bench/{(script or [name])[0]}.py",
            *(smallest if smoke else args).split(), "--out", shown]
    print(f"\n==== {name} ({time.strftime('%H:%M:%S')}, about {minutes:g} min)\n"
          f"$ {' '.join(argv[1:])}", flush=True)
    began = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(BENCH), str(ROOT), os.environ.get("PYTHONPATH")]))}
    rc = subprocess.run(argv, cwd=ROOT, env=env).returncode
    seconds = time.monotonic() - began
    status = ("ok" if rc == 0 else "skipped: it cannot run here (see its message above)"
              if rc == 2 and not out.exists() else f"failed (rc {rc})")
    print(f"==== {name}: {status} in {seconds / 60:.1f} min", flush=True)
    return {"name": name, "status": status, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated benchmarks among {', '.join(SUITE)}")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="folder for the markdown, JSON and plots (default bench/results)")
    parser.add_argument("--smoke", action="store_true", help="the smallest settings of each: "
                        "does the suite run? (measures nothing: --results elsewhere)")
    args = parser.parse_args()
    wanted = {n.strip() for n in (args.only or ",".join(SUITE)).split(",") if n.strip()}
    if not wanted or wanted - set(SUITE):
        unknown = ", ".join(sorted(wanted - set(SUITE))) or "(none given)"
        parser.error(f"--only: unknown benchmark(s) {unknown}; choose among {', '.join(SUITE)}")
    chosen = [n for n in SUITE if n in wanted]
    default = args.results.resolve() == DEFAULT_RESULTS
    if args.smoke and default:
        parser.error("--smoke measures nothing worth keeping: give --results another folder")
    args.results.mkdir(parents=True, exist_ok=True)
    print(f"{len(chosen)} benchmarks, about {sum(SUITE[n][2] for n in chosen):.0f} min with the "
          f"suite's settings; results into {args.results}", flush=True)
    began = time.monotonic()
    outcomes = [run_one(n, args.results, args.smoke) for n in chosen]
    total = time.monotonic() - began
    (args.results / "run_all.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d"), "smoke": args.smoke, "total_s": total,
         "benchmarks": outcomes}, indent=1) + "\n")
    report = [sys.executable, str(BENCH / "report.py"), "--results", str(args.results)]
    report_rc = subprocess.run(report + ([] if default else ["--no-readme"]), cwd=ROOT).returncode
    print(f"\nsuite: {total / 60:.1f} min")
    for o in outcomes:
        print(f"  {o['name']:18s} {o['status']:28s} {o['seconds'] / 60:5.1f} min")
    return 1 if report_rc or any(str(o["status"]).startswith("failed") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
