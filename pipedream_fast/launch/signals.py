"""The stop request and its signals, in a launcher and in its ranks.

SIGINT, SIGTERM and SIGHUP: their names and what an exit status says about them; `Stopped`,
what a rank raises on SIGTERM/SIGHUP; `stop_request`, this process's request under way, which a
SIGTERM or SIGHUP within `STOP_WINDOW_S` repeats rather than renews; a rank's handlers
(`on_stop_signal`, `raising_stop_signals`); a launcher's record of the signals it got
(`_catch_stop_signals`) and its stop of the ranks: the signal forwarded to each, the grace
period, SIGKILL for what is left (`_stop_processes`).
"""

from __future__ import annotations

import math
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from pipedream_fast.checkpoint.progress import SaveWatch

GRACE_S = 5.0
"""Default seconds between forwarding SIGINT/SIGTERM to a rank and killing it with SIGKILL."""

TERM_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals that ask a job to stop (scancel, a time limit, `timeout`, a closed terminal):
`Pipeline.train` and `LocalPipeline.train` stop at a step every rank agrees on (`stopping`)."""

STOP_SIGNALS = (signal.SIGINT, *TERM_SIGNALS)

STOP_WINDOW_S = GRACE_S
"""A SIGTERM or SIGHUP within this many seconds of the first one a process got is the same
request: a job-wide signal reaches a rank directly and again through its launcher."""


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
        self.heard_at: float | None = None  # the latest SIGTERM/SIGHUP, as `listen` heard it
        self._listening = False

    def start(self) -> None:
        self.at = time.monotonic()

    def listen(self) -> None:
        """Hears each SIGTERM or SIGHUP when it arrives (`heard_at`), in a thread, even while
        the main thread waits in C++. Python runs a signal's handler in the main thread only
        when that thread is back in Python, which for a rank stuck in a receive is never; its
        C-level handler, though, writes the signal's number to the wakeup fd at once. From
        the main thread only, and only where nothing else (asyncio) uses the wakeup fd."""
        if self._listening or threading.current_thread() is not threading.main_thread():
            return
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(theirs.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter
            previous = None
        if previous != -1:  # not ours to set, or someone else's (leave theirs)
            if previous is not None:
                signal.set_wakeup_fd(previous)
            ours.close()
            theirs.close()
            return
        self._listening = True
        threading.Thread(target=self._hear, args=(ours, theirs), daemon=True,
                         name="pipedream_fast stop signals").start()

    def _hear(self, ours: socket.socket, theirs: socket.socket) -> None:
        while True:
            try:
                numbers = ours.recv(64)
            except OSError:
                return
            if not numbers:
                return
            if any(n in TERM_SIGNALS for n in numbers):
                self.heard_at = time.monotonic()

    def last_heard(self) -> float | None:
        """When this process last got SIGTERM or SIGHUP (its handler's record or `listen`'s,
        whichever is later); None if never."""
        times = [t for t in (self.at, self.heard_at) if t is not None]
        return max(times) if times else None

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


@dataclass
class _Killed:
    """The ranks a stop had to kill, and why: the grace period ran out, or a signal that
    cuts it short (`_StopRequests.urgent`) came `after_s` seconds into the stop. `saves`:
    what the killed ranks were writing (a checkpoint cut short), as text."""
    ranks: list[int]
    grace: float
    cut_by: int | None = None
    after_s: float = 0.0
    saves: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        were = "was" if len(self.ranks) == 1 else "were"
        cut = "" if not self.saves else (
            f"; the save was cut: {'; '.join(self.saves)} (give a longer grace: --grace)")
        if self.cut_by is None:
            return (f"{_ranks_text(self.ranks)} did not stop within {self.grace:g} s and {were} "
                    f"killed (SIGKILL){cut}")
        return (f"{_ranks_text(self.ranks)} {were} still running when "
                f"{signal_name(self.cut_by)} came {self.after_s:.2f} s later, and {were} "
                f"killed (SIGKILL){cut}")


def _stop_processes(alive: Callable[[], list[int]], send: Callable[[int, int], None],
                    signum: int | None, grace: float,
                    cut_short: Callable[[], tuple[int, float] | None],
                    poll: Callable[[], None], began_at: float | None = None,
                    saves: SaveWatch | None = None,
                    say: Callable[[str], None] | None = None) -> _Killed:
    """Sends `signum` (if any) to the ranks `alive()` lists, waits up to `grace` seconds for
    them to exit (less once `cut_short()` names a signal: the launcher was told to hurry),
    then SIGKILLs the rest. `began_at`: when the stop was asked for (default now). `saves`:
    past the grace, a rank whose checkpoint save still progresses is waited for (until it
    stalls for `STALL_S`), and `say` is told how long the stop then took."""
    began_at = time.monotonic() if began_at is None else began_at
    if signum is not None:
        for r in alive():
            send(r, signum)
    deadline = time.monotonic() + grace
    cut = None
    waited_for_saves = False
    while alive() and (cut := cut_short()) is None:
        if time.monotonic() >= deadline:
            if saves is None or not any(saves.progressing(r) for r in alive()):
                break
            waited_for_saves = True  # past the grace: a stop in progress is not cut
        poll()
        time.sleep(0.02)
    killed = _Killed(alive(), grace)
    if killed.ranks and cut is not None:
        killed.cut_by, killed.after_s = cut[0], cut[1] - began_at
    if saves is not None:
        for r in killed.ranks:
            s = saves.saving(r)
            if s is not None:
                killed.saves.append(f"rank {r} had written {s.written / 2 ** 20:.0f} of about "
                                    f"{s.needed / 2 ** 20:.0f} MiB of {s.path}")
    for r in killed.ranks:
        send(r, signal.SIGKILL)
    if waited_for_saves and say is not None:
        took = time.monotonic() - began_at
        say(f"the ranks were still stopping (finishing the agreed step, saving their "
            f"checkpoint) when the {grace:g} s grace ran out; waited while they progressed: "
            f"the stop took {took:.1f} s (give --grace {math.ceil(took) + 5} to leave room)")
    return killed


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
