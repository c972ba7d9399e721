"""The autograd engine's backward, called without `torch.autograd.backward`'s Python layer.

That layer (`_make_grads`) compares each root's shape with its gradient's through torch.fx's
symbolic-shape helpers, imported and evaluated on every call: 20-40 us a call on a 2-core CPU,
against 15 us for the whole forward of a Linear(16, 16) stage, paid by every backward of every
microbatch. The engine checks the same itself, in C++: each root gradient's shape against its
root (and casts its dtype). A scalar root's gradient of ones, where none is given, is made
here as the public call makes it. So the gradients are the same bit for bit (the exactness
tests compare them with references that call `torch.autograd.backward`); what is lost is the
debug-logging hooks that `TORCH_LOGS` would attach, so under those logs the public call is
used.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Sequence

import torch

_ENGINE = getattr(torch.autograd.Variable, "_execution_engine", None)
_AUTOGRAD_LOG = logging.getLogger("torch.autograd.graph")
# What the public call does first: the context, so that torch.compile's settings reach the
# engine's device threads (a GPU's backward runs there; a CPU's in the caller's thread).
_STASH = getattr(torch._C, "_stash_obj_in_tls", None)


def backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None = None,
             retain_graph: bool = False,
             inputs: Sequence[torch.Tensor] | None = None) -> None:
    """`torch.autograd.backward(roots, grads, retain_graph=..., inputs=...)`: accumulates the
    gradients into the leaves' (or `inputs`') `.grad`."""
    if _ENGINE is None or _AUTOGRAD_LOG.isEnabledFor(logging.DEBUG) or inputs == []:
        # No engine handle (another torch), debug logs wanted, or an empty `inputs` (the
        # public call's error says what is wrong)
        torch.autograd.backward(list(roots), grads, retain_graph=retain_graph, inputs=inputs)
        return
    roots = tuple(roots)
    if _STASH is not None and roots and roots[0].device.type != "cpu":
        _STASH("context", contextvars.copy_context())
    given = tuple(_ones_for(r) for r in roots) if grads is None else \
        tuple(g if g is not None else _ones_for(r) for r, g in zip(roots, grads))
    _ENGINE.run_backward(roots, given, retain_graph, False, tuple(inputs or ()), True, True)


def _ones_for(root: torch.Tensor) -> torch.Tensor:
    """The gradient the public call makes for a root given none: ones, for a scalar only."""
    if root.numel() != 1:
        raise RuntimeError("grad can be implicitly created only for scalar outputs")
    return torch.ones_like(root, memory_format=torch.preserve_format)
