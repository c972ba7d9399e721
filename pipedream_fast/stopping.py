"""Stopping a run on SIGTERM at a step every rank agrees on.

SLURM, Kubernetes, torchrun and the launchers stop a job by sending SIGTERM to every rank, at
slightly different moments, while each rank is in a different action. Raising at once would
leave the ranks at different steps, with messages in flight and no checkpoint. So while
`Pipeline.train` runs, SIGTERM only records a request (`DeferredStop`). Each rank casts a vote
at the end of a step (every step, or every few when steps take milliseconds); the votes of a
step are combined by an asynchronous all-reduce that is read `lag` steps later (`StopVote`),
so in the steady state no rank waits for it, and every rank reads the same outcome after the
same step. The Pipeline then leaves the run there, as a
`break` would, saves a checkpoint when it has a `checkpoint_dir`, and raises `Stopped`.

SIGHUP (a closed terminal, some schedulers) is treated as SIGTERM. Clusters deliver the same
request more than once: SLURM (scancel, the time limit) signals every process of the job, so a
rank gets it directly and again forwarded by its launcher. A SIGTERM or SIGHUP within
`STOP_WINDOW_S` of the first is therefore the same request, here and after `train` returns
(`launch.stop_request`), so a copy cannot cut the stop or its clean-up short. A later repeat
acts at once, as does SIGTERM outside `train`. SIGINT (Ctrl-C) is not deferred: someone at a
keyboard wants the run to stop now.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from types import FrameType, TracebackType
from typing import Any
from collections.abc import Callable

import torch

from pipedream_fast.launch import (STOP_WINDOW_S, TERM_SIGNALS, Stopped, on_stop_signal,
                                   signal_name, stop_request, write_line)


class DeferredStop:
    """While inside (in the main thread), SIGTERM or SIGHUP is recorded in `signum` instead
    of acting; a repeat within `STOP_WINDOW_S` is the same request and changes nothing, a
    later one acts at once (`Stopped`, or the launcher's handler).

    Installed only over Python's default action or a handler of this package's launchers: a
    handler the user installed, or an ignored signal (nohup), is left alone. Leaving restores
    the previous handlers, except that Python's default action, once a request was recorded,
    comes back as the launchers' handler (`launch.on_stop_signal`), which ignores repeats of
    that request: a copy arriving during the clean-up does not kill the process. Should a
    signal arrive after leaving but before the restore (a generator closed outside the main
    thread cannot restore it), the previous action is taken then."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}  # signal -> the handler this one replaced
        self._active = False

    def __enter__(self) -> DeferredStop:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in TERM_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_DFL or str(getattr(previous, "__module__", None)) \
                    .startswith("pipedream_fast.launch"):  # the package and its modules
                self._previous[signum] = previous
                signal.signal(signum, self._record)
        self._active = bool(self._previous)
        return self

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self._active and self.signum is None:
            self.signum = signum
            stop_request.start()
            return
        if stop_request.repeated_by(signum):
            return  # the same request again (directly and through the launcher)
        active, previous = self._active, self._previous.get(signum, signal.SIG_DFL)
        self._restore()  # a later repeat, or a signal after leaving: act as before
        if active:
            write_line(f"pipedream_fast: {signal_name(signum)} again {stop_request.age() or 0:.1f} "
                       f"s after the stop request, past its {STOP_WINDOW_S:g} s window: stopping "
                       f"at once, with no agreed step and no checkpoint")
        if callable(previous):
            previous(signum, frame)
        elif active:
            raise Stopped(signum, " at once (asked again)")
        else:
            os.kill(os.getpid(), signum)  # the default action, now that it is back

    def _restore(self) -> None:
        self._active = False
        if not self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if previous is signal.SIG_DFL and self.signum is not None:
                previous = on_stop_signal  # ignores copies of the request under way
            signal.signal(signum, previous)
        self._previous = {}

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._restore()


class StopVote:
    """Every rank votes on stopping (0, or the signal it received) at the same steps; the
    outcome of a vote cast after step s is read after step s + `lag`, by then normally long
    combined. Collective: every rank casts and reads the same steps in the same order.

    A vote costs a small all-reduce, which is noticeable only when steps take a few
    milliseconds. So each vote also carries the rank's proposal for how many steps to leave
    between votes (about `every_s` seconds of its steps); the smallest proposal is what every
    rank reads, at the same step, and it spaces the votes cast after that. A stop therefore
    takes `lag` steps plus at most about `every_s` seconds. `agree` wraps a wait so that a
    rank that does not take part is named (the Pipeline's `_agree`)."""

    MAX_EVERY = 1024

    def __init__(self, group: Any, world_size: int, lag: int,
                 agree: Callable[[Callable[[], Any], str], None], every_s: float = 0.1) -> None:
        if lag < 1:
            raise ValueError(f"lag must be >= 1 step, got {lag}")
        self._group = group
        self._world_size = world_size
        self._lag = lag
        self._agree = agree
        self._every_s = every_s
        self._every = 1  # steps between votes, as last agreed
        self._next = 0  # the next step to vote after
        self._last: tuple[int, float] | None = None  # (step, time) of this rank's last vote
        self._pending: deque[tuple[int, torch.Tensor, Any]] = deque()
        self.signum = 0  # the agreed signal, once read

    def _proposal(self, step: int) -> int:
        now = time.perf_counter()
        last, self._last = self._last, (step, now)
        if last is None or step <= last[0]:
            return 1
        per_step = (now - last[1]) / (step - last[0])
        return max(1, min(self.MAX_EVERY, int(self._every_s / max(per_step, 1e-9))))

    def cast(self, step: int, signum: int | None) -> None:
        if step < self._next:
            return
        self._next = step + self._every
        vote = torch.tensor([signum or 0, -self._proposal(step)], dtype=torch.int64)
        work = None
        if self._world_size > 1:  # MAX of the signals and of minus the proposals
            work = self._group.all_reduce(vote, op="max", async_op=True)
        self._pending.append((step, vote, work))

    def _read(self, until: int) -> int:
        while self._pending and self._pending[0][0] <= until:
            _, vote, work = self._pending.popleft()
            if work is not None:
                self._agree(work.wait, "agreeing whether to stop")
            self.signum = max(self.signum, int(vote[0]))
            self._every = -int(vote[1])
        return self.signum

    def outcome(self, step: int) -> int:
        """The agreed signal (0: go on), from the votes cast up to step `step - lag`."""
        return self._read(step - self._lag)

    def settle(self) -> int:
        """Reads every vote cast: at the end of a run, and before leaving one together."""
        return self._read(1 << 62)
