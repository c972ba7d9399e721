"""Hand-off benchmarks of the activation queue (issue 2), against Python's own tools.

(a) Latency from a native producer thread (`ThreadedProducer`, bench/native_ext.py's bench-only
    extension, one bundle every `interval_us`) to a Python consumer blocked in `pop`, against
    `queue.Queue` fed by a Python thread; both stamps on CLOCK_MONOTONIC (`check_clocks`).
    Goal: median at most half of queue.Queue's. A split run divides the queue's latency into
    the consumer's wake-up (`stats()['pop_wait_s']`) and what follows (mutex, GIL, Bundle).
(b) Round trip between two Python threads through two ActivationQueues, against two bare
    `threading.Lock`s (the floor) and two `queue.Queue`s. Goal: within 10% of the Lock floor.

Each under three placements of the two threads (a wake-up across vCPUs costs tens of µs):
`split` (pinned to different CPUs), `same` (one CPU), `free`; variants interleaved, `repeats`
times each, samples pooled. `python bench/handoff.py` writes its section of
bench/results/core.md (`--no-write`: print only).
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
from pathlib import Path
from typing import Any

import torch

from pipedream_fast import _C

import harness  # noqa: E402 - siblings
import native_ext  # the bench-only extension with ThreadedProducer, built on first use

RESULTS = Path(__file__).resolve().parent / "results" / "core.md"


# ---- clocks ----------------------------------------------------------------------------------

def check_clocks(samples: int = 1000) -> int:
    """The largest gap between a `_C.now_ns()` reading and the `time.monotonic_ns()` readings
    that bracket it (0: always between them); raises if the two clocks disagree."""
    worst = 0
    for _ in range(samples):
        before, native, after = time.monotonic_ns(), _C.now_ns(), time.monotonic_ns()
        worst = max(worst, before - native, native - after)
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
    """Pins this thread and the partner it starts in the block: a new thread inherits its
    creator's CPU mask, so the partner lands on CPU b; the yielded function, called after the
    start, moves this thread to CPU a (`split`) or leaves it on b (`same`)."""
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
    """Each native hand-off as (wake-up, after wake-up) in ns: the pop's blocked time (its
    pop_wait growth) ends the wait at `start + waited`; hand-offs without a wait are left out."""
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
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{harness.machine()}, {platform.system()} {platform.release()}, "
            f"{torch.get_num_threads()} intra-op threads, load average at start {load}")


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
    return "\n".join(harness.markdown_table(
        ["variant", "median µs", "p10 µs", "p90 µs", "samples"],
        [(n, f"{s['median']:.1f}", f"{s['p10']:.1f}", f"{s['p90']:.1f}", int(s["n"]))
         for n, s in rows]))


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
    clock_gap, setting = check_clocks(), machine()
    placements = PLACEMENTS if len(os.sched_getaffinity(0)) >= 2 else ("free",)
    pooled = measure(count, interval_us, rounds, repeats, placements, spin_us)
    stats = {pl: {k: summary_us(v) for k, v in got.items()} for pl, got in pooled.items()}
    spin = f"spin {spin_us:g} µs"
    summary, details = [], []
    for pl, s in stats.items():
        ra, ga, rb, gb = verdicts(s)
        sa, sga, sb, sgb = verdicts(s, spin=True)
        med = {k: f"{v['median']:.1f}" for k, v in s.items()}
        summary.append([pl, med["native"], med["queue"], f"**{ra:.2f}** {ga}", med["aq"],
                        med["lock"], med["pyq"], f"**{rb:.2f}** {gb}", med["native_spin"],
                        f"**{sa:.2f}** {sga}", med["aq_spin"], f"**{sb:.2f}** {sgb}"])
        details += [f"#### placement `{pl}`", "", table([(label, s[key]) for label, key in (
            ("(a) ActivationQueue, C++ ThreadedProducer", "native"),
            ("(a) queue.Queue, Python producer thread", "queue"),
            ("(a) split run: consumer wake-up (C++ side)", "wake"),
            ("(a) split run: after wake-up (mutex, GIL, Bundle to Python)", "after"),
            ("(b) round trip, two ActivationQueues", "aq"),
            ("(b) round trip, two threading.Lock (floor)", "lock"),
            ("(b) round trip, two queue.Queue", "pyq"),
            (f"(a) ActivationQueue with spin_us={spin_us:g}", "native_spin"),
            (f"(b) round trip, two ActivationQueues with spin_us={spin_us:g}", "aq_spin"))]), ""]
    header = ["placement", "(a) ActivationQueue µs", "(a) queue.Queue µs",
              "(a) ratio, goal <= 0.50", "(b) ActivationQueue µs", "(b) Lock floor µs",
              "(b) queue.Queue µs", "(b) ratio, goal <= 1.10", f"(a) {spin}", "(a) ratio",
              f"(b) {spin}", "(b) ratio"]
    table_lines = harness.markdown_table(header, summary)
    table_lines[1] = "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | --- | ---: | --- |"
    return "\n".join([
        "## Queue hand-off (bench/handoff.py)", "",
        f"Command: `python bench/handoff.py --count {count} --interval-us {interval_us} "
        f"--rounds {rounds} --repeats {repeats} --spin-us {spin_us:g}`  ",
        f"Machine: {setting}  ",
        f"Clock check: `_C.now_ns()` always lay within {clock_gap} ns of the bracketing "
        "`time.monotonic_ns()` readings (same CLOCK_MONOTONIC).  ",
        f"(a): one-way latency, producer thread -> Python consumer blocked in pop, "
        f"{interval_us} µs between pushes, payload one 64x64 float tensor. "
        "(b): round trip between two Python threads. Placements: `split` = the two threads "
        "pinned to different CPUs, `same` = both on one CPU, `free` = unpinned.", "",
        *table_lines, "", "### Distributions", "", *details]).rstrip()


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
