"""`python -m research.study`: PipeDream against LocalSGD in simulated time (the theory
paper's comparison; the method is in `research.study`, the results in STUDY.md). Run from the
repository root.

    python -m research.study --objective quadratic
    python -m research.study --objective all --stages 2,4,8 --local-steps 1,4,16 \\
        --json study.json --plot-dir bench/results/study --out study.md
    python -m research.study --objective quadratic --stages 2 --quick --json out.json

PipeDream's staleness corrections (pd+predict, pd+nesterov, pd+lr-scale) run next to it
unless --staleness none. Prints one line per run and the tables; --json writes every curve
and figure, --out the tables as Markdown, --plot-dir one PNG per objective (loss against
simulated time) and, for the corrections, <objective>-staleness.png (loss against simulated
time) and <objective>-staleness-gap.png (the gap to sync at equal updates).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

PROG = "python -m research.study"
OBJECTIVE_CHOICES = ("quadratic", "logistic", "lm", "all")


class UsageError(Exception):
    """Bad command-line input that argparse cannot catch; printed without a traceback."""


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers such as 2,4,8; got "
                         f"{text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{what} must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objective", choices=OBJECTIVE_CHOICES, default="all",
                   help="quadratic, logistic (breast_cancer), lm (charlm on the text corpus, "
                        "real runtime) or all (default)")
    p.add_argument("--stages", default="2,4,8",
                   help="pipeline stages S, comma-separated (default 2,4,8; the LM takes "
                        "those that divide its 4 blocks)")
    p.add_argument("--local-steps", default="1,4,16",
                   help="LocalSGD's H values (default 1,4,16)")
    p.add_argument("--gap-stages",
                   help="the S values of the gamma^2 S^4 check, comma-separated (default "
                        "2,3,4,6,8; --quick 2,3)")
    p.add_argument("--staleness", default="predict,nesterov,lr-scale",
                   help="PipeDream's staleness corrections run next to it, comma-separated, "
                        "or none (default predict,nesterov,lr-scale)")
    p.add_argument("--budget", type=float, help="simulated time budget (default 4000; "
                                                "--quick 600)")
    p.add_argument("--lm-steps", type=int, help="LM microbatches per run (default 200)")
    p.add_argument("--quick", action="store_true",
                   help="a small smoke run: short budget, 3 step sizes, small gap check")
    p.add_argument("--json", help="write all results (curves included) as JSON here")
    p.add_argument("--out", help="write the tables as Markdown here")
    p.add_argument("--plot-dir", help="write one loss-vs-simulated-time PNG per objective here")
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from research import study

    stages = _ints(args.stages, "--stages")
    local_steps = _ints(args.local_steps, "--local-steps")
    settings = (study.Settings.quick(stages, local_steps) if args.quick
                else study.Settings(stages=stages, local_steps=local_steps))
    if args.gap_stages is not None:
        settings.gap_stages = _ints(args.gap_stages, "--gap-stages")
    settings.corrections = _corrections(args.staleness)
    if args.budget is not None:
        if args.budget <= 0:
            raise UsageError(f"--budget must be > 0, got {args.budget}")
        settings.budget = args.budget
    if args.lm_steps is not None:
        if args.lm_steps < 16:
            raise UsageError(f"--lm-steps must be >= 16, got {args.lm_steps}")
        settings.lm_steps = args.lm_steps
    lm_stages = tuple(s for s in stages if 4 % s == 0)
    if args.objective in ("lm", "all"):
        if not lm_stages:
            raise UsageError(f"the LM has 4 blocks: --stages must include 1, 2 or 4 for "
                             f"--objective lm, got {args.stages}")
        settings.lm_stages = lm_stages if not args.quick else lm_stages[:1]
    objectives = (["quadratic", "logistic", "lm"] if args.objective == "all"
                  else [args.objective])
    console = Console(file=sys.stderr, highlight=False)
    results = study.run_study(objectives, settings, progress=console.print)
    command = f"{PROG} " + " ".join(_argv(args))
    text = study.markdown(results, command)
    if args.plot_dir:
        results["plots"] = study.plot(results, args.plot_dir)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _corrections(text: str) -> tuple[str, ...]:
    from research.study.settings import CORRECTIONS

    if text == "none":
        return ()
    values = tuple(v for v in text.split(",") if v)
    bad = [v for v in values if v not in CORRECTIONS]
    if bad or not values:
        raise UsageError(f"--staleness takes {', '.join(CORRECTIONS)} (comma-separated) or "
                         f"none, got {text!r}")
    return values


def _argv(args: argparse.Namespace) -> list[str]:
    """The options of this run, as a command line (for the report)."""
    out = [f"--objective {args.objective}", f"--stages {args.stages}",
           f"--local-steps {args.local_steps}"]
    if args.gap_stages is not None:
        out.append(f"--gap-stages {args.gap_stages}")
    if args.staleness != "predict,nesterov,lr-scale":
        out.append(f"--staleness {args.staleness}")
    if args.budget is not None:
        out.append(f"--budget {args.budget:g}")
    if args.lm_steps is not None:
        out.append(f"--lm-steps {args.lm_steps}")
    if args.quick:
        out.append("--quick")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (UsageError, ValueError, FileNotFoundError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
