"""`launch(fn, nprocs)`: ranks as spawned processes that join the default process group and
run `fn`; their reports collected, their exits bounded, the rank that failed first blamed in a
`LaunchError`."""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipedream_fast.checkpoint.progress import SaveWatch
from pipedream_fast.launch.ranks import (SETTLE_S, _die_with_parent, _is_peer_symptom,
                                         _last_line, _own_session, flush_std_streams,
                                         kill_leftovers, loopback_store, rank_environment)
from pipedream_fast.launch.stderr_line import write_line
from pipedream_fast.launch.signals import (GRACE_S, STOP_SIGNALS, Stopped, _catch_stop_signals,
                                           _catchable, _ignore_stop_signals, _Killed,
                                           _stop_processes, _StopRequests, describe_exit,
                                           on_stop_signal, signal_name)

EXIT_S = 30.0
"""How long ranks that all reported success get to exit (the interpreter's teardown of torch
takes a few seconds on a busy machine) before they are killed."""


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


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int,
               args: Sequence[Any], timeout_s: float, report: Any, threads: int | None,
               env: dict[str, str]) -> None:
    _own_session()
    _die_with_parent()
    # A rank killed by a native fault (SIGSEGV, SIGABRT from std::terminate) says where each
    # of its threads was, in Python, on its stderr; otherwise only its exit status is known.
    faulthandler.enable(all_threads=True)
    for number in filter(_catchable, STOP_SIGNALS):
        signal.signal(number, on_stop_signal)
    os.environ.update({**rank_environment(rank, world_size, port), **env})
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
        # gloo returns from the init once this rank's side of the mesh is up: a fn that
        # destroys the group at once (to make one of its own) would cut a peer still
        # connecting ("Connection closed by peer"). No rank starts fn before all are through.
        dist.barrier()
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
        flush_std_streams()
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
            if self.process.pid is not None:
                kill_leftovers(self.process.pid)  # its DataLoader workers hold its sockets
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


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 300.0,
           threads_per_rank: int | None = None, grace: float = GRACE_S,
           stop: threading.Event | None = None) -> list[Any]:
    """Runs `fn(rank, world_size, *args)` in `nprocs` processes; returns the values by rank.

    `fn` and `args` must be picklable (a module-level function). `timeout` bounds every
    collective and transfer, so a stuck rank fails the job instead of hanging it. Each rank
    joins the default process group, and `fn` starts on none before every rank is through
    (a barrier), so `fn` may destroy the group and make its own.

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
    ranks: dict[int, _Rank] = {}
    saves = SaveWatch()  # a stop waits for a checkpoint save that progresses
    with _catch_stop_signals(stop) as requests, loopback_store(nprocs, timeout) as port:
        try:
            for rank in range(nprocs):
                reader, writer = ctx.Pipe(duplex=False)
                process = ctx.Process(target=_rank_main, daemon=False, name=f"rank {rank}",
                                      args=(rank, fn, nprocs, port, args, timeout, writer,
                                            threads_per_rank, saves.env))
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
            return _supervise(ranks, nprocs, grace, requests, saves)
        finally:
            _reap(ranks)
            saves.close()


def _say(text: str) -> None:
    write_line(f"pipedream_fast.launch: {text}")


def _supervise(ranks: dict[int, _Rank], nprocs: int, grace: float,
               requests: _StopRequests, saves: SaveWatch | None = None) -> list[Any]:
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
                                 lambda: requests.urgent(by_signal), poll, began_at, saves,
                                 _say) \
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
