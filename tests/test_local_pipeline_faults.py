"""Faults in the thread front end (`LocalPipeline`): every wait is bounded by the timeout, the
first failure surfaces at once with its rank named, a rank stuck in its own code is reported
after the timeout and left behind, and leaving `train()` early (break, exception, Ctrl-C,
`close()`) stops every rank and leaves the pipeline ready for the next `train()`."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream_fast import _C
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.local_pipeline import LocalPipeline, WorkerStuck
from pipedream_fast.runtime.transport import ACTIVATION, ThreadHub, ThreadTransport
from runtime_reference import train_reference

CHUNKS, BATCH = 2, 8


RELEASE = threading.Event()  # not an attribute: a replica's module is a deep copy


class Fault(nn.Module):
    """Identity, with a fault to order: raise, hang (until `RELEASE` is set) or sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "ok"
        self.sleep_s = 0.0
        self.calls = 0

    def __deepcopy__(self, memo: dict) -> Fault:
        copy = Fault()
        copy.mode, copy.sleep_s = self.mode, self.sleep_s
        return copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("injected fault")
        if self.mode == "hang":
            RELEASE.wait(60)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return x


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), Fault(), nn.Tanh(),   # stage 0: blocks 0..2
                         nn.Linear(12, 12), Fault(), nn.Linear(12, 4))  # stage 1: blocks 3..5


def plan(replicated: bool = False) -> Plan:
    """Two stages on ranks 0 and 1, or (`replicated`) stage 0 on ranks 0 and 1, 1 on 2."""
    first = (0, 1) if replicated else (0,)
    return Plan(model="faults", batch_size=BATCH, workers=len(first) + 1, schedule="1f1b",
                stages=[StagePlan(0, 3, len(first), first, 1.0),
                        StagePlan(3, 6, 1, (len(first),), 1.0)],
                bottleneck_ms=1.0, data_parallel_ms=1.0)


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(steps)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # no momentum: no optimizer state to carry


def make(timeout: float, schedule: str = "1f1b", replicated: bool = False
         ) -> tuple[LocalPipeline, Fault, Fault]:
    net = model()
    pipe = LocalPipeline(net, loss_fn, sgd, plan(replicated), schedule=schedule, chunks=CHUNKS,
                         timeout=timeout)
    return pipe, net[1], net[4]  # the (first replica's) stage modules hold these very modules


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name.startswith("pipedream-rank") and t.is_alive()]


def assert_clean(pipe: LocalPipeline) -> None:
    assert workers() == []
    for runtime in (rt for p in pipe._ranks for rt in p._stages.runtimes.values()):
        assert not runtime.inflight and not runtime.input_grads
        assert runtime.ring is None or runtime.ring.held_versions() == []


@pytest.fixture(autouse=True)
def no_leftover_threads():
    yield
    deadline = time.monotonic() + 10
    while workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers() == [], "a test left rank threads running"


# --- the hub -------------------------------------------------------------------------------

def test_a_closed_hub_gives_closed_queues_and_reduces_even_made_later():
    hub = ThreadHub(2, timeout_s=30.0)
    hub.close()
    start = time.monotonic()
    with pytest.raises(_C.QueueClosed, match="the run was stopped"):
        ThreadTransport(hub, 1).wait_recv(0, ACTIVATION, 1, 0)
    with pytest.raises(_C.QueueClosed):
        ThreadTransport(hub, 0).send(1, ACTIVATION, 1, 0, [torch.zeros(1)])
    with pytest.raises(RuntimeError, match="abandoned"):
        ThreadTransport(hub, 0).allreduce([0, 1], [torch.zeros(1)])
    assert time.monotonic() - start < 1.0


def test_an_allreduce_whose_replica_never_comes_times_out():
    hub = ThreadHub(2, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 0.3 s"):
        ThreadTransport(hub, 0).allreduce([0, 1], [torch.zeros(1)])
    assert time.monotonic() - start < 2.0


# --- failures ------------------------------------------------------------------------------

def test_an_error_on_rank_0s_first_action_surfaces_at_once():
    pipe, first, _ = make(timeout=30)
    list(pipe.train(data(1), steps=1))  # warm: the first call's set-up is not the point
    first.mode = "raise"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0, action 0 .*injected fault"):
        list(pipe.train(data(4), steps=4))
    assert time.monotonic() - start < 2.0
    assert_clean(pipe)
    first.mode = "ok"  # the pipeline is usable again
    assert len(list(pipe.train(data(2), steps=2))) == 2


@pytest.mark.parametrize("stuck_stage", [0, 1])
def test_a_stage_that_hangs_is_reported_after_the_timeout_and_left_behind(stuck_stage):
    pipe, *faults = make(timeout=3)
    RELEASE.clear()
    fault = faults[stuck_stage]
    fault.mode = "hang"
    start = time.monotonic()
    with pytest.raises(WorkerStuck) as caught:
        list(pipe.train(data(4), steps=4))
    elapsed = time.monotonic() - start
    message = str(caught.value)
    try:
        assert 2.9 < elapsed < 5.5, elapsed
        assert f"rank {stuck_stage} is in action" in message and "left behind" in message
        assert "over the timeout of 3 s" in message
        stuck = workers()
        assert [t.name for t in stuck] == [f"pipedream-rank{stuck_stage}"]
        with pytest.raises(RuntimeError, match=f"cannot run: rank {stuck_stage} is in action"):
            list(pipe.train(data(2), steps=2))
    finally:
        fault.mode = "ok"
        RELEASE.set()
    deadline = time.monotonic() + 5
    while workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers() == []
    assert len(list(pipe.train(data(2), steps=2))) == 2  # usable once the thread is back
    assert_clean(pipe)


def test_a_hung_replica_stops_the_run_and_its_twin_waits_no_longer_than_the_timeout():
    pipe, first, _ = make(timeout=3, replicated=True)
    RELEASE.clear()
    first.mode = "hang"  # rank 0's replica of stage 0; rank 1's goes on to the all-reduce
    start = time.monotonic()
    try:
        with pytest.raises(WorkerStuck, match="rank 0 is in action .* left behind"):
            list(pipe.train(data(4), steps=4))
        assert 2.9 < time.monotonic() - start < 5.5
        assert [t.name for t in workers()] == ["pipedream-rank0"]
    finally:
        first.mode = "ok"
        RELEASE.set()
    while workers() and time.monotonic() - start < 15:
        time.sleep(0.05)
    for step, _ in enumerate(pipe.train(data(30), steps=30)):  # usable again; break it
        if step == 2:
            break
    assert_clean(pipe)
    assert len(list(pipe.train(data(3), steps=3))) == 3


def test_a_stage_slower_than_the_timeout_surfaces_at_the_timeout_not_when_it_ends():
    pipe, _, last = make(timeout=1.5)
    last.sleep_s = 4.0
    start = time.monotonic()
    with pytest.raises(WorkerStuck, match="rank 1"):
        list(pipe.train(data(2), steps=2))
    assert time.monotonic() - start < 3.0
    last.sleep_s = 0.0


# --- leaving train() early -----------------------------------------------------------------

def test_a_break_stops_every_rank_and_the_next_train_is_correct():
    pipe, first, _ = make(timeout=30)
    first.sleep_s = 0.002  # the ranks must not outrun the break by the whole run
    for step, _ in enumerate(pipe.train(data(30), steps=30)):
        if step == 2:
            break
    assert_clean(pipe)
    calls = first.calls
    time.sleep(0.3)
    assert first.calls == calls < 2 * 30  # nobody trains behind the caller's back
    first.sleep_s = 0.0
    after_break = pipe.state_dict()
    # The next train() starts clean from the weights the break left: it equals plain
    # training from those weights (SGD without momentum: no optimizer state to carry).
    losses = list(pipe.train(data(5), steps=5))
    assert len(losses) == 5 and all(torch.isfinite(x) for x in losses)
    reference = model()
    reference[1], reference[4] = nn.Identity(), nn.Identity()  # deep-copyable (no Event)
    reference.load_state_dict(after_break)
    want = train_reference(reference, data(5), CHUNKS, loss_fn, sgd)
    for key, value in want.items():
        torch.testing.assert_close(pipe.state_dict()[key], value, atol=2e-5, rtol=1e-4)
    assert_clean(pipe)


def test_closing_the_generator_stops_every_rank():
    pipe, first, _ = make(timeout=30, schedule="pipedream")
    first.sleep_s = 0.002
    run = pipe.train(data(30), steps=30)
    next(run)
    run.close()
    assert_clean(pipe)
    first.sleep_s = 0.0
    assert len(list(pipe.train(data(3), steps=3))) == 3


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_an_exception_in_the_callers_loop_propagates_and_stops_every_rank(error):
    pipe, first, _ = make(timeout=30)
    first.sleep_s = 0.002
    with pytest.raises(error):
        for step, _ in enumerate(pipe.train(data(30), steps=30)):
            if step == 1:
                raise error()
    assert_clean(pipe)
    first.sleep_s = 0.0
    assert len(list(pipe.train(data(3), steps=3))) == 3


def test_ctrl_c_while_train_waits_stops_every_rank():
    # A job started in the background (`cmd &` without job control) inherits SIGINT ignored,
    # and interrupt_main then does nothing: the test sets Python's own handler itself.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    pipe, _, last = make(timeout=30)
    last.sleep_s = 0.05
    timer = threading.Timer(0.5, _thread.interrupt_main)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            list(pipe.train(data(200), steps=200))
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 2.0
    assert_clean(pipe)


CLI = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the shell ignores it
from pipedream_fast.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_of_train_with_threads_exits_promptly_without_an_abort(tmp_path: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI, "train", "--threads", "2", "--data", "synthetic",
         "--model", "mlp", "--steps", "100000", "--log-every", "50", "--out",
         str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    guard = threading.Timer(120, proc.kill)  # never wait for all 100,000 steps
    guard.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the ranks are up once the first progress line is out
            if "step" in line and "loss" in line:
                break
        else:
            pytest.fail(f"no progress: {proc.stderr.read() if proc.stderr else ''}")
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "terminate called" not in err, err[-2000:]
    # 130 (the command's "interrupted"), or -2 if the KeyboardInterrupt went uncaught.
    assert proc.returncode in (130, 1, -signal.SIGINT), (proc.returncode, err[-2000:])
    assert "interrupted" in err or "KeyboardInterrupt" in err
    assert elapsed < 20, elapsed  # mostly the interpreter's own exit (torch) on shared cores
