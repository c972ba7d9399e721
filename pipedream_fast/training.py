"""What both training front ends share: turning a loader into microbatches, a plan into a
schedule, and a rank's stage module into a `StageRuntime`.

`Pipeline` (one process per rank) and `LocalPipeline` (one thread per rank) differ only in
how ranks are started and how tensors travel; everything here is common to them.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from pipedream_fast.formats import FormatError, Plan
from pipedream_fast.ir import ActionKind, Schedule
from pipedream_fast.runtime.stage import OptimizerFactory, StageRuntime
from pipedream_fast.schedules import SCHEDULE_NAMES, make_schedule
from pipedream_fast.tracing import LayerChain

SYNCHRONOUS = ("gpipe", "1f1b", "data-parallel")
TRAINABLE = tuple(s for s in SCHEDULE_NAMES if s != "localsgd")


def check_trainable(schedule: str) -> None:
    if schedule not in TRAINABLE:
        raise ValueError(f"schedule {schedule!r} cannot be trained; choose one of "
                         f"{', '.join(TRAINABLE)} (localsgd is simulated only)")


def check_plan_fits(plan: Plan, chain: LayerChain) -> None:
    """Raises before training when the plan was made for another model: another block count,
    other block names, or other parameter sizes than the plan's stages recorded."""
    if plan.stages[-1].stop != len(chain):
        raise FormatError(f"the plan covers {plan.stages[-1].stop} blocks but the model splits "
                          f"into {len(chain)}; the plan was made for another model (re-run "
                          f"`pipedream-fast profile` and `plan` on this one)")
    for index, stage in enumerate(plan.stages):
        blocks = chain.blocks[stage.start:stage.stop]
        names = stage.extra.get("blocks")
        if names is not None and list(names) != [b.name for b in blocks]:
            raise FormatError(f"plan stage {index} expects blocks {list(names)} but the model's "
                              f"blocks {stage.start}..{stage.stop - 1} are "
                              f"{[b.name for b in blocks]}; the plan was made for another model")
        expected = stage.extra.get("parameter_bytes")
        found = sum(p.numel() * p.element_size() for b in blocks for p in b.module.parameters())
        if expected is not None and int(expected) != found:
            raise FormatError(f"plan stage {index} was planned for {int(expected)} bytes of "
                              f"parameters but the model's blocks {stage.start}..{stage.stop - 1} "
                              f"hold {found}; the plan was made for another model or size")


def model_fingerprint(chain: LayerChain) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Block names and parameter shapes: what every rank of one job must agree on."""
    return [(b.name, [tuple(p.shape) for p in b.module.parameters()]) for b in chain.blocks]


def split_microbatches(value: Any, chunks: int) -> list[Any]:
    """Splits a tensor, or a tuple/list/dict of tensors, into `chunks` along dimension 0."""
    if isinstance(value, torch.Tensor):
        if value.shape[0] % chunks:
            raise ValueError(f"a minibatch of {value.shape[0]} samples does not split into "
                             f"{chunks} equal microbatches; use a batch size divisible by chunks "
                             f"(and drop_last=True in the DataLoader)")
        return list(value.chunk(chunks))
    if isinstance(value, (tuple, list)):
        parts = [split_microbatches(v, chunks) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(chunks)]
    if isinstance(value, dict):
        parts = {k: split_microbatches(v, chunks) for k, v in value.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(chunks)]
    raise TypeError(f"cannot split a {type(value).__name__} into microbatches: inputs and "
                    f"targets must be tensors, or tuples, lists or dicts of tensors")


def positional_inputs(inputs: Any, input_names: Sequence[str]) -> tuple[Any, ...]:
    """The first stage's arguments: a tensor, a tuple/list of them, or a dict whose keys are the
    model's input names (anything else is passed as one argument)."""
    if isinstance(inputs, dict) and set(inputs) == set(input_names):
        return tuple(inputs[name] for name in input_names)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    return (inputs,)


class MicrobatchFeed:
    """Microbatches of a loader, read lazily in order and kept until every user has taken them.

    `uses[mb]` says how many takes microbatch `mb` gets (the first stage's inputs and the last
    stage's targets, possibly on different threads); microbatches nobody uses are dropped.
    """

    def __init__(self, batches: Iterator[Any], chunks: int, uses: dict[int, int]) -> None:
        self._batches = batches
        self._chunks = chunks
        self._uses = dict(uses)
        self._cache: dict[int, Any] = {}
        self._next_step = 0
        self._lock = threading.Lock()

    def take(self, mb: int) -> tuple[Any, Any]:
        with self._lock:
            while mb not in self._cache:
                if mb < self._next_step * self._chunks:
                    raise RuntimeError(f"microbatch {mb} was taken more often than declared")
                try:
                    batch = next(self._batches)
                except StopIteration:
                    raise RuntimeError(f"the data loader ran out at step {self._next_step}; give "
                                       f"it at least as many batches as steps") from None
                if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                    raise TypeError(f"the loader must yield (inputs, targets) pairs, got "
                                    f"{type(batch).__name__}")
                base = self._next_step * self._chunks
                for i, part in enumerate(zip(*(split_microbatches(x, self._chunks) for x in batch))):
                    if self._uses.get(base + i):
                        self._cache[base + i] = part
                self._next_step += 1
            value = self._cache[mb]
            self._uses[mb] -= 1
            if self._uses[mb] == 0:
                del self._cache[mb]
            return value


def feed_uses(schedule: Schedule, runtimes: dict[int, StageRuntime]) -> dict[int, int]:
    """How many takes each microbatch gets from the ranks in `runtimes` (rank -> runtime)."""
    uses: dict[int, int] = {}
    for rank, runtime in runtimes.items():
        if not (runtime.is_first or runtime.is_last):
            continue
        for a in schedule.actions[rank]:  # one take per forward (see data_sources)
            if a.kind is ActionKind.FORWARD and a.stage == runtime.stage:
                uses[a.microbatch] = uses.get(a.microbatch, 0) + 1
    return uses


def to_device(value: Any, device: torch.device) -> Any:
    """Moves a tensor or a tuple/list/dict of tensors (asynchronously from pinned memory)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def data_sources(feed: MicrobatchFeed, runtime: StageRuntime, input_names: Sequence[str],
                 device: torch.device = torch.device("cpu")
                 ) -> tuple[Callable[[int], tuple[Any, ...]] | None, Callable[[int], Any] | None]:
    """The executor's input source (first stage) and target source (last stage) for a rank,
    on the rank's device. A rank holding both reads each microbatch once."""
    targets: dict[int, Any] = {}

    def inputs(mb: int) -> tuple[Any, ...]:
        x, y = feed.take(mb)
        if runtime.is_last:
            targets[mb] = y
        return positional_inputs(to_device(x, device), input_names)

    def target(mb: int) -> Any:
        return to_device(targets.pop(mb) if runtime.is_first else feed.take(mb)[1], device)

    return (inputs if runtime.is_first else None), (target if runtime.is_last else None)


def build_schedule(plan: Plan, name: str, steps: int, chunks: int) -> Schedule:
    """The IR for `steps` minibatches of `chunks` microbatches on the plan's stages and ranks."""
    kwargs: dict[str, Any] = {"stage_ranks": [list(s.ranks) for s in plan.stages]}
    if name in SYNCHRONOUS + ("2bw",):
        kwargs["step_microbatches"] = chunks  # one update per minibatch
    return make_schedule(name, len(plan.stages), steps * chunks, **kwargs)


def stage_runtime(plan: Plan, rank: int, module: nn.Module, optimizer: OptimizerFactory,
                  schedule: Schedule, loss_fn: Callable[[Any, Any], torch.Tensor]) -> StageRuntime:
    stage = plan.stage_of_rank(rank)
    return StageRuntime(stage, module, optimizer, slots=schedule.max_versions[rank],
                        is_first=stage == 0, is_last=stage == len(plan.stages) - 1,
                        loss_fn=loss_fn)


def check_runtime_fits(runtime: StageRuntime, schedule: Schedule, rank: int) -> None:
    if runtime.ring is not None and runtime.ring.capacity < schedule.max_versions[rank]:
        raise ValueError(f"this run keeps {schedule.max_versions[rank]} weight versions on rank "
                         f"{rank} but the stage was set up for {runtime.ring.capacity}; use the "
                         f"same chunks in every call")


def original_names(model: nn.Module) -> dict[int, str]:
    """Tensor identity -> its name in the original model (stages share the tensors)."""
    names = {id(p): n for n, p in model.named_parameters()}
    names.update({id(b): n for n, b in model.named_buffers()})
    return names


def named_state(modules: Sequence[nn.Module], names: dict[int, str]) -> dict[str, torch.Tensor]:
    """Copies of the parameters and buffers of `modules` under their original names."""
    state: dict[str, torch.Tensor] = {}
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) in names:
                state[names[id(t)]] = t.detach().clone()
    return state
