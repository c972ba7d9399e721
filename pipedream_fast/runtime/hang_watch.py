"""A rank's flight recorder: says where the rank stands when it stops making progress.

A run that hangs (a peer stuck in its own code, a message that never comes, an all-reduce a
replica never joins) fails at the timeout, which is long on purpose (300 s by default: a
slow first step or a checkpoint must not fail a run). Until then nothing says why. A
`HangWatch` is a daemon thread beside the rank that looks at the executor's action in
progress every second; once one has lasted `after_s` (the `hang_report` option; a fifth of
the timeout by default), it writes one report, to stderr and to `reports`: the action, how
long, what it waits for (a message to receive, or room to send one: its channel, stage,
microbatch and peer; or an all-reduce and its ranks), the receives posted and not taken, and
the sends still queued on link threads (GPU links).
Every rank waiting on the same stuck peer reports, so the peer that is not waiting on
anyone stands out. One report per action: a rank that moves on and stops again reports again.

A stop request (SIGTERM, SIGHUP) that the rank cannot act on, because an action it is in does
not end, is reported too, `STOP_REPORT_S` after the signal and well inside the launcher's
grace: a hung job stopped by its operator says where each rank was before it is killed. The
signal is heard through `stop_request`, which hears it even while the rank's main thread
waits in C++.

The watch only reads (`Executor.standing`); it never interrupts the rank.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from pipedream_fast.launch.signals import stop_request
from pipedream_fast.launch.stderr_line import write_line

POLL_S = 1.0  # how often the watch looks; a report comes at most this late
STOP_REPORT_S = 1.0  # a stop request and the action in progress this old: say where it stands


class HangWatch:
    """Watches the executor `executor_of()` returns (None between runs) on rank `rank`."""

    def __init__(self, rank: int, after_s: float, executor_of: Callable[[], Any],
                 write: Callable[[str], None] | None = None,
                 stop_heard: Callable[[], float | None] = stop_request.last_heard) -> None:
        self.rank = rank
        self.after_s = after_s
        self._executor_of = executor_of
        self._write = write or write_line
        self.reports: list[str] = []
        self._reported: tuple[int, int] | None = None  # (id of the executor, action index)
        self._stop_heard = stop_heard  # when the latest stop request came (time.monotonic)
        self._stop_reported: float | None = None  # the request already reported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        stop_request.listen()  # in the main thread; elsewhere its handler's record serves
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"pipedream_fast hang watch of rank {self.rank}")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(min(POLL_S, self.after_s / 2)):
            try:
                self.check(time.perf_counter())
                self.check_stop(time.perf_counter(), time.monotonic())
            except Exception as err:  # noqa: BLE001 - a report must never fail the rank
                self._write(f"pipedream_fast: rank {self.rank}: the hang watch failed: {err!r}")
                return

    def check(self, now: float) -> str | None:
        """Reports the action in progress if it has lasted `after_s` and was not reported."""
        key, standing = self._standing(now, self.after_s)
        if standing is None:
            return None
        if key == self._reported:
            return None
        self._reported = key
        return self._report(f"pipedream_fast: rank {self.rank} has made no progress: {standing} "
                            f"(a report after {self.after_s:g} s without progress; the run fails "
                            f"at its timeout)")

    def check_stop(self, now: float, now_monotonic: float) -> str | None:
        """Reports where the rank stands if a stop request came `STOP_REPORT_S` ago or more
        and the action in progress has lasted as long; once per request."""
        heard = self._stop_heard()
        if heard is None or heard == self._stop_reported or now_monotonic - heard < STOP_REPORT_S:
            return None
        _, standing = self._standing(now, STOP_REPORT_S)
        if standing is None:
            return None
        self._stop_reported = heard
        return self._report(f"pipedream_fast: rank {self.rank}, asked to stop "
                            f"{now_monotonic - heard:.1f} s ago, is still {standing} (where it "
                            f"stands, should the stop not finish)")

    def _standing(self, now: float, lasted_s: float) -> tuple[tuple[int, int], str | None]:
        """The action in progress (the executor's id, the action's index) and where the rank
        stands, if that action has lasted `lasted_s` (else None; None too if it ended
        meanwhile)."""
        executor = self._executor_of()
        current = executor.current if executor is not None else None
        if current is None or now - current[2] < lasted_s:
            return (0, -1), None
        return (id(executor), current[0]), executor.standing(now)

    def _report(self, report: str) -> str:
        self.reports.append(report)
        self._write(report)
        return report

