"""Hand-off benchmarks of the activation queue (issue 2), side by side with Python's own tools.

Two questions, each against the baseline the issue names:

(a) Latency from a native producer thread (what the communication engine will be) to a
    Python consumer already blocked in `pop`: `ThreadedProducer` (bench/csrc, a bench-only
    extension that bench/native_ext.py builds on first use) pushes one bundle every
    `interval_us`, the consumer takes `_C.now_ns()` when `pop` returns and subtracts the
    bundle's `enqueued_ns`. Baseline: `queue.Queue` fed by a Python thread that sleeps the
    same interval and stamps `time.monotonic_ns()` right before `put`. Both stamps come from
    CLOCK_MONOTONIC (`_C.now_ns` is std::chrono::steady_clock); `check_clocks()` verifies it.
    Goal: median at most half of queue.Queue's.
(b) Round trip between two Python threads through two ActivationQueues, against the floor
    of two bare `threading.Lock`s handed back and forth, and against two `queue.Queue`s.
    Goal: within 10% of the Lock floor.

Where the two threads run decides most of the figure on a small VM (a wake-up across
vCPUs costs tens of µs, one on the same vCPU a few), so each comparison is made under three
placements: `split` (the two threads pinned to different CPUs: the production case of a
communication thread feeding a compute thread), `same` (both pinned to one CPU) and `free`
(the scheduler decides). The variants run interleaved, `repeats` times each, and samples
are pooled, so load from other processes hits all of them alike. For (a) the script also
splits the queue's latency into the consumer's wake-up (from `stats()['pop_wait_s']`) and
what follows it (mutex, GIL, the Bundle's conversion to Python), which is what the result
note discusses.

Run: `python bench/handoff.py` (writes its section of bench/results/core.md; `--no-write`
only prints). `write_results_section` is shared with bench/ring.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import queue
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from pathlib import Path

import torch

from pipedream_fast import _C

# A script next to this one: bench/ is on sys.path when run as `python bench/handoff.py`.
import native_ext  # the bench-only extension with ThreadedProducer, built on first use

RESULTS = Path(__file__).resolve().parent / "results" / "core.md"


# ---- clocks ----------------------------------------------------------------------------------

def check_clocks(samples: int = 1000) -> int:
    """Checks that `_C.now_ns()` reads the same clock as `time.monotonic_ns()`.

    Returns the largest gap seen between a `now_ns()` reading and the monotonic readings
    that bracket it (0 when it always lies between them). Raises if the clocks disagree.
    """
    worst = 0
    for _ in range(samples):
        before = time.monotonic_ns()
        native = _C.now_ns()
        after = time.monotonic_ns()
        gap = max(before - native, native - after, 0)
        worst = max(worst, gap)
    if worst > 1_000_000:
        raise RuntimeError(f"_C.now_ns() is not time.monotonic_ns(): off by {worst} ns; "
                           "latency across the two clocks would be meaningless")
    return worst


# ---- thread placement -------------------------------------------------------------------------

PLACEMENTS = ("split", "same", "free")
Started = Callable[[], None]


def _nothing() -> None:
    pass


@contextlib.contextmanager
def placement(kind: str) -> Iterator[Started]:
    """Pins this thread and the partner thread it starts inside the block.

    A new thread (Python or native) inherits the CPU mask of the thread that creates it. In
    the block this thread first runs on CPU b, so the partner it starts lands on b; calling
    the yielded function after the start moves this thread to CPU a (`split`) or leaves it
    on b (`same`). `free`, or a machine with one CPU, pins nothing.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if kind == "free" or len(cpus) < 2:
        yield _nothing
        return
    a, b = cpus[0], cpus[1]
    os.sched_setaffinity(0, {b})
    try:
        yield lambda: os.sched_setaffinity(0, {a if kind == "split" else b})
    finally:
        os.sched_setaffinity(0, set(cpus))


# ---- (a) native producer -> blocked Python consumer ------------------------------------------

def native_to_python(count: int, interval_us: int, payload: list[torch.Tensor],
                     started: Started = _nothing, spin_us: float = 0.0) -> list[int]:
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
                           started: Started = _nothing) -> list[int]:
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
                         started: Started = _nothing) -> tuple[list[int], list[int]]:
    """Splits each native hand-off into (wake-up, after wake-up) in ns.

    The queue's pop_wait counter grows by the time a pop spent blocked, measured in C++ from
    the start of the wait to the return of the condition-variable wait. The consumer notes
    `now_ns()` before `pop`, so `start + waited` is when the wait ended: wake-up is that
    minus `enqueued_ns`, the rest is releasing the mutex, taking the GIL and converting the
    Bundle. Hand-offs that found the queue non-empty (no wait) are left out.
    """
    q = _C.ActivationQueue(4, "split")
    producer = native_ext.load().ThreadedProducer(q, payload, count, interval_us)
    started()
    wake, after = [], []
    waited_before = 0.0
    for _ in range(count):
        start = _C.now_ns()
        bundle = q.pop()
        end = _C.now_ns()
        waited = q.stats()["pop_wait_s"]
        delta = round((waited - waited_before) * 1e9)
        waited_before = waited
        if delta > 0:
            woke = start + delta
            wake.append(woke - bundle.enqueued_ns)
            after.append(end - woke)
    producer.join()
    return wake, after


# ---- (b) Python <-> Python ping-pong ---------------------------------------------------------

def _ping_pong(send: Callable[[], object], receive: Callable[[], object],
               echo: Callable[[], None], rounds: int, started: Started) -> list[int]:
    """Round-trip times (ns): this thread sends and waits for the partner's echo."""
    partner = threading.Thread(target=echo)
    partner.start()
    started()
    times = []
    clock = time.perf_counter_ns
    for _ in range(rounds):
        t0 = clock()
        send()
        receive()
        times.append(clock() - t0)
    partner.join()
    return times


def ping_pong_activation_queue(rounds: int, started: Started = _nothing,
                               spin_us: float = 0.0) -> list[int]:
    there = _C.ActivationQueue(1, "ping", spin_us=spin_us)
    back = _C.ActivationQueue(1, "pong", spin_us=spin_us)

    def echo() -> None:
        for _ in range(rounds):
            there.pop()
            back.push([])

    return _ping_pong(lambda: there.push([]), back.pop, echo, rounds, started)


def ping_pong_lock(rounds: int, started: Started = _nothing) -> list[int]:
    """The floor: each side blocks on a held lock that the other side releases."""
    there, back = threading.Lock(), threading.Lock()
    there.acquire()
    back.acquire()

    def echo() -> None:
        for _ in range(rounds):
            there.acquire()
            back.release()

    return _ping_pong(there.release, back.acquire, echo, rounds, started)


def ping_pong_queue(rounds: int, started: Started = _nothing) -> list[int]:
    there: queue.Queue[None] = queue.Queue(1)
    back: queue.Queue[None] = queue.Queue(1)

    def echo() -> None:
        for _ in range(rounds):
            there.get()
            back.put(None)

    return _ping_pong(lambda: there.put(None), back.get, echo, rounds, started)


# ---- reporting -------------------------------------------------------------------------------

def summary_us(samples: list[int]) -> dict[str, float]:
    ordered = sorted(samples)
    n = len(ordered)
    return {"median": statistics.median(ordered) / 1e3, "p10": ordered[n // 10] / 1e3,
            "p90": ordered[(9 * n) // 10] / 1e3, "n": float(n)}


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} intra-op threads), load average at start {load}")


def write_results_section(key: str, markdown: str, path: Path = RESULTS) -> None:
    """Replaces (or appends) the section between `<!-- key -->` markers in core.md."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else (
        "# Core microbenchmarks (issue 2)\n\n"
        "Written by `bench/handoff.py` and `bench/ring.py`; each section says how it was "
        "made. pytest-benchmark variants: "
        "`python -m pytest bench/bench_core.py --benchmark-only`.\n")
    block = f"<!-- {key} -->\n{markdown.strip()}\n<!-- /{key} -->"
    pattern = re.compile(rf"<!-- {re.escape(key)} -->.*?<!-- /{re.escape(key)} -->", re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else (
        text.rstrip() + "\n\n" + block + "\n")
    path.write_text(text)


def table(rows: list[tuple[str, dict[str, float]]]) -> str:
    lines = ["| variant | median µs | p10 µs | p90 µs | samples |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, s in rows:
        lines.append(f"| {name} | {s['median']:.1f} | {s['p10']:.1f} | {s['p90']:.1f} "
                     f"| {int(s['n'])} |")
    return "\n".join(lines)


def measure(count: int, interval_us: int, rounds: int, repeats: int,
            placements: tuple[str, ...], spin_us: float) -> dict[str, dict[str, list[int]]]:
    """Samples (ns) per placement and variant, interleaved over `repeats`."""
    payload = [torch.zeros(64, 64)]
    native_to_python(200, interval_us, payload)  # warm-up: threads, allocator, code paths
    python_to_python_queue(200, interval_us, payload)
    for warm in (ping_pong_activation_queue, ping_pong_lock, ping_pong_queue):
        warm(500)
    keys = ("native", "queue", "wake", "after", "aq", "lock", "pyq", "native_spin", "aq_spin")
    pooled = {pl: {k: [] for k in keys} for pl in placements}

    def native_spin(*args: Any) -> list[int]:
        return native_to_python(*args, spin_us=spin_us)

    def aq_spin(*args: Any) -> list[int]:
        return ping_pong_activation_queue(*args, spin_us=spin_us)

    one_way = [(native_to_python, "native"), (python_to_python_queue, "queue"),
               (native_spin, "native_spin")]
    round_trip = [(ping_pong_activation_queue, "aq"), (ping_pong_lock, "lock"),
                  (ping_pong_queue, "pyq"), (aq_spin, "aq_spin")]
    for r in range(repeats):
        for pl in placements:
            got = pooled[pl]
            for fn, key in (one_way if r % 2 == 0 else one_way[::-1]):
                with placement(pl) as started:
                    got[key] += fn(count, interval_us, payload, started)
            with placement(pl) as started:
                wake, after = split_native_latency(count, interval_us, payload, started)
            got["wake"] += wake
            got["after"] += after
            for fn, key in round_trip[r % 4:] + round_trip[:r % 4]:
                with placement(pl) as started:
                    got[key] += fn(rounds, started)
        print(f"  repeat {r + 1}/{repeats} done", file=sys.stderr)
    return pooled


def verdicts(s: dict[str, dict[str, float]], spin: bool = False) -> tuple[float, str, float, str]:
    ratio_a = s["native_spin" if spin else "native"]["median"] / s["queue"]["median"]
    ratio_b = s["aq_spin" if spin else "aq"]["median"] / s["lock"]["median"]
    goal_a = "met" if ratio_a <= 0.5 else f"missed by {ratio_a / 0.5:.2f}x"
    goal_b = "met" if ratio_b <= 1.10 else f"missed: {100 * (ratio_b - 1):.0f}% over"
    return ratio_a, goal_a, ratio_b, goal_b


def run(count: int, interval_us: int, rounds: int, repeats: int, spin_us: float) -> str:
    """Measures everything and returns the markdown section."""
    clock_gap = check_clocks()
    setting = machine()
    placements = PLACEMENTS if len(os.sched_getaffinity(0)) >= 2 else ("free",)
    pooled = measure(count, interval_us, rounds, repeats, placements, spin_us)
    stats = {pl: {k: summary_us(v) for k, v in got.items()} for pl, got in pooled.items()}

    summary = [("| placement | (a) ActivationQueue µs | (a) queue.Queue µs "
                "| (a) ratio, goal <= 0.50 | (b) ActivationQueue µs | (b) Lock floor µs "
                "| (b) queue.Queue µs | (b) ratio, goal <= 1.10 "
                f"| (a) spin {spin_us:g} µs | (a) ratio | (b) spin {spin_us:g} µs | (b) ratio |"),
               "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | --- | ---: | --- |"]
    details = []
    for pl, s in stats.items():
        ratio_a, goal_a, ratio_b, goal_b = verdicts(s)
        spin_a, spin_goal_a, spin_b, spin_goal_b = verdicts(s, spin=True)
        summary.append(f"| {pl} | {s['native']['median']:.1f} | {s['queue']['median']:.1f} "
                       f"| **{ratio_a:.2f}** {goal_a} | {s['aq']['median']:.1f} "
                       f"| {s['lock']['median']:.1f} | {s['pyq']['median']:.1f} "
                       f"| **{ratio_b:.2f}** {goal_b} | {s['native_spin']['median']:.1f} "
                       f"| **{spin_a:.2f}** {spin_goal_a} | {s['aq_spin']['median']:.1f} "
                       f"| **{spin_b:.2f}** {spin_goal_b} |")
        details += [
            f"#### placement `{pl}`",
            "",
            table([
                ("(a) ActivationQueue, C++ ThreadedProducer", s["native"]),
                ("(a) queue.Queue, Python producer thread", s["queue"]),
                ("(a) split run: consumer wake-up (C++ side)", s["wake"]),
                ("(a) split run: after wake-up (mutex, GIL, Bundle to Python)", s["after"]),
                ("(b) round trip, two ActivationQueues", s["aq"]),
                ("(b) round trip, two threading.Lock (floor)", s["lock"]),
                ("(b) round trip, two queue.Queue", s["pyq"]),
                (f"(a) ActivationQueue with spin_us={spin_us:g}", s["native_spin"]),
                (f"(b) round trip, two ActivationQueues with spin_us={spin_us:g}", s["aq_spin"]),
            ]),
            "",
        ]
    command = (f"python bench/handoff.py --count {count} --interval-us {interval_us} "
               f"--rounds {rounds} --repeats {repeats} --spin-us {spin_us:g}")
    return "\n".join([
        "## Queue hand-off (bench/handoff.py)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {setting}  ",
        (f"Clock check: `_C.now_ns()` always lay within {clock_gap} ns of the bracketing "
         "`time.monotonic_ns()` readings (same CLOCK_MONOTONIC).  "),
        (f"(a): one-way latency, producer thread -> Python consumer blocked in pop, "
         f"{interval_us} µs between pushes, payload one 64x64 float tensor. "
         "(b): round trip between two Python threads. Placements: `split` = the two threads "
         "pinned to different CPUs, `same` = both on one CPU, `free` = unpinned."),
        "",
        "\n".join(summary),
        "",
        "### Distributions",
        "",
        *details,
    ]).rstrip()


def publish(key: str, section: str, write: bool) -> None:
    """Prints a results section and, unless `write` is off, stores it in bench/results/core.md."""
    print(section)
    if write:
        write_results_section(key, section)
        print(f"\nwritten to {RESULTS}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="hand-offs per run in (a)")
    parser.add_argument("--interval-us", type=int, default=200, help="producer pause in (a)")
    parser.add_argument("--rounds", type=int, default=2000, help="round trips per run in (b)")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved runs per variant")
    parser.add_argument("--spin-us", type=float, default=500.0,
                        help="spin_us of the opt-in spinning variants (default 500, more than "
                             "--interval-us so the consumer is still spinning when data comes)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    publish("handoff", run(args.count, args.interval_us, args.rounds, args.repeats,
                           args.spin_us), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
