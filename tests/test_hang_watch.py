"""The hang watch: a rank that makes no progress for `hang_report` seconds says where it
stands (its action, what it waits for, receives posted, sends queued), once per
action, long before the run fails at its timeout."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.ir import Action, ActionKind as K
from pipedream_fast.launch import launch
from pipedream_fast.options import OptionError, PipelineOptions
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.runtime.hang_watch import HangWatch

STEPS, CHUNKS, BATCH = 3, 2, 8
SLOW_CALL, SLOW_S, REPORT_S = 3, 2.5, 0.5
PLAN = Plan("mlp", BATCH // CHUNKS, 2, "1f1b",
            [StagePlan(0, 2, 1, (0,), 1.0), StagePlan(2, 3, 1, (1,), 1.0)], 1.0, 1.0)


class Standing:
    """An executor as the watch sees it: the action in progress and where it stands."""

    def __init__(self) -> None:
        self.current: tuple[int, Action, float] | None = None

    def standing(self, now: float) -> str | None:
        if self.current is None:
            return None
        return f"in action {self.current[0]} for {now - self.current[2]:.1f} s"


def test_an_action_is_reported_once_after_the_delay_and_a_later_one_again():
    executor, written = Standing(), []
    watch = HangWatch(3, 10.0, lambda: executor, write=written.append)
    assert watch.check(100.0) is None  # between actions
    executor.current = (7, Action(K.FORWARD, 1, 0, version=0), 100.0)
    assert watch.check(109.9) is None  # not yet
    report = watch.check(110.0)
    assert report is not None and report.startswith("pipedream_fast: rank 3 has made no "
                                                     "progress: in action 7 for 10.0 s")
    assert "after 10 s without progress" in report
    assert watch.check(150.0) is None  # the same action: one report
    executor.current = (8, Action(K.BACKWARD, 1, 0, version=0), 150.0)
    assert watch.check(161.0) is not None  # the next one stuck again
    assert written == watch.reports and len(written) == 2


def test_a_report_reaches_stderr_as_one_whole_line_in_one_write(monkeypatch):
    """Ranks share the launcher's stderr: a report written as text, then newline, joined
    rank 1's report to rank 0's in a CI log, and a reader looking for rank 0's line missed it."""
    import sys

    class Stream:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    stream = Stream()
    monkeypatch.setattr(sys, "stderr", stream)
    executor = Standing()
    executor.current = (7, Action(K.FORWARD, 1, 0, version=0), 100.0)
    report = HangWatch(0, 10.0, lambda: executor).check(110.0)
    assert stream.writes == [f"{report}\n"]


def test_hang_report_defaults_to_a_fifth_of_the_timeout_and_refuses_nonsense():
    assert PipelineOptions(timeout=100).hang_report_s == 20
    assert PipelineOptions(hang_report=0).hang_report_s == 0
    with pytest.raises(OptionError, match="hang_report must be seconds >= 0"):
        PipelineOptions(hang_report=-1)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g))
            for _ in range(STEPS)]


class SlowLoss:
    """The last stage's loss, which stalls on its `SLOW_CALL`-th call (a peer stuck in its
    own code, for a while)."""

    def __init__(self, stall: bool) -> None:
        self.calls, self.stall = 0, stall

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.stall and self.calls == SLOW_CALL:
            time.sleep(SLOW_S)
        return nn.functional.mse_loss(out, target)


def stall_job(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for stall in (False, True):
        pipe = Pipeline(mlp(), SlowLoss(stall), lambda ps: torch.optim.SGD(ps, lr=0.1),
                        plan=PLAN, schedule="1f1b", chunks=CHUNKS, timeout=60,
                        hang_report=REPORT_S)
        losses = [float(x) for x in pipe.train(batches(), STEPS)]
        watch = pipe._run_loop.hang_watch
        assert watch is not None
        out[stall] = (losses, list(watch.reports))
        pipe.close()
        out["stopped"] = watch._thread is None
    return out


@pytest.fixture(scope="module")
def stalled() -> list[dict[str, Any]]:
    return launch(stall_job, 2, timeout=120)


def test_a_stalled_peer_is_reported_by_both_ranks_long_before_the_timeout(stalled):
    waiting, stuck = stalled[0][True][1], stalled[1][True][1]
    # Rank 0 waits for the gradient its backward needs; rank 1 is in its own code.
    assert any("rank 0 has made no progress: in action" in r
               and "waiting for the gradient of stage 0, microbatch" in r
               and "from rank 1" in r for r in waiting), waiting
    assert any("rank 1 has made no progress: in action" in r and "(1F" in r
               and "not waiting for a message" in r for r in stuck), stuck


def test_the_watch_changes_nothing_and_stops_with_the_pipeline(stalled):
    for rank_out in stalled:
        assert rank_out[True][0] == rank_out[False][0]  # the same losses, stalled or not
        assert rank_out["stopped"]


def test_a_stop_request_is_reported_once_when_the_action_in_progress_outlasts_it():
    executor, written, heard = Standing(), [], [None]
    watch = HangWatch(1, 60.0, lambda: executor, write=written.append,
                      stop_heard=lambda: heard[0])
    executor.current = (4, Action(K.FORWARD, 1, 0, version=0), 100.0)
    assert watch.check_stop(130.0, 500.0) is None  # no request
    heard[0] = 499.5
    assert watch.check_stop(130.0, 500.0) is None  # the request is too recent
    report = watch.check_stop(131.0, 501.0)
    assert report == ("pipedream_fast: rank 1, asked to stop 1.5 s ago, is still in action 4 "
                      "for 31.0 s (where it stands, should the stop not finish)")
    assert watch.check_stop(140.0, 510.0) is None  # once per request
    executor.current = (5, Action(K.FORWARD, 1, 1, version=0), 140.0)
    heard[0] = 520.0
    assert watch.check_stop(140.5, 522.0) is None  # the action began only just now
    assert written == [report]


HUNG_JOB = """\
import sys, time, torch
from pathlib import Path
from torch import nn
from pipedream_fast import Pipeline

def loss(out, target):  # rank 1's user code hangs at its third microbatch
    loss.calls += 1
    if loss.calls == 3:
        Path(sys.argv[1]).touch()
        time.sleep(600)
    return nn.functional.mse_loss(out, target)
loss.calls = 0

torch.manual_seed(0)
pipe = Pipeline(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), loss,
                lambda ps: torch.optim.SGD(ps, lr=0.1), schedule="1f1b", chunks=2,
                balance=[2, 1], timeout=300, hang_report=0.5)
data = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(4)]
for _ in pipe.train(data, steps=4):
    pass
"""


def test_sigterm_during_a_hang_says_where_each_rank_stands_before_the_grace_ends(tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    job, hung, log = tmp_path / "job.py", tmp_path / "hung", tmp_path / "stderr.txt"
    job.write_text(HUNG_JOB)
    root = Path(__file__).resolve().parent.parent
    with open(log, "w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "pipedream_fast.cli", "run",
                                     "--nproc", "2", str(job), str(hung)], cwd=root,
                                    stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        # SIGTERM only once rank 0's own hang report says it waits for rank 1's gradient
        # (a fixed pause after rank 1 hangs is too short on a loaded machine).
        deadline = time.monotonic() + 120
        while not any(line.startswith("pipedream_fast: rank 0 has made no progress")
                      and "waiting for the gradient" in line
                      for line in log.read_text().splitlines()):
            assert launcher.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"rank 0 never reported its wait: {log.read_text()}"
            time.sleep(0.1)
        assert hung.exists()
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    finally:
        launcher.kill()
    stderr = log.read_text()
    # The default 5 s grace ends in SIGKILL (nothing progresses); before it, each rank said
    # where it was: rank 0 blocked in C++ waiting for rank 1, rank 1 in its own code.
    assert "SIGKILL" in stderr, stderr
    assert any(line.startswith("pipedream_fast: rank 0, asked to stop ") and
               "waiting for the gradient of stage 0, microbatch" in line and "from rank 1" in line
               for line in stderr.splitlines()), stderr
    assert any(line.startswith("pipedream_fast: rank 1, asked to stop ") and
               "not waiting for a message" in line for line in stderr.splitlines()), stderr
