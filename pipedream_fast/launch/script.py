"""`pipedream-fast run`: ranks as copies of a script, started by a bootstrap (`_RANK_BOOT`) that
runs it as `python script` would; a rank's end (`rank_ended`, `rank_failed`, `exit_now`), its
one-line error and the job's log folder; the launcher's wait, blame and stop (`run_script`)."""

from __future__ import annotations

import atexit
import gc
import io
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from pipedream_fast.checkpoint.progress import SaveWatch
from pipedream_fast.launch.ranks import (SETTLE_S, _die_with_parent, _is_peer_symptom,
                                         _last_line, flush_std_streams, kill_leftovers,
                                         loopback_store, rank_environment)
from pipedream_fast.launch.signals import (GRACE_S, _catch_stop_signals, _Killed,
                                           _stop_processes, describe_exit, shell_status,
                                           signal_name)

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
    flush_std_streams()
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
    """Called by a rank of `pipedream-fast run` (`_RANK_BOOT`) when its script, which used
    this library, ended, with the `SystemExit` that ended it (None: it ran to its end). The
    rank leaves with `exit_now`: atexit handlers (the library's release), files flushed, no
    interpreter teardown. A rank asked to stop (SIGTERM/SIGHUP, `Stopped`) so leaves well
    within the launcher's grace period; any rank so never meets the teardown's order of
    destruction, where gloo's threads could outlive what they use and abort the process
    ("terminate called without an active exception", seen in CI after a clean run)."""
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


_FOLLOWED = ".followed"
"""The mark a rank of `pipedream-fast run` leaves in the job's log folder (`rank<R>.followed`)
when its failure only followed another rank's (a closed connection; an error every rank
raised alike and another rank says): the launcher then blames the rank whose failure was its
own, which often exits later, having written its traceback and released its groups."""

FOLLOWER_WAIT_S = 5.0
"""How much longer than `SETTLE_S` the launcher waits for the first failure's cause to exit
when every rank that has failed so far only followed another's."""


def _mark_followed(rank: int | None) -> None:
    folder = os.environ.get(_user_errors().LOG_DIR_ENV)
    if folder and rank is not None:
        try:
            os.makedirs(folder, exist_ok=True)
            open(os.path.join(folder, f"rank{rank}{_FOLLOWED}"), "w").close()
        except OSError:  # a full disk: the launcher then blames the first to exit
            pass


def _followed(folder: str, rank: int) -> bool:
    """Whether `rank` marked its failure as following another rank's (`_FOLLOWED`)."""
    return os.path.exists(os.path.join(folder, f"rank{rank}{_FOLLOWED}"))


def _user_errors() -> Any:
    from pipedream_fast import user_errors
    return user_errors


def rank_failed(err: BaseException) -> NoReturn:
    """Called by a rank of `pipedream-fast run` (`_RANK_BOOT`) whose script raised `err`.

    An error of the user's code (a dataset, a loader, a factory, a batch) is one line,
    'rank 0, batch 4: ValueError: ... (at data.py:12); traceback in <log>'; a failure that
    follows another rank's (a closed connection: that rank says what went wrong), or that
    every rank raises alike and another rank says (`user_errors.note_said_by`), is only
    logged; anything else prints its traceback, as the interpreter would. Exits with 1, as
    `exit_now` does."""
    ue = _user_errors()
    rank = _rank_number()
    tb = _strip_boot(err.__traceback__)
    text = "".join(traceback.format_exception(type(err), err, tb))
    line = ue.describe(err, rank, peer_symptom=_is_peer_symptom)
    said_elsewhere = ue.said_by(err) not in (None, rank)  # every rank has it; another says it
    if said_elsewhere or (line is None and _is_peer_symptom(err)):
        _mark_followed(rank)  # before the log, which `_others_failed` looks for
    if line is not None or _is_peer_symptom(err):
        path = ue.write_log(text, ue.log_path(rank))
        if line is not None:
            if not said_elsewhere:
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


def run_script(script: str, script_args: Sequence[str], nprocs: int,
               grace: float = GRACE_S, max_restarts: int = 0) -> int:
    """`pipedream-fast run`: starts `nprocs` copies of a script with torchrun's environment,
    and, when the job fails, starts it again up to `max_restarts` times (as torchrun's
    --max-restarts; a job stopped by a signal is not restarted). Each attempt meets on a new
    port, so a restart never finds the last attempt's store. A script that continues its run
    (`Pipeline(..., checkpoint_dir=..., resume=True)`) then goes on from its last checkpoint.
    Returns the last attempt's status (see `_attempt`)."""
    def say(text: str) -> None:
        print(f"pipedream-fast run: {text}", file=sys.stderr, flush=True)

    for attempt in range(max_restarts + 1):
        code, stopped = _attempt(script, script_args, nprocs, grace)
        if code == 0 or stopped or attempt == max_restarts:
            if code and not stopped and max_restarts:
                say(f"the job failed {attempt + 1} times; no restart left (--max-restarts "
                    f"{max_restarts})")
            return code
        say(f"restarting the job (restart {attempt + 1} of {max_restarts})")
    raise AssertionError("not reached")


def _attempt(script: str, script_args: Sequence[str], nprocs: int,
             grace: float) -> tuple[int, bool]:
    """One attempt of `run_script`: its status, and whether a signal stopped it.

    Returns 0 when every rank exits with 0. When one fails, the others get SIGTERM (SIGKILL
    after `grace` seconds) and its status is returned, 128 + the signal number for a rank
    killed by a signal, as shells report it; the first failure is blamed, preferring, among
    those seen within `SETTLE_S` of it, a rank killed by a signal to one that exited with an
    error (which is how a rank reacts to its peer's death), and a rank whose error was its own
    to one that marked its failure as following another's (`_FOLLOWED`; while only such
    ranks have failed, the window stretches by up to `FOLLOWER_WAIT_S`). SIGINT, SIGTERM or SIGHUP to the
    launcher is forwarded to every rank, with the same grace period, and returns 128 + its
    number; a repeat of SIGTERM/SIGHUP within `STOP_WINDOW_S` is the same request, SIGINT
    cuts the grace period short. Each rank runs in a session of its own, so a signal to the
    launcher's process group reaches it once. Every line it prints goes to stderr and starts
    with "pipedream-fast run:".
    """
    def say(text: str) -> None:
        print(f"pipedream-fast run: {text}", file=sys.stderr, flush=True)

    procs: dict[int, subprocess.Popen[bytes]] = {}
    saves = SaveWatch()  # a stop waits for a checkpoint save that progresses
    with _catch_stop_signals(None) as requests, loopback_store(nprocs) as port:
        # Made by the first rank that fails, for the traceback its one line points to.
        logs = os.path.join(tempfile.gettempdir(), f"pipedream-fast-run-{os.getpid()}-{port}")
        try:
            for rank in range(nprocs):
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-c", _RANK_BOOT, script, *script_args],
                    env={**os.environ, **rank_environment(rank, nprocs, port), **saves.env,
                         "PIPEDREAM_FAST_LOG_DIR": logs},
                    start_new_session=True, preexec_fn=_die_with_parent)
                if requests.signum is not None:
                    break
            failures: dict[int, float] = {}
            ended: set[int] = set()
            while requests.signum is None:
                now = time.monotonic()
                for rank, proc in procs.items():
                    if rank not in ended and proc.poll() is not None:
                        ended.add(rank)
                        kill_leftovers(proc.pid)  # its DataLoader workers hold its sockets
                    if rank not in failures and proc.poll() not in (None, 0):
                        failures[rank] = now
                if failures and now - min(failures.values()) >= SETTLE_S:
                    if (not all(_followed(logs, r) for r in failures)
                            or len(failures) == len(procs)
                            or now - min(failures.values()) >= SETTLE_S + FOLLOWER_WAIT_S):
                        break
                if not failures and all(p.returncode is not None for p in procs.values()):
                    return 0, False
                time.sleep(0.05)
            signum = requests.signum
            by_signal = bool(requests.received)  # else a failed rank started this stop
            began_at = requests.received[0][1] if by_signal else None
            code = 0
            if signum is None:
                blamed = min(failures, key=lambda r: ((procs[r].returncode or 0) >= 0,
                                                      _followed(logs, r), failures[r]))
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
                                     began_at, saves, say) if alive() else _Killed([], grace)
            if signum is None:
                if killed.ranks:
                    say(str(killed))
                return code, False
            say(f"stopped by {signal_name(signum)}: sent it to the {len(procs)} ranks"
                + requests.repeats() + (f"; {killed}" if killed.ranks else ""))
            return 128 + signum, True
        finally:
            saves.close()
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
            for rank, proc in procs.items():
                try:
                    proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    say(f"rank {rank} (pid {proc.pid}) is still there 5 s after SIGKILL")
