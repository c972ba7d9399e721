"""The core's speed knobs (`pipedream_fast.Tuning`) on model A, one knob at a time.

Batch 32, 2 ranks of one torch thread, gloo on loopback; `pipedream` on 2 stages cut conv | fc,
bucket_mb with `data-parallel` (the only configuration with buckets), offload_stash only on 2
GPUs. Every value once a round, all in the same two processes: the median over the rounds of
samples/s after the warm-up (the slower rank's), and its ratio to the default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import nn

from pipedream_fast import Tuning, _C
from pipedream_fast.commands.train_settings import tuning_flag
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.models import build_cnn
from pipedream_fast.training import build_schedule

import harness  # noqa: E402 - a sibling

BATCH, WARMUP = 32, 3
MODEL_A_SPLIT, MODEL_A_BLOCKS = 6, 9  # cut conv | fc, as bench/vs_ddp.py
CHUNKS = {"pipedream": 1, "data-parallel": 2}


@dataclass(frozen=True)
class Knob:
    field: str               # the Tuning field
    schedule: str
    values: tuple[Any, ...]  # the default first
    quick: tuple[Any, ...] | None = None  # what --quick sweeps, when fewer

    def sweeps(self, quick: bool) -> tuple[Any, ...]:
        return self.quick if quick and self.quick else self.values


def plan_for(schedule: str) -> Plan:
    if schedule == "data-parallel":
        stages = [StagePlan(0, MODEL_A_BLOCKS, 2, (0, 1), 0.0)]
    else:
        stages = [StagePlan(0, MODEL_A_SPLIT, 1, (0,), 0.0),
                  StagePlan(MODEL_A_SPLIT, MODEL_A_BLOCKS, 1, (1,), 0.0)]
    return Plan("cnn", BATCH, 2, schedule, stages, 1.0, 1.0)


def slots_kept(schedule: str, steps: int) -> int:
    """The weight versions the schedule keeps at once on its busiest rank."""
    return max(build_schedule(plan_for(schedule), schedule, steps, CHUNKS[schedule]).max_versions)


def cpu_knobs(steps: int) -> list[Knob]:
    kept = slots_kept("pipedream", steps)
    return [Knob("queue_depth", "pipedream", (None, 1, 2, 32), (None, 1, 32)),
            Knob("spin_us", "pipedream", (0.0, 20.0, 100.0)),
            Knob("recv_pool", "pipedream", (Tuning.recv_pool, 1, 4)),
            Knob("weight_slots", "pipedream", (None, kept + 2)),
            Knob("bucket_mb", "data-parallel", (Tuning.bucket_mb, 100.0, 5.0, 1.0),
                 (Tuning.bucket_mb, 100.0, 5.0)),
            Knob("link_threads", "pipedream", (Tuning.link_threads, True)),
            Knob("io_priority", "pipedream", (Tuning.io_priority, "normal", "low", "idle"),
                 (Tuning.io_priority, "normal")),
            Knob("transfer_runs", "pipedream", (Tuning.transfer_runs, False)),
            Knob("split_channels", "pipedream", (Tuning.split_channels, True)),
            Knob("cpu_cache_mb", "pipedream", (Tuning.cpu_cache_mb, 0.0))]


OFFLOAD = Knob("offload_stash", "pipedream", (False, True))


def describe(knob: Knob, value: Any, steps: int) -> str:
    if value is None:  # the default of queue_depth and weight_slots: what it stands for
        meaning = {"queue_depth": f"{Tuning().process_queue_depth}",
                   "weight_slots": f"the schedule's {slots_kept(knob.schedule, steps)}"}
        return f"None = {meaning[knob.field]}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def timed_run(schedule: str, tuning: Tuning, steps: int) -> float:
    """Seconds this rank took for `steps` steps after the warm-up, under `tuning`."""
    from pipedream_fast.pipeline import Pipeline

    torch.manual_seed(0)
    pipe = Pipeline(build_cnn(), nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=0.01), plan=plan_for(schedule),
                    schedule=schedule, chunks=CHUNKS[schedule], timeout=300.0, tuning=tuning)
    g = torch.Generator().manual_seed(0)  # bench/vs_ddp.py's batch
    batch = torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    start = time.perf_counter()
    for i, _ in enumerate(pipe.train([batch] * (WARMUP + steps), WARMUP + steps)):
        if i == WARMUP - 1:
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    pipe.close()
    return elapsed


def rank_job(rank: int, world: int, runs: list[tuple[str, str, Any]], steps: int) -> list[float]:
    """Every (schedule, field, value) of `runs`, in order: this rank's seconds for each."""
    return [timed_run(schedule, Tuning(**{field: value}), steps) for schedule, field, value in runs]


def sweep(knobs: list[Knob], quick: bool, rounds: int, steps: int, on_gpus: bool
          ) -> list[dict[str, Any]]:
    """Every value of every knob in `rounds` rounds: a results row each."""
    runs = [(knob.schedule, knob.field, value) for _ in range(rounds) for knob in knobs
            for value in knob.sweeps(quick)]
    # Ranks that see no GPU: `launch` then picks gloo and the CPU.
    with mock.patch.dict(os.environ, {} if on_gpus else {"CUDA_VISIBLE_DEVICES": ""}):
        seconds = launch(rank_job, 2, runs, steps, timeout=600.0, threads_per_rank=1)
    samples: dict[tuple[str, Any], list[float]] = {}
    for (_, field, value), *per_rank in zip(runs, *seconds):
        samples.setdefault((field, value), []).append(BATCH * steps / max(per_rank))
    rows = []
    for knob in knobs:
        values = knob.sweeps(quick)
        base = samples[(knob.field, values[0])]
        default = statistics.median(base)
        for value in values:
            got = samples[(knob.field, value)]
            median = statistics.median(got)
            rows.append(row(knob, value, describe(knob, value, WARMUP + steps)
                            + (" (default)" if value == values[0] else ""),
                            median, got, median / default,
                            [g / b for g, b in zip(got, base)]))
    return rows


def row(knob: Knob, value: Any, label: str, samples_per_s: float | None, rounds: list[float],
        ratio: float | None, round_ratios: list[float] | None = None) -> dict[str, Any]:
    """`round_ratios`: against the default within each round (the rounds interleave the
    values, so these cancel the machine's drift from round to round)."""
    return {"knob": knob.field, "flag": tuning_flag(knob.field),
            "schedule": knob.schedule, "value": value, "label": label,
            "samples_per_s": samples_per_s, "rounds": rounds, "vs_default": ratio,
            "round_ratios": round_ratios or []}


def spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=harness.positive, default=None,
                        help="measured steps per configuration (default 20; 6 with --quick)")
    parser.add_argument("--rounds", type=harness.positive, default=None,
                        help="interleaved rounds (default 3; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer steps, rounds, values")
    parser.add_argument("--out", help="write the table here (markdown), and .json beside it")
    args = parser.parse_args()
    steps, rounds = harness.sizes(args, {"steps": 20, "rounds": 3}, {"steps": 6, "rounds": 2},
                                  args.quick).values()
    began = time.perf_counter()
    rows = sweep(cpu_knobs(WARMUP + steps), args.quick, rounds, steps, on_gpus=False)
    if _C.cuda_enabled and torch.cuda.device_count() >= 2:
        rows += sweep([OFFLOAD], args.quick, rounds, steps, on_gpus=True)
    else:
        rows.append(row(OFFLOAD, True, "True", None, [], None))
    text = "\n".join([
        "# The core's speed knobs on model A", "", f"Command: `{harness.command()}`", "",
        f"Machine: {harness.machine()}. Model A, batch {BATCH}, 2 ranks of 1 thread, gloo on "
        f"loopback; {steps} measured steps after {WARMUP} warm-up, median of {rounds} "
        f"interleaved rounds. 'Per round': the value against the default within each "
        f"round; where that range comes within 2% of 1.00x, or spans it, the knob's effect is "
        f"within this machine's noise.", "",
        *harness.markdown_table(
            ["knob", "flag", "schedule", "value", "samples/s", "vs default", "per round"],
            [[r["knob"], f"`{r['flag']}`", r["schedule"], r["label"],
              harness.fmt(r["samples_per_s"], ".1f", "GPU only: not measured on CPU"),
              "-" if r["vs_default"] is None else f"{r['vs_default']:.2f}x",
              spread(r["round_ratios"])]
             for r in rows], left=4)]) + "\n"
    harness.emit(args.out, text, {"command": harness.command(), "batch": BATCH,
                                  "warmup": WARMUP, "steps": steps, "rounds": rounds,
                                  **harness.machine_info(), "rows": rows})
    print(f"swept in {time.perf_counter() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
