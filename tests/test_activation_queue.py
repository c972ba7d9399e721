"""Tests of `pipedream_fast._C.ActivationQueue` and the native `ThreadedProducer`.

`ThreadedProducer` is bench-only: it lives in the extension that bench/native_ext.py builds on
first use (cached in build/bench_ext/), not in the library; its tests skip only where no
compiler or ninja can build it.

The queue is the hand-off between pipeline stages and between communication threads and the
compute thread, so what matters is exactly what a deadlocked or lossy pipeline would get
wrong: FIFO order with tags intact, blocking on both sides, timeouts and close() that wake
every waiter with a clear exception, the GIL being released while a thread waits, and no
copies of the tensors. Blocking is checked with threads and events; the only time bounds
are generous ones (a waiter must still be waiting after 0.2 s, must be woken within 10 s).
"""

from __future__ import annotations

import collections
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedream_fast import _C

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import native_ext  # noqa: E402  (bench/native_ext.py: the bench-only extension's loader)

WAKE_S = 10.0  # how long a woken thread may take to finish (generous: 2 busy cores)
STILL_BLOCKED_S = 0.2  # time a thread gets to reach its blocking call; it must still wait


class Runner(threading.Thread):
    """Runs `fn` in a daemon thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.started_call = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        self.started_call.set()
        try:
            self.result = self.fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            self.error = err

    def finish(self) -> None:
        self.join(WAKE_S)
        assert not self.is_alive(), "thread still blocked after close/push/pop"


def start(fn: Callable[[], object]) -> Runner:
    """Starts `fn` in a thread and gives it time to reach its blocking call."""
    runner = Runner(fn)
    runner.start()
    assert runner.started_call.wait(WAKE_S)
    runner.join(STILL_BLOCKED_S)
    return runner


def full_queue(capacity: int = 2, name: str = "full") -> _C.ActivationQueue:
    q = _C.ActivationQueue(capacity, name)
    for i in range(capacity):
        q.push([torch.tensor([i])], microbatch=i)
    return q


# ---- order, tags, identity -------------------------------------------------------------------

def test_fifo_order_and_tags() -> None:
    q = _C.ActivationQueue(8, "stage0->1")
    assert (q.capacity, q.name, len(q), q.closed) == (8, "stage0->1", 0, False)
    before = _C.now_ns()
    for mb in range(5):
        q.push([torch.full((2,), mb), torch.zeros(1)], microbatch=mb, version=10 + mb)
    after = _C.now_ns()
    assert len(q) == 5
    stamps = []
    for mb in range(5):
        b = q.pop()
        assert (b.microbatch, b.version, len(b.tensors)) == (mb, 10 + mb, 2)
        assert torch.equal(b.tensors[0], torch.full((2,), mb))
        stamps.append(b.enqueued_ns)
    assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= after
    assert len(q) == 0
    assert "microbatch=4" in repr(b) and "version=14" in repr(b)


def test_default_tags_and_empty_bundle() -> None:
    q = _C.ActivationQueue(1)
    assert q.name == "queue"
    q.push([])
    b = q.pop()
    assert (b.tensors, b.microbatch, b.version) == ([], -1, -1)


def test_tensors_are_not_copied() -> None:
    q = _C.ActivationQueue(2, "nocopy")
    a, b = torch.arange(1000.0), torch.ones(3, 4, dtype=torch.float64)
    q.push([a, b], microbatch=0)
    out = q.pop().tensors
    assert [t.data_ptr() for t in out] == [a.data_ptr(), b.data_ptr()]
    out[0][0] = -7.0  # same storage: the producer's tensor sees the write
    assert a[0].item() == -7.0
    assert out[1].dtype == torch.float64 and out[1].shape == (3, 4)


def test_try_pop() -> None:
    q = _C.ActivationQueue(2, "try")
    assert q.try_pop() is None
    q.push([torch.zeros(1)], microbatch=3)
    got = q.try_pop()
    assert got is not None and got.microbatch == 3
    assert q.try_pop() is None


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.one_of(st.integers(0, 1000), st.none()), max_size=40),
       capacity=st.integers(1, 5))
def test_behaves_like_a_bounded_deque(ops: list[int | None], capacity: int) -> None:
    """Random push (an int) / pop (None) sequences, non-blocking: same as a bounded deque."""
    q = _C.ActivationQueue(capacity, "model")
    model: collections.deque[int] = collections.deque()
    high = 0
    for op in ops:
        if op is None:
            got = q.try_pop()
            if model:
                assert got is not None and got.microbatch == model.popleft()
            else:
                assert got is None
        elif len(model) < capacity:
            q.push([], microbatch=op, timeout=0)
            model.append(op)
            high = max(high, len(model))
        else:
            with pytest.raises(_C.QueueTimeout):
                q.push([], microbatch=op, timeout=0)
        assert len(q) == len(model)
    stats = q.stats()
    assert stats["high_water"] == high
    assert stats["pushed"] - stats["popped"] == len(model)


# ---- blocking --------------------------------------------------------------------------------

def test_push_blocks_while_full_until_a_pop() -> None:
    q = full_queue(2)
    pusher = start(lambda: q.push([torch.tensor([2])], microbatch=2))
    assert pusher.is_alive(), "push into a full queue returned without waiting"
    assert q.pop().microbatch == 0
    pusher.finish()
    assert pusher.error is None
    assert [q.pop().microbatch for _ in range(2)] == [1, 2]
    assert q.stats()["push_wait_s"] > 0


def test_pop_blocks_while_empty_until_a_push() -> None:
    q = _C.ActivationQueue(2, "empty")
    popper = start(q.pop)
    assert popper.is_alive(), "pop from an empty queue returned without waiting"
    q.push([torch.ones(2)], microbatch=5, version=1)
    popper.finish()
    assert popper.error is None
    assert (popper.result.microbatch, popper.result.version) == (5, 1)
    assert q.stats()["pop_wait_s"] > 0


@pytest.mark.parametrize("side", ["push", "pop"])
@pytest.mark.parametrize("timeout", [0.0, 0.05])
def test_timeout_raises_with_queue_name(side: str, timeout: float) -> None:
    name = "grad-recv-3"
    q = full_queue(1, name) if side == "push" else _C.ActivationQueue(1, name)

    def call() -> object:
        return q.push([], timeout=timeout) if side == "push" else q.pop(timeout=timeout)

    t0 = time.monotonic()
    with pytest.raises(_C.QueueTimeout, match=name) as info:
        call()
    assert time.monotonic() - t0 >= 0.9 * timeout
    assert isinstance(info.value, TimeoutError)
    assert "timed out" in str(info.value)
    assert len(q) == (1 if side == "push" else 0)  # a failed push leaves nothing behind


@pytest.mark.parametrize("side", ["push", "pop"])
def test_negative_timeout_is_rejected(side: str) -> None:
    q = _C.ActivationQueue(1, "neg")
    with pytest.raises(ValueError, match="timeout"):
        if side == "push":
            q.push([], timeout=-0.5)
        else:
            q.pop(timeout=-1)
    assert len(q) == 0


@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_below_one_is_rejected(capacity: int) -> None:
    with pytest.raises(ValueError, match=r"'acts'.*capacity must be >= 1, got " + str(capacity)):
        _C.ActivationQueue(capacity, "acts")


# ---- close -----------------------------------------------------------------------------------

def test_close_wakes_every_blocked_popper_and_pusher() -> None:
    empty = _C.ActivationQueue(1, "empty")
    full = full_queue(1)
    poppers = [start(empty.pop) for _ in range(3)]
    pushers = [start(lambda: full.push([torch.zeros(1)])) for _ in range(3)]
    assert all(r.is_alive() for r in poppers + pushers)
    empty.close()
    full.close()
    for r in poppers + pushers:
        r.finish()
        assert isinstance(r.error, _C.QueueClosed), r.error
        assert isinstance(r.error, RuntimeError)
    assert "empty" in str(poppers[0].error) and "full" in str(pushers[0].error)
    assert len(full) == 1  # the blocked pushes added nothing


def test_pop_drains_before_reporting_closed() -> None:
    q = _C.ActivationQueue(4, "drain")
    for mb in range(3):
        q.push([torch.tensor([mb])], microbatch=mb)
    q.close()
    q.close()  # idempotent
    assert q.closed
    with pytest.raises(_C.QueueClosed, match="closed queue 'drain'"):
        q.push([torch.zeros(1)])
    assert [q.pop(timeout=0).microbatch for _ in range(3)] == [0, 1, 2]
    with pytest.raises(_C.QueueClosed, match="drain"):
        q.pop()  # no timeout: must not wait on a closed, drained queue
    with pytest.raises(_C.QueueClosed):
        q.pop(timeout=0)
    assert q.try_pop() is None
    assert q.stats()["pushed"] == q.stats()["popped"] == 3


# ---- the GIL ---------------------------------------------------------------------------------

@pytest.mark.parametrize("side", ["pop", "push"])
def test_gil_is_released_while_blocked(side: str) -> None:
    """A thread blocked in push/pop must let other Python threads run.

    The blocked call has a 5 s timeout. If it held the GIL, this thread could not run its
    Python loop nor unblock it, and the blocked call would end in QueueTimeout instead.
    """
    q = full_queue(1, "gil") if side == "push" else _C.ActivationQueue(1, "gil")
    blocked = start(lambda: q.push([], microbatch=9, timeout=5.0) if side == "push"
                    else q.pop(timeout=5.0))
    assert blocked.is_alive()
    iterations = 0
    for _ in range(200_000):  # pure Python: needs the GIL on every bytecode
        iterations += 1
    if side == "push":
        assert q.pop().microbatch == 0
    else:
        q.push([torch.zeros(1)], microbatch=9)
    blocked.finish()
    assert blocked.error is None, f"blocked {side} kept the main thread out: {blocked.error!r}"
    assert iterations == 200_000
    assert q.stats()[f"{side}_wait_s"] > 0


# ---- counters --------------------------------------------------------------------------------

def test_counters_without_waiting() -> None:
    q = _C.ActivationQueue(4, "count")
    for i in range(3):
        q.push([], microbatch=i)
    q.pop()
    q.push([])
    q.try_pop()
    assert q.stats() == {"pushed": 4, "popped": 2, "push_wait_s": 0.0, "pop_wait_s": 0.0,
                         "high_water": 3}


def test_wait_counters_include_timed_out_waits() -> None:
    q = _C.ActivationQueue(1, "waits")
    with pytest.raises(_C.QueueTimeout):
        q.pop(timeout=0.02)
    q.push([])
    with pytest.raises(_C.QueueTimeout):
        q.push([], timeout=0.02)
    stats = q.stats()
    assert stats["pop_wait_s"] >= 0.015 and stats["push_wait_s"] >= 0.015
    assert (stats["pushed"], stats["popped"], stats["high_water"]) == (1, 0, 1)


# ---- many threads ----------------------------------------------------------------------------

def test_many_producers_and_consumers_lose_and_duplicate_nothing() -> None:
    producers, consumers, per_producer = 4, 4, 500
    q = _C.ActivationQueue(8, "mpmc")
    received: list[list[int]] = [[] for _ in range(consumers)]

    def produce(p: int) -> None:
        for i in range(per_producer):
            q.push([torch.tensor([p, i])], microbatch=p * per_producer + i, version=p)

    def consume(c: int) -> None:
        while True:
            try:
                b = q.pop(timeout=WAKE_S)
            except _C.QueueClosed:
                return
            assert b.tensors[0].tolist() == [b.version, b.microbatch - b.version * per_producer]
            received[c].append(b.microbatch)

    consumer_threads = [threading.Thread(target=consume, args=(c,)) for c in range(consumers)]
    producer_threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in consumer_threads + producer_threads:
        t.start()
    for t in producer_threads:
        t.join(60)
    q.close()
    for t in consumer_threads:
        t.join(60)
    assert not any(t.is_alive() for t in consumer_threads + producer_threads)
    everything = [mb for got in received for mb in got]
    assert sorted(everything) == list(range(producers * per_producer))
    for got in received:  # FIFO: each consumer sees each producer's items in push order
        for p in range(producers):
            mine = [mb for mb in got if mb // per_producer == p]
            assert mine == sorted(mine)
    stats = q.stats()
    assert stats["pushed"] == stats["popped"] == producers * per_producer
    assert 1 <= stats["high_water"] <= 8


# ---- the native producer thread --------------------------------------------------------------

@pytest.fixture(scope="module")
def bench_ext() -> ModuleType:
    """The bench-only extension with ThreadedProducer, built here if no build is cached."""
    missing = native_ext.missing_tools()
    if missing:
        pytest.skip(missing)
    return native_ext.load()


def test_threaded_producer_delivers_everything_in_order(bench_ext: ModuleType) -> None:
    q = _C.ActivationQueue(4, "native")
    payload = [torch.arange(6.0), torch.ones(2, dtype=torch.int64)]
    producer = bench_ext.ThreadedProducer(q, payload, 300)
    previous_stamp = 0
    for mb in range(300):
        b = q.pop(timeout=WAKE_S)
        assert (b.microbatch, b.version) == (mb, -1)
        assert [t.data_ptr() for t in b.tensors] == [t.data_ptr() for t in payload]
        assert b.enqueued_ns >= previous_stamp
        previous_stamp = b.enqueued_ns
    producer.join()
    producer.join()  # a second join is harmless
    assert len(q) == 0 and not q.closed
    assert q.stats()["pushed"] == 300


def test_threaded_producer_with_interval_meets_a_blocked_consumer(bench_ext: ModuleType) -> None:
    q = _C.ActivationQueue(2, "paced")
    producer = bench_ext.ThreadedProducer(q, [torch.zeros(1)], 5, interval_us=2000)
    got = [q.pop(timeout=WAKE_S).microbatch for _ in range(5)]
    producer.join()
    assert got == [0, 1, 2, 3, 4]
    assert q.stats()["pop_wait_s"] > 0


def test_threaded_producer_join_raises_when_queue_closed_under_it(bench_ext: ModuleType) -> None:
    q = _C.ActivationQueue(1, "shut")
    producer = bench_ext.ThreadedProducer(q, [torch.zeros(1)], 10)
    deadline = time.monotonic() + WAKE_S
    while len(q) < 1 and time.monotonic() < deadline:  # producer fills the queue and blocks
        time.sleep(0.001)
    q.close()
    with pytest.raises(_C.QueueClosed, match="shut"):
        producer.join()
    producer.join()  # the error is reported once
    assert q.pop().microbatch == 0  # what was pushed before close is still delivered


DROP_WITHOUT_JOIN = textwrap.dedent("""
    import faulthandler, sys, torch
    from pipedream_fast import _C
    sys.path.insert(0, sys.argv[1])
    import native_ext
    q = _C.ActivationQueue(4, "dropped")
    producer = native_ext.load().ThreadedProducer(q, [torch.zeros(3)], 2, interval_us=200_000)
    q.pop()  # the thread now sleeps before its second push
    faulthandler.dump_traceback_later(3, exit=True)  # native watchdog: needs no GIL
    del producer  # ~ThreadedProducer: close the queue, join the thread
    faulthandler.cancel_dump_traceback_later()
    print("dropped")
""")


def test_dropping_an_unjoined_producer_does_not_deadlock(bench_ext: ModuleType) -> None:
    # The fixture has built the extension: the child process loads the cached build.
    done = subprocess.run([sys.executable, "-c", DROP_WITHOUT_JOIN, str(BENCH)],
                          capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and "dropped" in done.stdout, done.stderr[-2000:]


def test_spinning_waiters_still_hand_over_in_order_and_honour_close():
    q = _C.ActivationQueue(2, "spin", spin_us=200.0)
    got: list[int] = []

    def consume() -> None:
        try:
            while True:
                got.append(q.pop(timeout=5).microbatch)
        except _C.QueueClosed:
            pass

    consumer = threading.Thread(target=consume)
    consumer.start()
    for i in range(200):
        q.push([torch.zeros(1)], microbatch=i, timeout=5)
    q.close()
    consumer.join(timeout=10)
    assert not consumer.is_alive()
    assert got == list(range(200))
    with pytest.raises(ValueError, match="spin_us"):
        _C.ActivationQueue(2, "bad", spin_us=-1.0)
