"""The benchmark suite in one command: every comparison of the project's claims, one after the
other on the same machine, then the plots and docs/results.md's results table from what they wrote.

    python bench/run_all.py                  # about 30 minutes on 2 cores
    python bench/run_all.py --only vs_ddp,sim_accuracy
    python bench/run_all.py --smoke --results /tmp/smoke   # the smallest settings: does it run?

Each benchmark runs as its own process with the settings below and writes its markdown and
JSON into the results folder (bench/results by default); one that fails or cannot run here
(the emulated cluster needs root and network namespaces) is reported and the suite goes on.
Then `bench/report.py` draws the plots and rewrites the table between the markers in
docs/results.md (only for the default results folder). Run it on a quiet machine: these are
throughput measurements on shared cores, and another process on them shows in every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DEFAULT_RESULTS = BENCH / "results"


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    args: tuple[str, ...]        # the suite's settings
    smoke: tuple[str, ...]       # the smallest that still runs every path
    minutes: float               # expected on 2 cores, with the suite's settings
    claim: str


SUITE = (
    Benchmark("overhead", "overhead.py", ("--steps", "200", "--repeat", "3"),
              ("--steps", "10", "--repeat", "1"), 1.0,
              "executor cost per action against plain isend/irecv"),
    Benchmark("memory", "memory.py", ("--models", "cnn,charlm,bert", "--ranks", "2,4",
                                      "--cap-rounds", "3"),
              ("--models", "cnn", "--ranks", "2", "--cap-rounds", "1"), 7.0,
              "every rank's predicted peak memory within 10% of the measured one; a plan "
              "under a memory cap stays under it"),
    Benchmark("sim_accuracy", "sim_accuracy.py", ("--steps", "20"),
              ("--steps", "6", "--repeats", "1", "--only", "pipedream,data-parallel"), 5.0,
              "simulator within 10% of the runtime for every trainable schedule"),
    Benchmark("adaptive", "adaptive.py", (), ("--models", "convs", "--steps", "convs=30",
                                              "--repeats", "1", "--retries", "0"), 11.0,
              "adapt=True with one rank slowed 1.5x part-way recovers at least 80% of the gap "
              "to the best static plan"),
    Benchmark("vs_pipelining", "vs_pipelining.py", ("--steps", "6", "--repeats", "2"),
              ("--quick", "--steps", "4", "--repeats", "1"), 3.0,
              "1f1b at least 1.2x torch.distributed.pipelining's Schedule1F1B"),
    # Set-up dominates (our torch.export capture of a model: 2-3 s a run on a quiet
    # machine, 5-20 s on a busy one): 1.2 min quiet, up to 6 busy.
    Benchmark("zoo_vs_pipelining", "zoo_vs_pipelining.py", (),
              ("--smoke", "--models", "nanogpt,gpt2"), 2.5,
              "the zoo's transformers unedited: which library splits and trains them, "
              "samples/s, losses against the loop, tied-weight drift"),
    Benchmark("knobs", "knobs.py", ("--quick",), ("--quick", "--steps", "4"), 3.5,
              "each knob of the core, swept on model A"),
    Benchmark("vs_ddp", "vs_ddp.py", ("--scale", "0.5", "--retries", "0"),
              ("--models", "convs", "--rates", "1gbit", "--scale", "0.1", "--retries", "0"),
              6.5, "pipedream against DDP at 10/1/0.1 Gbit/s; the balanced-pipeline limit"),
    # Full caps: DDP at 100 Mbit/s reaches the target for real instead of being projected.
    Benchmark("time_to_accuracy", "time_to_accuracy.py", (),
              ("--quick", "--cap-s", "20"), 7.0,
              "time to the same test accuracy, pipedream against DDP on slow links"),
    Benchmark("staleness_lm", "staleness_lm.py", (), ("--quick",), 14.0,
              "staleness corrections (predict, nesterov, lr-scale) on the char LM at 4 stages: "
              "loss against samples, pipedream against 1f1b, SGD+momentum and Adam"),
)


@dataclass
class Outcome:
    name: str
    status: str   # "ok", "failed (rc N)", "skipped: why"
    seconds: float


def run_one(bench: Benchmark, results: Path, smoke: bool) -> Outcome:
    out = results / f"{bench.name}.md"
    # Relative to the checkout where possible: each report quotes its command.
    shown = os.path.relpath(out, ROOT) if out.resolve().is_relative_to(ROOT) else str(out)
    argv = [sys.executable, os.path.relpath(BENCH / bench.script, ROOT),
            *(bench.smoke if smoke else bench.args), "--out", shown]
    print(f"\n==== {bench.name} ({time.strftime('%H:%M:%S')}, about {bench.minutes:g} min): "
          f"{bench.claim}\n$ {' '.join(argv[1:])}", flush=True)
    began = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The benchmarks import each other (netcluster) and the package from the checkout.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), str(ROOT),
                                                      env.get("PYTHONPATH")]))
    rc = subprocess.run(argv, cwd=ROOT, env=env).returncode
    seconds = time.monotonic() - began
    if rc == 0:
        status = "ok"
    elif rc == 2 and not out.exists():
        status = "skipped: it cannot run here (see its message above)"
    else:
        status = f"failed (rc {rc})"
    print(f"==== {bench.name}: {status} in {seconds / 60:.1f} min", flush=True)
    return Outcome(bench.name, status, seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [b.name for b in SUITE]
    parser.add_argument("--only", help=f"comma-separated benchmarks among {', '.join(names)}")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="folder for the markdown, JSON and plots (default bench/results)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest settings of each: checks the suite runs, measures "
                             "nothing worth keeping (use with --results elsewhere)")
    parser.add_argument("--no-report", action="store_true",
                        help="skip the plots and the results table")
    args = parser.parse_args()
    chosen = list(SUITE)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown or not wanted:
            parser.error(f"--only: unknown benchmark(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose among {', '.join(names)}")
        chosen = [b for b in SUITE if b.name in wanted]
    if args.smoke and args.results.resolve() == DEFAULT_RESULTS:
        parser.error("--smoke measures nothing worth keeping: give --results another folder")
    args.results.mkdir(parents=True, exist_ok=True)
    print(f"{len(chosen)} benchmarks, about {sum(b.minutes for b in chosen):.0f} min with the "
          f"suite's settings; results into {args.results}", flush=True)
    began = time.monotonic()
    outcomes = [run_one(b, args.results, args.smoke) for b in chosen]
    total = time.monotonic() - began
    (args.results / "run_all.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d"), "smoke": args.smoke, "total_s": total,
         "benchmarks": [o.__dict__ for o in outcomes]}, indent=1) + "\n")
    report_rc = 0
    if not args.no_report:
        command = [sys.executable, str(BENCH / "report.py"), "--results", str(args.results)]
        if args.results.resolve() != DEFAULT_RESULTS:
            command.append("--no-readme")
        report_rc = subprocess.run(command, cwd=ROOT).returncode
    print(f"\nsuite: {total / 60:.1f} min")
    for o in outcomes:
        print(f"  {o.name:18s} {o.status:28s} {o.seconds / 60:5.1f} min")
    failed = [o for o in outcomes if o.status.startswith("failed")]
    return 1 if failed or report_rc else 0


if __name__ == "__main__":
    sys.exit(main())
