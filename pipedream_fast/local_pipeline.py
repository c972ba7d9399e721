"""`LocalPipeline`: every rank of a plan as a thread of this process (one per stage replica).

The same schedule IR and the same `Executor` as the multi-process `Pipeline`; only the
transport differs: tensors are handed over through the C++ activation queues (no copy, GIL
released while waiting). On CPU the threads share the cores; on a multi-GPU machine each
stage's module can live on its own device.

    pipe = LocalPipeline(model, loss_fn, optimizer_factory, plan, schedule="pipedream", chunks=4)
    for loss in pipe.train(loader, steps=100): ...

Stopping. Every wait is bounded by `timeout`: a rank blocked on a queue or an all-reduce gives
up after it, and the thread that drives `train()` watches every rank's current action, so a
rank stuck in its own code for longer is reported too (`WorkerStuck`). The first failure
stops the run: the hub is closed, which wakes every waiting rank at once, and each rank stops
before its next action. A thread cannot be interrupted in the middle of user code: one stuck
there is left behind (a daemon thread) and the `LocalPipeline` refuses to train until it
returns. Leaving `train()` early (a `break`, an exception or Ctrl-C in the caller's loop,
`close()` of the generator) stops the run the same way, with every rank's thread joined
before `train()` is left, and discards the microbatches in flight. The stages keep the
updates they applied: a synchronous schedule's stages may be one update apart (the last
stage updates first), an asynchronous one's up to the pipeline's depth, and the next
`train()` goes on from there.

SIGTERM (or SIGHUP) during `train()` stops every rank after the same step instead, as the
multi-process `Pipeline` does (`pipedream_fast.stopping`): the signal is only recorded
(`DeferredStop`); the driving thread then picks the step (`_StopPoint`: one that no rank has
finished yet), each rank stops right after finishing it and performs what that step still
owes its peers (its sends and updates, `Executor.drain`), so every stage holds exactly the
updates of the steps trained; `train()` then raises `Stopped` (exit code 143) with that step,
and the caller can save the model there.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import queue
import threading
import time
from collections import defaultdict
from typing import Any
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from pipedream_fast.formats import Plan
from pipedream_fast.ir import Action, Schedule
from pipedream_fast.launch import Stopped
from pipedream_fast.runtime.executor import Executor
from pipedream_fast.runtime.stage import OptimizerFactory, StageRuntime
from pipedream_fast.runtime.transport import ThreadHub, ThreadTransport
from pipedream_fast.stopping import DeferredStop
from pipedream_fast.tracing import check_no_shared_parameters
from pipedream_fast.tracing import trace as trace_model
from pipedream_fast.training import (EpochBatches, MicrobatchFeed, build_schedule,
                                     check_localsgd_options,
                                     check_plan_fits, check_runtime_fits, check_trainable,
                                     data_source, feed_uses, named_state, original_names,
                                     resolve_schedule, stage_runtime, steps_for, target_spec,
                                     StepTracker)
from pipedream_fast.tuning import Tuning


_POLL_S = 0.25    # how often the driving thread looks at the ranks while it waits for news
_SETTLE_S = 0.2   # how long a rank already over its time gets to come back once stopped


class WorkerStuck(TimeoutError):
    """A rank ran one action (or waited) for longer than the timeout. When its thread does
    not come back, it is left behind and the message says so."""


class _Stopped(Exception):
    """Raised in a rank's thread, before its next action, once its run is stopped."""


class _TrackedExecutor(Executor):
    """An `Executor` that records the action it performs and since when, and stops before
    its next action once `stop` is set."""

    transport: ThreadTransport

    def __init__(self, *args: Any, stop: threading.Event, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stop = stop
        self.index = -1
        self.current: Action | None = None
        self.since = time.monotonic()  # when the current action began

    def _handlers(self) -> dict[Any, Callable[[Action], Any]]:
        def tracked(handler: Callable[[Action], Any]) -> Callable[[Action], Any]:
            def perform(action: Action) -> Any:
                if self._stop.is_set():
                    raise _Stopped("the run was stopped")
                self.index += 1
                self.current = action
                self.since = time.monotonic()
                return handler(action)
            return perform
        return {kind: tracked(handler) for kind, handler in super()._handlers().items()}

    def phase_age(self, now: float) -> float:
        """How long the rank has been in its current wait, or computing since its last one."""
        return now - max(self.since, self.transport.since)

    def describe(self, now: float) -> str:
        if self.current is None:
            where = "has not begun its first action"
        else:
            where = f"is in action {self.index} ({self.current.to_text()})"
        waiting = self.transport.waiting
        doing = f"waiting for the {waiting}" if waiting else "computing"
        return f"rank {self.rank} {where}, {doing} for {self.phase_age(now):.1f} s"


class _StopPoint:
    """The step after which every rank of a run stops when asked to (SIGTERM): ranks report
    each step they finish and stop once they have finished `steps`; the driving thread sets
    `steps` to one that no rank has finished yet, so every rank can still stop right there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._finished = 0  # the most steps any rank has finished
        self.steps: int | None = None

    def finished(self, steps: int) -> bool:
        """A rank has finished its first `steps` steps: whether it stops here."""
        with self._lock:
            self._finished = max(self._finished, steps)
            return self.steps is not None and steps >= self.steps

    def choose(self, at_least: int) -> int:
        """Sets the stop after the next step any rank finishes, and at least `at_least`
        steps (those the caller was given already); returns it."""
        with self._lock:
            if self.steps is None:
                self.steps = max(self._finished + 1, at_least)
            return self.steps


_LIVE: set[_Run] = set()  # runs that have threads: stopped at interpreter exit at the latest


@atexit.register
def _stop_live_runs() -> None:
    # A thread still inside C++ (a queue wait, autograd) when the interpreter finalises makes
    # the process abort ("terminate called without an active exception"): stop them first.
    deadline = time.monotonic() + 2.0
    for run in list(_LIVE):
        run.stop()
        for t in run.threads:  # those a second Ctrl-C kept stop() from joining
            t.join(max(0.0, deadline - time.monotonic()))


class _Run:
    """One `train()` call's threads, one per rank, and what they report."""

    def __init__(self, executors: list[_TrackedExecutor], hub: ThreadHub,
                 stop: threading.Event, timeout: float, steps: int, chunks: int) -> None:
        self.executors = executors
        self.hub = hub
        self.timeout = timeout
        self.steps, self.chunks = steps, chunks
        self.point = _StopPoint()
        self._stop = stop
        self._results: queue.Queue[tuple[str, int, Any]] = queue.Queue()
        self._poll = min(_POLL_S, max(0.01, timeout / 10))
        self._settle = min(_SETTLE_S, timeout)
        self.threads = [threading.Thread(target=self._work, args=(e,), daemon=True,
                                         name=f"pipedream-rank{e.rank}") for e in executors]
        self.reported: set[int] = set()  # ranks that finished or failed
        self.stopped = False
        self.ended = False  # the LocalPipeline has cleaned up after it
        self.batches: EpochBatches | None = None  # what it reads: where the next run goes on
        self.stuck: list[tuple[_TrackedExecutor, threading.Thread]] = []

    def _work(self, executor: _TrackedExecutor) -> None:
        tracker = StepTracker(executor.schedule, executor.rank, self.chunks)
        try:
            for _, action, loss in executor.run():
                if loss is not None:
                    self._results.put(("loss", executor.rank, (action.microbatch, loss)))
                if any(self.point.finished(step + 1) for step in tracker.done(action,
                                                                             self.steps)):
                    # The agreed step: what it owes the peers, then nothing more (as a
                    # Pipeline rank after its vote).
                    executor.drain(self.chunks * (self.point.steps or 0))
                    break
            self._results.put(("done", executor.rank, None))
        except BaseException as err:  # noqa: BLE001 - reported to the caller by the driver
            self._results.put(("error", executor.rank, err))  # first: the cause comes first
            self.hub.close()  # wake every other rank so nobody waits for this one

    def start(self) -> None:
        _LIVE.add(self)
        for t in self.threads:
            t.start()

    @property
    def running(self) -> bool:
        return len(self.reported) < len(self.executors)

    def next_event(self) -> tuple[str, int, Any]:
        """The next report of a rank ("loss" or "done"), or ("", -1, None) after a poll
        interval without one; a failure (a rank's error, or a rank over its time) stops the
        run and is raised."""
        while True:
            if self.stopped:  # by a later train() call, while this one's caller waited
                raise RuntimeError("this train() was stopped: train() was called again "
                                   "before it ended")
            try:
                kind, rank, value = self._results.get(timeout=self._poll)
            except queue.Empty:
                kind, rank, value = "", -1, None
            if not kind:
                late = self._overdue()
                if late is not None:
                    raise self._failure(None, late)
                return kind, rank, value
            if kind == "error":
                self.reported.add(rank)
                raise self._failure(value, None)
            if kind == "done":
                self.reported.add(rank)
            return kind, rank, value

    def _overdue(self) -> _TrackedExecutor | None:
        """A rank computing for longer than the timeout (a waiting rank's own wait times out
        at the timeout: it is only caught here, a little later, should that fail)."""
        now = time.monotonic()
        for e, t in zip(self.executors, self.threads):
            if e.rank in self.reported or not t.is_alive():
                continue
            limit = self.timeout + (1.0 if e.transport.waiting else 0.0)
            if e.phase_age(now) > limit:
                return e
        return None

    def stop(self, late: _TrackedExecutor | None = None) -> list[tuple[_TrackedExecutor,
                                                                        threading.Thread]]:
        """Stops every rank and joins its thread, each within the timeout; returns those that
        did not come back (stuck in their own code: they are left behind)."""
        if self.stopped:
            return self.stuck
        self.stopped = True
        self._stop.set()  # each rank stops before its next action
        self.hub.close()  # and one blocked on a queue or an all-reduce wakes at once
        now = time.monotonic()
        try:
            for e, t in zip(self.executors, self.threads):
                if not t.is_alive():
                    continue
                if e.transport.waiting is not None:
                    deadline = now + self.timeout  # woken by the close: back at once
                elif e is late or e.phase_age(now) >= self.timeout:
                    deadline = now + self._settle  # over its time already
                else:  # computing: its action may finish, within the timeout
                    deadline = now + max(self._settle, self.timeout - e.phase_age(now))
                t.join(max(0.0, deadline - time.monotonic()))
        finally:  # also when a second Ctrl-C cuts the joins short
            self.stuck = [(e, t) for e, t in zip(self.executors, self.threads) if t.is_alive()]
            if not self.stuck:
                _LIVE.discard(self)
        return self.stuck

    def _failure(self, error: BaseException | None, late: _TrackedExecutor | None
                 ) -> BaseException:
        """Stops the run after a rank's `error` or a `late` rank; what `train()` raises."""
        now = time.monotonic()
        late_text = late.describe(now) if late is not None else ""
        stuck = self.stop(late)
        if error is not None and not stuck:
            return error
        if stuck:
            text = "; ".join(e.describe(time.monotonic()) for e, _ in stuck)
            text = (f"{text}, over the timeout of {self.timeout:g} s. A thread cannot be "
                    f"interrupted in the middle of its work: {_its(len(stuck))} left behind, "
                    f"running in the background, and this LocalPipeline cannot train again "
                    f"until {_it(len(stuck))} returns")
        else:
            text = f"{late_text}, over the timeout of {self.timeout:g} s"
        if error is not None:
            text += f" (first reported: {error})"
        failure = WorkerStuck(text)
        failure.__cause__ = error
        return failure


def _its(n: int) -> str:
    return "its thread is" if n == 1 else "their threads are"


def _it(n: int) -> str:
    return "it" if n == 1 else "they"


class LocalPipeline:
    """Trains `model` with `plan` and `schedule`, one thread per rank of the plan.

    `tuning`: the speed knobs that apply to threads (queue depth and spin of the hand-off
    queues, bucket size, weight slots, offloaded stash; see `Tuning`).

    `schedule="localsgd"` takes `local_steps` (H) and `model_replicas` (R) as `Pipeline` does
    (one microbatch per loader minibatch, so `chunks` stays 1); `state_dict` is weight copy 0,
    the averaged model after every complete round."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: OptimizerFactory, plan: Plan | str, schedule: str = "pipedream",
                 chunks: int = 1, timeout: float = 300.0, trace: bool = False,
                 seed: int = 0, *, tuning: Tuning | None = None,
                 local_steps: int | None = None, model_replicas: int | None = None) -> None:
        check_trainable(schedule)
        self.plan = Plan.load(plan) if isinstance(plan, str) else plan
        self.schedule_name = resolve_schedule(schedule, self.plan)
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        check_localsgd_options(self.schedule_name, chunks, None, local_steps, model_replicas)
        self.local_steps = local_steps
        self.model_replicas = model_replicas
        self.chunks = chunks
        self.timeout = timeout
        self.trace = trace
        self.seed = seed  # the loader's shuffling, per (seed, epoch), as in Pipeline
        self.tuning = tuning or Tuning()
        for param in model.parameters():  # where each stage's weight ring will live
            self.tuning.check_device(param.device)
        self._epoch = 0
        self._step = 0  # steps trained, counted as checkpoints and `Stopped.step` count them
        self._names = original_names(model)
        chain = trace_model(model)
        check_no_shared_parameters(chain)  # one process: a tensor cannot live in two stages
        self._flatten_inputs = chain.flatten_inputs  # a loader's inputs as stage 0's arguments
        check_plan_fits(self.plan, chain)
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._modules: dict[tuple[int, int], nn.Module] = {}  # (stage, rank) -> its module
        for index, stage in enumerate(self.plan.stages):
            module = chain.stage_module(stage.start, stage.stop)
            for i, rank in enumerate(stage.ranks):
                self._modules[(index, rank)] = module if i == 0 else copy.deepcopy(module)
        self._runtimes: dict[tuple[int, int], StageRuntime] = {}
        self._run: _Run | None = None  # the train() call in progress
        self._left_behind: list[tuple[_TrackedExecutor, threading.Thread]] = []
        self.last_stats: dict[int, dict[str, Any]] = {}
        self.last_events: list[Any] = []

    def _runtimes_of(self, rank: int, schedule: Schedule) -> dict[int, StageRuntime]:
        """The stage runtimes of one rank (thread), made on first use."""
        out = {}
        for stage in schedule.stages_of(rank):
            key = (stage, rank)
            if key not in self._runtimes:
                self._runtimes[key] = stage_runtime(self.plan, stage, rank, self._modules[key],
                                                    self._optimizer, schedule, self._loss_fn,
                                                    tuning=self.tuning)
            check_runtime_fits(self._runtimes[key], schedule, rank)
            out[stage] = self._runtimes[key]
        return out

    def _check_usable(self) -> None:
        """Refuses to train while a thread left behind by a timeout still runs; once they
        are all gone, clears what they left."""
        if self._run is not None:  # the generator of an earlier train() is still open
            self._end(self._run, early=True)
        if not self._left_behind:
            return
        now = time.monotonic()
        alive = [e.describe(now) for e, t in self._left_behind if t.is_alive()]
        if alive:
            raise RuntimeError(f"this LocalPipeline cannot train: {'; '.join(alive)} (left "
                               f"behind after a timeout; a thread cannot be interrupted). Wait "
                               f"for {'it' if len(alive) == 1 else 'them'} to return, or train "
                               f"a new LocalPipeline")
        self._left_behind = []
        self._abandon()

    def _abandon(self) -> None:
        for runtime in self._runtimes.values():
            runtime.abandon_run()

    def _end(self, run: _Run, early: bool) -> None:
        """After a run (once): where the data goes on and, when it ended `early`, its ranks
        stopped and what was in flight discarded, unless threads are left behind (then at
        the next call, once they are gone)."""
        if run.ended:
            return
        run.ended = True
        if self._run is run:
            self._run = None
        stuck = run.stop()
        if run.batches is not None:
            self._epoch = run.batches.epochs_started()
        if stuck:
            self._left_behind = list(stuck)
        elif early:
            self._abandon()

    def train(self, loader: Iterable[Any], steps: int | None = None, *,
              epochs: int | None = None) -> Iterator[torch.Tensor]:
        """Trains `steps` minibatches or `epochs` passes over `loader` (default one; each
        call begins a new epoch); yields each minibatch's mean microbatch loss.

        Leaving the loop early stops every rank and discards the microbatches in flight
        (the stages keep the updates they applied; see the module's docstring). SIGTERM or
        SIGHUP stops every rank after the same step, then raises `Stopped` (code 143 or 129)
        whose `step` counts the steps this LocalPipeline trained, as a checkpoint does."""
        self._check_usable()
        steps = steps_for(loader, steps, epochs)
        batches = EpochBatches(loader, self.seed, self._epoch)
        first = next(batches, None)
        if first is None:
            raise ValueError("the data loader is empty")
        spec = target_spec(first[1])
        schedule = build_schedule(self.plan, self.schedule_name, steps, self.chunks,
                                  self.local_steps, self.model_replicas)
        ranks = range(schedule.num_ranks)
        runtimes = {rank: self._runtimes_of(rank, schedule) for rank in ranks}
        feed = MicrobatchFeed(itertools.chain([first], batches), self.chunks,
                              feed_uses(schedule, ranks))
        hub = ThreadHub(schedule.num_ranks, self.timeout, depth=self.tuning.thread_queue_depth,
                        spin_us=self.tuning.spin_us)
        stop = threading.Event()
        executors = []
        for rank in ranks:
            for runtime in runtimes[rank].values():
                runtime.begin_run()
            inputs = data_source(feed, schedule, rank, self._flatten_inputs)
            executors.append(_TrackedExecutor(schedule, rank, runtimes[rank],
                                              ThreadTransport(hub, rank), inputs,
                                              target_spec=spec, trace=self.trace, stop=stop))
        run = _Run(executors, hub, stop, self.timeout, steps, self.chunks)
        run.batches = batches
        self._run = run
        finished = False
        next_step = 0  # the steps yielded (counted before the yield: a break there had it)
        try:
            with DeferredStop() as request:
                run.start()
                losses: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)  # step -> mb -> loss
                while run.running:
                    if request.signum is not None:
                        run.point.choose(next_step)
                    kind, _, value = run.next_event()
                    if kind == "loss":
                        mb, loss = value  # every rank reports the losses it learns: keep one per mb
                        if mb // self.chunks >= next_step:  # not a step yielded already
                            losses[mb // self.chunks][mb] = loss
                    while next_step < (run.point.steps or steps) and \
                            len(losses.get(next_step, ())) == self.chunks:
                        got = losses.pop(next_step)
                        next_step += 1
                        yield torch.stack(list(got.values())).mean()
                # else every rank stopped after the same step, with steps left in flight
                finished = run.point.steps is None or run.point.steps >= steps
                signum = request.signum
        finally:
            # Also on a break, an exception or Ctrl-C in the caller's loop, close(): no thread
            # may outlive train() inside a wait (it would abort the process at exit).
            self._step += next_step
            self._end(run, early=not finished)
        self.last_stats = {e.rank: e.stats.to_dict() for e in executors}
        self.last_events = [ev for e in executors for ev in (e.events or [])]
        if signum is not None:
            raise Stopped(signum, f" after step {self._step}", step=self._step)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers under their original names."""
        return named_state([self._modules[(i, s.ranks[0])] for i, s in enumerate(self.plan.stages)],
                           self._names)
