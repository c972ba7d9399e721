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
import itertools
import queue
import threading
from collections import defaultdict
from typing import Any
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from pipedream_fast.formats import Plan
from pipedream_fast.ir import Schedule
from pipedream_fast.runtime.executor import Executor
from pipedream_fast.runtime.stage import OptimizerFactory, StageRuntime
from pipedream_fast.runtime.transport import ThreadHub, ThreadTransport
from pipedream_fast.tracing import check_no_shared_parameters
from pipedream_fast.tracing import trace as trace_model
from pipedream_fast.training import (EpochBatches, MicrobatchFeed, build_schedule,
                                     check_plan_fits, check_runtime_fits, check_trainable,
                                     data_source, feed_uses, named_state, original_names,
                                     resolve_schedule, stage_runtime, steps_for, target_spec)


class LocalPipeline:
    """Trains `model` with `plan` and `schedule`, one thread per rank of the plan."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: OptimizerFactory, plan: Plan | str, schedule: str = "pipedream",
                 chunks: int = 1, timeout: float = 300.0, trace: bool = False,
                 seed: int = 0) -> None:
        check_trainable(schedule)
        self.plan = Plan.load(plan) if isinstance(plan, str) else plan
        self.schedule_name = resolve_schedule(schedule, self.plan)
        self.chunks = chunks
        self.timeout = timeout
        self.trace = trace
        self.seed = seed  # the loader's shuffling, per (seed, epoch), as in Pipeline
        self._epoch = 0
        self._names = original_names(model)
        chain = trace_model(model)
        check_no_shared_parameters(chain)  # one process: a tensor cannot live in two stages
        self._input_names = chain.input_names
        check_plan_fits(self.plan, chain)
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._modules: dict[tuple[int, int], nn.Module] = {}  # (stage, rank) -> its module
        for index, stage in enumerate(self.plan.stages):
            module = chain.stage_module(stage.start, stage.stop)
            for i, rank in enumerate(stage.ranks):
                self._modules[(index, rank)] = module if i == 0 else copy.deepcopy(module)
        self._runtimes: dict[tuple[int, int], StageRuntime] = {}
        self.last_stats: dict[int, dict[str, Any]] = {}
        self.last_events: list[Any] = []

    def _runtimes_of(self, rank: int, schedule: Schedule) -> dict[int, StageRuntime]:
        """The stage runtimes of one rank (thread), made on first use."""
        out = {}
        for stage in schedule.stages_of(rank):
            key = (stage, rank)
            if key not in self._runtimes:
                self._runtimes[key] = stage_runtime(self.plan, stage, rank, self._modules[key],
                                                    self._optimizer, schedule, self._loss_fn)
            check_runtime_fits(self._runtimes[key], schedule, rank)
            out[stage] = self._runtimes[key]
        return out

    def train(self, loader: Iterable[Any], steps: int | None = None, *,
              epochs: int | None = None) -> Iterator[torch.Tensor]:
        """Trains `steps` minibatches or `epochs` passes over `loader` (default one; each
        call begins a new epoch); yields each minibatch's mean microbatch loss."""
        steps = steps_for(loader, steps, epochs)
        batches = EpochBatches(loader, self.seed, self._epoch)
        first = next(batches, None)
        if first is None:
            raise ValueError("the data loader is empty")
        spec = target_spec(first[1])
        schedule = build_schedule(self.plan, self.schedule_name, steps, self.chunks)
        ranks = range(schedule.num_ranks)
        runtimes = {rank: self._runtimes_of(rank, schedule) for rank in ranks}
        feed = MicrobatchFeed(itertools.chain([first], batches), self.chunks,
                              feed_uses(schedule, ranks))
        hub = ThreadHub(schedule.num_ranks, self.timeout)
        results: queue.Queue[tuple[str, Any]] = queue.Queue()
        executors = []
        for rank in ranks:
            for runtime in runtimes[rank].values():
                runtime.begin_run()
            inputs = data_source(feed, schedule, rank, self._input_names)
            executors.append(Executor(schedule, rank, runtimes[rank],
                                      ThreadTransport(hub, rank), inputs, target_spec=spec,
                                      trace=self.trace))

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
        losses: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)  # step -> mb -> loss
        next_step, running, error = 0, len(threads), None
        while running:
            kind, value = results.get()
            if kind == "error":
                error = error or value
                running -= 1
            elif kind == "done":
                running -= 1
            else:
                mb, loss = value  # every rank reports the losses it learns: keep one per mb
                losses[mb // self.chunks][mb] = loss
                while len(losses.get(next_step, ())) == self.chunks:
                    yield torch.stack(list(losses.pop(next_step).values())).mean()
                    next_step += 1
        for t in threads:
            t.join()
        if error is not None:
            raise error
        self._epoch = batches.epochs_started()
        self.last_stats = {e.rank: e.stats.to_dict() for e in executors}
        self.last_events = [ev for e in executors for ev in (e.events or [])]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers under their original names."""
        return named_state([self._modules[(i, s.ranks[0])] for i, s in enumerate(self.plan.stages)],
                           self._names)
