"""Start a pipeline job: `launch(fn, nprocs)` in Python, `pipedream-fast run --nproc N script.py`.

Each rank is a fresh process (spawned, so CUDA and threads start clean) with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set as torchrun sets them. `launch` also joins the
default process group (gloo on CPU, NCCL when every rank has a GPU) before calling `fn(rank,
world_size, *args)` and returns every rank's return value. If one rank fails, the others are
stopped and the failure is raised with that rank's traceback: nothing is left hanging.

Stopping is one path for both launchers. SIGINT, SIGTERM or SIGHUP sent to the launcher is
forwarded to every rank; a rank still running `grace` seconds later (a stuck or SIGSTOPped one)
is killed with SIGKILL. When a rank fails, the others get SIGTERM and the same grace period. No
wait on a child is unbounded: everything is polled against a deadline. On Linux the ranks also
die with SIGKILL when the launcher itself dies without a chance to stop them (SIGKILL, out of
memory).

Clusters signal a job as a whole: `kill -- -PGID` and `timeout` signal the launcher's process
group, SLURM (scancel, the time limit) every process of the job. Each rank therefore runs in a
session of its own (as torchrun's do), so a signal to the launcher's group reaches the ranks once,
forwarded; and a SIGTERM or SIGHUP within `STOP_WINDOW_S` of the first one a process got is the
same request, not a second one (`stop_request`), in the launcher and in the ranks alike. Only
a later repeat, or SIGINT, acts at once.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import pickle
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GRACE_S = 5.0
"""Default seconds between forwarding SIGINT/SIGTERM to a rank and killing it with SIGKILL."""

EXIT_S = 30.0
"""How long ranks that all reported success get to exit (the interpreter's teardown of torch
takes a few seconds on a busy machine) before they are killed."""

SETTLE_S = 0.5
"""After the first failure, how long the launcher keeps collecting others before it decides
which rank to blame (a killed rank's peers fail a moment later, on the closed connection)."""

TERM_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals that ask a job to stop (scancel, a time limit, `timeout`, a closed terminal):
`Pipeline.train` and `LocalPipeline.train` stop at a step every rank agrees on (`stopping`)."""

STOP_SIGNALS = (signal.SIGINT, *TERM_SIGNALS)

STOP_WINDOW_S = GRACE_S
"""A SIGTERM or SIGHUP within this many seconds of the first one a process got is the same
request: a job-wide signal reaches a rank directly and again through its launcher."""

# What a rank sees when a peer dies or hangs: a closed or reset connection, a timeout.
_PEER_SYMPTOM = re.compile(
    r"time[ds]? ?out|connection (?:closed|reset|refused|abort)|closed by peer|broken pipe|"
    r"is rank \d+ alive|abandoned|(?:send|receiving .*) failed|DistBackendError|"
    r"DistNetworkError|QueueTimeout", re.IGNORECASE)


class LaunchError(RuntimeError):
    """A rank of a launched job failed, or the job was stopped; the message names the rank
    and carries its traceback. `rank`: the rank blamed (None when the launcher was stopped
    by a signal); `returncode`: that rank's exit code (negative: killed by that signal);
    `stopped_by`: the signal that stopped the launcher, if that is what ended the job.
    `user_error`: when the blamed rank's error came from the user's code (a dataset, a
    batch, a factory: `user_errors.describe`), that in one line; a command shows it instead
    of the tracebacks, which it keeps in a log (`log_details`)."""

    def __init__(self, message: str, rank: int | None = None, returncode: int | None = None,
                 stopped_by: int | None = None, user_error: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.returncode = returncode
        self.stopped_by = stopped_by
        self.user_error = user_error

    def log_details(self, folder: str | os.PathLike[str] | None = None) -> None:
        """For an error of the user's code: writes the message (the tracebacks) to
        folder/error.log (default: a new file in the temporary folder), and makes the
        message `user_error` and that file's name. Nothing for any other failure."""
        if self.user_error is None:
            return
        from pipedream_fast import user_errors
        path = user_errors.write_log(str(self), user_errors.log_path(None, folder))
        self.args = (f"{self.user_error}; traceback in {path}",)
        self.user_error = None

    @property
    def exit_code(self) -> int:
        """The exit status a command should end with: 128 + signal number for a signal (as
        shells report it), else the rank's exit code, else 1."""
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        if self.returncode is not None and self.returncode < 0:
            return 128 - self.returncode
        return self.returncode or 1


class Stopped(SystemExit):
    """Raised in a rank by SIGTERM: at once in a rank of `launch`, or, in `Pipeline.train`,
    after a step every rank agreed on (see `pipedream_fast.stopping`), so that `finally`
    blocks run. A `SystemExit` with code 128 + the signal's number: `except Exception` does
    not swallow it, and uncaught it ends the process with the status a shell expects."""

    def __init__(self, signum: int, detail: str = "", step: int | None = None) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.detail = detail
        self.step = step  # the step every rank stopped after (None: stopped where it was)

    def __str__(self) -> str:
        return f"stopped by {signal_name(self.signum)}{self.detail}"


class _StopRequest:
    """When this process got the stop request under way (its first SIGTERM or SIGHUP), shared
    by every handler that sees one, so that a repeat is recognised wherever it lands."""

    def __init__(self) -> None:
        self.at: float | None = None

    def start(self) -> None:
        self.at = time.monotonic()

    def age(self) -> float | None:
        """Seconds since the request began; None if there is none."""
        return None if self.at is None else time.monotonic() - self.at

    def repeated_by(self, signum: int) -> bool:
        """Whether `signum` repeats the request (same kind, within `STOP_WINDOW_S`)."""
        age = self.age()
        return signum in TERM_SIGNALS and age is not None and age <= STOP_WINDOW_S


stop_request = _StopRequest()


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """'was killed by SIGKILL', 'stopped on SIGTERM (exit code 143)' or 'exited with code 3'."""
    if returncode < 0:
        return f"was killed by {signal_name(-returncode)}"
    if returncode - 128 in STOP_SIGNALS:  # what a rank that handled the signal exits with
        return f"stopped on {signal_name(returncode - 128)} (exit code {returncode})"
    return f"exited with code {returncode}"


def shell_status(returncode: int) -> int:
    """An exit code as a shell reports it: 128 + signal number for a signal."""
    return 128 - returncode if returncode < 0 else returncode


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the launcher dies (even by SIGKILL). Best effort."""
    if not sys.platform.startswith("linux"):
        return
    try:
        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the call
        os.kill(os.getpid(), signal.SIGKILL)


def _flush_open_files() -> None:
    """Flushes every open file object that can be written, as the interpreter's teardown
    would when it destroys them (a script's log file left open, say)."""
    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():
        if issubclass(type(obj), kinds):  # type(), not isinstance: no proxy's __class__
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError, AttributeError, RuntimeError):
                pass


def exit_now(code: int) -> NoReturn:
    """Ends this process as the interpreter would (non-daemon threads joined, atexit
    handlers run, open files flushed), without the teardown of its modules, which takes
    seconds on a busy machine (torch's, the garbage of a training run, gloo's groups). For a
    rank that stopped: its checkpoint is on disk (fsynced) and its peers are leaving too."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()  # what the interpreter does first: wait for non-daemon threads
    atexit._run_exitfuncs()
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def _exit_status(done: SystemExit | None) -> int:
    """The status the interpreter gives a process ended by `done` (None: the script ended)."""
    code = None if done is None else done.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def rank_ended(done: SystemExit | None) -> None:
    """Called by a rank of `pipedream-fast run` (`_RANK_BOOT`) when its script ended, with
    the `SystemExit` that ended it: a rank that was asked to stop (SIGTERM/SIGHUP, `Stopped`)
    leaves at once (`exit_now`), well within the launcher's grace period; else this returns
    and the interpreter exits as usual."""
    if isinstance(done, Stopped) or stop_request.at is not None:
        exit_now(_exit_status(done))


def _strip_boot(tb: Any) -> Any:
    while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
        tb = tb.tb_next
    return tb


def _rank_number() -> int | None:
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


def _others_failed(rank: int | None, wait_s: float) -> bool:
    """Whether another rank of this job wrote a failure log within `wait_s` seconds."""
    folder = os.environ.get(_user_errors().LOG_DIR_ENV)
    if not folder:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            names = os.listdir(folder)
        except OSError:
            names = []
        if any(n.endswith(".log") and n != f"rank{rank}.log" for n in names):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _user_errors() -> Any:
    from pipedream_fast import user_errors
    return user_errors


def rank_failed(err: BaseException) -> NoReturn:
    """Called by a rank of `pipedream-fast run` (`_RANK_BOOT`) whose script raised `err`.

    An error of the user's code (a dataset, a loader, a factory, a batch) is one line,
    'rank 0, batch 3: ValueError: ... (at data.py:12); traceback in <log>'; a failure that
    follows another rank's (a closed connection: that rank says what went wrong) is only
    logged; anything else prints its traceback, as the interpreter would. Exits with 1, as
    `exit_now` does."""
    ue = _user_errors()
    rank = _rank_number()
    tb = _strip_boot(err.__traceback__)
    text = "".join(traceback.format_exception(type(err), err, tb))
    line = ue.describe(err, rank, peer_symptom=_is_peer_symptom)
    if line is not None or _is_peer_symptom(err):
        path = ue.write_log(text, ue.log_path(rank))
        if line is not None:
            print(f"{line}; traceback in {path}", file=sys.stderr, flush=True)
        # the first to fail says so, in one line; waiting less than the launcher's SETTLE_S,
        # after which it stops the ranks still running
        elif not _others_failed(rank, 0.8 * SETTLE_S):
            print(f"rank {rank}: {_last_line(text)}; traceback in {path}", file=sys.stderr,
                  flush=True)
    else:
        sys.excepthook(type(err), err, tb)
    # atexit handlers (the library's release of its threads and groups) run, the teardown
    # does not: it is slow, and a failed run's half-released state has aborted in it
    # ("terminate called without an active exception", 1 run in 3 of a shape error)
    exit_now(1)


_RANK_BOOT = """def _boot():
    import builtins, importlib.machinery, os, sys
    script = os.path.abspath(sys.argv[1])
    sys.argv[:] = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    namespace = sys.modules["__main__"].__dict__
    namespace.clear()
    namespace.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None,
                     __annotations__={}, __builtins__=builtins, __file__=script,
                     __cached__=None,
                     __loader__=importlib.machinery.SourceFileLoader("__main__", script))
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    done = None
    try:
        exec(code, namespace)
    except SystemExit as exit:
        done = exit
    except KeyboardInterrupt:
        raise
    except BaseException as err:
        launch = sys.modules.get("pipedream_fast.launch")
        if launch is None:
            raise
        launch.rank_failed(err)
    launch = sys.modules.get("pipedream_fast.launch")
    if launch is not None:
        launch.rank_ended(done)
    if done is not None:
        raise done
_boot()
"""
"""How `pipedream-fast run` starts a rank's script (`python -c _RANK_BOOT script args`): as
`python script args` would (its folder first on sys.path, `__main__` its module, nothing of
this package imported before it), but the end is this package's when the script used it: a
stopped rank exits at once (`rank_ended`), a user's error is one line (`rank_failed`)."""


# --- the launcher's own signals ------------------------------------------------------------

class _StopRequests:
    """SIGINT/SIGTERM/SIGHUP received by the launcher (recorded, not raised), with when they
    came, or a `stop` event."""

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.received: list[tuple[int, float]] = []
        self.stop = stop

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.received.append((signum, time.monotonic()))

    @property
    def signum(self) -> int | None:
        """The first signal received; SIGTERM for a set `stop` event; None if neither."""
        if self.received:
            return self.received[0][0]
        return signal.SIGTERM if self.stop is not None and self.stop.is_set() else None

    def urgent(self, by_signal: bool) -> tuple[int, float] | None:
        """The signal that cuts a stop's grace period short, and when it came. During a stop
        that a failure or `stop` started, any signal. During one that a signal started
        (`by_signal`), SIGINT (Ctrl-C again, or after SIGTERM) or a SIGTERM/SIGHUP more than
        `STOP_WINDOW_S` after the first: a repeat within the window is the same request
        (`timeout` signals its child and then its whole process group, SLURM every process
        of the job)."""
        if not by_signal:
            return self.received[0] if self.received else None
        first_at = self.received[0][1]
        for signum, at in self.received[1:]:
            if signum == signal.SIGINT or at - first_at > STOP_WINDOW_S:
                return signum, at
        return None

    def stopped(self) -> tuple[int, float] | None:
        """SIGTERM and now, once the `stop` event is set."""
        if self.stop is not None and self.stop.is_set():
            return signal.SIGTERM, time.monotonic()
        return None

    def repeats(self) -> str:
        """'; SIGTERM came again 0.05 s later: the same request' when it did, for messages."""
        if len(self.received) < 2 or self.urgent(True) is not None:
            return ""
        (first, first_at), (again, at) = self.received[0], self.received[1]
        how = "again " if again == first else ""
        times = "" if len(self.received) == 2 else f" ({len(self.received) - 1} times)"
        return (f"; {signal_name(again)} came {how}{at - first_at:.2f} s later{times}: the "
                f"same request")


def _catchable(signum: int) -> bool:
    """Whether a stop handler may take `signum` over: not a SIGHUP the caller ignores (nohup)."""
    return signum != signal.SIGHUP or signal.getsignal(signum) is not signal.SIG_IGN


@contextmanager
def _catch_stop_signals(stop: threading.Event | None) -> Iterator[_StopRequests]:
    """Records SIGINT, SIGTERM and SIGHUP while inside; the previous handlers come back on the
    way out. Handlers can only be installed from the main thread: elsewhere only `stop`
    counts."""
    requests = _StopRequests(stop)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in filter(_catchable, STOP_SIGNALS):
            previous[signum] = signal.signal(signum, requests.handler)
    try:
        yield requests
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


# --- launch: ranks as spawned processes ----------------------------------------------------

def _ignore_stop_signals() -> None:
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


def on_stop_signal(signum: int, frame: FrameType | None) -> None:
    """A rank's handler outside the deferred stop: SIGTERM/SIGHUP raise `Stopped`, SIGINT
    KeyboardInterrupt, at once, so that `finally` blocks run; a repeat of the request under
    way (`stop_request`) is ignored, so it cannot cut that request's clean-up short."""
    if stop_request.repeated_by(signum):
        return
    _ignore_stop_signals()  # one stop per rank: a second signal must not cut its clean-up
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


@contextmanager
def raising_stop_signals() -> Iterator[None]:
    """While inside (in the main thread), SIGTERM and SIGHUP raise `Stopped`, as in a rank of
    `launch`: a command says how it stopped instead of dying silently. `Pipeline.train` and
    `LocalPipeline.train` defer them to an agreed step (`stopping.DeferredStop`)."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in filter(_catchable, TERM_SIGNALS):
            previous[signum] = signal.signal(signum, on_stop_signal)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def _own_session() -> None:
    """Puts this rank in a session (and process group) of its own, as torchrun does: a signal
    to the launcher's process group (`kill -- -PGID`, `timeout`, Ctrl-C) then reaches the rank
    once, forwarded by the launcher, not twice."""
    try:
        os.setsid()
    except (AttributeError, OSError):  # not POSIX, or already a group leader
        pass


def _is_peer_symptom(err: BaseException) -> bool:
    """Whether a failure looks like the consequence of another rank's death or hang (closed
    connection, timeout) rather than a failure of this rank's own."""
    seen = 0
    current: BaseException | None = err
    while current is not None and seen < 8:
        if isinstance(current, (TimeoutError, ConnectionError, EOFError)) or \
                _PEER_SYMPTOM.search(f"{type(current).__name__}: {current}"):
            return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int,
               args: Sequence[Any], timeout_s: float, report: Any, threads: int | None) -> None:
    _own_session()
    _die_with_parent()
    for number in filter(_catchable, STOP_SIGNALS):
        signal.signal(number, on_stop_signal)
    os.environ.update(rank_environment(rank, world_size, port))
    if threads:
        torch.set_num_threads(threads)
    code = 0
    try:
        backend = "nccl" if torch.cuda.is_available() and \
            torch.cuda.device_count() >= world_size else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        # Plain pickle copies tensors into the message; torch's shared-memory handles would
        # die with this process.
        message = pickle.dumps(("ok", pickle.dumps(value)))
        _ignore_stop_signals()  # from here on the rank has nothing left to stop
        report.send_bytes(message)
    except BaseException as err:  # report everything, including KeyboardInterrupt, then die
        _ignore_stop_signals()
        text = traceback.format_exc()
        if isinstance(err, (Stopped, KeyboardInterrupt)):
            signum: int = err.signum if isinstance(err, Stopped) else int(signal.SIGINT)
            code = 128 + signum
            outcome: tuple[Any, ...] = ("stopped", text, signum)
        else:
            code = 1
            outcome = ("error", text, _is_peer_symptom(err), _describe_user_error(err, rank))
        try:
            report.send_bytes(pickle.dumps(outcome))
        except OSError:
            pass  # the launcher is gone
    finally:
        report.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if code:
        # The traceback is in the report. Exit at once, as multiprocessing's forked children
        # do: the interpreter's teardown of torch takes seconds, and a stopped rank should
        # be gone well within the launcher's grace period.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)


def _describe_user_error(err: BaseException, rank: int) -> str | None:
    """The one line of an error of the user's code (`user_errors.describe`), if it is one."""
    try:
        from pipedream_fast import user_errors
        return user_errors.describe(err, rank, peer_symptom=_is_peer_symptom)
    except Exception:  # noqa: BLE001 - a report must go out whatever this finds
        return None


@dataclass
class _Rank:
    process: Any
    reports: queue.SimpleQueue[Any]  # what the reader thread got: the report, then None (EOF)
    reader: threading.Thread
    connection: Any
    report: tuple[Any, ...] | None = None
    eof: bool = False
    exited_at: float | None = None
    failed_at: float | None = None

    @property
    def returncode(self) -> int | None:
        code: int | None = self.process.exitcode
        return code

    def collect(self, now: float) -> None:
        while True:
            try:
                item = self.reports.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.eof = True
            elif self.report is None:
                self.report = item
        if self.exited_at is None and self.returncode is not None:
            self.exited_at = now
        if self.failed_at is None and (self.failing or self.died_silently(now)):
            self.failed_at = self.exited_at if self.report is None else now

    @property
    def failing(self) -> bool:
        return self.report is not None and self.report[0] != "ok"

    def died_silently(self, now: float) -> bool:
        """Exited without a report. EOF proves none is coming; a forked grandchild holding
        the pipe open delays EOF, so after 1 s the exit alone decides."""
        return self.report is None and self.exited_at is not None and \
            (self.eof or now - self.exited_at > 1.0)


def _read_reports(connection: Any, out: queue.SimpleQueue[Any]) -> None:
    """A rank's reader thread: its one report, then None at end of file (the rank exited;
    a truncated report, from a rank killed while writing, counts as none)."""
    try:
        out.put(pickle.loads(connection.recv_bytes()))
    except (EOFError, OSError, pickle.UnpicklingError, ValueError, TypeError):
        pass
    out.put(None)


def _blame(ranks: dict[int, _Rank]) -> int | None:
    """The rank whose failure ended the job (see `launch`); None if none failed."""
    def key(r: int) -> tuple[int, float]:
        report = ranks[r].report
        if report is None or report[0] == "stopped":
            kind = 0  # killed, crashed, or stopped by a signal sent to it
        elif report[0] == "error" and not report[2]:
            kind = 1  # an error of its own
        else:
            kind = 2  # a peer symptom: closed connection, timeout
        return kind, ranks[r].failed_at or 0.0
    failed = [r for r in ranks if ranks[r].failed_at is not None]
    return min(failed, key=key) if failed else None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _failure_message(ranks: dict[int, _Rank], blamed: int) -> str:
    n = len(ranks)
    r = ranks[blamed]
    report, code = r.report, r.returncode
    if report is None:
        assert code is not None
        if code < 0:
            head = f"rank {blamed} of {n} was killed by {signal_name(-code)} (it sent no report)"
        else:
            head = (f"rank {blamed} of {n} exited with code {code} without a report (os._exit, "
                    f"or a crash in native code)")
        text = ""
    elif report[0] == "stopped":
        head = f"rank {blamed} of {n} was stopped by {signal_name(report[2])}:"
        text = report[1]
    else:
        head = f"rank {blamed} of {n} failed:"
        text = report[1]
    others = []
    for o in sorted(ranks):
        other = ranks[o]
        if o != blamed and other.failed_at is not None:
            others.append(f"  rank {o}: {_last_line(other.report[1])}" if other.report
                          else f"  rank {o} {describe_exit(other.returncode or 0)}")
    if others:
        text += "then the other ranks failed:\n" + "\n".join(others) + "\n"
    return f"{head}\n{text}" if text else head


@dataclass
class _Killed:
    """The ranks a stop had to kill, and why: the grace period ran out, or a signal that
    cuts it short (`_StopRequests.urgent`) came `after_s` seconds into the stop."""
    ranks: list[int]
    grace: float
    cut_by: int | None = None
    after_s: float = 0.0

    def __str__(self) -> str:
        were = "was" if len(self.ranks) == 1 else "were"
        if self.cut_by is None:
            return (f"{_ranks_text(self.ranks)} did not stop within {self.grace:g} s and {were} "
                    f"killed (SIGKILL)")
        return (f"{_ranks_text(self.ranks)} {were} still running when "
                f"{signal_name(self.cut_by)} came {self.after_s:.2f} s later, and {were} "
                f"killed (SIGKILL)")


def _stop_processes(alive: Callable[[], list[int]], send: Callable[[int, int], None],
                    signum: int | None, grace: float,
                    cut_short: Callable[[], tuple[int, float] | None],
                    poll: Callable[[], None], began_at: float | None = None) -> _Killed:
    """Sends `signum` (if any) to the ranks `alive()` lists, waits up to `grace` seconds for
    them to exit (less once `cut_short()` names a signal: the launcher was told to hurry),
    then SIGKILLs the rest. `began_at`: when the stop was asked for (default now)."""
    began_at = time.monotonic() if began_at is None else began_at
    if signum is not None:
        for r in alive():
            send(r, signum)
    deadline = time.monotonic() + grace
    cut = None
    while alive() and time.monotonic() < deadline and (cut := cut_short()) is None:
        poll()
        time.sleep(0.02)
    killed = _Killed(alive(), grace)
    if killed.ranks and cut is not None:
        killed.cut_by, killed.after_s = cut[0], cut[1] - began_at
    for r in killed.ranks:
        send(r, signal.SIGKILL)
    return killed


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 300.0,
           threads_per_rank: int | None = None, grace: float = GRACE_S,
           stop: threading.Event | None = None) -> list[Any]:
    """Runs `fn(rank, world_size, *args)` in `nprocs` processes; returns the values by rank.

    `fn` and `args` must be picklable (a module-level function). `timeout` bounds every
    collective and transfer, so a stuck rank fails the job instead of hanging it.

    Failures raise `LaunchError` naming one rank, chosen as follows. The first failure seen
    (an error report, or a process that ended without one) opens a short window (`SETTLE_S`);
    among the failures seen by its end, a rank that died without a report (killed, crashed)
    or was stopped by a signal sent to it comes first, then a rank whose error is its own,
    then one whose error looks like a peer's death (closed connection, timeout); ties go to
    the earliest. The others are then sent SIGTERM, and SIGKILL after `grace` seconds.

    SIGINT, SIGTERM or SIGHUP to this process (when called from the main thread; the
    previous handlers are restored on return), or setting `stop`, forwards that signal
    (SIGTERM for `stop`) to every rank, waits up to `grace` seconds, kills the rest, and
    raises KeyboardInterrupt for SIGINT, a `LaunchError` with `stopped_by` set otherwise; a
    repeat of SIGTERM/SIGHUP within `STOP_WINDOW_S` is the same request, SIGINT cuts the wait
    short. In a rank, SIGTERM and SIGHUP raise `Stopped` and SIGINT KeyboardInterrupt, so its
    `finally` blocks run (`Pipeline.train` first stops at an agreed step).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = mp.get_context("spawn")
    port = free_port()
    ranks: dict[int, _Rank] = {}
    with _catch_stop_signals(stop) as requests:
        try:
            for rank in range(nprocs):
                reader, writer = ctx.Pipe(duplex=False)
                process = ctx.Process(target=_rank_main, daemon=False, name=f"rank {rank}",
                                      args=(rank, fn, nprocs, port, args, timeout, writer,
                                            threads_per_rank))
                try:
                    process.start()  # fails here if fn or args cannot be pickled
                except BaseException:
                    reader.close()
                    raise
                finally:
                    writer.close()  # the rank holds the only write end: its exit is our EOF
                reports: queue.SimpleQueue[Any] = queue.SimpleQueue()
                thread = threading.Thread(target=_read_reports, args=(reader, reports),
                                          name=f"pipedream-launch-rank{rank}", daemon=True)
                thread.start()
                ranks[rank] = _Rank(process, reports, thread, reader)
                if requests.signum is not None:
                    break
            return _supervise(ranks, nprocs, grace, requests)
        finally:
            _reap(ranks)


def _supervise(ranks: dict[int, _Rank], nprocs: int, grace: float,
               requests: _StopRequests) -> list[Any]:
    def poll() -> None:
        now = time.monotonic()
        for r in ranks.values():
            r.collect(now)

    while True:
        poll()
        if requests.signum is not None:
            break
        failed = [r.failed_at for r in ranks.values() if r.failed_at is not None]
        if failed:
            first_failure = min(failed)
            unsure = any(r.exited_at is not None and r.report is None and r.failed_at is None
                         for r in ranks.values())  # exited: is a report still on its way?
            if time.monotonic() - first_failure >= SETTLE_S and not unsure:
                break
        elif len(ranks) == nprocs and all(r.report is not None for r in ranks.values()):
            break  # every rank reported success: what is left is their exit, bounded below
        time.sleep(0.02)

    signum = requests.signum
    by_signal = bool(requests.received)  # else a failure or `stop` started this stop
    began_at = requests.received[0][1] if by_signal else None
    blamed = _blame(ranks) if signum is None else None

    def alive() -> list[int]:
        return [i for i, r in ranks.items() if r.returncode is None]

    def send(i: int, sig: int) -> None:
        pid = ranks[i].process.pid
        if pid is not None and ranks[i].returncode is None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    if signum is not None or blamed is not None:
        killed = _stop_processes(alive, send, signum or signal.SIGTERM, grace,
                                 lambda: requests.urgent(by_signal), poll, began_at) \
            if alive() else _Killed([], grace)
    else:  # every rank reported success and is only left to exit: no signal, a deadline
        killed = _stop_processes(alive, send, None, max(grace, EXIT_S),
                                 lambda: requests.urgent(False) or requests.stopped(), poll)
        signum = requests.signum  # a signal now still stops the launcher
    if signum is not None:
        after = f"; {killed}" if killed.ranks else ""
        message = (f"stopped by {signal_name(signum)}: sent it to the {len(ranks)} ranks"
                   f"{requests.repeats()}{after}")
        if signum == signal.SIGINT:
            raise KeyboardInterrupt(message)
        raise LaunchError(message, stopped_by=signum)
    if blamed is not None:
        r = ranks[blamed]
        returncode = r.returncode
        if r.report is not None:  # its own exit code may still be on its way
            returncode = r.report[2] + 128 if r.report[0] == "stopped" else 1
        report = r.report
        user_error = report[3] if report is not None and report[0] == "error" and \
            len(report) > 3 else None
        raise LaunchError(_failure_message(ranks, blamed), rank=blamed, returncode=returncode,
                          user_error=user_error)
    return [pickle.loads(ranks[r].report[1]) for r in range(nprocs)]  # type: ignore[index]


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _reap(ranks: dict[int, _Rank]) -> None:
    """Every rank's process is gone (SIGKILL for any still there; bounded waits), its reader
    thread finished and its pipe closed, so nothing blocks at interpreter exit."""
    for r in ranks.values():
        if r.returncode is None:
            try:
                r.process.kill()
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + 5.0
    for r in ranks.values():
        r.process.join(max(0.0, deadline - time.monotonic()))
        if r.returncode is not None:
            r.reader.join(max(0.0, min(1.0, deadline - time.monotonic())))
            if not r.reader.is_alive():
                r.connection.close()
            r.process.close()


# --- run_script: ranks as scripts ----------------------------------------------------------

def run_script(script: str, script_args: Sequence[str], nprocs: int,
               grace: float = GRACE_S) -> int:
    """`pipedream-fast run`: starts `nprocs` copies of a script with torchrun's environment.

    Returns 0 when every rank exits with 0. When one fails, the others get SIGTERM (SIGKILL
    after `grace` seconds) and its status is returned, 128 + the signal number for a rank
    killed by a signal, as shells report it; the first failure is blamed, preferring, among
    those seen within `SETTLE_S` of it, a rank killed by a signal to one that exited with an
    error (which is how a rank reacts to its peer's death). SIGINT, SIGTERM or SIGHUP to the
    launcher is forwarded to every rank, with the same grace period, and returns 128 + its
    number; a repeat of SIGTERM/SIGHUP within `STOP_WINDOW_S` is the same request, SIGINT
    cuts the grace period short. Each rank runs in a session of its own, so a signal to the
    launcher's process group reaches it once. Every line it prints goes to stderr and starts
    with "pipedream-fast run:".
    """
    def say(text: str) -> None:
        print(f"pipedream-fast run: {text}", file=sys.stderr, flush=True)

    port = free_port()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    # Made by the first rank that fails, for the traceback its one line points to.
    logs = os.path.join(tempfile.gettempdir(), f"pipedream-fast-run-{os.getpid()}-{port}")
    with _catch_stop_signals(None) as requests:
        try:
            for rank in range(nprocs):
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-c", _RANK_BOOT, script, *script_args],
                    env={**os.environ, **rank_environment(rank, nprocs, port),
                         "PIPEDREAM_FAST_LOG_DIR": logs},
                    start_new_session=True, preexec_fn=_die_with_parent)
                if requests.signum is not None:
                    break
            failures: dict[int, float] = {}
            while requests.signum is None:
                now = time.monotonic()
                for rank, proc in procs.items():
                    if rank not in failures and proc.poll() not in (None, 0):
                        failures[rank] = now
                if failures and now - min(failures.values()) >= SETTLE_S:
                    break
                if not failures and all(p.returncode is not None for p in procs.values()):
                    return 0
                time.sleep(0.05)
            signum = requests.signum
            by_signal = bool(requests.received)  # else a failed rank started this stop
            began_at = requests.received[0][1] if by_signal else None
            code = 0
            if signum is None:
                blamed = min(failures, key=lambda r: ((procs[r].returncode or 0) >= 0,
                                                      failures[r]))
                rc = procs[blamed].returncode or 0
                code = shell_status(rc)

            def alive() -> list[int]:
                return [r for r, p in procs.items() if p.poll() is None]

            if signum is None:
                if alive():
                    rest = "; stopping the other ranks"
                elif all(p.returncode == rc for p in procs.values()):
                    rest = "; so did every rank" if len(procs) > 1 else ""
                else:
                    rest = "; the other ranks have ended"
                say(f"rank {blamed} {describe_exit(rc)}{rest}")

            def send(r: int, sig: int) -> None:
                try:
                    procs[r].send_signal(sig)
                except ProcessLookupError:
                    pass

            killed = _stop_processes(alive, send, signum or signal.SIGTERM, grace,
                                     lambda: requests.urgent(by_signal), lambda: None,
                                     began_at) if alive() else _Killed([], grace)
            if signum is None:
                if killed.ranks:
                    say(str(killed))
                return code
            say(f"stopped by {signal_name(signum)}: sent it to the {len(procs)} ranks"
                + requests.repeats() + (f"; {killed}" if killed.ranks else ""))
            return 128 + signum
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
            for rank, proc in procs.items():
                try:
                    proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    say(f"rank {rank} (pid {proc.pid}) is still there 5 s after SIGKILL")
