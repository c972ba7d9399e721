"""Soak: a long run of pipedream on 2 stages of a small MLP through `LocalPipeline` (2 threads)
and `Pipeline` (2 processes, gloo); every `--every` steps each rank samples its resident memory,
threads and open file descriptors, which must stay flat after warm-up (the first 10%).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.local_pipeline import LocalPipeline
from pipedream_fast.pipeline import Pipeline

import harness  # noqa: E402 - a sibling

BATCH = 16
SGD = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 8))


def plan() -> Plan:
    return Plan("soak-mlp", BATCH, 2, "pipedream",
                [StagePlan(0, 2, 1, (0,), 1.0), StagePlan(2, 5, 1, (1,), 1.0)], 1.0, 1.0)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same 16 minibatches again and again, `steps` of them."""
    g = torch.Generator().manual_seed(1)
    pool = [(torch.randn(BATCH, 32, generator=g), torch.randint(0, 8, (BATCH,), generator=g))
            for _ in range(16)]
    return [pool[i % len(pool)] for i in range(steps)]


def sample() -> dict[str, int]:
    status = dict(x.split(":", 1) for x in Path("/proc/self/status").read_text().splitlines())
    return {"rss_kb": int(status["VmRSS"].split()[0]), "threads": int(status["Threads"]),
            "fds": len(os.listdir("/proc/self/fd"))}


def soak(train: Any, steps: int, every: int) -> dict[str, Any]:
    began = time.perf_counter()
    samples = [(step, sample()) for step, _ in enumerate(train(batches(steps), steps=steps), 1)
               if step % every == 0 or step == steps]
    return {"samples": samples, "seconds": time.perf_counter() - began}


def process_job(rank: int, world: int, steps: int, every: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    pipe = Pipeline(model(), nn.functional.cross_entropy, SGD, plan=plan(),
                    schedule="pipedream", timeout=120)
    out = soak(pipe.train, steps, every)
    pipe.close()
    return out


def row(name: str, run: dict[str, Any], steps: int) -> list[str]:
    """First sample after warm-up -> last (± the largest spread between samples)."""
    after = [v for s, v in run["samples"] if s > steps // 10]
    first, last = after[0], after[-1]
    spread = {k: max(v[k] for v in after) - min(v[k] for v in after) for k in first}
    return [name, f"{steps:,}", f"{run['seconds']:.0f}",
            f"{first['rss_kb'] / 1024:.1f} → {last['rss_kb'] / 1024:.1f} "
            f"(±{spread['rss_kb'] / 1024:.1f})",
            f"{first['threads']} → {last['threads']}", f"{first['fds']} → {last['fds']}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--out", default="bench/results/soak.md")
    args = parser.parse_args()
    steps, every = args.microbatches, args.every
    torch.set_num_threads(1)
    local = LocalPipeline(model(), nn.functional.cross_entropy, SGD, plan(),
                          schedule="pipedream", timeout=120)
    rows = [row("LocalPipeline (2 threads, one process)", soak(local.train, steps, every), steps)]
    rows += [row(f"Pipeline rank {rank} (2 processes, gloo)", run, steps)
             for rank, run in enumerate(launch(process_job, 2, steps, every, timeout=600))]
    harness.write_results(
        args.out, "Soak: memory, threads and descriptors over a long run",
        [f"pipedream schedule (weight stashing) on 2 stages of a small MLP, one microbatch of "
         f"{BATCH} per step. Samples every {every} steps from the end of warm-up (the first "
         f"10%) to the end: first → last (± the largest spread between samples)."],
        ["front end", "microbatches", "seconds", "resident MB", "threads", "open fds"], rows)
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
