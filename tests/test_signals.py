"""Issue 10, item 1 and 7 (launchers): stopping is a first-class path; issue 22: signals as
clusters send them.

Faults injected into both launchers, `launch(fn, n)` and `pipedream-fast run` (and through
`launch`, `pipedream-fast train --nproc`): kill -9 of either rank, SIGTERM and SIGINT to the
launcher, a SIGSTOPped rank; SIGTERM to the launcher's whole process group, SIGHUP, SIGTERM
twice, SIGINT after SIGTERM. Each test asserts the outcome: every process is gone within the
grace period plus a few seconds, the right rank is named, each rank gets a signal once, and
the exit codes are those of a shell (128 + the signal number).

Process start-up (torch's import) dominates on 2 busy cores, so the ranks that are not the
point (the signal is) are plain scripts that do not import torch, and `pipedream-fast run` is
called in-process (as `cli.main`) where the signal can be sent to this process.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipedream_fast.cli import main
from pipedream_fast.launch import LaunchError, Stopped, launch
from pipedream_fast.stopping import DeferredStop

launch_module = sys.modules["pipedream_fast.launch"]  # the package exports the function too

ROOT = Path(__file__).resolve().parent.parent
GRACE = 2.0       # seconds the launchers give the ranks before SIGKILL, in these tests
SLACK = 8.0       # what "a few seconds" may take on 2 busy cores
START = 120.0     # how long the ranks may take to start (torch import on busy cores)


# --- helpers --------------------------------------------------------------------------------

def write_pid(folder: str | Path, rank: int | str) -> None:
    """The rank's pid in folder/rankN.pid, written whole (renamed into place)."""
    path = Path(folder) / f"rank{rank}.pid"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(path.with_suffix(".tmp"), path)


def wait_for_pids(folder: Path, ranks: Sequence[int], timeout: float = START,
                  alive: Callable[[], bool] = lambda: True) -> list[int]:
    deadline = time.monotonic() + timeout
    paths = [folder / f"rank{r}.pid" for r in ranks]
    while not all(p.exists() for p in paths):
        missing = ", ".join(p.name for p in paths if not p.exists())
        assert alive(), f"the launcher ended before its ranks started (no {missing})"
        assert time.monotonic() < deadline, (f"the ranks did not start: no {missing} in "
                                             f"{folder} after {timeout:g} s")
        time.sleep(0.05)
    return [int(p.read_text()) for p in paths]


def gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for its parent or init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """The pids still running after `timeout` seconds (killed by the test, so none leak)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if not gone(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


SLEEPER = """\
import os, sys, time
folder, rank = sys.argv[1], os.environ["RANK"]
path = os.path.join(folder, f"rank{rank}.pid")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
end = time.monotonic() + 60  # a safety net: the tests stop it long before
while time.monotonic() < end:
    time.sleep(0.05)
"""

# A real job: two ranks training a small MLP Pipeline on an endless stream of minibatches.
# Each writes its pid once it has trained a step.
TRAINER = """\
import itertools, os, sys
import torch
from torch import nn
from pipedream_fast import Pipeline
folder, rank = sys.argv[1], os.environ["RANK"]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                      nn.Linear(16, 4))
pipe = Pipeline(model, nn.functional.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.01),
                schedule="1f1b", chunks=2, balance=[3, 2], timeout=60)
data = ((torch.randn(8, 8), torch.randint(0, 4, (8,))) for _ in itertools.count())
for step, _ in enumerate(pipe.train(data, steps=10**6)):
    if step == 1:
        path = os.path.join(folder, f"rank{rank}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
"""


# A rank that notes every SIGTERM/SIGHUP it gets (rankN.signals, one name a line) and exits
# with 128 + the first one's number half a second after it ("slow": a clean-up, as a
# checkpoint save), or never ("stubborn").
STOPPER = """\
import os, signal, sys, time
folder, mode, rank = sys.argv[1], sys.argv[2], os.environ["RANK"]
got = []
def note(signum, frame):
    got.append((signum, time.monotonic()))
    with open(os.path.join(folder, f"rank{rank}.signals"), "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
for s in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, note)
path = os.path.join(folder, f"rank{rank}.pid")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
end = time.monotonic() + 60  # a safety net: the tests stop it long before
while time.monotonic() < end:
    time.sleep(0.02)
    if got and mode == "slow" and time.monotonic() - got[0][1] > 0.5:
        sys.exit(128 + got[0][0])
"""


def signals_got(folder: Path, ranks: Sequence[int]) -> list[list[str]]:
    return [(folder / f"rank{r}.signals").read_text().split() for r in ranks]


def script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(text)
    return path


def in_thread(work: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


# --- launch(): kill -9 of either rank -------------------------------------------------------

def busy_job(rank: int, world: int, folder: str) -> None:
    """All-reduces until a peer dies: the survivor fails on the closed connection."""
    write_pid(folder, rank)
    t = torch.zeros(1)
    end = time.monotonic() + 60  # a safety net: the test kills a rank long before
    while time.monotonic() < end:
        dist.all_reduce(t)
        time.sleep(0.01)


@pytest.mark.parametrize("victim", [1, 0])
def test_launch_names_the_rank_killed_by_sigkill_not_the_survivor(tmp_path, victim):
    killed_at: list[float] = []
    pids: list[int] = []

    def kill() -> None:
        pids.extend(wait_for_pids(tmp_path, [0, 1]))
        time.sleep(0.3)
        killed_at.append(time.monotonic())
        os.kill(pids[victim], signal.SIGKILL)

    thread = in_thread(kill)
    with pytest.raises(LaunchError) as info:
        launch(busy_job, 2, str(tmp_path), timeout=30, grace=GRACE)
    raised_at = time.monotonic()
    thread.join(1)
    err = info.value
    first_line = str(err).splitlines()[0]
    assert first_line.startswith(f"rank {victim} of 2 was killed by SIGKILL"), str(err)
    assert (err.rank, err.returncode, err.exit_code) == (victim, -signal.SIGKILL, 137)
    assert raised_at - killed_at[0] < GRACE + SLACK
    assert all(gone(p) for p in pids)  # launch reaped both before raising


def _rank(report: tuple | None, failed_at: float, exitcode: int | None = 1) -> Any:
    return launch_module._Rank(SimpleNamespace(exitcode=exitcode), queue.SimpleQueue(), None,
                               None, report=report, failed_at=failed_at)


def test_blame_prefers_a_killed_rank_then_an_own_error_then_a_peer_symptom():
    peer = ("error", "RuntimeError: Connection reset by peer", True)
    own = ("error", "ValueError: boom", False)
    stopped = ("stopped", "Stopped: stopped by SIGTERM", signal.SIGTERM)
    blame = launch_module._blame
    assert blame({0: _rank(peer, 1.0), 1: _rank(None, 1.2, -9)}) == 1
    assert blame({0: _rank(peer, 1.0), 1: _rank(own, 1.2)}) == 1
    assert blame({0: _rank(own, 1.1), 1: _rank(stopped, 1.2, None)}) == 1
    assert blame({0: _rank(peer, 1.1), 1: _rank(peer, 1.0)}) == 1  # else the earliest
    assert blame({0: _rank(("ok", b""), None, 0), 1: _rank(None, None, None)}) is None


# --- pipedream-fast run: signals to the launcher --------------------------------------------

# `python -m pipedream_fast.cli ARGS` with SIGHUP set as argv[1] says (SIG_DFL, SIG_IGN) and
# SIGINT as Python sets it at start-up, whatever this test run inherited. Under `nohup` SIGHUP
# is ignored, under `cmd &` in a script SIGINT too, and an ignored signal stays ignored in
# every child; the launcher (rightly) keeps an ignored SIGHUP ignored, so a test that sends
# the command a SIGHUP must start it as a terminal would, with SIGHUP at its default.
AS_STARTED = """\
import runpy, signal, sys
signal.signal(signal.SIGHUP, getattr(signal, sys.argv.pop(1)))
signal.signal(signal.SIGINT, signal.default_int_handler)
runpy.run_module("pipedream_fast.cli", run_name="__main__", alter_sys=True)
"""


def cli_process(*args: str, sighup: str = "SIG_DFL") -> subprocess.Popen[str]:
    """The command in a session of its own, so that a Ctrl-C (to its process group) reaches
    it and its ranks, not pytest; its SIGHUP `sighup` (default: as from a terminal), not what
    this test run inherited (see `AS_STARTED`)."""
    return subprocess.Popen([sys.executable, "-c", AS_STARTED, sighup, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def ignored_stop_signals(pid: int) -> str:
    """Which of SIGHUP, SIGINT and SIGTERM process `pid` ignores (its /proc status), for
    messages."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "?"
    mask = int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("SigIgn:")), 16)
    names = [s.name for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)
             if mask >> (s - 1) & 1]
    return ", ".join(names) or "none of SIGHUP, SIGINT, SIGTERM"


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def finish(process: subprocess.Popen[str], timeout: float, awaited: str) -> tuple[str, str]:
    """The (stdout, stderr) of `process` once it exits. If it has not within `timeout` seconds
    the test fails, naming what it waited for (`awaited`), the stop signals the process
    ignored and what it had written so far, rather than with a bare TimeoutExpired."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ignoring = ignored_stop_signals(process.pid)
        process.kill()
    try:
        stdout, stderr = process.communicate(timeout=5)
    except subprocess.TimeoutExpired as again:  # its ranks still hold the pipes
        stdout, stderr = again.stdout, again.stderr
    pytest.fail(f"{awaited}: still running {timeout:g} s later (it ignored: {ignoring}); "
                f"killed.\n--- its stdout so far ---\n{_text(stdout)}"
                f"--- its stderr so far ---\n{_text(stderr)}")


@pytest.mark.parametrize("signum, job", [(signal.SIGTERM, TRAINER), (signal.SIGINT, SLEEPER)],
                         ids=["SIGTERM-pipeline", "SIGINT-sleeper"])
def test_run_forwards_sigterm_and_sigint_and_leaves_no_rank(tmp_path, signum, job):
    launcher = cli_process("run", "--nproc", "2", "--grace", str(GRACE),
                           str(script(tmp_path, job)), str(tmp_path))
    try:
        pids = wait_for_pids(tmp_path, [0, 1], alive=lambda: launcher.poll() is None)
        sent = time.monotonic()
        launcher.send_signal(signum)
        _, stderr = finish(launcher, GRACE + SLACK, f"`pipedream-fast run` to exit after "
                                                    f"{signal.Signals(signum).name}")
        assert time.monotonic() - sent < GRACE + SLACK
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum, stderr
    name = signal.Signals(signum).name
    assert f"pipedream-fast run: stopped by {name}: sent it to the 2 ranks" in stderr
    assert wait_gone(pids, 2.0) == []


def test_run_kills_a_sigstopped_rank_after_the_grace_period(tmp_path, capsys):
    """Rank 1 is stopped (SIGSTOP), then the launcher gets SIGTERM: rank 0 dies of it, rank
    1 cannot; it is SIGKILLed after the grace period and the launcher returns 143."""
    pids: list[int] = []
    sent: list[float] = []

    def stop_then_terminate() -> None:
        pids.extend(wait_for_pids(tmp_path, [0, 1]))
        os.kill(pids[1], signal.SIGSTOP)
        while state(pids[1]) != "T":
            time.sleep(0.01)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)  # to this process, where run_script runs

    before = signal.getsignal(signal.SIGTERM)
    thread = in_thread(stop_then_terminate)
    code = main(["run", "--nproc", "2", "--grace", str(GRACE),
                 str(script(tmp_path, SLEEPER)), str(tmp_path)])
    thread.join(1)
    assert code == 143
    assert GRACE <= time.monotonic() - sent[0] < GRACE + SLACK
    err = capsys.readouterr().err
    assert ("pipedream-fast run: stopped by SIGTERM: sent it to the 2 ranks; rank 1 did not "
            f"stop within {GRACE:g} s and was killed (SIGKILL)") in err
    assert all(gone(p) for p in pids)
    assert signal.getsignal(signal.SIGTERM) is before  # the launcher's handler is gone


def test_run_exits_137_naming_the_rank_killed_by_sigkill(tmp_path, capsys):
    pids: list[int] = []

    def kill() -> None:
        pids.extend(wait_for_pids(tmp_path, [0, 1]))
        os.kill(pids[1], signal.SIGKILL)

    thread = in_thread(kill)
    code = main(["run", "--nproc", "2", "--grace", str(GRACE),
                 str(script(tmp_path, SLEEPER)), str(tmp_path)])
    thread.join(1)
    assert code == 137
    err = capsys.readouterr().err
    assert "pipedream-fast run: rank 1 was killed by SIGKILL; stopping the other ranks" in err
    assert all(gone(p) for p in pids)


# --- pipedream-fast run: signals as clusters send them (issue 22) ----------------------------

@pytest.mark.parametrize("signum, target", [(signal.SIGTERM, "group"),
                                            (signal.SIGHUP, "launcher")], ids=["SIGTERM-group",
                                                                               "SIGHUP"])
def test_run_passes_a_group_wide_sigterm_and_sighup_to_each_rank_once(tmp_path, signum,
                                                                      target):
    """`kill -- -PGID` and `timeout` signal the launcher's whole process group: each rank must
    get the signal once (it runs in a session of its own and the launcher forwards it), not
    once directly and once forwarded. SIGHUP (a closed terminal) is forwarded like SIGTERM."""
    launcher = cli_process("run", "--nproc", "2", "--grace", str(GRACE),
                           str(script(tmp_path, STOPPER)), str(tmp_path), "slow")
    try:
        pids = wait_for_pids(tmp_path, [0, 1], alive=lambda: launcher.poll() is None)
        if target == "group":
            os.killpg(launcher.pid, signum)
        else:
            launcher.send_signal(signum)
        _, stderr = finish(launcher, GRACE + SLACK,
                           f"`pipedream-fast run` to exit after {signal.Signals(signum).name} "
                           f"to the {target} (its ranks end 0.5 s after theirs)")
    finally:
        launcher.kill()
    name = signal.Signals(signum).name
    assert launcher.returncode == 128 + signum, stderr
    assert f"pipedream-fast run: stopped by {name}: sent it to the 2 ranks\n" in stderr
    assert signals_got(tmp_path, [0, 1]) == [[name], [name]]
    assert wait_gone(pids, 2.0) == []


def test_run_keeps_an_inherited_ignored_sighup_ignored(tmp_path):
    """Started under `nohup` (SIGHUP ignored), the launcher leaves SIGHUP ignored: a closed
    terminal does not stop the job, nor reach its ranks; SIGTERM still stops it."""
    launcher = cli_process("run", "--nproc", "2", "--grace", str(GRACE),
                           str(script(tmp_path, STOPPER)), str(tmp_path), "slow",
                           sighup="SIG_IGN")
    try:
        wait_for_pids(tmp_path, [0, 1], alive=lambda: launcher.poll() is None)
        launcher.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert launcher.poll() is None, "a SIGHUP stopped a launcher started under nohup"
        launcher.send_signal(signal.SIGTERM)
        _, stderr = finish(launcher, GRACE + SLACK, "`pipedream-fast run` (SIGHUP ignored) to "
                                                    "exit after SIGTERM")
    finally:
        launcher.kill()
    assert launcher.returncode == 143, stderr
    assert "pipedream-fast run: stopped by SIGTERM: sent it to the 2 ranks\n" in stderr
    assert signals_got(tmp_path, [0, 1]) == [["SIGTERM"], ["SIGTERM"]]  # no SIGHUP, ever


def test_run_takes_a_second_sigterm_within_the_window_as_the_same_request(tmp_path, capsys):
    """Two SIGTERMs 50 ms apart (`timeout` signals its child, then its whole group): one
    request. The launcher forwards it once and lets the ranks finish their clean-up rather
    than SIGKILL them, and says what happened."""
    pids: list[int] = []

    def terminate_twice() -> None:
        pids.extend(wait_for_pids(tmp_path, [0, 1]))
        os.kill(os.getpid(), signal.SIGTERM)  # to this process, where run_script runs
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = in_thread(terminate_twice)
    code = main(["run", "--nproc", "2", "--grace", str(GRACE),
                 str(script(tmp_path, STOPPER)), str(tmp_path), "slow"])
    thread.join(1)
    err = capsys.readouterr().err
    assert code == 143, err
    assert re.search(r"pipedream-fast run: stopped by SIGTERM: sent it to the 2 ranks; SIGTERM "
                     r"came again 0\.\d\d s later: the same request\n", err), err
    assert "SIGKILL" not in err
    assert signals_got(tmp_path, [0, 1]) == [["SIGTERM"], ["SIGTERM"]]
    assert all(gone(p) for p in pids)


def test_run_says_a_sigint_after_sigterm_cut_the_grace_period_short(tmp_path, capsys):
    """SIGINT 50 ms after SIGTERM kills ranks that ignore SIGTERM at once: the message says so
    (it said "did not stop within 2 s", 50 ms after the signal)."""
    pids: list[int] = []
    sent: list[float] = []

    def terminate_then_interrupt() -> None:
        pids.extend(wait_for_pids(tmp_path, [0, 1]))
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    thread = in_thread(terminate_then_interrupt)
    code = main(["run", "--nproc", "2", "--grace", str(GRACE),
                 str(script(tmp_path, STOPPER)), str(tmp_path), "stubborn"])
    thread.join(1)
    err = capsys.readouterr().err
    assert code == 143, err
    assert time.monotonic() - sent[0] < GRACE
    assert re.search(r"pipedream-fast run: stopped by SIGTERM: sent it to the 2 ranks; ranks "
                     r"0, 1 were still running when SIGINT came 0\.\d\d s later, and were "
                     r"killed \(SIGKILL\)\n", err), err
    assert all(gone(p) for p in pids)


def test_a_rank_takes_a_repeat_within_the_window_as_the_same_request(monkeypatch):
    """In a rank (handlers as `launch` sets them): SIGHUP is deferred as SIGTERM is; a copy of
    the request within the window, during `train` or after it (the clean-up), changes
    nothing; a repeat after the window stops the rank at once."""
    launch_module = sys.modules["pipedream_fast.launch"]
    monkeypatch.setattr(launch_module.signals, "STOP_WINDOW_S", 0.5)  # where it is read
    monkeypatch.setattr(launch_module.stop_request, "at", None)
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, launch_module.on_stop_signal)

    def deliver(signum: int) -> None:
        os.kill(os.getpid(), signum)
        time.sleep(0.01)  # the handler runs in this (the main) thread, between bytecodes

    try:
        with DeferredStop() as request:
            deliver(signal.SIGHUP)
            deliver(signal.SIGTERM)  # the copy the launcher forwards
            assert request.signum == signal.SIGHUP
        deliver(signal.SIGTERM)  # a late copy, during the clean-up after train
        with pytest.raises(Stopped) as stopped:
            with DeferredStop() as request:
                deliver(signal.SIGTERM)
                time.sleep(0.6)
                deliver(signal.SIGTERM)  # asked again after the window: at once
        assert stopped.value.code == 143 and stopped.value.step is None
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)


# --- pipedream-fast train --nproc: signals to the launcher ----------------------------------

def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_train_stops_its_ranks_on_sigterm_and_sigint(tmp_path, signum):
    """SIGTERM goes to the launcher only (as Kubernetes sends it): the ranks stop after an
    agreed step and write the run's checkpoint. SIGINT goes to the launcher's process group,
    as Ctrl-C in a terminal does: the ranks, each in a session of its own, get it forwarded."""
    out = tmp_path / "run"
    launcher = cli_process("train", "--nproc", "2", "--steps", "100000", "--data",
                           "synthetic", "--model", "mlp", "--log-every", "10",
                           "--out", str(out))
    try:
        deadline = time.monotonic() + START
        while not (out / "metrics.csv").exists() or \
                len((out / "metrics.csv").read_text().splitlines()) < 2:  # a step was logged
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, (f"training did not start: no step in "
                                                 f"{out / 'metrics.csv'} after {START:g} s")
            time.sleep(0.1)
        # The ranks, not the resource tracker multiprocessing also starts.
        ranks = [c for c in children(launcher.pid)
                 if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(ranks) == 2
        sent = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(launcher.pid, signum)
        else:
            launcher.send_signal(signum)
        _, stderr = finish(launcher, 5.0 + SLACK,  # train's grace is the default
                           f"`pipedream-fast train --nproc 2` to exit after "
                           f"{signal.Signals(signum).name}")
        assert time.monotonic() - sent < 5.0 + SLACK
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum, stderr
    assert f"pipedream-fast train: stopped by {signal.Signals(signum).name}" in stderr
    assert wait_gone(ranks, 2.0) == []
    if signum == signal.SIGTERM:  # the ranks agreed on a step and saved the run there
        assert (out / "checkpoint" / "manifest.json").exists()
