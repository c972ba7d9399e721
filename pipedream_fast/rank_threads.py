"""The rank threads of a `Pipeline(ranks="threads")`: every rank is a thread of this process
running the same per-rank Pipeline code as a process would, in a `ThreadWorld`.

The caller's thread drives them. A collective call (evaluate, save, predict...) runs on every
rank thread at once and returns each rank's result. `train` is a generator on every rank:
each rank thread runs its own and, after yielding a step, waits until the caller has taken
that step and asked for the next (`_Gate`), so a caller's `break` after step k reaches every
rank right after its step k, exactly as an SPMD script's `break` reaches every process. The
losses are the same on every rank; the caller gets each step from the first rank that has it.

Failures. The first rank to fail (an error, or a wait over the timeout) aborts every other
rank's waits at once (`ThreadShared.abort`), as a dead process's closed sockets do, and its
error is what the caller gets. Errors every rank raises together at the same step (an agreed
stop, a NaN loss) are not failures: each rank finishes its part (a checkpoint) first. A thread
stuck in its own code cannot be interrupted: it is left behind (a daemon thread), the call
raises `WorkerStuck`, and the Pipeline refuses further calls until it returns. Then the
shared state is reset and the ranks run again, each having discarded what was in flight (as
after a `break`, the stages may be an update apart).
"""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

from pipedream_fast.launch import Stopped
from pipedream_fast.stopping import DeferredStop
from pipedream_fast.world import Aborted, ThreadShared, ThreadWorld

_SETTLE_S = 0.5  # how long an aborted rank gets to come back before it is left behind


class WorkerStuck(TimeoutError):
    """A rank thread did not come back within the timeout; it is left behind."""


def _in_thread(rank: int, fn: Callable[[], Any]) -> tuple[Future[Any], threading.Thread]:
    """Runs `fn` in a new thread of rank `rank`, in the caller's context (a daemon: one stuck
    in user code never keeps the process from exiting)."""
    future: Future[Any] = Future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            future.set_result(context.run(fn))
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            future.failed_at = time.monotonic()  # type: ignore[attr-defined]
            future.set_exception(err)

    thread = threading.Thread(target=run, daemon=True, name=f"pipedream-rank{rank}")
    thread.start()
    return future, thread


def _failed_at(future: Future[Any]) -> float:
    return getattr(future, "failed_at", float("inf"))


def _together(err: BaseException) -> bool:
    """Raised by every rank at the same step on its own: not a failure to abort for."""
    from pipedream_fast.rank.state import NonFiniteLoss
    return isinstance(err, (Stopped, NonFiniteLoss))


class RankThreads:
    """`size` rank threads and the state they share (see the module's docstring). Each call
    has threads of its own, gone when it returns."""

    def __init__(self, size: int, timeout_s: float,
                 on_reset: Callable[[], None] | None = None,
                 describe: Callable[[int], str] | None = None) -> None:
        if size < 1:
            raise ValueError(f"workers must be >= 1 rank threads, got {size}")
        self.size = size
        self.timeout_s = timeout_s
        self.shared = ThreadShared(size, timeout_s)
        self.worlds = [ThreadWorld(r, self.shared) for r in range(size)]
        self._on_reset = on_reset  # the Pipeline drops what the abort closed
        self._describe = describe or (lambda rank: f"rank {rank}")  # what a rank is doing
        self._left_behind: list[tuple[int, threading.Thread]] = []

    def _check_usable(self) -> None:
        """After a failure: refused while a thread left behind still runs; once every one is
        back, the shared state is reset and the ranks can run again."""
        if self.shared.aborted is None:
            return
        stuck = [rank for rank, t in self._left_behind if t.is_alive()]
        if stuck:
            doing = "; ".join(self._describe(rank) for rank in stuck)
            raise RuntimeError(f"this Pipeline cannot run: {doing}, left behind after "
                               f"{self.shared.aborted} (a thread cannot be interrupted). Wait "
                               f"for {'them' if len(stuck) > 1 else 'it'} to return, or make a "
                               f"new Pipeline")
        self._left_behind = []
        self.shared.reset()
        made = max(w.made for w in self.worlds)
        for world in self.worlds:  # ranks that failed early made fewer: align the counts
            world.made = made
        if self._on_reset is not None:
            self._on_reset()

    def call(self, fn: Callable[[int], Any]) -> list[Any]:
        """`fn(rank)` on every rank thread at once; every rank's result, in rank order."""
        self._check_usable()
        began = time.monotonic()
        started = [_in_thread(r, functools.partial(fn, r)) for r in range(self.size)]
        return self._results(started, began)

    def _results(self, started: list[tuple[Future[Any], threading.Thread]],
                 began: float) -> list[Any]:
        futures = [f for f, _ in started]
        # Every wait of a rank is bounded by the timeout, so a rank stuck in its own code makes
        # the others fail within it: no deadline is needed here.
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = min((f for f in futures if f in done and f.exception() is not None),
                     key=_failed_at, default=None)
        if failed is None and not pending:
            return [f.result() for f in futures]
        if failed is not None and _together(failed.exception()):  # type: ignore[arg-type]
            wait(pending, timeout=self.timeout_s + _SETTLE_S)
            pending = {f for f in pending if not f.done()}
            if not pending:
                raise self._first_error(futures)
        reason = (f"rank {futures.index(failed)} failed ({failed.exception()})" if failed
                  is not None else f"no rank thread finished within {self.timeout_s:g} s")
        self.shared.abort(reason)
        wait(pending, timeout=_SETTLE_S)
        stuck = [i for i, f in enumerate(futures) if not f.done()]
        self._left_behind = [(i, started[i][1]) for i in stuck]
        if stuck:
            doing = "; ".join(self._describe(rank) for rank in stuck)
            # Over the timeout, or busy in its own work when another rank failed early.
            late = (f"over the timeout of {self.timeout_s:g} s"
                    if time.monotonic() - began >= self.timeout_s else "still busy")
            error = WorkerStuck(f"{doing}, {late}, and did "
                                f"not return after {reason}: a thread cannot be interrupted in "
                                f"the middle of its work, so {'they are' if len(stuck) > 1 else 'it is'} "
                                f"left behind, running in the background")
            if failed is not None:
                error.__cause__ = failed.exception()
            raise error
        raise self._first_error(futures)

    @staticmethod
    def _first_error(futures: list[Future[Any]]) -> BaseException:
        """The cause: the first rank's error, before those it caused in the others (an
        abort, a closed queue)."""
        failed = sorted((f for f in futures if f.exception() is not None), key=_failed_at)
        own = [f for f in failed if not isinstance(f.exception(), Aborted)]
        return (own or failed)[0].exception()  # type: ignore[return-value]

    def train(self, start: Callable[[int, DeferredStop], Iterator[Any]]) -> Iterator[Any]:
        """Drives `start(rank, request)`, every rank's train generator, in step with the
        caller (see `_Gate`); yields each step's loss once."""
        self._check_usable()
        gate = _Gate(self.size)
        with DeferredStop() as request:  # the caller's thread gets the signal
            def follow(rank: int) -> None:
                gate.follow(rank, start(rank, request))
            began = time.monotonic()
            started = [_in_thread(r, functools.partial(follow, r)) for r in range(self.size)]
            futures = [f for f, _ in started]
            taken = 0
            try:
                while True:
                    item = gate.next_step(taken, futures, self.timeout_s)
                    if item is _END:
                        break
                    taken += 1
                    yield item
                    gate.go()
            finally:
                gate.stop()  # a break, an error, or (harmless) every rank done
                self._results(started, began)


_END = object()


class _Gate:
    """Holds each rank at its yield of step k until the caller has taken step k and asked for
    the next (`go`), or left (`stop`): every rank then leaves its generator there, as a
    `break` at step k does in a process."""

    def __init__(self, size: int) -> None:
        self._cond = threading.Condition()
        self._allowed = 0  # steps every rank may go past
        self._stopped = False
        self._losses: dict[int, Any] = {}  # step -> loss, from the first rank to yield it
        self._taken = 0  # steps the caller has taken
        self._ended = 0  # ranks whose generator ended

    def follow(self, rank: int, steps: Iterator[Any]) -> None:
        """A rank thread's loop over its own train generator."""
        try:
            for step, loss in enumerate(steps):
                with self._cond:
                    if step >= self._taken:
                        self._losses.setdefault(step, loss)
                    self._cond.notify_all()
                    while step >= self._allowed and not self._stopped:
                        self._cond.wait()
                    leave = step >= self._allowed
                if leave:
                    close = getattr(steps, "close", None)
                    if close is not None:
                        close()  # GeneratorExit at the yield: the rank leaves as on a break
                    return
        finally:
            with self._cond:
                self._ended += 1
                self._cond.notify_all()

    def next_step(self, step: int, futures: list[Future[Any]], timeout_s: float) -> Any:
        """The loss of `step`, once a rank has it; _END when every generator ended; returns
        early (with _END) when a rank failed, for the caller to collect the error."""
        with self._cond:
            while step not in self._losses:
                if self._ended == len(futures) or any(f.done() for f in futures):
                    return _END
                self._cond.wait(0.25)
            self._taken = step + 1
            return self._losses.pop(step)

    def go(self) -> None:
        with self._cond:
            self._allowed += 1
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
