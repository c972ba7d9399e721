"""`LocalPipeline`: every rank of a plan as a thread of this process (one per stage replica).

The same schedule IR and the same `Executor` as the multi-process `Pipeline`; only the
transport differs: tensors are handed over through the C++ activation queues (no copy, GIL
released while waiting). On CPU the threads share the cores; on a multi-GPU machine each
stage's module can live on its own device.

    pipe = LocalPipeline(model, loss_fn, optimizer_factory, plan, schedule="pipedream", chunks=4)
    for loss in pipe.train(loader, steps=100): ...
"""

from __future__ import annotations

import copy
import queue
import threading
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from pipedream_fast.formats import FormatError, Plan
from pipedream_fast.ir import ActionKind, Schedule
from pipedream_fast.pipeline import SYNCHRONOUS, as_call, split_microbatches
from pipedream_fast.runtime.executor import Executor
from pipedream_fast.runtime.stage import OptimizerFactory, StageRuntime
from pipedream_fast.runtime.transport import ThreadHub, ThreadTransport
from pipedream_fast.schedules import SCHEDULE_NAMES, make_schedule
from pipedream_fast.tracing import trace as trace_model


class _SharedFeed:
    """Microbatches read once from the loader and handed to every rank that uses them."""

    def __init__(self, batches: Iterator[Any], chunks: int, uses: dict[int, int]) -> None:
        self._batches = batches
        self._chunks = chunks
        self._uses = dict(uses)  # mb -> how many ranks still need it
        self._cache: dict[int, Any] = {}
        self._next_step = 0
        self._lock = threading.Lock()

    def take(self, mb: int) -> Any:
        with self._lock:
            while mb not in self._cache:
                try:
                    batch = next(self._batches)
                except StopIteration:
                    raise RuntimeError(f"the data loader ran out at step {self._next_step}; give "
                                       f"it at least as many batches as steps") from None
                for i, part in enumerate(zip(*(split_microbatches(x, self._chunks) for x in batch))):
                    if self._uses.get(self._next_step * self._chunks + i):
                        self._cache[self._next_step * self._chunks + i] = part
                self._next_step += 1
            value = self._cache[mb]
            self._uses[mb] -= 1
            if self._uses[mb] == 0:
                del self._cache[mb]
            return value


class LocalPipeline:
    """Trains `model` with `plan` and `schedule`, one thread per rank of the plan."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: OptimizerFactory, plan: Plan | str, schedule: str = "pipedream",
                 chunks: int = 1, timeout: float = 300.0, trace: bool = False) -> None:
        if schedule not in SCHEDULE_NAMES or schedule == "localsgd":
            raise ValueError(f"schedule {schedule!r} cannot be trained; choose one of "
                             f"{', '.join(s for s in SCHEDULE_NAMES if s != 'localsgd')}")
        self.plan = Plan.load(plan) if isinstance(plan, str) else plan
        self.schedule_name = schedule
        self.chunks = chunks
        self.timeout = timeout
        self.trace = trace
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._names.update({id(b): n for n, b in model.named_buffers()})
        chain = trace_model(model)
        if self.plan.stages[-1].stop != len(chain):
            raise FormatError(f"the plan covers {self.plan.stages[-1].stop} blocks but the model "
                              f"splits into {len(chain)}; the plan was made for another model")
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._modules: dict[int, nn.Module] = {}  # rank -> its stage module
        for stage in self.plan.stages:
            module = chain.stage_module(stage.start, stage.stop)
            for i, rank in enumerate(stage.ranks):
                self._modules[rank] = module if i == 0 else copy.deepcopy(module)
        self._runtimes: dict[int, StageRuntime] = {}
        self.last_stats: dict[int, dict[str, Any]] = {}
        self.last_events: list[Any] = []

    def _schedule(self, steps: int) -> Schedule:
        kwargs: dict[str, Any] = {"stage_ranks": [list(s.ranks) for s in self.plan.stages]}
        if self.schedule_name in SYNCHRONOUS + ("2bw",):
            kwargs["step_microbatches"] = self.chunks
        return make_schedule(self.schedule_name, len(self.plan.stages), steps * self.chunks,
                             **kwargs)

    def _runtime(self, rank: int, schedule: Schedule) -> StageRuntime:
        if rank not in self._runtimes:
            stage = self.plan.stage_of_rank(rank)
            self._runtimes[rank] = StageRuntime(
                stage, self._modules[rank], self._optimizer, schedule.max_versions[rank],
                is_first=stage == 0, is_last=stage == len(self.plan.stages) - 1,
                loss_fn=self._loss_fn)
        return self._runtimes[rank]

    def train(self, loader: Iterable[Any], steps: int) -> Iterator[torch.Tensor]:
        """Trains `steps` minibatches; yields each minibatch's mean microbatch loss."""
        schedule = self._schedule(steps)
        uses: dict[int, int] = defaultdict(int)
        for rank in range(schedule.num_ranks):
            runtime = self._runtime(rank, schedule)
            for a in schedule.actions[rank]:
                if a.kind is ActionKind.FORWARD:
                    uses[a.microbatch] += int(runtime.is_first) + int(runtime.is_last)
        feed = _SharedFeed(iter(loader), self.chunks, uses)
        hub = ThreadHub(schedule.num_ranks, self.timeout)
        results: queue.Queue[tuple[str, Any]] = queue.Queue()
        executors = []
        for rank in range(schedule.num_ranks):
            runtime = self._runtimes[rank]
            runtime.begin_run()
            executors.append(Executor(
                schedule, rank, {runtime.stage: runtime}, ThreadTransport(hub, rank),
                (lambda mb: as_call(feed.take(mb)[0])) if runtime.is_first else None,
                (lambda mb: feed.take(mb)[1]) if runtime.is_last else None, trace=self.trace))

        def work(executor: Executor) -> None:
            try:
                for _, action, loss in executor.run():
                    if loss is not None:
                        results.put(("loss", (action.microbatch, loss)))
                results.put(("done", executor.rank))
            except BaseException as err:  # noqa: BLE001 - reported to the caller below
                hub.close()  # wake every other rank so nobody waits for the dead one
                results.put(("error", err))

        threads = [threading.Thread(target=work, args=(e,), name=f"pipedream-rank{e.rank}",
                                    daemon=True) for e in executors]
        for t in threads:
            t.start()
        losses: dict[int, list[torch.Tensor]] = defaultdict(list)
        next_step, running, error = 0, len(threads), None
        while running:
            kind, value = results.get()
            if kind == "error":
                error = error or value
                running -= 1
            elif kind == "done":
                running -= 1
            else:
                mb, loss = value
                losses[mb // self.chunks].append(loss)
                while len(losses.get(next_step, ())) == self.chunks:
                    yield torch.stack(losses.pop(next_step)).mean()
                    next_step += 1
        for t in threads:
            t.join()
        if error is not None:
            raise error
        self.last_stats = {e.rank: e.stats.to_dict() for e in executors}
        self.last_events = [ev for e in executors for ev in (e.events or [])]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers under their original names."""
        state: dict[str, torch.Tensor] = {}
        for stage in self.plan.stages:
            module = self._modules[stage.ranks[0]]
            for t in list(module.parameters()) + list(module.buffers()):
                if id(t) in self._names:
                    state[self._names[id(t)]] = t.detach().clone()
        return state
