"""Interleaved 1F1B and ZB-H1 against 1F1B, ours and torch.distributed.pipelining's.

Model A (the built-in `cnn`, batch 32, SGD) on 2 ranks (1 thread each, gloo), 4 microbatches
per step. The 2-stage contenders cut the model where the planner's straight plan does; the
interleaved ones use the planner's 4-stage looped plan (`plan --stages-per-rank 2`: blocks
balanced by profiled time, stage k on rank k mod 2). Every contender runs the very same
stages and microbatches:

  torch.distributed.pipelining Schedule1F1B              (2 stages)
  torch.distributed.pipelining ScheduleInterleaved1F1B   (4 stages, 2 per rank)
  pipedream_fast 1f1b                                    (2 stages)
  pipedream_fast interleaved-1f1b                        (4 stages, 2 per rank)
  torch.distributed.pipelining ScheduleInterleavedZeroBubble (4 stages, 2 per rank)
  pipedream_fast zb-h1                                   (2 stages)

    python bench/interleaved.py [--steps 20] [--chunks 4] [--out bench/results/interleaved.md]

Throughput counts steady-state samples/s: the clock starts after the warm-up steps. The
simulator's prediction for each of our schedules is printed beside it.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
from torch import nn

from model_a import BATCH, batch, time_torch_schedule, train_with_plan  # sibling in bench/
from pipedream_fast.formats import Plan, Profile
from pipedream_fast.launch import launch
from pipedream_fast.models import build_cnn

def torch_rank(rank: int, world: int, plan: dict, steps: int, chunks: int,
               zero_bubble: bool = False) -> float:
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                              ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    children = list(build_cnn().children())
    bounds = [(s["start"], s["stop"]) for s in plan["stages"]]
    mine = [k for k in range(len(bounds)) if plan["stages"][k]["ranks"] == [rank]]
    stages = [PipelineStage(nn.Sequential(*children[bounds[k][0]:bounds[k][1]]), k, len(bounds),
                            torch.device("cpu")) for k in mine]
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    loss = nn.functional.cross_entropy
    looped = ScheduleInterleavedZeroBubble if zero_bubble else ScheduleInterleaved1F1B
    schedule = (Schedule1F1B(stages[0], chunks, loss_fn=loss) if len(stages) == 1 else
                looped(stages, chunks, loss_fn=loss))
    return time_torch_schedule(schedule, opt, 0 in mine, len(bounds) - 1 in mine, steps)


def ours_rank(rank: int, world: int, plan: dict, steps: int, chunks: int, schedule: str) -> float:
    return train_with_plan(Plan.from_dict(plan), steps, chunks, schedule)


def plans(chunks: int) -> tuple[Profile, Plan, Plan]:
    from pipedream_fast.planner import make_plan
    from pipedream_fast.profiler import profile_model
    from pipedream_fast.topology import Topology

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, _ = batch()
    micro = x[: BATCH // chunks]
    profile = profile_model(build_cnn(), micro, BATCH // chunks, progress=False, model_name="cnn")
    topology = Topology.parse("2x1.25e9")
    return (profile, make_plan(profile, topology, schedule="1f1b", straight=True),
            make_plan(profile, topology, schedule="1f1b", stages_per_rank=2))


def predicted(profile: Profile, plan: Plan, schedule: str, chunks: int, steps: int) -> float:
    """Samples/s the simulator predicts from the microbatch-size profile."""
    from pipedream_fast.schedules import make_schedule
    from pipedream_fast.sim import ProfileCosts, simulate

    sched = make_schedule(schedule, len(plan.stages), chunks * steps,
                          stage_ranks=[list(s.ranks) for s in plan.stages],
                          chunks=chunks)
    result = simulate(sched, ProfileCosts.from_plan(profile, plan, bandwidth=1.25e9))
    return BATCH * steps / result.makespan * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    profile, straight, looped = plans(args.chunks)
    print("2 stages:", [(s.start, s.stop) for s in straight.stages],
          "| 4 looped stages:", [(s.start, s.stop, s.ranks[0]) for s in looped.stages], flush=True)
    rows: list[tuple[str, float, str]] = []

    def record(name: str, value: float, note: str = "") -> None:
        rows.append((name, value, note))
        print(f"{name:62s} {value:7.1f} samples/s {note}", flush=True)

    for plan, theirs, zb in ((straight, "Schedule1F1B, 2 stages", False),
                             (looped, "ScheduleInterleaved1F1B, 2 x 2 stages", False),
                             (looped, "ScheduleInterleavedZeroBubble, 2 x 2 stages", True)):
        record(f"torch.distributed.pipelining {theirs}",
               launch(torch_rank, 2, plan.to_dict(), args.steps, args.chunks, zb)[0])
    for plan, ours in ((straight, "1f1b"), (looped, "interleaved-1f1b"), (straight, "zb-h1")):
        guess = predicted(profile, plan, ours, args.chunks, args.steps)
        record(f"pipedream_fast {ours}, {len(plan.stages)} stages",
               launch(ours_rank, 2, plan.to_dict(), args.steps, args.chunks, ours)[0],
               f"(simulator: {guess:.1f})")
    if args.out:
        theirs = {name: v for name, v, _ in rows}
        lines = ["# Interleaved 1F1B, model A, batch 32, 2 ranks, CPU", "",
                 f"Command: `python bench/interleaved.py --steps {args.steps} --chunks "
                 f"{args.chunks} --out {args.out}`", "",
                 f"Machine: {os.cpu_count()} cores, {platform.machine()}, torch "
                 f"{torch.__version__}, Python {sys.version.split()[0]}.", "",
                 f"Stages: 2-stage {[(s.start, s.stop) for s in straight.stages]}; looped "
                 f"{[(s.start, s.stop) for s in looped.stages]} (blocks [start, stop), stage k "
                 f"on rank k mod 2), from a profile at the microbatch size.", "",
                 "| contender | samples/s | note |", "| --- | ---: | --- |"]
        lines += [f"| {name} | {value:.1f} | {note} |" for name, value, note in rows]
        ratio = (theirs["pipedream_fast interleaved-1f1b, 4 stages"] /
                 theirs["torch.distributed.pipelining ScheduleInterleaved1F1B, 2 x 2 stages"])
        zb = (theirs["pipedream_fast zb-h1, 2 stages"] /
              theirs["torch.distributed.pipelining ScheduleInterleavedZeroBubble, 2 x 2 stages"])
        lines += ["", f"pipedream_fast interleaved-1f1b / torch ScheduleInterleaved1F1B: "
                      f"**{ratio:.2f}x**; pipedream_fast zb-h1 / torch "
                      f"ScheduleInterleavedZeroBubble: **{zb:.2f}x**."]
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
