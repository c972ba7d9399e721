"""Runtime overhead per action: the executor against plain torch.distributed on one schedule.

Two ranks, each holding a near-empty stage (one Linear(16, 16); the last adds the loss), run
the same 1f1b action stream (chunks 4, so it has its sends, receives and optimizer steps):

  pipedream_fast    `Pipeline.train`: the executor, the C++ transport, the weight ring
  plain torch       a loop over the very same actions: `dist.isend`/`dist.irecv` with
                    preallocated buffers, a forward, a backward, `optimizer.step()`

Both do the same arithmetic, so the difference per action is what the runtime adds (queues,
bookkeeping, the executor's dispatch). Time per action is rank 0's run time over its number
of actions, after a warm-up run, median of --repeat runs.

    python bench/overhead.py [--steps 400] [--repeat 3] [--out bench/results/overhead.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.ir import ActionKind as K
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.training import build_schedule

WIDTH, BATCH, CHUNKS = 16, 16, 4
PLAN = Plan("tiny", BATCH // CHUNKS, 2, "1f1b",
            [StagePlan(0, 1, 1, (0,), 0.0), StagePlan(1, 2, 1, (1,), 0.0)], 1.0, 1.0)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
            for _ in range(steps)]


def executor_rank(rank: int, world: int, steps: int, repeat: int) -> dict[str, float]:
    torch.set_num_threads(1)
    pipe = Pipeline(model(), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.01),
                    plan=PLAN, schedule="1f1b", chunks=CHUNKS)
    batches = data(steps)
    times = []
    for run in range(repeat + 1):
        list(pipe.train(batches, steps))
        if run:  # the first run warms up
            times.append(pipe.last_stats["total_s"] / pipe.last_stats["actions"])
    pipe.close()
    return {"us_per_action": statistics.median(times) * 1e6,
            "actions": float(pipe.last_stats["actions"])}


def plain_rank(rank: int, world: int, steps: int, repeat: int) -> dict[str, float]:
    """The same action stream, driven by plain torch.distributed point-to-point calls."""
    torch.set_num_threads(1)
    stage = model()[rank]
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.01)
    batches = data(steps)
    times, count = [], 0
    for run in range(repeat + 1):
        schedule = build_schedule(PLAN, "1f1b", steps, CHUNKS)
        actions = list(schedule.program(rank))
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        pending: dict[tuple[str, int], tuple[Any, torch.Tensor]] = {}
        sends: list[Any] = []
        began = time.perf_counter()
        for a in actions:
            mb = a.microbatch
            if a.kind is K.RECV_ACT or a.kind is K.RECV_GRAD:
                assert mb is not None and a.peer is not None
                buffer = torch.empty(BATCH // CHUNKS, WIDTH)
                pending[(a.kind.value, mb)] = (dist.irecv(buffer, src=a.peer), buffer)
            elif a.kind is K.FORWARD:
                assert mb is not None
                if rank == 0:
                    x = batches[mb // CHUNKS][0].chunk(CHUNKS)[mb % CHUNKS]
                else:
                    work, x = pending.pop((K.RECV_ACT.value, mb))
                    work.wait()
                x = x.detach().requires_grad_(rank > 0)
                inputs[mb], out = x, stage(x)
                if rank == world - 1:
                    target = batches[mb // CHUNKS][1].chunk(CHUNKS)[mb % CHUNKS]
                    out = nn.functional.mse_loss(out, target) / CHUNKS
                outputs[mb] = out
            elif a.kind is K.SEND_ACT:
                assert mb is not None and a.peer is not None
                sends.append(dist.isend(outputs[mb].detach(), dst=a.peer))
            elif a.kind is K.BACKWARD:
                assert mb is not None
                out = outputs.pop(mb)
                if rank == world - 1:
                    out.backward()
                else:
                    work, grad = pending.pop((K.RECV_GRAD.value, mb))
                    work.wait()
                    out.backward(grad)
            elif a.kind is K.SEND_GRAD:
                assert mb is not None and a.peer is not None
                grad = inputs.pop(mb).grad
                assert grad is not None
                sends.append(dist.isend(grad, dst=a.peer))
            elif a.kind is K.OPTIMIZER_STEP:
                optimizer.step()
                optimizer.zero_grad()
            if len(sends) > 8:
                sends.pop(0).wait()
        for work in sends:
            work.wait()
        elapsed = time.perf_counter() - began
        dist.barrier()
        count = len(actions)
        if run:
            times.append(elapsed / count)
    return {"us_per_action": statistics.median(times) * 1e6, "actions": float(count)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args()
    if args.steps < 1 or args.repeat < 1:
        parser.error("--steps and --repeat must be >= 1")
    rows = []
    for name, fn in (("plain torch.distributed", plain_rank),
                     ("pipedream_fast executor", executor_rank)):
        result = launch(fn, 2, args.steps, args.repeat, timeout=600)[0]
        rows.append((name, result["us_per_action"], int(result["actions"])))
        print(f"{name:26s} {result['us_per_action']:8.1f} us/action "
              f"({int(result['actions'])} actions on rank 0)", flush=True)
    base = rows[0][1]
    overhead = rows[1][1] - base
    print(f"overhead: {overhead:+.1f} us per action ({rows[1][1] / base:.2f}x)")
    if args.out:
        lines = ["# Runtime overhead per action (near-empty stages)", "",
                 f"Command: `python bench/overhead.py {' '.join(sys.argv[1:])}`", "",
                 f"Machine: {os.cpu_count()} cores, "
                 f"{platform.processor() or platform.machine()}, torch {torch.__version__}; "
                 f"{time.strftime('%Y-%m-%d')}. Two ranks, gloo, 1 thread each; 1f1b, "
                 f"{args.steps} steps of {CHUNKS} microbatches; Linear({WIDTH}, {WIDTH}) "
                 f"per stage.", "",
                 "| driver | us per action (rank 0) | actions | vs plain |",
                 "| --- | ---: | ---: | ---: |"]
        lines += [f"| {name} | {us:.1f} | {n} | {us / base:.2f}x |" for name, us, n in rows]
        lines += ["", f"The executor adds {overhead:+.1f} us per action over the plain loop."]
        Path(args.out).write_text("\n".join(lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"steps": args.steps, "rows": [{"driver": name, "us_per_action": us, "actions": n}
                                           for name, us, n in rows],
             "ratio": rows[1][1] / base}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
