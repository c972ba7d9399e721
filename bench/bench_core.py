"""Microbenchmarks of the core: `--set handoff|ring` write their sections of
bench/results/core.md, `--set streams` bench/results/streams.md (`--no-write`: print only);
`python -m pytest bench/bench_core.py --benchmark-only` times the planner (issue 3: 100 blocks,
64 workers, 3 levels under 1 s; bench/results/planner.md).

handoff (issue 2): (a) one-way latency, native producer thread -> Python consumer blocked in `pop`,
vs `queue.Queue` (goal: at most half); (b) round trips between two Python threads through
ActivationQueues, vs `threading.Lock`s (the floor; goal: within 10%). ring: `WeightRing.snapshot()`
of a 52 MB stage vs a flat `copy_` (goal: >= 80% of its bandwidth) and PipeDream's `state_dict`
clone stash (goal: >= 3x faster). streams: per schedule and N = 1k .. 1M microbatches, start-up time
and peak memory (neither may grow with N); then `pipedream-fast train` for 1M steps.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import itertools
import math
import os
import platform
import queue
import random
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast import _C
from pipedream_fast.formats import BlockProfile, Profile
from pipedream_fast.ir import validate
from pipedream_fast.planner import make_plan
from pipedream_fast.schedules import TRAINABLE, kind as schedule_kind, make_schedule
from pipedream_fast.topology import Topology

import harness  # noqa: E402 - siblings
import native_ext  # the bench-only extension with ThreadedProducer, built on first use

RESULTS = Path(__file__).resolve().parent / "results"
Started = Callable[[], None]


# ---- handoff ---------------------------------------------------------------------------------
def check_clocks(samples: int = 1000) -> int:
    """The largest gap (ns) between `_C.now_ns()` and the `time.monotonic_ns()` around it."""
    worst = 0
    for _ in range(samples):
        before, native, after = time.monotonic_ns(), _C.now_ns(), time.monotonic_ns()
        worst = max(worst, before - native, native - after)
    if worst > 1_000_000:
        raise RuntimeError(f"_C.now_ns() is not time.monotonic_ns(): off by {worst} ns")
    return worst


@contextlib.contextmanager
def placement(kind: str) -> Iterator[Started]:
    """Pins this thread, so the partner it starts in the block (inheriting its CPU mask) lands
    on CPU b; the yielded function then moves it to CPU a (`split`) or leaves it on b (`same`)."""
    cpus = sorted(os.sched_getaffinity(0))
    if kind == "free" or len(cpus) < 2:
        yield lambda: None
        return
    a, b = cpus[0], cpus[1]
    os.sched_setaffinity(0, {b})
    try:
        yield lambda: os.sched_setaffinity(0, {a if kind == "split" else b})
    finally:
        os.sched_setaffinity(0, set(cpus))


def native_to_python(count: int, interval_us: int, payload: list[torch.Tensor],
                     started: Started, spin_us: float = 0.0) -> list[int]:
    """Latencies (ns) of `count` hand-offs from a ThreadedProducer to a blocked Python pop."""
    q = _C.ActivationQueue(4, "handoff", spin_us=spin_us)
    producer = native_ext.load().ThreadedProducer(q, payload, count, interval_us)
    started()
    latencies = []
    for _ in range(count):
        bundle = q.pop()
        latencies.append(_C.now_ns() - bundle.enqueued_ns)
    producer.join()
    return latencies


def python_to_python_queue(count: int, interval_us: int, payload: list[torch.Tensor],
                           started: Started) -> list[int]:
    """The baseline: a Python thread sleeping `interval_us`, then `queue.Queue.put`."""
    q: queue.Queue[tuple[int, list[torch.Tensor]]] = queue.Queue(4)

    def produce() -> None:
        for _ in range(count):
            time.sleep(interval_us * 1e-6)
            q.put((time.monotonic_ns(), payload))

    producer = threading.Thread(target=produce)
    producer.start()
    started()
    latencies = []
    for _ in range(count):
        stamp, _tensors = q.get()
        latencies.append(time.monotonic_ns() - stamp)
    producer.join()
    return latencies


def split_native_latency(count: int, interval_us: int, payload: list[torch.Tensor],
                         started: Started) -> tuple[list[int], list[int]]:
    """Each native hand-off as (wake-up, after wake-up) in ns: the pop's blocked time (its
    pop_wait growth) ends at `start + waited`; hand-offs without a wait are left out."""
    q = _C.ActivationQueue(4, "split")
    producer = native_ext.load().ThreadedProducer(q, payload, count, interval_us)
    started()
    wake, after, waited_before = [], [], 0.0
    for _ in range(count):
        start = _C.now_ns()
        bundle = q.pop()
        end = _C.now_ns()
        waited = q.stats()["pop_wait_s"]
        delta = round((waited - waited_before) * 1e9)
        waited_before = waited
        if delta > 0:
            wake.append(start + delta - bundle.enqueued_ns)
            after.append(end - start - delta)
    producer.join()
    return wake, after


def channel(kind: str, name: str, spin_us: float) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(put, get) of an ActivationQueue (`aq`), held `threading.Lock` (`lock`) or `queue.Queue`."""
    if kind == "aq":
        q = _C.ActivationQueue(1, name, spin_us=spin_us)
        return (lambda: q.push([])), q.pop
    if kind == "lock":
        lock = threading.Lock()
        lock.acquire()
        return lock.release, lock.acquire
    box: queue.Queue[None] = queue.Queue(1)
    return (lambda: box.put(None)), box.get


def ping_pong(kind: str, rounds: int, started: Started, spin_us: float = 0.0) -> list[int]:
    """Round-trip times (ns) to a partner thread echoing each message, through `channel`s."""
    (send, take), (reply, receive) = channel(kind, "ping", spin_us), channel(kind, "pong", spin_us)

    def echo() -> None:
        for _ in range(rounds):
            take()
            reply()

    partner = threading.Thread(target=echo)
    partner.start()
    started()
    times, clock = [], time.perf_counter_ns
    for _ in range(rounds):
        t0 = clock()
        send()
        receive()
        times.append(clock() - t0)
    partner.join()
    return times


def machine() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{harness.machine()}, {platform.system()} {platform.release()}, "
            f"{torch.get_num_threads()} intra-op threads, load average at start {load}")


def publish(key: str, section: str, write: bool) -> None:
    """Prints `section`; with `write`, puts it between its `<!-- key -->` markers in core.md."""
    print(section)
    if not write:
        return
    core = RESULTS / "core.md"
    text = core.read_text() if core.exists() else "# Core microbenchmarks (issue 2)\n"
    block = f"<!-- {key} -->\n{section.strip()}\n<!-- /{key} -->"
    pattern = re.compile(rf"<!-- {re.escape(key)} -->.*?<!-- /{re.escape(key)} -->", re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else (
        text.rstrip() + "\n\n" + block + "\n")
    core.write_text(text)
    print(f"\nwritten to {core}")


def measure(count: int, interval_us: int, trips: int, rounds: int,
            spin_us: float) -> dict[str, dict[str, list[int]]]:
    """Samples (ns) per placement and variant, pooled over `rounds` interleaved rounds."""
    placements = ("split", "same", "free") if len(os.sched_getaffinity(0)) >= 2 else ("free",)
    payload = [torch.zeros(64, 64)]
    one_way: dict[str, Callable[..., Any]] = {
        "native": native_to_python, "queue": python_to_python_queue,
        "native_spin": functools.partial(native_to_python, spin_us=spin_us),
        "split": split_native_latency}
    round_trip = {k: functools.partial(ping_pong, kind, spin_us=spin) for k, kind, spin in
                  (("aq", "aq", 0.0), ("lock", "lock", 0.0), ("pyq", "pyq", 0.0),
                   ("aq_spin", "aq", spin_us))}

    def driver(pl: str, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        def run() -> Any:
            with placement(pl) as started:
                return fn(*args, started)
        return run

    drivers: dict[tuple[str, str], Callable[[], Any]] = {}
    for pl in placements:
        drivers |= {(pl, k): driver(pl, fn, count, interval_us, payload)
                    for k, fn in one_way.items()}
        drivers |= {(pl, k): driver(pl, fn, trips) for k, fn in round_trip.items()}
    pooled: dict[str, dict[str, list[int]]] = {pl: {} for pl in placements}
    for (pl, key), runs in harness.alternate(drivers, rounds).items():
        if key == "split":  # (wake-up, after it) per run
            pooled[pl]["wake"] = [x for wake, _ in runs for x in wake]
            pooled[pl]["after"] = [x for _, after in runs for x in after]
        else:
            pooled[pl][key] = [x for run in runs for x in run]
    return pooled


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    """The median, 10th and 90th percentile of `values`."""
    ordered, n = sorted(values), len(values)
    return statistics.median(ordered), ordered[n // 10], ordered[9 * n // 10]


def ratio(s: dict[str, list[float]], key: str, floor: str, goal: float) -> str:
    """Median of `key` over median of `floor`, and whether it meets `goal`."""
    value = s[key][0] / s[floor][0]
    met = "met" if value <= goal else (f"missed by {value / goal:.2f}x" if goal < 1 else
                                       f"missed: {100 * (value - 1):.0f}% over")
    return f"**{value:.2f}** {met}"


DETAILS = (("(a) ActivationQueue, C++ ThreadedProducer", "native"),
           ("(a) queue.Queue, Python producer thread", "queue"),
           ("(a) split run: consumer wake-up (C++ side)", "wake"),
           ("(a) split run: after wake-up (mutex, GIL, Bundle to Python)", "after"),
           ("(b) round trip, two ActivationQueues", "aq"),
           ("(b) round trip, two threading.Lock (floor)", "lock"),
           ("(b) round trip, two queue.Queue", "pyq"),
           ("(a) ActivationQueue with spin_us={}", "native_spin"),
           ("(b) round trip, two ActivationQueues with spin_us={}", "aq_spin"))


def handoff_section(count: int, interval_us: int, trips: int, rounds: int, spin_us: float) -> str:
    clock_gap, setting = check_clocks(), machine()
    summary, details = [], []
    for pl, got in measure(count, interval_us, trips, rounds, spin_us).items():
        # per variant: median, p10, p90 (µs) and the number of samples
        s = {k: [*(x / 1e3 for x in percentiles(v)), len(v)] for k, v in got.items()}
        med = {k: f"{v[0]:.1f}" for k, v in s.items()}
        summary.append([pl, med["native"], med["queue"], ratio(s, "native", "queue", 0.5),
                        med["aq"], med["lock"], med["pyq"], ratio(s, "aq", "lock", 1.1),
                        med["native_spin"], ratio(s, "native_spin", "queue", 0.5),
                        med["aq_spin"], ratio(s, "aq_spin", "lock", 1.1)])
        details += [f"#### placement `{pl}`", "", *harness.markdown_table(
            ["variant", "median µs", "p10 µs", "p90 µs", "samples"],
            [(label.format(f"{spin_us:g}"), *(f"{x:.1f}" for x in s[key][:3]), s[key][3])
             for label, key in DETAILS]), ""]
    spin = f"spin {spin_us:g} µs"
    table = harness.markdown_table(
        ["placement", "(a) ActivationQueue µs", "(a) queue.Queue µs", "(a) ratio, goal <= 0.50",
         "(b) ActivationQueue µs", "(b) Lock floor µs", "(b) queue.Queue µs",
         "(b) ratio, goal <= 1.10", f"(a) {spin}", "(a) ratio", f"(b) {spin}", "(b) ratio"],
        summary)
    table[1] = "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | --- | ---: | --- |"
    return "\n".join([
        "## Queue hand-off (bench/bench_core.py --set handoff)", "",
        f"Command: `python bench/bench_core.py --set handoff --count {count} --interval-us "
        f"{interval_us} --trips {trips} --rounds {rounds} --spin-us {spin_us:g}`  ",
        f"Machine: {setting}  ",
        f"Clock check: `_C.now_ns()` always lay within {clock_gap} ns of the bracketing "
        "`time.monotonic_ns()` readings (same CLOCK_MONOTONIC).  ",
        f"(a): one-way latency, producer thread -> Python consumer blocked in pop, "
        f"{interval_us} µs between pushes, payload one 64x64 float tensor. "
        "(b): round trip between two Python threads. Placements: `split` = the two threads "
        "pinned to different CPUs, `same` = both on one CPU, `free` = unpinned.", "",
        *table, "", "### Distributions", "", *details]).rstrip()


# ---- ring ------------------------------------------------------------------------------------
LAYERS, WIDTH = 100, 360
SNAPSHOT, FLAT = "WeightRing.snapshot()", "flat dst.copy_(src), same bytes"
STASH_DROP = "state_dict clone stash, dropped at once"
STASH_KEEP = "state_dict clone stash, last 4 kept"
COPY_KEPT = "breakdown: state_dict copy_ into 200 kept tensors"


def variants() -> tuple[dict[str, Callable[[], object]], _C.WeightRing, int]:
    """The stage's variants, its ring of 4 slots and its bytes of parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ring = _C.WeightRing(list(model.parameters()), 4)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    kept = {k: v.clone() for k, v in model.state_dict().items()}

    def stash(keep: int) -> Callable[[], None]:  # PipeDream's, the last `keep` kept alive
        alive: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=keep)
        return lambda: alive.append({k: v.clone() for k, v in model.state_dict().items()})

    def copy_into_kept() -> None:
        for k, v in model.state_dict().items():
            kept[k].copy_(v)

    return {SNAPSHOT: lambda: ring.release(ring.snapshot()), FLAT: lambda: dst.copy_(src),
            STASH_DROP: stash(0), STASH_KEEP: stash(4), COPY_KEPT: copy_into_kept}, ring, nbytes


def timed(fn: Callable[[], object], reps: int) -> tuple[list[float], int]:
    """Seconds per call (one sample per call) and the minor page faults of all calls."""
    samples, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def ring_section(reps: int, rounds: int) -> str:
    setting = machine()
    fns, ring, nbytes = variants()
    runs = harness.alternate({k: functools.partial(timed, fn, reps) for k, fn in fns.items()},
                             rounds)
    samples = {k: [t for times, _ in v for t in times] for k, v in runs.items()}
    faults = {k: sum(n for _, n in v) for k, v in runs.items()}
    median = {k: statistics.median(v) for k, v in samples.items()}
    snap = median[SNAPSHOT]
    of_flat, vs_drop, vs_keep = (median[k] / snap for k in (FLAT, STASH_DROP, STASH_KEEP))
    rows = [(name, *(f"{x * 1e3:.2f}" for x in percentiles(values)),
             f"{nbytes / median[name] / 1e9:.2f}", f"{median[name] / snap:.2f}x",
             f"{faults[name] / len(values):.0f}") for name, values in samples.items()]
    goal_bw = "met" if of_flat >= 0.8 else f"MISSED by {100 * (0.8 - of_flat):.0f} points"
    met = [name for name, x in (("dropped", vs_drop), ("kept", vs_keep)) if x >= 3]
    verdict = ("met for both stash variants" if len(met) == 2 else
               f"met only against the {met[0]} stash" if met else
               f"MISSED by {3 / max(vs_drop, vs_keep):.2f}x")
    return "\n".join([
        "## Weight-ring snapshot (bench/bench_core.py --set ring)", "",
        f"Command: `python bench/bench_core.py --set ring --reps {reps} --rounds {rounds}`  ",
        f"Machine: {setting}  ",
        f"Stage: {LAYERS} x Linear({WIDTH}, {WIDTH}) = {ring.num_params} parameter tensors, "
        f"{nbytes / 1e6:.1f} MB float32 ({nbytes // 4096} pages of 4 KiB), ring of 4 slots; "
        f"{rounds * reps} timed calls per variant.", "",
        *harness.markdown_table(["variant", "median ms", "p10 ms", "p90 ms", "GB/s",
                                 "vs snapshot", "page faults/call"], rows), "",
        f"Snapshot bandwidth / flat copy: **{100 * of_flat:.0f}%** (goal >= 80%): {goal_bw}.  ",
        f"Snapshot speed-up over the state_dict stash (goal >= 3x): {verdict} (dropped: "
        f"{vs_drop:.1f}x, last 4 kept: {vs_keep:.1f}x)."])


# ---- streams ---------------------------------------------------------------------------------
LENGTHS, WALK = (1_000, 10_000, 100_000, 1_000_000), 20_000


def validated(name: str, n: int) -> Any:
    """The schedule of `n` microbatches (4 stages; 4 chunks where it steps per minibatch;
    interleaved 2 stages a rank; data-parallel 4 replicas), validated."""
    kw: dict = {"num_stages": 4, **({"chunks": 4} if schedule_kind(name).chunked_steps else {})}
    if name == "interleaved-1f1b":
        kw["stages_per_rank"] = 2
    if name == "data-parallel":
        kw.update(num_stages=1, replicas=[4])
    schedule = make_schedule(name, num_microbatches=n, **kw)
    validate(schedule)
    return schedule


def start_up(name: str, n: int) -> str:
    """Seconds to a validated schedule and every rank's first action, microseconds per action
    over rank 0's first WALK actions, peak MiB of the same with tracemalloc on."""
    began = time.perf_counter()
    schedule = validated(name, n)
    programs = [schedule.program(r) for r in range(schedule.num_ranks)]
    for program in programs:
        next(program)
    seconds = time.perf_counter() - began
    walked = time.perf_counter()
    count = sum(1 for _ in itertools.islice(programs[0], WALK))  # fewer if the run is short
    per_action_us = (time.perf_counter() - walked) / count * 1e6
    tracemalloc.start()  # again, measured apart: tracing slows the walk down
    for _ in itertools.islice(validated(name, n).program(0), WALK):
        pass
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return f"{seconds * 1e3:.0f} ms, {per_action_us:.0f} µs/action, {peak:.2f} MiB"


def million_steps(seconds: float) -> list[str]:
    command = [sys.executable, "-m", "pipedream_fast.cli", *("train --model cnn --threads 2 "
               "--schedule pipedream --steps 1000000 --batch-size 32 --log-every 20").split()]
    began = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    stop = threading.Timer(seconds, proc.kill)  # which ends its output, and the loop
    stop.start()
    first_loss, next_sample = None, 0.0
    samples: list[tuple[float, float, str]] = []
    try:
        for line in proc.stdout:
            now = time.perf_counter() - began
            if "loss" in line and now >= next_sample:  # the first loss line, then every 10%
                first_loss = now if first_loss is None else first_loss
                status = Path(f"/proc/{proc.pid}/status").read_text()  # no VmRSS once exited
                samples.append((now, int(status.split("VmRSS:")[1].split()[0]) / 1024
                                if "VmRSS:" in status else math.nan, line.strip()))
                next_sample = now + seconds / 10
    finally:
        stop.cancel()
        proc.kill()
        proc.wait()
    return [f"Command: `{' '.join(['pipedream-fast'] + command[3:])}`, stopped after "
            f"{seconds:.0f} s.", "",
            f"First loss line after **{first_loss:.1f} s** (profiling and planning the CNN "
            f"included)." if first_loss is not None else "No loss line appeared.", "",
            "| seconds | resident MiB | last line |", "| ---: | ---: | --- |",
            *[f"| {t:.0f} | {m:.0f} | `{text}` |" for t, m, text in samples]]


def streams_text(seconds: float) -> str:
    rows = []
    for name in TRAINABLE:
        rows.append([name, *(start_up(name, n) for n in LENGTHS)])
        print(" | ".join(rows[-1]), flush=True)
    return "\n".join([
        "# Schedules as streams: start-up and memory against the run's length", "",
        f"Command: `{harness.command()}`", "", f"Machine: {harness.machine()}.", "",
        "## Start-up: make the schedule, validate it, every rank's first action", "",
        f"Each cell: start-up time; time per action while rank 0's first {WALK:,} actions are "
        f"generated; peak Python memory of the start-up plus that walk (4 stages; 4 "
        f"microbatches per step where the schedule steps per minibatch; interleaved: 2 ranks "
        f"x 2 stages; data-parallel: 4 replicas).", "",
        *harness.markdown_table(["schedule", *(f"N = {n:,}" for n in LENGTHS)], rows), "",
        "## A million steps, end to end", "", *million_steps(seconds)]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", choices=("handoff", "ring", "streams"), required=True)
    parser.add_argument("--rounds", type=int, help="interleaved rounds (handoff 6, ring 10)")
    parser.add_argument("--count", type=int, default=1000, help="handoff: hand-offs a run (a)")
    parser.add_argument("--interval-us", type=int, default=200, help="handoff: producer pause")
    parser.add_argument("--trips", type=int, default=2000, help="handoff: round trips a run (b)")
    parser.add_argument("--spin-us", type=float, default=500.0, help="handoff: spinners' spin_us")
    parser.add_argument("--reps", type=int, default=10, help="ring: timed calls per round")
    parser.add_argument("--seconds", type=float, default=150.0, help="streams: training time")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    rounds = args.rounds or (6 if args.set == "handoff" else 10)
    if args.set == "streams":
        harness.emit(None if args.no_write else RESULTS / "streams.md", streams_text(args.seconds))
    else:
        publish(args.set, handoff_section(args.count, args.interval_us, args.trips, rounds,
                                          args.spin_us) if args.set == "handoff"
                else ring_section(args.reps, rounds), write=not args.no_write)
    return 0


# ---- pytest-benchmark: the planner (issue 3; the original PipeDream took up to 8 s) -------------
def synthetic_profile(num_blocks: int = 100, seed: int = 0) -> Profile:
    """Uneven blocks: 3-30 ms, 0.1-10 MB activations, up to 100 MB of parameters each."""
    rng = random.Random(seed)
    blocks = [BlockProfile(name=f"block{k}", forward_ms=rng.uniform(1, 10),
                           backward_ms=rng.uniform(2, 20),
                           activation_bytes=rng.randint(10**5, 10**7),
                           parameter_bytes=rng.randint(10**4, 10**8), optimizer_state_bytes=0,
                           extra={"saved_bytes": rng.randint(10**5, 10**7)})
              for k in range(num_blocks)]
    return Profile(model="synthetic-100", batch_size=32, device="cpu", blocks=blocks)


@pytest.mark.parametrize("topology", ["4x1e11,4x2.5e10,4x1.25e9", "2x1e11,4x2e10,8x1e9", "64x1e10"])
def test_plan_100_blocks_64_workers(benchmark, topology: str) -> None:
    plan = benchmark(make_plan, synthetic_profile(), Topology.parse(topology))
    assert plan.workers <= 64 and plan.stages[-1].stop == 100
    assert benchmark.stats.stats.median < 1.0


def test_plan_with_memory_limit_3_levels(benchmark) -> None:
    """Informational: a memory limit makes tables depend on the position in the pipeline."""
    topo = Topology.parse("4x1e11,4x2.5e10,4x1.25e9", memory_per_worker=2 * 10**9)
    plan = benchmark.pedantic(make_plan, args=(synthetic_profile(), topo), rounds=3, iterations=1)
    assert all(s.extra["memory_bytes"] <= 2 * 10**9 for s in plan.stages)


if __name__ == "__main__":
    sys.exit(main())
