"""pytest-benchmark runs of the core microbenchmarks (issue 2); no assertions on speed.

    python -m pytest bench/bench_core.py --benchmark-only

Groups: `pingpong` (a round trip between two threads: two ActivationQueues, two Locks, the
floor, and two queue.Queues; threads pinned `split` or `same`, see bench/handoff.py);
`snapshot` (bench/ring.py's variants); `handoff` (runs of 100 paced hand-offs; each run's
latency median in `extra_info["median_latency_us"]`).
"""

from __future__ import annotations

import queue
import statistics
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from pipedream_fast import _C

# Scripts next to this file: pytest puts bench/ (no __init__.py) on sys.path.
import handoff
import ring as ring_bench

RoundTrip = Callable[[], object]


# ---- ping-pong -------------------------------------------------------------------------------

def _activation_queue_pair() -> Iterator[RoundTrip]:
    there, back = _C.ActivationQueue(1, "ping"), _C.ActivationQueue(1, "pong")

    def echo() -> None:
        while True:
            try:
                there.pop()
            except _C.QueueClosed:
                return
            back.push([])

    partner = threading.Thread(target=echo, daemon=True)
    partner.start()
    yield lambda: (there.push([]), back.pop())
    there.close()
    partner.join(10)


def _lock_pair() -> Iterator[RoundTrip]:
    there, back = threading.Lock(), threading.Lock()
    there.acquire()
    back.acquire()
    stop = False

    def echo() -> None:
        while True:
            there.acquire()
            if stop:
                return
            back.release()

    partner = threading.Thread(target=echo, daemon=True)
    partner.start()
    yield lambda: (there.release(), back.acquire())
    stop = True
    there.release()
    partner.join(10)


def _queue_pair() -> Iterator[RoundTrip]:
    there: queue.Queue[int | None] = queue.Queue(1)
    back: queue.Queue[int] = queue.Queue(1)

    def echo() -> None:
        while there.get() is not None:
            back.put(1)

    partner = threading.Thread(target=echo, daemon=True)
    partner.start()
    yield lambda: (there.put(1), back.get())
    there.put(None)
    partner.join(10)


PAIRS = {"activation_queue": _activation_queue_pair, "lock_floor": _lock_pair,
         "queue_queue": _queue_pair}


@pytest.mark.benchmark(group="pingpong", warmup=True)
@pytest.mark.parametrize("placement", ["split", "same"])
@pytest.mark.parametrize("kind", list(PAIRS))
def test_pingpong(benchmark, kind: str, placement: str) -> None:
    with handoff.placement(placement) as started:
        pair = PAIRS[kind]()
        round_trip = next(pair)  # the partner thread starts here, on the partner's CPU
        started()
        benchmark.pedantic(round_trip, rounds=3000, iterations=1, warmup_rounds=300)
        next(pair, None)  # stop the partner thread


# ---- snapshot --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stage() -> tuple[torch.nn.Module, _C.WeightRing, int]:
    model = ring_bench.build_stage()
    weights = _C.WeightRing(list(model.parameters()), 4)
    return model, weights, ring_bench.param_bytes(model)


@pytest.mark.benchmark(group="snapshot", warmup=True)
@pytest.mark.parametrize("kind", ["ring_snapshot", "flat_copy", "state_dict_dropped",
                                  "state_dict_keep4"])
def test_snapshot(benchmark, stage, kind: str) -> None:
    model, weights, nbytes = stage
    fn = {
        "ring_snapshot": lambda: ring_bench.snapshot_fn(weights),
        "flat_copy": lambda: ring_bench.flat_copy_fn(nbytes),
        "state_dict_dropped": lambda: ring_bench.state_dict_fn(model, keep=0),
        "state_dict_keep4": lambda: ring_bench.state_dict_fn(model, keep=4),
    }[kind]()
    benchmark.pedantic(fn, rounds=60, iterations=1, warmup_rounds=5)
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GB_per_s_median"] = nbytes / benchmark.stats.stats.median / 1e9


# ---- hand-off latency ------------------------------------------------------------------------

@pytest.mark.benchmark(group="handoff")
@pytest.mark.parametrize("placement", ["split", "same"])
@pytest.mark.parametrize("kind", ["native_producer_to_activation_queue",
                                  "python_producer_to_queue_queue"])
def test_handoff_latency(benchmark, kind: str, placement: str) -> None:
    run = {"native_producer_to_activation_queue": handoff.native_to_python,
           "python_producer_to_queue_queue": handoff.python_to_python_queue}[kind]
    payload = [torch.zeros(64, 64)]
    medians: list[float] = []

    def one_run() -> None:
        with handoff.placement(placement) as started:
            medians.append(statistics.median(run(100, 200, payload, started)) / 1e3)

    benchmark.pedantic(one_run, rounds=10, iterations=1, warmup_rounds=1)
    benchmark.extra_info["median_latency_us"] = statistics.median(medians[1:])
