"""Hand-off benchmarks of the activation queue (issue 2), against Python's own tools.

(a) One-way latency from a native producer thread (bench/native_ext.py's `ThreadedProducer`,
    a bundle every `interval_us`) to a Python consumer blocked in `pop`, against `queue.Queue`
    fed by a Python thread; goal: median at most half of queue.Queue's. A split run divides it
    into the consumer's wake-up and what follows (mutex, GIL, Bundle).
(b) Round trip between two Python threads through two ActivationQueues, against two
    `threading.Lock`s (the floor) and two `queue.Queue`s; goal: within 10% of the floor.

Threads placed `split` (two CPUs), `same` (one CPU) or `free`; variants interleaved, samples
pooled over `repeats`. `python bench/handoff.py` writes its section of bench/results/core.md
(`--no-write`: print only).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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

import torch

from pipedream_fast import _C

import harness  # noqa: E402 - siblings
import native_ext  # the bench-only extension with ThreadedProducer, built on first use

RESULTS = Path(__file__).resolve().parent / "results" / "core.md"
PLACEMENTS = ("split", "same", "free")
Started = Callable[[], None]


def _nothing() -> None:
    pass


def check_clocks(samples: int = 1000) -> int:
    """The largest gap (ns) between a `_C.now_ns()` reading and the `time.monotonic_ns()`
    readings around it; raises if the two clocks disagree."""
    worst = 0
    for _ in range(samples):
        before, native, after = time.monotonic_ns(), _C.now_ns(), time.monotonic_ns()
        worst = max(worst, before - native, native - after)
    if worst > 1_000_000:
        raise RuntimeError(f"_C.now_ns() is not time.monotonic_ns(): off by {worst} ns")
    return worst


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


# ---- (a) producer thread -> blocked Python consumer ------------------------------------------

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
    pop_wait growth) ends at `start + waited`; hand-offs without a wait are left out."""
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
            wake.append(start + delta - bundle.enqueued_ns)
            after.append(end - start - delta)
    producer.join()
    return wake, after


# ---- (b) Python <-> Python round trips -------------------------------------------------------

def ping_pong(kind: str, rounds: int, started: Started = _nothing,
              spin_us: float = 0.0) -> list[int]:
    """Round-trip times (ns): this thread sends and waits for the partner's echo, through two
    ActivationQueues (`aq`), two held `threading.Lock`s each side releases for the other
    (`lock`, the floor) or two `queue.Queue`s (`pyq`)."""
    if kind == "aq":
        there = _C.ActivationQueue(1, "ping", spin_us=spin_us)
        back = _C.ActivationQueue(1, "pong", spin_us=spin_us)
        send, receive, take, reply = (lambda: there.push([])), back.pop, there.pop, (
            lambda: back.push([]))
    elif kind == "lock":
        there, back = threading.Lock(), threading.Lock()
        there.acquire()
        back.acquire()
        send, receive, take, reply = there.release, back.acquire, there.acquire, back.release
    else:
        there, back = queue.Queue(1), queue.Queue(1)
        send, receive, take, reply = (lambda: there.put(None)), back.get, there.get, (
            lambda: back.put(None))

    def echo() -> None:
        for _ in range(rounds):
            take()
            reply()

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


# ---- measuring and reporting -----------------------------------------------------------------

def machine() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{harness.machine()}, {platform.system()} {platform.release()}, "
            f"{torch.get_num_threads()} intra-op threads, load average at start {load}")


def publish(key: str, section: str, write: bool) -> None:
    """Prints a results section and, if `write`, puts it between the `<!-- key -->` markers
    of bench/results/core.md (replaced, or appended)."""
    print(section)
    if not write:
        return
    text = RESULTS.read_text() if RESULTS.exists() else "# Core microbenchmarks (issue 2)\n"
    block = f"<!-- {key} -->\n{section.strip()}\n<!-- /{key} -->"
    pattern = re.compile(rf"<!-- {re.escape(key)} -->.*?<!-- /{re.escape(key)} -->", re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else (
        text.rstrip() + "\n\n" + block + "\n")
    RESULTS.write_text(text)
    print(f"\nwritten to {RESULTS}")


def measure(count: int, interval_us: int, rounds: int, repeats: int,
            spin_us: float) -> dict[str, dict[str, list[int]]]:
    """Samples (ns) per placement and variant, interleaved over `repeats`."""
    placements = PLACEMENTS if len(os.sched_getaffinity(0)) >= 2 else ("free",)
    payload = [torch.zeros(64, 64)]
    native_to_python(200, interval_us, payload)  # warm-up: threads, allocator, code paths
    python_to_python_queue(200, interval_us, payload)
    for kind in ("aq", "lock", "pyq"):
        ping_pong(kind, 500)
    one_way = [(native_to_python, "native"), (python_to_python_queue, "queue"),
               (functools.partial(native_to_python, spin_us=spin_us), "native_spin")]
    round_trip = [(functools.partial(ping_pong, kind, spin_us=spin), key) for kind, spin, key in
                  (("aq", 0.0, "aq"), ("lock", 0.0, "lock"), ("pyq", 0.0, "pyq"),
                   ("aq", spin_us, "aq_spin"))]
    keys = [k for _, k in one_way + round_trip] + ["wake", "after"]
    pooled: dict[str, dict[str, list[int]]] = {pl: {k: [] for k in keys} for pl in placements}
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


def run(count: int, interval_us: int, rounds: int, repeats: int, spin_us: float) -> str:
    """Measures everything and returns the markdown section."""
    clock_gap, setting = check_clocks(), machine()
    summary, details = [], []
    for pl, got in measure(count, interval_us, rounds, repeats, spin_us).items():
        # per variant: median, p10, p90 (µs) and the number of samples
        s = {k: [statistics.median(v) / 1e3, sorted(v)[len(v) // 10] / 1e3,
                 sorted(v)[9 * len(v) // 10] / 1e3, len(v)] for k, v in got.items()}
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
        *table, "", "### Distributions", "", *details]).rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="hand-offs per run in (a)")
    parser.add_argument("--interval-us", type=int, default=200, help="producer pause in (a)")
    parser.add_argument("--rounds", type=int, default=2000, help="round trips per run in (b)")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved runs per variant")
    parser.add_argument("--spin-us", type=float, default=500.0,
                        help="spin_us of the spinning variants (above --interval-us: still "
                             "spinning when data comes)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    publish("handoff", run(args.count, args.interval_us, args.rounds, args.repeats,
                           args.spin_us), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
