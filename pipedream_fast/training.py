"""What every rank's run is set up from: the plan checked against the model (or made from a
manual split), the schedule built from the plan, a stage module turned into a
`StageRuntime`, when a step is done on a rank, and the model's names for its tensors.

The data side (loaders, microbatches, seeded epochs) is `data_feed`, re-exported here.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from pipedream_fast.formats import FormatError, Plan, StagePlan
from pipedream_fast.ir import KIND_SPECS, Action, ActionKind, Schedule, validate
from pipedream_fast.runtime.stage import OptimizerFactory, StageRuntime
from pipedream_fast.schedules import TRAINABLE, kind, make_schedule
from pipedream_fast.schedules.registry import splits_backward
from pipedream_fast.tracing import LayerChain
from pipedream_fast.tuning import Tuning
# re-exported: the data side of a run
from pipedream_fast.data_feed import (split_microbatches as split_microbatches,
                                      microbatch_sizes as microbatch_sizes, model_loss as
                                      model_loss, InputsOnly as InputsOnly, MicrobatchFeed as
                                      MicrobatchFeed, reads_data as reads_data, feed_uses as
                                      feed_uses, to_device as to_device, CPU as CPU, data_source as
                                      data_source, target_spec as target_spec, batch_size as
                                      batch_size, pad_batch as pad_batch, check_loader as
                                      check_loader, steps_for as steps_for, GLOBAL_STATE as
                                      GLOBAL_STATE, seeded as seeded, fingerprint as fingerprint,
                                      EpochBatches as EpochBatches)


def check_trainable(schedule: str) -> None:
    if schedule == "auto":
        return
    if kind(schedule).trainable is False:
        raise ValueError(f"schedule {schedule!r} cannot be trained (simulation only); choose "
                         f"one of {', '.join(TRAINABLE)}, or auto")


def resolve_schedule(schedule: str, plan: Plan) -> str:
    """`auto` means the plan's schedule (`plan --schedule auto` chose it by simulation)."""
    if schedule != "auto":
        return schedule
    if plan.schedule not in TRAINABLE:
        raise ValueError(f"schedule='auto' takes the plan's schedule, but the plan names "
                         f"{plan.schedule!r}; choose one of {', '.join(TRAINABLE)}")
    return plan.schedule


def check_plan_fits(plan: Plan, chain: LayerChain) -> None:
    """Raises before training when the plan was made for another model: another block count,
    other block names, or other parameter sizes than the plan's stages recorded."""
    if plan.stages[-1].stop != len(chain):
        raise FormatError(f"the plan covers {plan.stages[-1].stop} blocks but the model splits "
                          f"into {len(chain)} ({block_list(chain)}); the plan was made for "
                          f"another model (re-run `pipedream-fast profile` and `plan` on this "
                          f"one)")
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


def block_list(chain: LayerChain) -> str:
    """The model's blocks, numbered, for error messages: `0:conv1, 1:conv2, ...`."""
    return ", ".join(f"{i}:{b.name}" for i, b in enumerate(chain.blocks))


def manual_plan(chain: LayerChain, world_size: int, schedule: str,
                balance: Sequence[int] | None = None,
                split_points: Sequence[str] | None = None, model_name: str = "model") -> Plan:
    """A plan from a manual split, one rank per stage: `balance` (blocks per stage, as in
    torchgpipe) or `split_points` (the names of the blocks that start stages 1, 2, ...)."""
    names = [b.name for b in chain.blocks]
    if (balance is None) == (split_points is None):
        raise ValueError("give balance or split_points, not both")
    if split_points is not None:
        starts = [0] + [_first_block(names, p, chain) for p in split_points]
        if starts != sorted(set(starts)):
            raise ValueError(f"split points {list(split_points)} must name blocks after the "
                             f"first, in model order, each once; the blocks are "
                             f"{block_list(chain)}")
        balance = [b - a for a, b in zip(starts, starts[1:] + [len(names)])]
    assert balance is not None
    if any(int(n) < 1 for n in balance) or sum(balance) != len(names):
        raise ValueError(f"balance {list(balance)} must give each stage >= 1 block and cover the "
                         f"model's {len(names)} blocks ({block_list(chain)}); it covers "
                         f"{sum(balance)}")
    if len(balance) != world_size:
        raise ValueError(f"a manual split of {len(balance)} stages runs one stage per rank, but "
                         f"this job has {world_size} ranks; start {len(balance)} processes")
    stages, start = [], 0
    for rank, count in enumerate(balance):
        stages.append(StagePlan(start, start + int(count), 1, (rank,), 0.0,
                                {"blocks": names[start:start + int(count)]}))
        start += int(count)
    return Plan(model=model_name, batch_size=0, workers=world_size,
                schedule=schedule if schedule != "auto" else "1f1b", stages=stages,
                bottleneck_ms=0.0, data_parallel_ms=0.0, extra={"split": "manual"})


def _first_block(names: Sequence[str], point: str, chain: LayerChain) -> int:
    """The block a split point names: a block, or a module holding several blocks (`layer3`
    of a ResNet: its first block, `layer3.0`)."""
    if point in names:
        return names.index(point)
    inside = [i for i, n in enumerate(names) if n.startswith(point + ".")]
    if not inside:
        raise ValueError(f"split point {point!r} is neither a block of the model nor a module "
                         f"holding blocks; its blocks are {block_list(chain)}")
    return inside[0]


def model_fingerprint(chain: LayerChain) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Block names and parameter shapes: what every rank of one job must agree on."""
    return [(b.name, [tuple(p.shape) for p in b.module.parameters()]) for b in chain.blocks]


def weight_copies(schedule: Schedule) -> int:
    """The weight copies each stage keeps: localsgd's model replicas, else 1."""
    return int(schedule.params.get("model_replicas", 1)) if schedule.name == "localsgd" else 1


def build_schedule(plan: Plan, name: str, steps: int, chunks: int,
                   schedule_options: Mapping[str, Any] | None = None) -> Schedule:
    """The IR for `steps` minibatches of `chunks` microbatches on the plan's stages and ranks,
    as a stream (nothing is generated before the run walks it), with the options the
    schedule declares (localsgd: one microbatch per step, H and R)."""
    kwargs: dict[str, Any] = {"stage_ranks": [list(s.ranks) for s in plan.stages]}
    if kind(name).chunked_steps:
        kwargs["chunks"] = chunks  # one update per minibatch
    schedule = make_schedule(name, len(plan.stages), steps * chunks, **kwargs,
                             **dict(schedule_options or {}))
    validate(schedule)  # proven on its window before any rank runs it
    return schedule


def ring_slots(schedule: Schedule, rank: int, tuning: Tuning) -> int:
    """The weight-version slots of `rank`'s stages: what the schedule keeps there, or
    `tuning.weight_slots`. Too few is checked against the rank that keeps the most, so every
    rank refuses alike (none trains on, waiting for a peer that gave up)."""
    if tuning.weight_slots is None:
        return schedule.max_versions[rank]
    most = max(range(schedule.num_ranks), key=lambda r: schedule.max_versions[r])
    need = schedule.max_versions[most]
    if tuning.weight_slots < need:
        raise ValueError(f"weight_slots={tuning.weight_slots} is too few: schedule "
                         f"{schedule.name!r} keeps {need} weight versions at once (on rank "
                         f"{most}); use weight_slots >= {need}, or None for what the schedule "
                         f"needs")
    return tuning.weight_slots


def stage_runtime(plan: Plan, stage: int, rank: int, module: nn.Module,
                  optimizer: torch.optim.Optimizer | OptimizerFactory | None, schedule: Schedule,
                  loss_fn: Callable[[Any, Any], torch.Tensor], scheduler: Any = None,
                  precision: str = "fp32", tuning: Tuning | None = None,
                  optimizer_factory: OptimizerFactory | None = None,
                  scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None
                  ) -> StageRuntime:
    """A rank's stage; with localsgd, one weight copy per model replica, the copies beyond
    the module's own each with an optimizer from `optimizer_factory` (default: `optimizer`
    when it is a factory) and a scheduler from `scheduler_factory`."""
    tuning = tuning or Tuning()
    runtime = StageRuntime(stage, module, optimizer, slots=ring_slots(schedule, rank, tuning),
                           is_first=stage == 0, is_last=stage == len(plan.stages) - 1,
                           loss_fn=loss_fn, split_backward=splits_backward(schedule.name),
                           scheduler=scheduler, precision=precision,
                           offload_stash=tuning.offload_stash, bucket_bytes=tuning.bucket_bytes)
    copies = weight_copies(schedule)
    if copies > 1:
        if optimizer_factory is None and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer_factory = optimizer
        if optimizer_factory is None and runtime.params:
            raise ValueError("localsgd's weight copies need an optimizer factory")
        runtime.add_copies(copies, optimizer_factory or (lambda ps: torch.optim.SGD(ps, 0.0)),
                           scheduler_factory)
    return runtime


def check_backend(schedule: Schedule, backend: str) -> None:
    """NCCL matches point-to-point messages between two ranks by the order they are issued
    and ignores tags, so two links in one direction between the same ranks (two stage
    boundaries, or activations and gradients, as interleaved placements have) could swap
    messages. Refuse those before training rather than risk it."""
    if backend != "nccl":
        return
    links: dict[tuple[int, int], set[str]] = defaultdict(set)
    for s in range(schedule.num_stages - 1):
        for a in schedule.stage_ranks[s]:
            for b in schedule.stage_ranks[s + 1]:
                if a != b:
                    links[(a, b)].add(f"activations to stage {s + 1}")
                    links[(b, a)].add(f"gradients to stage {s}")
    for (src, dst), kinds in sorted(links.items()):
        if len(kinds) > 1:
            what = " and ".join(sorted(kinds))
            raise ValueError(f"with NCCL, rank {src} would send rank {dst} {what} on separate "
                             f"links, and NCCL matches messages by issue order, not by tag; "
                             f"this placement runs on gloo (CPU) only for now, or use a plan "
                             f"with one stage per rank")


# The computes a rank counts towards a step: each microbatch's forward and the action that ends
# its backward.
_COUNTED = frozenset(k for k in ActionKind
                     if k is ActionKind.FORWARD or KIND_SPECS[k].ends_microbatch)


class StepTracker:
    """Says when a rank is done with each step (minibatch), from the actions it performs.

    A rank is done with step k once it has run the forward and the backward of every
    microbatch of step k that its stages take, in order of steps. The count is known from the
    layout alone, so nothing about the stream has to be generated ahead.
    """

    def __init__(self, schedule: Schedule, rank: int, chunks: int) -> None:
        self._schedule = schedule
        self._rank = rank
        self._chunks = chunks
        self._stages = schedule.stages_of(rank)
        self._left: dict[int, int] = {}  # step -> computes still to run on this rank
        self._next = 0
        # Stages of one rank each run every microbatch here: the count is the same every step
        self._fixed = (2 * chunks * len(self._stages)
                       if all(schedule.stage_ranks[s] == (rank,) for s in self._stages) else None)

    def _expected(self, step: int) -> int:
        if self._fixed is not None:
            return self._fixed
        mbs = range(step * self._chunks, (step + 1) * self._chunks)
        return 2 * sum(self._schedule.rank_of(s, mb) == self._rank
                       for s in self._stages for mb in mbs)

    def done(self, action: Action, steps: int) -> list[int]:
        """The steps (< `steps`) this action completes, in order. A step's count starts on its
        first use. Called after every action: the common cases return early."""
        left = self._left
        if action.kind in _COUNTED:
            assert action.microbatch is not None
            step = action.microbatch // self._chunks
            count = left.get(step)
            left[step] = (self._expected(step) if count is None else count) - 1
        elif left.get(self._next):  # nothing counted, the next step not done: the same
            return []
        finished = []
        while self._next < steps:
            count = left.get(self._next)
            if count is None:
                count = left[self._next] = self._expected(self._next)
            if count:
                break
            del left[self._next]
            finished.append(self._next)
            self._next += 1
        return finished


def check_runtime_fits(runtime: StageRuntime, schedule: Schedule, rank: int) -> None:
    if len(runtime.copies) != weight_copies(schedule):
        raise ValueError(f"this run keeps {weight_copies(schedule)} weight copies of stage "
                         f"{runtime.stage} but it was set up with {len(runtime.copies)}; use the "
                         f"same model_replicas in every run")
    if runtime.ring is not None and runtime.ring.capacity < schedule.max_versions[rank]:
        raise ValueError(f"this run keeps {schedule.max_versions[rank]} weight versions on rank "
                         f"{rank} but stage {runtime.stage} was set up for "
                         f"{runtime.ring.capacity}; use the same chunks in every call")


def original_names(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """Tensor identity -> every key it has in `model.state_dict()`, in that order (stages
    share the tensors). A tied weight has several keys, and a strict `load_state_dict` wants
    each; a non-persistent buffer has none (it is not saved), nor has a tensor that only a
    stage's traced code holds."""
    names: dict[int, tuple[str, ...]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):  # not a module's get_extra_state()
            names[id(value)] = names.get(id(value), ()) + (key,)
    return names


def named_state(modules: Sequence[nn.Module], names: dict[int, tuple[str, ...]]
                ) -> dict[str, torch.Tensor]:
    """Copies of the tensors of `modules` under all their keys in the original model's
    `state_dict()`; the keys of one tensor share one copy, as in `state_dict()`."""
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for module in modules:
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            keys = names.get(id(t), ())
            if not keys and isinstance(t, nn.Parameter):  # it would be lost without a word
                raise ValueError(f"parameter {name} of a stage has no key in the model's "
                                 f"state_dict(), so it cannot be saved: it is not a tensor of "
                                 f"the model given (a model built on the meta device gets new "
                                 f"tensors when its stage is materialised; pass a built model)")
            if keys:
                copy = t.detach().clone()
                state.update(dict.fromkeys(keys, copy))
    return state
