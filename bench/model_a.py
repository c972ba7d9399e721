"""Model A end to end: pipedream_fast against a single process and torch.distributed.pipelining.

Model A is the built-in `cnn` (6 convolutions 64-64-128-128-256-256 on 3x32x32, max-pool every
2, Linear 4096-4096-4096-10), batch 32, SGD. Every contender runs in this one invocation, one
after the other, so the figures are side by side on the same machine state:

  single process, 1 and 2 intra-op threads            (the ceiling for 2 cores)
  torch.distributed.pipelining Schedule1F1B, 2 ranks  (1 thread per rank, gloo)
  pipedream_fast 'pipedream' and '1f1b', 2 ranks      (1 thread per rank, gloo)

    python bench/model_a.py [--steps 30] [--split 6] [--out bench/results/model_a.md]

Throughput counts steady-state samples/s: the clock starts after the warm-up steps.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.models import build_cnn
from pipedream_fast.pipeline import Pipeline

BATCH = 32
WARMUP = 3


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def single_process(threads: int, steps: int) -> float:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    start = 0.0
    for i in range(steps):
        if i == WARMUP:
            start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return BATCH * (steps - WARMUP) / (time.perf_counter() - start)


def torch_pipelining_rank(rank: int, world: int, split: int, steps: int, chunks: int) -> float:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_cnn()
    children = list(model.children())
    part = nn.Sequential(*(children[:split] if rank == 0 else children[split:]))
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    opt = torch.optim.SGD(part.parameters(), lr=0.01)
    schedule = Schedule1F1B(stage, chunks, loss_fn=nn.functional.cross_entropy)
    return time_torch_schedule(schedule, opt, rank == 0, rank == world - 1, steps)


def time_torch_schedule(schedule: Any, opt: torch.optim.Optimizer, holds_first: bool,
                        holds_last: bool, steps: int) -> float:
    """Steady-state samples/s of a torch.distributed.pipelining schedule on this rank."""
    x, y = batch()
    start = 0.0
    for i in range(steps):
        if i == WARMUP:
            dist.barrier()
            start = time.perf_counter()
        opt.zero_grad()
        schedule.step(*((x,) if holds_first else ()),
                      **({"target": y, "losses": []} if holds_last else {}))
        opt.step()
    dist.barrier()
    return BATCH * (steps - WARMUP) / (time.perf_counter() - start)


def pipedream_fast_rank(rank: int, world: int, split: int, steps: int, chunks: int,
                        schedule: str) -> float:
    plan = Plan("cnn", BATCH, 2, schedule, [StagePlan(0, split, 1, (0,), 0.0),
                                             StagePlan(split, 9, 1, (1,), 0.0)], 1.0, 1.0)
    return train_with_plan(plan, steps, chunks, schedule)


def train_with_plan(plan: Plan, steps: int, chunks: int, schedule: str) -> float:
    """Steady-state samples/s of model A under `plan` on this rank (1 thread)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pipe = Pipeline(build_cnn(), nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=0.01), plan=plan, schedule=schedule,
                    chunks=chunks)
    data = [batch()] * steps
    start = 0.0
    for i, _ in enumerate(pipe.train(data, steps)):
        if i == WARMUP - 1:
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    pipe.close()
    return BATCH * (steps - WARMUP) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--split", type=int, default=6, help="first block of stage 1 (default 6)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    rows: list[tuple[str, float]] = []

    def record(name: str, value: float) -> None:
        rows.append((name, value))
        print(f"{name:60s} {value:7.1f} samples/s", flush=True)

    record("single process, 1 thread", single_process(1, args.steps))
    record("single process, 2 threads", single_process(2, args.steps))
    torch.set_num_threads(1)
    record("torch.distributed.pipelining 1F1B, 2 ranks, 2 microbatches",
           launch(torch_pipelining_rank, 2, args.split, args.steps, 2)[1])
    record("torch.distributed.pipelining 1F1B, 2 ranks, 4 microbatches",
           launch(torch_pipelining_rank, 2, args.split, args.steps, 4)[1])
    record("pipedream_fast pipedream, 2 ranks (minibatch = microbatch)",
           launch(pipedream_fast_rank, 2, args.split, args.steps, 1, "pipedream")[1])
    record("pipedream_fast 1f1b, 2 ranks, 4 microbatches",
           launch(pipedream_fast_rank, 2, args.split, args.steps, 4, "1f1b")[1])
    base = rows[0][1]
    if args.out:
        lines = ["# Model A, batch 32, CPU", "",
                 f"Command: `python bench/model_a.py --steps {args.steps} --split {args.split} "
                 f"--out {args.out}`", "",
                 f"Machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
                 f"torch {torch.__version__}, Python {sys.version.split()[0]}.", "",
                 "| contender | samples/s | vs 1-thread single process |", "| --- | ---: | ---: |"]
        lines += [f"| {name} | {value:.1f} | {value / base:.2f}x |" for name, value in rows]
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
