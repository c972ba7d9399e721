"""`Pipeline`: the drop-in training API.

    pipe = Pipeline(model, loss_fn=..., optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                    plan="plan.json", schedule="pipedream", chunks=4)
    for loss in pipe.train(loader, steps=100): ...     # loss on last-stage ranks, else None
    loss = pipe.step(inputs, targets)                  # synchronous schedules: one minibatch

One process per rank (under torchrun, `pipedream-fast run`, or `pipedream_fast.launch`): the
Pipeline joins the default process group (gloo on CPU, NCCL on GPU; initialised from the
environment if needed), cuts the model with the plan, keeps only its own stage(s), builds the
schedule and hands its rank's actions to an `Executor`. A loader minibatch is split into
`chunks` microbatches; microbatch ids run on across steps (step k holds k*chunks ...).
"""

from __future__ import annotations

import os
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipedream_fast.formats import FormatError, Plan, StagePlan
from pipedream_fast.ir import Schedule
from pipedream_fast.runtime.executor import Executor
from pipedream_fast.runtime.stage import OptimizerFactory, StageRuntime
from pipedream_fast.runtime.transport import ProcessTransport
from pipedream_fast.tracing import trace as trace_model
from pipedream_fast.schedules import SYNCHRONOUS
from pipedream_fast.training import (MicrobatchFeed, StepTracker, build_schedule, check_backend,
                                     check_plan_fits, check_runtime_fits, check_trainable,
                                     data_sources, feed_uses, model_fingerprint, named_state,
                                     original_names, positional_inputs, resolve_schedule,
                                     stage_runtime)

CHECKPOINT_FORMAT = "pipedream_fast.checkpoint/2"  # /2: one entry per stage the rank holds


def _default_device() -> torch.device:
    """The rank's GPU under NCCL (LOCAL_RANK), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return torch.device("cpu")


def _ensure_process_group(timeout_s: float) -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("Pipeline needs a process group: run under torchrun, "
                           "`pipedream-fast run --nproc N script.py` or pipedream_fast.launch "
                           "(or call torch.distributed.init_process_group first)")
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


class Pipeline:
    """Pipeline-parallel training of `model` on the ranks of the default process group."""

    def __init__(self, model: nn.Module | Callable[[], nn.Module],
                 loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: OptimizerFactory, plan: None | str | os.PathLike[str] | Plan = None,
                 schedule: str = "pipedream", microbatch_size: int | None = None,
                 chunks: int | None = None, example_inputs: Any = None,
                 timeout: float = 300.0, trace: bool = False,
                 leaf_modules: Sequence[Any] = (), device: str | torch.device | None = None
                 ) -> None:
        check_trainable(schedule)
        if chunks is not None and chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        _ensure_process_group(timeout)
        if not isinstance(model, nn.Module) and callable(model):
            with torch.device("meta"):  # a factory: build on meta, materialise only this stage
                model = model()
        self.rank = dist.get_rank()
        self.device = torch.device(device) if device is not None else _default_device()
        self.world_size = dist.get_world_size()
        self.schedule_name = schedule
        self.microbatch_size = microbatch_size
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.timeout = timeout
        self.trace = trace
        self.plan = self._resolve_plan(model, plan, example_inputs, leaf_modules)
        self.schedule_name = resolve_schedule(schedule, self.plan)
        self._names = original_names(model)
        chain = trace_model(model, leaf_modules=leaf_modules)
        self._input_names = chain.input_names
        check_plan_fits(self.plan, chain)
        self._check_same_model_everywhere(chain)
        self.stage_indices = self.plan.stages_of_rank(self.rank)
        self._modules: dict[int, nn.Module] = {}  # the stages this rank holds
        for index in self.stage_indices:
            stage_plan = self.plan.stages[index]
            module = chain.stage_module(stage_plan.start, stage_plan.stop)
            self._materialize(module, self.device)
            self._modules[index] = module.to(self.device)
        self._optimizer_factory = optimizer
        self._runtimes: dict[int, StageRuntime] = {}
        self._optimizer_states: dict[int, Any] = {}
        self._transport = ProcessTransport([s.ranks for s in self.plan.stages], timeout,
                                           device=self.device)
        self._step = 0  # minibatches trained so far
        self.last_stats: dict[str, Any] = {}
        self.last_events: list[Any] = []

    @property
    def stage_modules(self) -> dict[int, nn.Module]:
        """The stages this rank holds (several in interleaved plans), by stage index."""
        return dict(self._modules)

    # --- set-up ------------------------------------------------------------------------------
    def _resolve_plan(self, model: nn.Module, plan: Any, example_inputs: Any,
                      leaf_modules: Sequence[Any]) -> Plan:
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if plan is None:
            plan = self._plan_on_the_fly(model, example_inputs, leaf_modules)
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be None, a path or a Plan, got {type(plan).__name__}")
        if plan.workers != self.world_size:
            raise FormatError(f"the plan is for {plan.workers} workers but this job has "
                              f"{self.world_size} ranks; start {plan.workers} processes or make "
                              f"a plan for {self.world_size}")
        return plan

    def _plan_on_the_fly(self, model: nn.Module, example_inputs: Any,
                         leaf_modules: Sequence[Any]) -> Plan:
        """Rank 0 profiles and plans; every rank gets the same plan by broadcast."""
        payload: list[Any] = [None]
        if self.rank == 0:
            if self.world_size == 1:
                blocks = len(trace_model(model, leaf_modules=leaf_modules))
                plan = Plan(model=type(model).__name__, batch_size=1, workers=1,
                            schedule="1f1b" if self.schedule_name == "auto" else self.schedule_name,
                            stages=[StagePlan(0, blocks, 1, (0,), 0.0)],
                            bottleneck_ms=0.0, data_parallel_ms=0.0)
            else:
                if example_inputs is None:
                    raise ValueError("Pipeline(plan=None) profiles the model and needs "
                                     "example_inputs (one minibatch of inputs); or pass a plan")
                from pipedream_fast.planner.choose import choose_schedule, plan_for
                from pipedream_fast.profiler import profile_model  # planning is rank 0's job
                from pipedream_fast.topology import Topology
                args = positional_inputs(example_inputs, trace_model(model).input_names)
                profile = profile_model(model, args[0] if len(args) == 1 else args,
                                        batch_size=int(args[0].shape[0]), progress=False)
                topology = Topology.parse(f"{self.world_size}x1e9")
                plan = (choose_schedule(profile, topology) if self.schedule_name == "auto" else
                        plan_for(self.schedule_name, profile, topology))
            payload[0] = plan.to_dict()
        dist.broadcast_object_list(payload, src=0)
        return Plan.from_dict(payload[0])

    def _check_same_model_everywhere(self, chain: Any) -> None:
        """Every rank must have built the same model; compared before any training."""
        prints: list[Any] = [None] * self.world_size
        dist.all_gather_object(prints, model_fingerprint(chain))
        for rank, other in enumerate(prints):
            if other != prints[0]:
                differ = next(i for i, (a, b) in enumerate(zip(prints[0], other)) if a != b) \
                    if len(other) == len(prints[0]) else None
                where = (f"block {differ} ({prints[0][differ][0]})" if differ is not None
                         else f"{len(prints[0])} vs {len(other)} blocks")
                raise FormatError(f"rank {rank} built a different model than rank 0 ({where}); "
                                  f"every rank must construct the same model")

    @staticmethod
    def _materialize(module: nn.Module, device: torch.device) -> None:
        """A meta-device stage gets real memory, initialised by each layer's reset_parameters
        (only this rank's stage is ever allocated)."""
        if not any(p.is_meta for p in module.parameters()):
            return
        module.to_empty(device=device)
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()

    def _runtimes_for(self, schedule: Schedule) -> dict[int, StageRuntime]:
        for index, module in self._modules.items():
            if index not in self._runtimes:
                runtime = stage_runtime(self.plan, index, self.rank, module,
                                        self._optimizer_factory, schedule, self.loss_fn)
                state = self._optimizer_states.pop(index, None)
                if state is not None and runtime.optimizer is not None:
                    runtime.optimizer.load_state_dict(state)
                self._runtimes[index] = runtime
            check_runtime_fits(self._runtimes[index], schedule, self.rank)
        return self._runtimes

    def _chunks_for(self, batch_inputs: Any) -> int:
        if self.chunks is not None:
            return self.chunks
        if self.microbatch_size is None:
            return 1
        first = batch_inputs
        while not isinstance(first, torch.Tensor):
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        if first.shape[0] % self.microbatch_size:
            raise ValueError(f"batch size {first.shape[0]} is not a multiple of microbatch_size "
                             f"{self.microbatch_size}")
        return first.shape[0] // self.microbatch_size

    # --- training -----------------------------------------------------------------------------
    def train(self, loader: Iterable[Any], steps: int) -> Iterator[torch.Tensor | None]:
        """Trains `steps` minibatches from `loader` (pairs of inputs, targets). Yields each
        minibatch's mean microbatch loss on last-stage ranks, None on the others."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        batches = iter(loader)
        first = next(batches, None)
        if first is None:
            raise ValueError("the data loader is empty")
        chunks = self._chunks_for(first[0])
        schedule = build_schedule(self.plan, self.schedule_name, steps, chunks)
        check_backend(schedule, str(dist.get_backend()))
        runtimes = self._runtimes_for(schedule)

        def replay() -> Iterator[Any]:
            yield first
            yield from batches

        feed = MicrobatchFeed(replay(), chunks, feed_uses(schedule, [self.rank]))
        inputs, targets = data_sources(feed, schedule, self.rank, self._input_names, self.device)
        executor = Executor(schedule, self.rank, runtimes, self._transport,
                            inputs, targets, trace=self.trace)
        tracker = StepTracker(schedule, self.rank, chunks)
        losses: dict[int, list[torch.Tensor]] = defaultdict(list)
        for runtime in runtimes.values():
            runtime.begin_run()
        for _, action, loss in executor.run():
            if loss is not None:
                assert action.microbatch is not None
                losses[action.microbatch // chunks].append(loss)
            for step in tracker.done(action, steps):
                got = losses.pop(step, [])
                yield torch.stack(got).mean() if got else None
        self._step += steps
        self.last_stats = executor.stats.to_dict()
        self.last_events = executor.events or []

    def step(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        """One minibatch of a synchronous schedule (gpipe, 1f1b, data-parallel)."""
        if self.schedule_name not in SYNCHRONOUS:
            raise ValueError(f"step() trains one flushed minibatch and needs a synchronous "
                             f"schedule ({', '.join(SYNCHRONOUS)}); {self.schedule_name!r} "
                             f"streams microbatches: use train(loader, steps)")
        out = list(self.train([(inputs, targets)], steps=1))
        return out[-1]

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters and buffers, original keys, on rank 0 (None elsewhere).
        Collective: every rank must call it."""
        mine = named_state([m for i, m in self._modules.items()
                            if self.plan.stages[i].ranks[0] == self.rank], self._names)
        gathered: list[Any] = [None] * self.world_size if self.rank == 0 else None  # type: ignore
        dist.gather_object(mine, gathered, dst=0)
        if self.rank != 0:
            return None
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part)
        return full

    def save(self, path: str | os.PathLike[str]) -> None:
        """Each rank writes its stage (weights, optimizer state, step) to `path/rank<r>.pt`
        atomically; rank 0 adds the plan. Collective."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        stages = {}
        for index, module in self._modules.items():
            runtime = self._runtimes.get(index)
            optimizer = runtime.optimizer if runtime is not None else None
            stages[index] = {"model": module.state_dict(),
                             "optimizer": optimizer.state_dict() if optimizer else None}
        state = {"format": CHECKPOINT_FORMAT, "rank": self.rank, "step": self._step,
                 "schedule": self.schedule_name, "stages": stages}
        tmp = folder / f"rank{self.rank}.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, folder / f"rank{self.rank}.pt")
        if self.rank == 0:
            self.plan.save(folder / "plan.json")
        dist.barrier()

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module,
             loss_fn: Callable[[Any, Any], torch.Tensor], optimizer: OptimizerFactory,
             **kwargs: Any) -> Pipeline:
        """Rebuilds a Pipeline saved with `save` (same world size) and restores its state."""
        folder = Path(path)
        pipe = cls(model, loss_fn, optimizer, plan=folder / "plan.json", **kwargs)
        file = folder / f"rank{pipe.rank}.pt"
        if not file.exists():
            raise FileNotFoundError(f"checkpoint {folder} has no file for rank {pipe.rank}; was it "
                                    f"saved with {pipe.world_size} ranks?")
        state = torch.load(file, weights_only=False)
        held = sorted(state.get("stages", {})) if isinstance(state, dict) else None
        if state.get("format") != CHECKPOINT_FORMAT or held != list(pipe.stage_indices):
            raise FormatError(f"{file} is not a checkpoint of stages {list(pipe.stage_indices)} "
                              f"(format {state.get('format')!r}, stages {held})")
        for index, saved in state["stages"].items():
            pipe._modules[index].load_state_dict(saved["model"])
            if saved["optimizer"] is not None:
                pipe._optimizer_states[index] = saved["optimizer"]
        pipe._step = int(state["step"])
        return pipe

    def close(self) -> None:
        self._transport.close()
