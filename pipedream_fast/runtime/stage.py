"""One pipeline stage as a rank holds it: module, weight versions, gradients, optimizer.

    live parameters (newest version) ── ring.snapshot(v) ──▶ slot v (a retained version)
    forward(mb, v):  on the live parameters if v is the newest and not retained,
                     else on the ring's tensors of v (torch.func.functional_call)
    backward(mb):    autograd on the graph its forward built, so it sees the forward's version
                     (or in two parts, input then weight gradient: `split_backward`)
    every version's `.grad` is a view of the ring's flat gradient buffers, so all backward
    passes accumulate into one resident buffer that the optimizer reads and the all-reduce sends.

Weight copies (localsgd): a stage may hold R independent copies of its weights, one per model
replica (`copy` of the IR actions). Copy 0 is the module's own parameters; copies 1..R-1
(`add_copies`) are separate tensors, each with its own weight ring, gradient buffers,
optimizer (and optimizer state) and scheduler. A forward of copy c > 0 runs the module with
copy c's tensors (torch.func.functional_call), so its backward fills copy c's gradients and
its update steps copy c's optimizer. `average(v)` sets every copy to the mean of all copies;
the optimizer states stay per copy (not averaged). Buffers (batch-norm running statistics)
are the module's, shared by the copies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipedream_fast import _C
from pipedream_fast.runtime.engine_backward import backward as engine_backward
from pipedream_fast.runtime.buckets import DEFAULT_BUCKET_BYTES, GradientBuckets
from pipedream_fast.runtime.memory import MemoryMeter
from pipedream_fast.runtime.staleness_correction import StalenessCorrection
from pipedream_fast.runtime.split_backward import (Call, CallRecorder, input_part, splittable,
                                                   weight_part)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

_NOT_MEASURED = contextlib.nullcontext()  # reused: nothing made per forward when unmeasured

# precision -> the autocast dtype of forward passes (None: no autocast)
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class InFlight:
    """What a forward leaves for its backward (activation stashing)."""

    inputs: tuple[Any, ...]         # leaves that need an input gradient (received tensors)
    outputs: tuple[torch.Tensor, ...]  # the tensors backward starts from
    calls: list[Call] = field(default_factory=list)  # recorded for a split backward
    roots: list[torch.Tensor] = field(default_factory=list)  # kept from the input part
    root_grads: list[torch.Tensor] | None = None
    weights_done: bool = False


def _floats(values: Sequence[Any]) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


class WeightCopy:
    """One independent set of a stage's weights: parameters, a ring of their versions, flat
    gradient buffers, an optimizer and scheduler of its own, and its newest version."""

    def __init__(self, params: list[nn.Parameter], slots: int, offload_stash: bool,
                 optimizer: torch.optim.Optimizer | OptimizerFactory | None,
                 scheduler: Any = None) -> None:
        self.params = params
        self.newest = 0
        self.scheduler = scheduler  # an LR scheduler, stepped once per update of this copy
        self.ring: _C.WeightRing | None = None
        self.grads: list[torch.Tensor] = []
        self.optimizer: torch.optim.Optimizer | None = None
        if params:
            self.ring = _C.WeightRing(params, max(1, slots), offload_stash)
            self.grads = self.ring.attach_grad_buffers()
            if optimizer is None:
                raise ValueError("an optimizer factory is needed for a stage with parameters")
            self.optimizer = (optimizer if isinstance(optimizer, torch.optim.Optimizer)
                              else optimizer(params))


class StageRuntime:
    """Executes FORWARD/BACKWARD/SNAPSHOT/RELEASE/OPTIMIZER_STEP for one stage on one rank."""

    def __init__(self, stage: int, module: nn.Module,
                 optimizer: torch.optim.Optimizer | OptimizerFactory | None,
                 slots: int, is_first: bool, is_last: bool,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 split_backward: bool = False, scheduler: Any = None,
                 precision: str = "fp32", offload_stash: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """`slots`: weight versions the ring holds; `offload_stash`: they live in pinned host
        memory (CUDA weights only); `bucket_bytes`: the all-reduce bucket size when the stage
        is replicated (see `Tuning`)."""
        self.stage = stage
        self.module = module
        self.is_first = is_first
        self.is_last = is_last
        self.loss_fn = loss_fn
        if precision not in AUTOCAST_DTYPES:
            raise ValueError(f"precision must be one of {', '.join(AUTOCAST_DTYPES)}, got "
                             f"{precision!r}")
        self.autocast_dtype = AUTOCAST_DTYPES[precision]
        # The backward starts from loss * loss_scale: 1 / chunks in a run (the update's
        # average, applied at the root), times the scale under fp16.
        self.loss_scale = 1.0
        self.prepared = False  # gradients already averaged and unscaled for this update
        named = list(module.named_parameters())
        self.param_names = [name for name, _ in named]
        self.offload_stash = offload_stash
        self.inflight: dict[int, InFlight] = {}
        self.input_grads: dict[int, list[torch.Tensor]] = {}  # made, not yet taken
        self.recorder = CallRecorder(module) if split_backward else None
        self.trainable = sum(1 for _, p in named if p.requires_grad)  # what the calls must cover
        self.buckets: GradientBuckets | None = None  # set up when the stage is replicated
        self.bucket_bytes = bucket_bytes
        # copies[0] is the module's own parameters; localsgd adds one copy per model replica.
        self.copies = [WeightCopy([p for _, p in named], slots, offload_stash, optimizer,
                                  scheduler)]
        self.slots = slots
        # Asynchronous schedules' correction for stale weights (`use_correction`), if any.
        self.correction: StalenessCorrection | None = None
        self.pending_correction_state: dict[str, Any] | None = None  # from a checkpoint
        self.meter: MemoryMeter | None = None  # measure_memory: what the microbatches hold

    def measure_with(self, meter: MemoryMeter) -> None:
        """Counts what this stage's microbatches in flight hold on `meter` (`memory`); the
        stage's weights and gradients are not activations."""
        self.meter = meter
        for c in self.copies:
            if c.ring is not None:
                meter.exclude([*c.ring.live_buffers(), *c.ring.grad_buffers()])

    def use_correction(self, kind: str | None) -> None:
        """The staleness correction of a run's schedule (None: none). A stage keeps its
        correction's state (the velocity) from run to run while the kind stays the same."""
        if kind is None:
            self.correction = None
            return
        if self.correction is None or self.correction.kind != kind:
            self.correction = StalenessCorrection(kind)
        if self.pending_correction_state is not None:
            self.correction.load_state_dict(self.pending_correction_state)
            self.pending_correction_state = None

    def restore_correction(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's staleness correction state (None: it had none, so a correction
        starts from zero velocity); applied now, or at the next run's `use_correction`."""
        if self.correction is not None:
            self.correction = StalenessCorrection(self.correction.kind)
            if state is not None:
                self.correction.load_state_dict(state)
            return
        self.pending_correction_state = state

    # Copy 0, as every schedule but localsgd knows the stage.
    @property
    def params(self) -> list[nn.Parameter]:
        return self.copies[0].params

    @property
    def grads(self) -> list[torch.Tensor]:
        return self.copies[0].grads

    @property
    def ring(self) -> _C.WeightRing | None:
        return self.copies[0].ring

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.copies[0].optimizer

    @property
    def scheduler(self) -> Any:
        return self.copies[0].scheduler

    @property
    def newest(self) -> int:
        return self.copies[0].newest

    @newest.setter
    def newest(self, version: int) -> None:
        self.copies[0].newest = version

    def add_copies(self, total: int, optimizer: OptimizerFactory,
                   scheduler: SchedulerFactory | None = None) -> None:
        """Holds `total` weight copies (localsgd's model replicas): the new ones start from
        copy 0's current weights, each with an optimizer (and scheduler) of its own. A stage
        that holds `total` already keeps its copies (they carry on from the last run)."""
        if total < 1:
            raise ValueError(f"a stage holds at least one weight copy, got {total}")
        if len(self.copies) > total:
            raise ValueError(f"stage {self.stage} holds {len(self.copies)} weight copies; a run "
                             f"with {total} model replicas cannot use them")
        while len(self.copies) < total:
            params = [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                      for p in self.params]
            # One slot: no schedule retains an older version of a copy > 0 (localsgd updates
            # a replica only after its backward); `snapshot` would say so if one did.
            weights = WeightCopy(params, 1, self.offload_stash, optimizer if params else None)
            if scheduler is not None and weights.optimizer is not None:
                weights.scheduler = scheduler(weights.optimizer)
            self.copies.append(weights)

    def _copy(self, copy: int) -> WeightCopy:
        if copy >= len(self.copies):
            raise RuntimeError(f"stage {self.stage}: the schedule uses weight copy {copy} but the "
                               f"stage holds {len(self.copies)} (model_replicas)")
        return self.copies[copy]

    def average(self, version: int) -> None:
        """AVERAGE: every copy becomes the mean of all copies' newest weights, as `version`
        (1 + the newest of any copy). Optimizer states stay per copy, not averaged."""
        want = max(c.newest for c in self.copies) + 1
        if version != want:
            raise RuntimeError(f"stage {self.stage}: average to version {version} but the newest "
                               f"copy is at {want - 1}")
        rings = [c.ring for c in self.copies if c.ring is not None]
        if len(rings) > 1:
            with torch.no_grad():  # one flat buffer per dtype and device, in every copy alike
                for buffers in zip(*(ring.live_buffers() for ring in rings)):
                    mean = torch.stack(buffers).mean(dim=0)
                    for b in buffers:
                        b.copy_(mean)
        for c in self.copies:
            c.newest = version

    @classmethod
    def for_inference(cls, stage: int, module: nn.Module, is_first: bool, is_last: bool,
                      precision: str = "fp32") -> StageRuntime:
        """A stage that only runs `infer` on its module's own weights: no weight ring, no
        optimizer (so evaluating never touches the training state)."""
        runtime = cls(stage, nn.Module(), None, 1, is_first, is_last, None, precision=precision)
        runtime.module = module
        return runtime

    # --- versions -----------------------------------------------------------------------
    def begin_run(self) -> None:
        """Each schedule numbers versions from 0: the current weights become version 0."""
        for c in self.copies:
            if c.ring is not None and c.ring.held_versions():
                raise RuntimeError(f"stage {self.stage}: versions {c.ring.held_versions()} are "
                                   f"still retained from the previous run; its schedule did not "
                                   f"release them")
        if self.inflight:
            raise RuntimeError(f"stage {self.stage}: microbatches {sorted(self.inflight)} of the "
                               f"previous run never finished their backward")
        for c in self.copies:
            c.newest = 0

    def abandon_run(self) -> None:
        """Discards what a run that was stopped early left behind, so the next `begin_run`
        starts clean: the microbatches in flight (their graphs and input gradients), the
        retained weight versions and the accumulated gradients. The live weights and the
        optimizer state keep every update that was applied."""
        if self.meter is not None:
            for microbatch in self.inflight:
                self.meter.release(self.stage, microbatch)
        self.inflight.clear()
        self.input_grads.clear()
        if self.recorder is not None:
            self.recorder.recording = None
        for c in self.copies:
            if c.ring is not None:
                for version in c.ring.held_versions():
                    c.ring.release(version)
            for g in c.grads:
                g.zero_()
        self.prepared = False
        if self.buckets is not None:
            self.buckets.forget()  # reductions begun for the update that never came
        if self.correction is not None:
            self.correction.forget_in_flight()

    def snapshot(self, version: int, copy: int = 0) -> None:
        weights = self._copy(copy)
        if weights.ring is None or weights.ring.holds(version):
            return  # already retained (snapshots are taken at the first forward that needs one)
        self._check_newest(version, "snapshot", copy)
        weights.ring.snapshot(version)

    def release(self, version: int, copy: int = 0) -> None:
        ring = self._copy(copy).ring
        if ring is not None:
            ring.release(version)

    def _check_newest(self, version: int, what: str, copy: int = 0) -> None:
        newest = self._copy(copy).newest
        if version != newest:
            of = f" (copy {copy})" if copy else ""
            raise RuntimeError(f"stage {self.stage}: {what} of version {version}{of}, but the "
                               f"newest is {newest} and {version} is not retained; the schedule "
                               f"must SNAPSHOT a version before an update if it is used later")

    def _autocast(self) -> Any:
        """Autocast as one process would run it; its weight cache is off, because the cached
        low-precision copies would outlive the in-place updates of the weights."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        first = next(self.module.parameters(), None)
        device = first.device.type if first is not None else "cpu"
        return torch.autocast(device, dtype=self.autocast_dtype, cache_enabled=False)

    def _call(self, version: int, inputs: tuple[Any, ...], copy: int = 0,
              microbatch: int = 0, delay: int = 0) -> Any:
        """The module on weight version `version` of copy `copy`, shifted by the staleness
        correction for a microbatch `delay` updates behind (see `staleness_correction`)."""
        ring = self._copy(copy).ring
        correction = self.correction if copy == 0 else None
        if ring is not None and ring.holds(version):
            tensors = ring.tensors(version)
            if self.meter is not None:  # a stashed version is not an activation
                self.meter.exclude(tensors)
            if self.buckets is not None:
                self.buckets.watch(tensors)
            shifted = correction.read(tensors, microbatch, delay) if correction else None
            weights = dict(zip(self.param_names, shifted or tensors))
            return torch.func.functional_call(self.module, weights, inputs)
        if ring is not None:
            self._check_newest(version, "forward", copy)
        if copy:  # another model replica's weights (their gradients go to that copy)
            live: dict[str, torch.Tensor] = dict(zip(self.param_names, self.copies[copy].params))
            return torch.func.functional_call(self.module, live, inputs)
        shifted = correction.read(self.params, microbatch, delay) if correction else None
        if shifted is not None:
            return torch.func.functional_call(self.module, dict(zip(self.param_names, shifted)),
                                              inputs)
        return self.module(*inputs)

    # --- compute ------------------------------------------------------------------------
    def forward(self, microbatch: int, version: int, inputs: tuple[Any, ...],
                target: Any = None, copy: int = 0, delay: int = 0,
                weight: float = 1.0) -> tuple[Any, ...]:
        """Runs the stage on weight copy `copy`; returns what crosses the next cut (the loss
        on the last stage). `delay`: the stage's updates between the version read and the
        one the microbatch's gradient is applied to (for the staleness correction).
        `weight` (last stage): the loss is multiplied by it, so that the backward starts from
        the weighed loss and the loss reported is weighed alike (a microbatch's share of its
        step's samples; 1.0, the even share, multiplies by nothing)."""
        if not self.is_first:
            for t in _floats(inputs):
                t.requires_grad_(True)
        calls: list[Call] = []
        if self.recorder is not None:
            self.recorder.recording = calls
        meter = self.meter
        try:
            if self.autocast_dtype is None and meter is None:  # no context: 3 calls fewer
                out = self._call(version, inputs, copy, microbatch, delay)
                loss = self.loss_fn(out, target) if self.is_last and self.loss_fn else None
            else:
                with self._autocast(), (meter.recording(self.stage, microbatch) if meter
                                        else _NOT_MEASURED):
                    out = self._call(version, inputs, copy, microbatch, delay)
                    loss = (self.loss_fn(out, target) if self.is_last and self.loss_fn
                            else None)
        finally:
            if self.recorder is not None:
                self.recorder.recording = None
        if self.is_last:
            assert loss is not None, "the last stage needs a loss function"
            if weight != 1.0:
                loss = loss * weight
            outputs: tuple[Any, ...] = (loss,)
        else:
            outputs = out if isinstance(out, tuple) else (out,)
        grad_inputs = () if self.is_first else tuple(_floats(inputs))
        self.inflight[microbatch] = InFlight(grad_inputs, tuple(outputs), calls)
        if meter is not None:
            meter.hold(self.stage, microbatch, (*inputs, *outputs))
        return outputs

    def infer(self, inputs: tuple[Any, ...]) -> Any:
        """Forward only, for evaluation: eval mode (no dropout, running batch-norm
        statistics), no graph, nothing stashed; the newest weights."""
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad(), self._autocast():
                return self.module(*inputs)
        finally:
            self.module.train(was_training)

    def _roots(self, state: InFlight, output_grads: Sequence[torch.Tensor] | None
               ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Where backward starts: the loss, or the outputs that need a gradient, with theirs."""
        if self.is_last:
            if self.loss_scale != 1.0:
                return [state.outputs[0] * self.loss_scale], None
            return list(state.outputs), None
        assert output_grads is not None
        pairs = [(o, g) for o, g in zip(_floats(state.outputs), output_grads) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def backward(self, microbatch: int, output_grads: Sequence[torch.Tensor] | None) -> None:
        """The whole backward of a microbatch; it ends the microbatch on this stage."""
        state = self.inflight.pop(microbatch)
        roots, grads = self._roots(state, output_grads)
        if roots:
            engine_backward(roots, grads)
        if not self.is_first:
            self.input_grads[microbatch] = [t.grad if t.grad is not None else torch.zeros_like(t)
                                            for t in state.inputs]
        if self.meter is not None:
            self.meter.release(self.stage, microbatch)

    def backward_input(self, microbatch: int, output_grads: Sequence[torch.Tensor] | None) -> None:
        """The input-gradient part of a split backward (see `split_backward`)."""
        state = self.inflight[microbatch]
        roots, grads = self._roots(state, output_grads)
        state.roots, state.root_grads = roots, grads
        if self.is_first or not roots:
            return  # nothing upstream waits: the weight part does the backward
        if splittable(state.calls, self.trainable):
            self.input_grads[microbatch] = input_part(roots, grads, state.inputs)
            return
        engine_backward(roots, grads)  # cannot split: all of it now
        state.weights_done = True
        self.input_grads[microbatch] = [t.grad if t.grad is not None else torch.zeros_like(t)
                                        for t in state.inputs]

    def backward_weight(self, microbatch: int) -> None:
        """The weight-gradient part; it ends the microbatch on this stage."""
        state = self.inflight.pop(microbatch)
        if self.meter is not None:  # its graph and held tensors go with this part
            self.meter.release(self.stage, microbatch)
        if state.weights_done or not state.roots:
            return
        if self.is_first:
            engine_backward(state.roots, state.root_grads)
        else:
            weight_part(state.calls, state.roots, state.root_grads)

    def take_input_grads(self, microbatch: int) -> list[torch.Tensor]:
        return self.input_grads.pop(microbatch)

    def prepare_update(self, microbatches: Sequence[int], copy: int = 0) -> None:
        """Turns the accumulated gradients (of weight copy `copy`) into the update's:
        averaged over `microbatches` and, under fp16 loss scaling, unscaled. The roots
        averaged already where the update holds `chunks` microbatches (`loss_scale` =
        scale / chunks): this divides by what is left, the fp16 scale or another count."""
        if not self.prepared:
            grads = self._copy(copy).grads
            scale = 1.0 / (len(microbatches) * self.loss_scale)
            if grads and abs(scale - 1.0) > 1e-12:  # the roots averaged already: a pass saved
                torch._foreach_mul_(grads, scale)
            self.prepared = True

    def step(self, version: int, microbatches: Sequence[int], skip: bool = False,
             copy: int = 0) -> None:
        """Averages the accumulated gradients over `microbatches` (unless `prepare_update`
        did), updates weight copy `copy` with its optimizer (unless `skip`: an fp16
        overflow), clears them, steps the copy's scheduler."""
        weights = self._copy(copy)
        if version != weights.newest + 1:
            of = f" (copy {copy})" if copy else ""
            raise RuntimeError(f"stage {self.stage}: update to version {version}{of} but the "
                               f"newest is {weights.newest}")
        if weights.optimizer is not None:
            self.prepare_update(microbatches, copy)
            if not skip:
                self._optimizer_step(weights, microbatches, copy)
            elif self.correction is not None and copy == 0:
                self.correction.learning_rate_factor(microbatches)  # forgets their delays
            if weights.grads:
                torch._foreach_zero_(weights.grads)
            if weights.scheduler is not None:
                weights.scheduler.step()
        if self.buckets is not None:
            self.buckets.forget()  # the next update's gradients are reduced afresh
        self.prepared = False
        weights.newest = version

    def _optimizer_step(self, weights: WeightCopy, microbatches: Sequence[int],
                        copy: int) -> None:
        """The optimizer's step; under a staleness correction with its learning rates scaled
        for the update's delay (restored after), and the velocity updated from what moved."""
        assert weights.optimizer is not None
        correction = self.correction if copy == 0 else None
        if correction is None:
            weights.optimizer.step()
            return
        factor = correction.learning_rate_factor(microbatches)
        groups = weights.optimizer.param_groups
        rates = [g["lr"] for g in groups]
        if factor != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * factor
        correction.before_update(weights.params)
        try:
            weights.optimizer.step()
        finally:
            for g, lr in zip(groups, rates):
                g["lr"] = lr
        correction.after_update(weights.params)
