"""Activation recomputation: a block whose activations are not kept by its forward, and are
made again during its backward by running it a second time (`Pipeline(recompute=...)`).

    forward:   block(*inputs) under torch.utils.checkpoint (non-reentrant): the outputs are
               computed, the tensors autograd would save inside the block are dropped
    backward:  the first use of a dropped tensor re-runs the block from its inputs, then the
               gradients go on as without recomputation

Three things make the second run compute exactly what the first did:

* **The weights the forward read.** Under weight stashing a forward reads a retained version
  of its stage's weights (swapped in by `torch.func.functional_call`), and by the time of the
  backward the module may hold other ones. The tensors the block used are captured at the
  forward, and the re-run reads those same tensors (a retained version stays in the ring until
  its backward is done; live weights are not updated before the backward of a microbatch
  that read them, or autograd itself would refuse the backward).
* **The random state.** Dropout draws its mask from the generator: torch.utils.checkpoint
  saves the CPU (and the inputs' CUDA device's) random state before the forward and replays
  it for the re-run, so the mask is the same.
* **The buffers.** A block in training mode updates its buffers (batch norm's running
  statistics, its batch count) as it runs: the re-run would update them a second time, so
  they are put back as they were after it.

Non-reentrant, because the reentrant form cannot run under `torch.autograd.grad` with
`inputs=`, which the split backward of zero-bubble schedules relies on.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def recomputed(block: nn.Module, values: tuple[Any, ...]) -> Any:
    """`block(*values)` with its activations made again in the backward (see the module's
    docstring)."""
    # The tensors this forward reads (a retained version's, under functional_call).
    weights: dict[str, torch.Tensor] = dict(block.named_parameters(remove_duplicate=False))

    def run(*inputs: Any) -> Any:
        return torch.func.functional_call(block, weights, inputs)

    return checkpoint(run, *values, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: (contextlib.nullcontext(), _BuffersKept(block)))


class _BuffersKept:
    """The block's buffers as they were before a re-run, put back after it. Reusable: a
    split backward (zb-h1) may re-run a block once for each of its two parts."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.saved = [(b, b.detach().clone()) for b in self.block.buffers()]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)
        self.saved = []
