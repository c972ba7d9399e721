"""Schedules as streams: start-up time and memory against the run's length.

Part 1: for every trainable schedule on 4 stages and N = 1k .. 1M microbatches, the time from
`make_schedule` through validation to every rank's first action, and the peak Python memory
(tracemalloc) of that plus rank 0's first 20,000 actions; neither may depend on N. Part 2:
`pipedream-fast train --schedule pipedream --steps 1000000` on the CNN, the time to its first
loss line and its resident memory while it trains, for `--seconds`.

    python bench/streams.py [--seconds 150]   # writes bench/results/streams.md
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import torch

from pipedream_fast.ir import validate
from pipedream_fast.schedules import TRAINABLE, kind, make_schedule

RESULTS = Path(__file__).resolve().parent / "results" / "streams.md"
LENGTHS = (1_000, 10_000, 100_000, 1_000_000)
WALK = 20_000


def schedule_kwargs(name: str) -> dict:
    kw: dict = {"num_stages": 4}
    if kind(name).chunked_steps:
        kw["chunks"] = 4
    if name == "interleaved-1f1b":
        kw["stages_per_rank"] = 2
    if name == "data-parallel":
        kw.update(num_stages=1, replicas=[4])
    return kw


def start_up(name: str, n: int) -> tuple[float, float, float]:
    """(seconds to a validated schedule and every rank's first action, microseconds per
    action over rank 0's first WALK actions, peak MiB of the same with tracemalloc on)."""
    began = time.perf_counter()
    schedule = make_schedule(name, num_microbatches=n, **schedule_kwargs(name))
    validate(schedule)
    programs = [schedule.program(r) for r in range(schedule.num_ranks)]
    for program in programs:
        next(program)
    seconds = time.perf_counter() - began
    walked = time.perf_counter()
    count = sum(1 for _ in itertools.islice(programs[0], WALK))  # fewer if the run is short
    per_action_us = (time.perf_counter() - walked) / count * 1e6
    tracemalloc.start()  # again, measured apart: tracing slows the walk down
    schedule = make_schedule(name, num_microbatches=n, **schedule_kwargs(name))
    validate(schedule)
    for _ in itertools.islice(schedule.program(0), WALK):
        pass
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return seconds, per_action_us, peak


def part1() -> list[str]:
    lines = ["| schedule | " + " | ".join(f"N = {n:,}" for n in LENGTHS) + " |",
             "| --- | " + " | ".join("---:" for _ in LENGTHS) + " |"]
    for name in TRAINABLE:
        cells = []
        for n in LENGTHS:
            seconds, per_action, peak = start_up(name, n)
            cells.append(f"{seconds * 1e3:.0f} ms, {per_action:.0f} µs/action, {peak:.2f} MiB")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (the ranks are threads: one process)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def part2(seconds: float) -> list[str]:
    command = [sys.executable, "-m", "pipedream_fast.cli", "train", "--model", "cnn",
               "--threads", "2", "--schedule", "pipedream", "--steps", "1000000",
               "--batch-size", "32", "--log-every", "20"]
    began = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    first_loss = None
    samples: list[tuple[float, float, str]] = []
    last_line = ""
    next_sample = 0.0
    try:
        while time.perf_counter() - began < seconds and proc.poll() is None:
            for line in iter(proc.stdout.readline, ""):
                if "loss" in line:
                    last_line = line.strip()
                    if first_loss is None:
                        first_loss = time.perf_counter() - began
            now = time.perf_counter() - began
            if first_loss is not None and now >= next_sample:
                samples.append((now, rss_mib(proc.pid), last_line))
                next_sample = now + seconds / 10
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lines = [f"Command: `{' '.join(['pipedream-fast'] + command[3:])}`, stopped after "
             f"{seconds:.0f} s.", "",
             f"First loss line after **{first_loss:.1f} s** (profiling and planning the CNN "
             f"included)." if first_loss is not None else "No loss line appeared.", "",
             "| seconds | resident MiB | last line |", "| ---: | ---: | --- |"]
    lines += [f"| {t:.0f} | {m:.0f} | `{text}` |" for t, m, text in samples]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="how long part 2 trains")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    header = [
        "# Schedules as streams: start-up and memory against the run's length", "",
        "Command: `python bench/streams.py --seconds "
        f"{args.seconds:.0f}`", "",
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}.", "",
        "## Start-up: make the schedule, validate it, every rank's first action", "",
        f"Each cell: start-up time; time per action while rank 0's first {WALK:,} actions are "
        f"generated; peak Python memory of the start-up plus that walk (4 stages; 4 "
        f"microbatches per step where the schedule steps per minibatch; interleaved: 2 ranks "
        f"x 2 stages; data-parallel: 4 replicas).", ""]
    body = part1()
    body += ["", "## A million steps, end to end", ""] + part2(args.seconds)
    text = "\n".join(header + body) + "\n"
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)
        print(f"written to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
