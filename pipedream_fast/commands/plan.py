"""`pipedream-fast plan`: choose stages, replicas and ranks for a profile on a topology.

    pipedream-fast plan --profile profile.json --topology 8x1e9 --schedule 1f1b --out plan.json
    pipedream-fast plan --profile profile.json --topology 4x12.5e9,4x1.25e9 --no-straight
    pipedream-fast plan --profile profile.json --topology 8x1e9 --evaluate plan.json

Prints a table of the stages (blocks, replicas, ranks, predicted times, memory) followed by
the bottleneck, the data-parallel time and the speedup over data parallelism. As in `train`,
every stage gets one rank unless --no-straight lets the planner replicate stages (PipeDream's
hierarchical plans, replicas across servers).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipedream_fast.cli import UsageError
from pipedream_fast.commands import DEFAULT_BANDWIDTH, add_straight
from pipedream_fast.formats import Plan, Profile
from pipedream_fast.options import byte_count
from pipedream_fast.planner import STRATEGIES, evaluate_plan
from pipedream_fast.planner.choose import choose_schedule, predict, prediction_text, plan_for
from pipedream_fast.planner.costs import RECOMPUTE
from pipedream_fast.schedules import SCHEDULE_NAMES, kind
from pipedream_fast.topology import Topology


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan", help="split a profiled model into pipeline stages with replicas",
        description="Run PipeDream's dynamic program (or a baseline) on a profile and a "
                    "topology and write the plan JSON.")
    parser.add_argument("--profile", required=True, help="profile JSON from `pipedream-fast profile`")
    parser.add_argument("--topology", required=True, metavar="COUNTxBANDWIDTH[,...]",
                        help="levels innermost first, e.g. 4x12.5e9,4x1.25e9 = servers of 4 "
                             "workers at 12.5 GB/s, 4 servers joined at 1.25 GB/s")
    parser.add_argument("--workers", type=int, default=None,
                        help="expected worker count; an error unless the topology multiplies to it")
    parser.add_argument("--memory-per-worker", type=byte_count, default=None, metavar="BYTES",
                        help="per-worker memory; plans that do not fit are excluded")
    parser.add_argument("--recompute", choices=RECOMPUTE, default="auto",
                        help="auto (default): a stage recomputes its activations in the backward "
                             "(one more forward) only where keeping them does not fit "
                             "--memory-per-worker; none: never; all: every stage")
    add_straight(parser)  # train's flag: plan a profile as `train` would plan it
    # Every schedule: each is planned as `train` plans it (`plan_for`: its memory rules, or
    # those of the schedule it derives from, and the planning it needs, such as 2 stages per
    # rank for interleaved-1f1b), and the plan names it.
    parser.add_argument("--schedule", choices=SCHEDULE_NAMES + ("auto",), default="pipedream",
                        help="decides weight versions, in-flight microbatches and the planning "
                             "it needs (default pipedream); auto: plan every trainable schedule "
                             "and keep the one the simulator predicts fastest within the "
                             "memory limit")
    parser.add_argument("--strategy", choices=STRATEGIES, default=None,
                        help="dp: PipeDream's dynamic program (default; data-parallel for "
                             "--schedule data-parallel); data-parallel; or the baselines "
                             "uniform, params (balance parameters), time (balance time)")
    parser.add_argument("--chunks", type=int, default=None,
                        help="microbatches per step, all of which GPipe keeps in flight "
                             "(default: the worker count)")
    parser.add_argument("--stages-per-rank", type=int, default=None, metavar="V",
                        help="plan workers x V stages balanced by time, stage k on rank k mod "
                             "workers (default: the schedule's, 2 for interleaved-1f1b, zb-v "
                             "and looped-bfs, else 1)")
    parser.add_argument("--evaluate", metavar="PLAN", default=None,
                        help="instead of planning, re-cost this existing plan on the profile")
    parser.add_argument("--quiet", action="store_true", help="do not print the table")
    parser.add_argument("--out", default=None, help="where to write the plan JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    topology = Topology.parse(args.topology, args.memory_per_worker)
    if args.workers is not None and args.workers != topology.workers:
        counts = " x ".join(str(level.count) for level in topology.levels)
        raise UsageError(f"--topology {args.topology} has {counts} = {topology.workers} workers "
                         f"but --workers is {args.workers}; make the level counts multiply to it")
    if args.chunks is not None and args.chunks < 1:
        raise UsageError(f"--chunks must be >= 1, got {args.chunks}")
    if args.stages_per_rank is not None and args.stages_per_rank < 1:
        raise UsageError(f"--stages-per-rank must be >= 1, got {args.stages_per_rank}")
    profile = Profile.load(args.profile)
    if args.evaluate:
        plan = evaluate_plan(Plan.load(args.evaluate), profile, topology, args.chunks)
    elif args.schedule == "auto":
        plan = choose_schedule(profile, topology, straight=args.straight,
                               recompute=args.recompute)
    else:
        plan = plan_for(args.schedule, profile, topology, straight=args.straight,
                        recompute=args.recompute, **_planning(args))
        plan.schedule = args.schedule  # not the schedule it was planned as (zb-h1: 1f1b)
    if args.out:
        plan.save(args.out)
    if not args.quiet:
        print_plan(plan, profile)
        # the figure `simulate` and `train` give for this plan (`predict`)
        print(prediction_text(predict(profile, plan, plan.schedule, chunks=args.chunks,
                                      bandwidth=DEFAULT_BANDWIDTH), plan.schedule))
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _planning(args: argparse.Namespace) -> dict[str, Any]:
    """The `make_plan` options given on the command line, over those the schedule needs; one
    that contradicts what the schedule is (data-parallel's strategy) is refused."""
    given = {name: value for name, value in (("strategy", args.strategy),
                                             ("chunks", args.chunks),
                                             ("stages_per_rank", args.stages_per_rank))
             if value is not None}
    needed = kind(args.schedule).planning.get("strategy")
    if needed is not None and given.get("strategy", needed) != needed:
        raise UsageError(f"--schedule {args.schedule} is planned with --strategy {needed}, "
                         f"not {given['strategy']}; drop --strategy, or plan another schedule "
                         f"with it")
    return given


def _rank_ranges(ranks: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 8, 9) -> '0-3,8-9'."""
    parts: list[str] = []
    run_start = prev = ranks[0]
    for rank in list(ranks[1:]) + [None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(str(run_start) if run_start == prev else f"{run_start}-{prev}")
        if rank is not None:
            run_start = prev = rank
    return ",".join(parts)


def _block_names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_plan(plan: Plan, profile: Profile) -> None:
    """A readable table of the plan's stages and its headline figures."""
    from rich.console import Console
    from rich.table import Table

    topology = plan.extra.get("topology", {})
    levels = ", ".join(f"{level['workers']} x {level['bandwidth'] / 1e9:g} GB/s"
                       for level in topology.get("levels", []))
    table = Table(title=f"{plan.extra.get('strategy', 'plan')} plan for {plan.model} "
                        f"(batch {plan.batch_size}) on {levels or plan.workers} - "
                        f"schedule {plan.schedule}")
    for column in ("stage", "blocks", "names", "replicas", "ranks", "compute ms", "predicted ms",
                   "comm out ms", "versions", "recompute", "memory/worker"):
        table.add_column(column, justify="left" if column in ("names", "ranks") else "right")
    names = [b.name for b in profile.blocks]
    for index, stage in enumerate(plan.stages):
        extra = stage.extra
        comm = extra.get("comm_out_ms")
        table.add_row(
            str(index),
            str(stage.start) if stage.stop == stage.start + 1 else f"{stage.start}-{stage.stop - 1}",
            _block_names(names[stage.start:stage.stop]),
            str(stage.replicas), _rank_ranges(stage.ranks),
            f"{extra['compute_ms']:.2f}" if "compute_ms" in extra else "",
            f"{stage.predicted_ms:.2f}", "" if comm is None else f"{comm:.2f}",
            str(extra.get("weight_versions", "")), "yes" if extra.get("recompute") else "",
            _human(extra["memory_bytes"]) if "memory_bytes" in extra else "")
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 130)
    console.print(table)

    where = plan.extra.get("bottleneck", {})
    if where.get("kind") == "cut":
        at = f"the cut after stage {where['after_stage']}"
    elif where.get("kind") == "stage":
        at = f"stage {where['stage']}"
    else:
        at = "?"
    idle = plan.extra.get("idle_workers", 0)
    console.print(f"bottleneck: {plan.bottleneck_ms:.2f} ms per minibatch ({at}); "
                  f"data parallel: {plan.data_parallel_ms:.2f} ms; "
                  f"speedup vs data parallel: {plan.speedup_vs_data_parallel:.2f}x")
    choice = plan.extra.get("schedule_choice")
    if choice:
        table = Table(title="schedules compared (simulated, microbatches of the profiled size)")
        for column in ("schedule", "samples/s", "why"):
            table.add_column(column, justify="right" if column == "samples/s" else "left")
        for row in choice:
            rate = row["samples_per_s"]
            table.add_row(row["schedule"], "" if rate is None else f"{rate:.1f}", row["why"])
        console.print(table)
    console.print(f"workers used: {plan.workers}" + (f" ({idle} idle)" if idle else "")
                  + f"; cost model: {plan.extra.get('cost_model', '?')}", highlight=False)
