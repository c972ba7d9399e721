"""`pipedream-fast simulate`: generate a schedule, validate it, run it in virtual time.

    pipedream-fast simulate --schedule pipedream --stages 4 --microbatches 16 --unit-cost
    pipedream-fast simulate --profile p.json --plan plan.json --microbatches 64 --json
    pipedream-fast simulate ... --trace run.json --timeline run.png --save-schedule ir.json

With --profile/--plan the stages, replicas and rank layout come from the plan (and the
schedule too, unless --schedule overrides it); --stages/--replicas may only repeat them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipedream_fast.cli import UsageError
from pipedream_fast.commands import DEFAULT_BANDWIDTH
from pipedream_fast.formats import Plan, Profile
from pipedream_fast.options import add_schedule_flags, schedule_values
from pipedream_fast.planner.choose import predict, prediction_size, prediction_text
from pipedream_fast.schedules import SCHEDULE_NAMES, make_schedule
from pipedream_fast.sim import CostModel, ProfileCosts, SimResult, UnitCosts, simulate


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate", help="run a schedule in virtual time: makespan, bubbles, weight delays",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # auto is offered as `plan` and `train` offer it, and refused with what to run instead:
    # choosing is planning (each schedule its own plan), which a simulation of one plan is not.
    p.add_argument("--schedule", choices=SCHEDULE_NAMES + ("auto",),
                   help="schedule to generate (default with --plan: the plan's); auto is "
                        "`plan --schedule auto`'s choice: simulate the plan it writes")
    p.add_argument("--stages", type=int, help="pipeline stages (taken from --plan if given)")
    p.add_argument("--microbatches", type=int,
                   help="microbatches in the whole run (N = steps x chunks); default with "
                        "--profile and --plan: those of the prediction `plan` and `train` "
                        "report (8 steps), else required")
    p.add_argument("--replicas", help="ranks per stage, e.g. 2,1,1 (default 1 each)")
    p.add_argument("--stages-per-rank", type=int,
                   help="v stages per rank, stage g on rank g mod (stages / v): interleaved-1f1b")
    p.add_argument("--chunks", type=int,
                   help="microbatches per step (one update each) for the schedules that step "
                        "per minibatch: gpipe/1f1b/interleaved-1f1b/zb-h1/data-parallel "
                        "(default all N) and 2bw (default: the number of workers)")
    add_schedule_flags(p)  # the options schedules declare (localsgd's --local-steps ...)
    costs = p.add_argument_group("costs (default --unit-cost)")
    costs.add_argument("--unit-cost", action="store_true",
                       help="forward 1, backward 1, communication 0")
    costs.add_argument("--forward-cost", type=float, help="time of one stage forward")
    costs.add_argument("--backward-cost", type=float, help="time of one stage backward")
    costs.add_argument("--comm-cost", type=float, help="time of one transfer or all-reduce")
    costs.add_argument("--profile", help="Profile JSON (with --plan): costs in ms")
    costs.add_argument("--plan", help="Plan JSON (with --profile): stages, replicas, ranks")
    costs.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH,
                       metavar="BYTES_PER_S",
                       help=f"between ranks when the plan has no topology (default "
                            f"{DEFAULT_BANDWIDTH / 1e9:g}e9)")
    costs.add_argument("--latency", type=float, default=0.0, help="ms per message (default 0)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead")
    out.add_argument("--trace", help="write a Chrome/Perfetto trace JSON here")
    out.add_argument("--timeline", help="write a pipeline diagram PNG here")
    out.add_argument("--save-schedule", help="write the schedule IR (JSON) here")
    p.set_defaults(func=run)


def _replicas(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise UsageError(f"--replicas must be comma-separated integers such as 2,1,1; "
                         f"got {text!r}") from None
    if min(values) < 1:
        raise UsageError(f"--replicas counts must be >= 1, got {text!r}")
    return values


def _costs(args: argparse.Namespace) -> tuple[CostModel, Plan | None]:
    custom = [args.forward_cost, args.backward_cost, args.comm_cost]
    if (args.profile is None) != (args.plan is None):
        raise UsageError("--profile and --plan go together")
    if args.profile is not None:
        if args.unit_cost or any(c is not None for c in custom):
            raise UsageError("choose one cost source: --unit-cost, --forward-cost/"
                             "--backward-cost/--comm-cost, or --profile with --plan")
        profile, plan = Profile.load(args.profile), Plan.load(args.plan)
        return ProfileCosts.from_plan(profile, plan, args.bandwidth, args.latency), plan
    if args.unit_cost and any(c is not None for c in custom):
        raise UsageError("--unit-cost fixes forward 1, backward 1, comm 0; drop it to set "
                         "--forward-cost/--backward-cost/--comm-cost")
    f = 1.0 if args.forward_cost is None else args.forward_cost
    b = 1.0 if args.backward_cost is None else args.backward_cost
    comm = 0.0 if args.comm_cost is None else args.comm_cost
    if min(f, b, comm) < 0:
        raise UsageError(f"costs must be >= 0, got forward {f}, backward {b}, comm {comm}")
    return UnitCosts(f, b, comm), None


def _layout(args: argparse.Namespace, plan: Plan | None) -> dict[str, Any]:
    if args.schedule == "auto":
        raise UsageError("--schedule auto chooses a schedule by planning each one, which "
                         "simulate does not do: run `pipedream-fast plan --schedule auto` and "
                         "simulate the plan it writes (--plan, without --schedule), or name "
                         f"one of {', '.join(SCHEDULE_NAMES)}")
    replicas = _replicas(args.replicas)
    if plan is None:
        if args.stages is None:
            raise UsageError("--stages is required unless --plan gives the stages")
        if args.schedule is None:
            raise UsageError("--schedule is required unless --plan names one")
        if args.stages_per_rank is not None:
            if replicas is not None:
                raise UsageError("give --stages-per-rank or --replicas, not both")
            return {"name": args.schedule, "num_stages": args.stages,
                    "stages_per_rank": args.stages_per_rank}
        return {"name": args.schedule, "num_stages": args.stages, "replicas": replicas}
    if args.stages is not None and args.stages != plan.num_stages:
        raise UsageError(f"--stages {args.stages} contradicts the plan, which has "
                         f"{plan.num_stages} stages; drop --stages or re-plan")
    plan_replicas = [s.replicas for s in plan.stages]
    if replicas is not None and replicas != plan_replicas:
        raise UsageError(f"--replicas {args.replicas} contradicts the plan's replicas "
                         f"{','.join(map(str, plan_replicas))}; drop --replicas or re-plan")
    name = args.schedule or plan.schedule
    if name not in SCHEDULE_NAMES:
        raise UsageError(f"the plan names schedule {name!r}, which this simulator does not "
                         f"know; pass --schedule (one of {', '.join(SCHEDULE_NAMES)})")
    return {"name": name, "num_stages": plan.num_stages,
            "stage_ranks": [list(s.ranks) for s in plan.stages]}


def run(args: argparse.Namespace) -> int:
    costs, plan = _costs(args)
    layout = _layout(args, plan)
    predicted = None
    if plan is not None:  # the figure `plan` and `train` give for this plan (`predict`)
        profile = Profile.load(args.profile)
        name = layout["name"]
        predicted = predict(profile, plan, name, chunks=args.chunks, bandwidth=args.bandwidth,
                            options=schedule_values(args))
        if args.microbatches is None:
            args.microbatches, per_step = prediction_size(plan, name, chunks=args.chunks)
            args.chunks = args.chunks or per_step
    if args.microbatches is None:
        raise UsageError("--microbatches is required unless --profile and --plan are given")
    schedule = make_schedule(num_microbatches=args.microbatches, chunks=args.chunks,
                             **schedule_values(args), **layout)
    result = simulate(schedule, costs)
    memory = _memory(args, result, plan)
    if args.save_schedule:
        schedule.save(args.save_schedule)
    if args.trace:
        from pipedream_fast.sim import write_simulation_trace
        write_simulation_trace(result, args.trace)
    if args.timeline:
        from pipedream_fast.timeline import draw_timeline
        draw_timeline(result, args.timeline)
    if args.json:
        data = result.to_dict()
        if plan is not None:
            data["samples_per_s"] = result.throughput * plan.batch_size * 1e3
            data["predicted_samples_per_s"] = predicted
        if memory:
            data["memory"] = {rank: m.to_dict() for rank, m in memory.items()}
        print(json.dumps(data, indent=2))
    else:
        print(summary(result, plan))
        if predicted is not None and args.latency == 0:
            print(prediction_text(predicted, layout["name"]))
        if memory:
            print(memory_summary(memory))
    return 0


def _memory(args: argparse.Namespace, result: SimResult, plan: Plan | None) -> dict[int, Any]:
    """Each rank's predicted memory (`sim_memory`), with a profile that has the blocks'
    held bytes; empty otherwise (unit costs, or a profile older than them)."""
    if plan is None or args.profile is None:
        return {}
    from pipedream_fast.sim_memory import predict_memory
    profile = Profile.load(args.profile)
    if not all("held_bytes" in b.extra for b in profile.blocks):
        return {}
    chunks = int(result.schedule.params.get("chunks") or 1)
    return predict_memory(result, profile, plan, profile.batch_size, chunks)


def memory_summary(memory: dict[int, Any]) -> str:
    """The predicted peak per rank, by kind, in MiB."""
    mib = 1 << 20
    lines = ["", "predicted memory per rank (MiB; the profile's batch as the microbatch)",
             "rank  peak     weights  versions  gradients  optimizer  activations"]
    for rank, m in sorted(memory.items()):
        st = m.static
        lines.append(f"{rank:<5} {m.total_peak / mib:<8.2f} {st['parameters'] / mib:<8.2f} "
                     f"{st['weight_versions'] / mib:<9.2f} {st['gradients'] / mib:<10.2f} "
                     f"{st['optimizer'] / mib:<10.2f} {m.activations_peak / mib:.2f}")
    return "\n".join(lines)


def summary(result: SimResult, plan: Plan | None = None) -> str:
    s, unit = result.schedule, result.time_unit
    params = ", ".join(f"{k} {v}" for k, v in s.params.items() if k != "replicas")
    lines = [f"schedule {s.name}: {s.num_stages} stages, {s.num_microbatches} microbatches, "
             f"{s.num_ranks} ranks (replicas {','.join(map(str, s.replicas))})"
             + (f", {params}" if params else ""),
             f"makespan    {result.makespan:g} {unit}{'s' if unit == 'unit' else ''}",
             f"throughput  {result.throughput:.4g} microbatches/{unit}"
             + (f" = {result.throughput * plan.batch_size * 1e3:.4g} samples/s" if plan else ""),
             f"idle        {100 * result.idle_fraction:.1f}% of all rank time", "",
             "rank  stages  busy      idle%   peak versions  peak stashed"]
    for r in result.ranks:
        idle = 100 * (1 - r.busy / result.makespan) if result.makespan else 0.0
        lines.append(f"{r.rank:<5} {','.join(map(str, r.stages)):<7} {r.busy:<9g} "
                     f"{idle:<7.1f} {r.peak_versions:<14} {r.peak_stashed}")
    d = result.delays
    lo, hi = d.steady_range
    lines.append("")
    if d.max_delay is None:
        lines.append(f"weight delay: no steady state (needs microbatches m with {lo} <= m < "
                     f"{hi}; run more than {2 * s.num_stages} microbatches)")
    else:
        lines.append(f"weight delay over steady state (microbatches {lo}..{hi - 1}): "
                     f"max {d.max_delay}, mean {d.mean_delay:.3g}")
        per = d.per_stage()
        lines.append("  per update stage: " + ", ".join(
            f"{st}: max {v['max']} mean {v['mean']:.3g}" for st, v in per.items()
            if v["count"]))
        lines.append("  histogram (delay: count): " + ", ".join(
            f"{k}: {v}" for k, v in d.histogram().items()))
    return "\n".join(lines)
