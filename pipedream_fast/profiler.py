"""Measure a model block by block and write a `Profile` (what the planner reads).

Each block is run on its own, exactly as a pipeline stage would run it: its forward takes
detached copies of the tensors crossing its input cut (marked as requiring gradients, and fed
through one more copy, so that a block starting with an in-place op such as ResNet's
`ReLU(inplace=True)` does not write into an autograd leaf), and its backward starts from
gradients for the tensors crossing its output cut and produces gradients for its inputs and
parameters. So a block's measured backward includes the work a stage does to send gradients
upstream, and nothing is double counted across blocks. An error names the block it came from.

    cut k-1 ──▶ forward(block k) ──▶ cut k          timed: forward_ms
    grad k-1 ◀── backward(block k) ◀── grad k       timed: backward_ms
    grad k-1 ◀── input part of it  ◀── grad k       timed: extra backward_input_ms

* Times: median of `repeat` runs after `warmup` runs; wall clock (perf_counter) on CPU, CUDA
  events on the current stream on GPU.
* activation_bytes: bytes of all tensors crossing the cut after the block (skips included).
* parameter_bytes: the block's parameters (each counted once).
* optimizer_state_bytes: measured, not assumed: the chosen optimizer takes one step with lr=0
  (weights do not change) and every tensor in its state is counted and charged to the block
  owning the parameter. Plain SGD keeps none; momentum SGD one buffer; Adam two plus a step.
* extra `saved_bytes`: bytes autograd keeps for the block's backward (recorded with
  `torch.autograd.graph.saved_tensors_hooks`, parameters excluded): the per-microbatch memory a
  stage holds while a microbatch is in flight. The planner's memory model uses it.
* extra `held_bytes`: those, the block's inputs and its outputs, each storage once: what the
  block holds until its backward, additive over a stage's blocks once the cuts inside it are
  taken off (`sim_memory`).
* extra `optimizer_ms`, `grad_scale_ms`, `grad_zero_ms`, `snapshot_ms`: one optimizer step
  over the block's parameters; the passes over its gradients an update adds (the mean over
  several microbatches, the clearing); one copy of its weights (what retaining a weight
  version costs). The simulator charges them to OPTIMIZER_STEP and SNAPSHOT. They do not
  depend on the microbatch size.

Only hooks and plain autograd are used; PyTorch is not patched.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from pipedream_fast.formats import BlockProfile, Profile
from pipedream_fast.runtime.cpu_cache import CpuCacheHold
from pipedream_fast.tracing import LayerChain, trace
from pipedream_fast.tuning import Tuning

# lr=0 so that the one measuring step leaves the weights as they were.
OPTIMIZERS: dict[str, Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.0),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.0, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.0),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.0),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=0.0),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.0),
}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a (possibly nested) value crossing a cut."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _nbytes(tensors: Iterator[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _detach(value: Any) -> Any:
    """A fresh leaf copy of a cut value; floating tensors require grad, as a stage input does."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point() or value.is_complex())
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value


def _copies(value: Any) -> Any:
    """What a block is fed: a copy of every tensor of a cut value (of the leaves `_detach`
    made, a non-leaf one). A block that starts by writing into its input in place
    (`ReLU(inplace=True)`) then neither fails on a leaf that requires grad nor changes the
    reference values the next runs start from. The copy is made outside the timed region."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copies(v) for v in value)
    return value


@contextmanager
def _blaming(what: str) -> Iterator[None]:
    """Names the block (or pass) whose measurement failed: the error alone names no block."""
    try:
        yield
    except Exception as err:
        raise RuntimeError(f"profiling {what} failed: {type(err).__name__}: {err}") from err


class _Timer:
    """Wall clock on CPU; CUDA events on GPU (no host sync inside the timed region)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end), result
        begin = time.perf_counter()
        result = fn()
        return (time.perf_counter() - begin) * 1e3, result


def _saved_bytes(module: nn.Module, inputs: tuple[Any, ...]) -> tuple[int, int]:
    """Bytes autograd saves for the backward of one forward of `module` (weights excluded),
    and the bytes the block holds until its backward: those, its inputs and its outputs,
    each storage once (what a stage holds per microbatch in flight, `sim_memory`)."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    fed = _copies(_detach(inputs))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = module(*fed)
    held = dict(storages)
    for t in [*_tensors(fed), *_tensors(outputs)]:
        storage = t.untyped_storage()
        held[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()), sum(held.values())


def _optimizer_state_bytes(chain: LayerChain, inputs: tuple[Any, ...],
                           make: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]
                           ) -> list[int]:
    """Per block, bytes of the optimizer state after one step over all parameters."""
    # Each parameter once: a tied weight is held by two blocks.
    params = list(dict.fromkeys(p for b in chain.blocks for p in b.module.parameters()
                                if p.requires_grad))
    if not params:
        return [0] * len(chain)
    for p in params:
        p.grad = None
    outputs = chain.stage_module(0, len(chain))(*_copies(_detach(inputs)))
    loss = sum(t.float().sum() for t in _tensors(outputs) if t.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    for p in params:  # a parameter the output does not depend on still gets a state
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer = make(params)
    optimizer.step()
    per_param = {id(p): _nbytes(_tensors(list(optimizer.state[p].values())))
                 for p in params if p in optimizer.state}
    return [sum(per_param.get(id(p), 0) for p in b.module.parameters()) for b in chain.blocks]


def _update_costs_ms(timer: _Timer, chain: LayerChain,
                     make: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer],
                     warmup: int, repeat: int) -> list[tuple[float, float, float, float]]:
    """Per block, in ms: one `step()` of an optimizer over the block's parameters (gradients
    present); the two passes over the gradients an update of the runtime adds (scaling them
    to the mean over the step's microbatches, zeroing them); and one copy of the weights into
    buffers of their own, which is what retaining a weight version (SNAPSHOT) costs. Each
    block's weights are copied back afterwards, so an optimizer with a learning rate changes
    nothing."""
    costs = []
    for block in chain.blocks:
        params: list[torch.Tensor] = [p for p in block.module.parameters() if p.requires_grad]
        if not params:
            costs.append((0.0, 0.0, 0.0, 0.0))
            continue
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with torch.no_grad():
            kept = [p.detach().clone() for p in params]
        optimizer = make(params)  # type: ignore[arg-type]  # they are the block's Parameters
        grads = [p.grad for p in params if p.grad is not None]
        runs: list[list[float]] = [[], [], [], []]  # step, scale, zero, copy
        for run in range(warmup + repeat):
            with torch.no_grad():
                times = (timer(optimizer.step)[0],
                         timer(lambda: torch._foreach_mul_(grads, 1.0))[0],  # noqa: B023
                         timer(lambda: torch._foreach_zero_(grads))[0],  # noqa: B023
                         timer(lambda: torch._foreach_copy_(kept, params))[0])  # noqa: B023
            if run >= warmup:
                for series, ms in zip(runs, times):
                    series.append(ms)
        with torch.no_grad():
            torch._foreach_copy_(params, kept)  # the weights as they were (kept is a copy)
        step, scale, zero, copy = (statistics.median(series) for series in runs)
        costs.append((step, scale, zero, copy))
    return costs


def _input_part_ms(timer: _Timer, module: nn.Module, inputs: tuple[Any, ...]) -> float:
    """Time of the input-gradient part of the block's backward alone (what a zero-bubble
    schedule's BACKWARD_INPUT does; the rest of backward_ms is its weight part)."""
    leaf_inputs = _detach(inputs)
    wanted = [t for t in _tensors(leaf_inputs) if t.requires_grad]
    outputs = [t for t in _tensors(module(*_copies(leaf_inputs))) if t.requires_grad]
    if not wanted or not outputs:
        return 0.0
    grads = [torch.ones_like(t) for t in outputs]
    ms, _ = timer(lambda: torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
    return float(ms)


def _progress(enabled: bool) -> Any:
    """A rich progress bar on stderr (a no-op context when disabled)."""
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=True)


def profile_model(model: nn.Module, example_input: Any, batch_size: int, *,
                  optimizer: str | Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer] = "sgd",
                  warmup: int = 2, repeat: int = 5, device: str | torch.device = "cpu",
                  progress: bool = True, model_name: str | None = None,
                  leaf_modules: Sequence[Any] = (), chain: LayerChain | None = None,
                  cpu_cache_mb: float | None = None) -> Profile:
    """Trace `model`, run each block alone, and return its per-block `Profile`.

    `example_input` is one minibatch of `batch_size` samples (a tensor or a tuple of them).
    The model is moved to `device` and put in training mode; its weights are not changed.
    `cpu_cache_mb`: on the CPU the blocks are measured under the memory behaviour the
    runtime will train with (the C++ core's CPU block cache, `Tuning.cpu_cache_mb`; None:
    its default; 0: malloc's), since a block whose large tensors are faulted in afresh at
    every run takes longer than the same block on reused memory.
    """
    if warmup < 0 or repeat < 1:
        raise ValueError(f"need warmup >= 0 and repeat >= 1, got warmup={warmup}, repeat={repeat}")
    if batch_size <= 0:
        raise ValueError(f"batch size must be positive, got {batch_size}")
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose one of "
                             f"{', '.join(OPTIMIZERS)} or pass a factory params -> Optimizer")
        make_optimizer, optimizer_name = OPTIMIZERS[optimizer], optimizer
    else:
        make_optimizer, optimizer_name = optimizer, getattr(optimizer, "__name__", "custom")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available here")
    model.to(dev).train()
    inputs = tuple(t.to(dev) if isinstance(t, torch.Tensor) else t
                   for t in (example_input if isinstance(example_input, (tuple, list))
                             else (example_input,)))
    if chain is None:  # a Pipeline passes the chain it cuts, captured as it captures it
        chain = trace(model, inputs, leaf_modules=leaf_modules, check=False)
    timer = _Timer(dev)

    # Measuring runs forwards in training mode, which move buffers (batch norm's running
    # statistics and its counter): they are put back afterwards, as the weights are.
    kept_buffers = [(b, b.detach().clone()) for b in model.buffers()]

    # Reference inputs of every block, from one forward of the whole chain (each block fed
    # copies: one that writes into its input in place must not change the recorded one).
    block_inputs: list[tuple[Any, ...]] = []
    with torch.no_grad():
        values: tuple[Any, ...] = inputs
        for k, block in enumerate(chain.blocks):
            block_inputs.append(values)
            with _blaming(f"block {k} ({block.name!r})"):
                values = block.module(*_copies(values))

    runs = warmup + repeat
    title = f"profiling {model_name or type(model).__name__}"
    saved_grads = {p: p.grad for p in model.parameters()}
    cache = CpuCacheHold(dev, (Tuning() if cpu_cache_mb is None
                               else Tuning(cpu_cache_mb=cpu_cache_mb)).cpu_cache_bytes)
    try:
        with _progress(progress) as bar:
            task = bar.add_task(title, total=len(chain) * runs + 1) if bar else None
            measured = []
            for k, block in enumerate(chain.blocks):
                if bar is not None:
                    bar.update(task, description=f"{title}: {block.name}")
                forward_ms, backward_ms, input_ms = [], [], []
                outputs: Any = ()
                with _blaming(f"block {k} ({block.name!r})"):
                    for run in range(runs):
                        # timer() calls each lambda at once, inside this iteration, so the loop
                        # variables they read are the current ones (B023 warns of late binding).
                        fed = _copies(_detach(block_inputs[k]))
                        f_ms, outputs = timer(lambda: block.module(*fed))  # noqa: B023
                        needs_grad = [t for t in _tensors(outputs) if t.requires_grad]
                        grads = [torch.ones_like(t) for t in needs_grad]
                        b_ms, _ = timer(lambda: torch.autograd.backward(  # noqa: B023
                            needs_grad, grads) if needs_grad else None)  # noqa: B023
                        i_ms = _input_part_ms(timer, block.module, block_inputs[k])
                        if run >= warmup:
                            forward_ms.append(f_ms)
                            backward_ms.append(b_ms)
                            input_ms.append(i_ms)
                        if bar is not None:
                            bar.advance(task)
                    saved_held = _saved_bytes(block.module, block_inputs[k])
                measured.append((block.name, statistics.median(forward_ms),
                                 statistics.median(backward_ms), _nbytes(_tensors(outputs)),
                                 *saved_held, statistics.median(input_ms)))
            if bar is not None:
                bar.update(task, description=f"{title}: optimizer state")
            before = None  # the built-in optimizers have lr 0; a factory's may step weights
            if not isinstance(optimizer, str):
                with torch.no_grad():
                    before = [p.detach().clone() for p in model.parameters()]
            with _blaming("the optimizer state (one step over the whole model)"):
                optimizer_bytes = _optimizer_state_bytes(chain, inputs, make_optimizer)
            update_ms = _update_costs_ms(timer, chain, make_optimizer, warmup, repeat)
            if before is not None:
                with torch.no_grad():
                    torch._foreach_copy_(list(model.parameters()), before)
                del before
            if bar is not None:
                bar.advance(task)
    finally:
        cache.release()
        for p, grad in saved_grads.items():
            p.grad = grad  # undo what the measuring backward passes accumulated
        with torch.no_grad():
            for buffer, value in kept_buffers:
                buffer.copy_(value)

    blocks: list[BlockProfile] = []
    for (name, f_ms, b_ms, act, saved, held, i_ms), block, opt, (step_ms, scale_ms, zero_ms,
                                                          copy_ms) in zip(
            measured, chain.blocks, optimizer_bytes, update_ms):
        param_bytes = _nbytes(block.module.parameters())
        blocks.append(BlockProfile(name=name, forward_ms=f_ms, backward_ms=b_ms,
                                   activation_bytes=act, parameter_bytes=param_bytes,
                                   optimizer_state_bytes=opt,
                                   extra={"saved_bytes": saved, "held_bytes": held,
                                          "backward_input_ms": min(i_ms, b_ms),
                                          "optimizer_ms": step_ms,
                                          "grad_scale_ms": scale_ms, "grad_zero_ms": zero_ms,
                                          "snapshot_ms": copy_ms}))
    return Profile(model=model_name or type(model).__name__, batch_size=batch_size,
                   device=str(dev), blocks=blocks,
                   extra={"optimizer": optimizer_name, "warmup": warmup, "repeat": repeat,
                          "input_bytes": _nbytes(_tensors(inputs)),
                          "torch_version": torch.__version__})
