"""The core's speed knobs (`pipedream_fast.Tuning`) on model A, one knob at a time.

Model A, batch 32, 2 ranks of one torch thread, gloo on loopback. queue_depth, spin_us,
recv_pool and weight_slots are swept with `pipedream` on 2 stages cut conv | fc (one 32-sample
microbatch per step); bucket_mb with `data-parallel` (chunks=2), the only configuration with
buckets; offload_stash only where there are 2 GPUs and a CUDA build. All configurations run in
the same two processes in rounds (each round every value of every knob once); a figure is the
median over the rounds of steady-state samples/s (the slower rank's clock after the warm-up),
with its ratio to the knob's default.

    python bench/knobs.py [--steps 20] [--rounds 3] [--quick] [--out bench/results/knobs.md]

--quick: 6 measured steps, 2 rounds, at most 3 values per knob. --out writes the table there
and the figures to knobs.json beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from pipedream_fast import Tuning, _C
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.models import build_cnn
from pipedream_fast.training import build_schedule

import harness  # noqa: E402 - a sibling
from vs_ddp import fixed_batch  # noqa: E402 - a sibling (the same batch of 32)

BATCH = 32
WARMUP = 3
MODEL_A_SPLIT = 6  # conv | fc, as bench/vs_ddp.py
MODEL_A_BLOCKS = 9
CHUNKS = {"pipedream": 1, "data-parallel": 2}
GPU_ONLY = "GPU only: not measured on CPU"


@dataclass(frozen=True)
class Knob:
    field: str               # the Tuning field
    schedule: str
    values: tuple[Any, ...]  # the default first
    quick: tuple[Any, ...]   # what --quick sweeps (the default first)

    @property
    def flag(self) -> str:
        return f"--{self.field.replace('_', '-')}"


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
            Knob("spin_us", "pipedream", (0.0, 20.0, 100.0), (0.0, 20.0, 100.0)),
            Knob("recv_pool", "pipedream", (Tuning.recv_pool, 1, 4), (Tuning.recv_pool, 1, 4)),
            Knob("weight_slots", "pipedream", (None, kept + 2), (None, kept + 2)),
            Knob("bucket_mb", "data-parallel", (Tuning.bucket_mb, 100.0, 5.0, 1.0),
                 (Tuning.bucket_mb, 100.0, 5.0))]


OFFLOAD = Knob("offload_stash", "pipedream", (False, True), (False, True))


def describe(knob: Knob, value: Any, steps: int) -> str:
    if value is None:  # the default of queue_depth and weight_slots: what it stands for
        meaning = {"queue_depth": f"{Tuning().process_queue_depth}",
                   "weight_slots": f"the schedule's {slots_kept(knob.schedule, steps)}"}
        return f"None = {meaning[knob.field]}"
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---- the ranks -------------------------------------------------------------------------------

def timed_run(schedule: str, tuning: Tuning, steps: int) -> float:
    """Seconds this rank took for `steps` steps after the warm-up, under `tuning`."""
    from pipedream_fast.pipeline import Pipeline

    torch.manual_seed(0)
    pipe = Pipeline(build_cnn(), nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, lr=0.01), plan=plan_for(schedule),
                    schedule=schedule, chunks=CHUNKS[schedule], timeout=300.0, tuning=tuning)
    start = time.perf_counter()
    for i, _ in enumerate(pipe.train([fixed_batch()] * (WARMUP + steps), WARMUP + steps)):
        if i == WARMUP - 1:
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    pipe.close()
    return elapsed


def rank_job(rank: int, world: int, runs: list[tuple[str, str, Any]], steps: int) -> list[float]:
    """Every (schedule, field, value) of `runs`, in order: this rank's seconds for each."""
    return [timed_run(schedule, Tuning(**{field: value}), steps)
            for schedule, field, value in runs]


# ---- the sweep -------------------------------------------------------------------------------

def sweep(knobs: list[Knob], quick: bool, rounds: int, steps: int, on_gpus: bool
          ) -> dict[tuple[str, Any], list[float]]:
    """(field, value) -> samples/s of each round."""
    runs = [(knob.schedule, knob.field, value) for _ in range(rounds) for knob in knobs
            for value in (knob.quick if quick else knob.values)]
    # Ranks that see no GPU: `launch` then picks gloo and the CPU.
    with contextlib.nullcontext() if on_gpus else mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": ""}):
        seconds = launch(rank_job, 2, runs, steps, timeout=600.0, threads_per_rank=1)
    samples: dict[tuple[str, Any], list[float]] = {}
    for (_, field, value), *per_rank in zip(runs, *seconds):
        samples.setdefault((field, value), []).append(BATCH * steps / max(per_rank))
    return samples


def gpus_for_offload() -> bool:
    return _C.cuda_enabled and torch.cuda.device_count() >= 2


@dataclass
class Row:
    knob: Knob
    value: Any
    label: str
    samples_per_s: float | None  # median over the rounds; None: not measured
    rounds: list[float]
    ratio: float | None


def rows_of(knobs: list[Knob], samples: dict[tuple[str, Any], list[float]], quick: bool,
            steps: int) -> list[Row]:
    rows = []
    for knob in knobs:
        values = knob.quick if quick else knob.values
        default = statistics.median(samples[(knob.field, values[0])])
        for value in values:
            runs = samples[(knob.field, value)]
            median = statistics.median(runs)
            label = describe(knob, value, steps) + (" (default)" if value == values[0] else "")
            rows.append(Row(knob, value, label, median, runs, median / default))
    return rows


def markdown(rows: list[Row], command: str, steps: int, rounds: int) -> str:
    m = harness.machine_info()
    lines = ["# The core's speed knobs on model A", "", f"Command: `{command}`", "",
             f"Machine: {m['cores']} cores, {m['processor']}, torch {m['torch']}, Python "
             f"{m['python']}. Model A, "
             f"batch {BATCH}, 2 ranks of 1 thread, gloo on loopback; {steps} measured steps "
             f"after {WARMUP} warm-up, median of {rounds} interleaved rounds.", ""]
    lines += harness.markdown_table(
        ["knob", "flag", "schedule", "value", "samples/s", "vs default"],
        [[r.knob.field, f"`{r.knob.flag}`", r.knob.schedule, r.label,
          harness.fmt(r.samples_per_s, ".1f", GPU_ONLY),
          "-" if r.ratio is None else f"{r.ratio:.2f}x"] for r in rows], left=4)
    return "\n".join(lines) + "\n"


def write(out: Path, rows: list[Row], command: str, steps: int, rounds: int) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(rows, command, steps, rounds))
    harness.write_json(out.with_suffix(".json"), {
        "command": command, "batch": BATCH, "warmup": WARMUP, "steps": steps,
        "rounds": rounds, "cores": os.cpu_count(), "torch": torch.__version__,
        "rows": [{"knob": r.knob.field, "flag": r.knob.flag, "schedule": r.knob.schedule,
                  "value": r.value, "label": r.label, "samples_per_s": r.samples_per_s,
                  "rounds": r.rounds, "vs_default": r.ratio} for r in rows]}, indent=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="measured steps per configuration (default 20; 6 with --quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds (default 3; 2 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps, rounds and values: the sweep in under 4 minutes")
    parser.add_argument("--out", default=None, type=Path,
                        help="write the table here (markdown) and knobs.json beside it")
    args = parser.parse_args()
    steps = args.steps or (6 if args.quick else 20)
    rounds = args.rounds or (2 if args.quick else 3)
    if steps < 1 or rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    command = harness.command()
    began = time.perf_counter()
    knobs = cpu_knobs(WARMUP + steps)
    rows = rows_of(knobs, sweep(knobs, args.quick, rounds, steps, on_gpus=False), args.quick,
                   WARMUP + steps)
    if gpus_for_offload():
        rows += rows_of([OFFLOAD], sweep([OFFLOAD], args.quick, rounds, steps, on_gpus=True),
                        args.quick, WARMUP + steps)
    else:
        rows.append(Row(OFFLOAD, True, "True", None, [], None))
    print(markdown(rows, command, steps, rounds), flush=True)
    print(f"swept in {time.perf_counter() - began:.0f} s", flush=True)
    if args.out:
        write(args.out, rows, command, steps, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
