"""A backward in two parts, for zero-bubble schedules: the input gradient now, the weight
gradient later, without computing anything twice.

    forward:  every submodule that owns parameters is recorded as it runs: its outputs and
              the very parameter tensors it used (a retained version's, under functional_call)
    input:    autograd.grad(roots -> stage inputs, retain_graph) walks only the path to the
              inputs, skipping every weight-gradient kernel; hooks keep the gradient that
              reaches each recorded output on the way
    weight:   for each recorded call, backward(its outputs, their kept gradients, inputs=its
              parameters): only that module's own weight-gradient work, into `.grad`

A forward where one module ran twice, or two calls shared a parameter, cannot be split that
way (a call's backward would also reach the parameters through the other call), nor one that
read a parameter outside a recorded call (a graph captured by torch.export reads its weights
as attributes): then the input part runs the whole backward and the weight part has nothing
left to do. Outputs the input
path never reaches (their gradient was not kept) get their weight gradients from the roots in
the weight part, restricted to their parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pipedream_fast.runtime.engine_backward import backward as engine_backward


@dataclass(eq=False)
class Call:
    """One run of a submodule with parameters: its outputs, their gradients, its parameters."""

    module: nn.Module
    outputs: list[torch.Tensor]
    params: list[torch.Tensor]
    grads: list[torch.Tensor | None] = field(default_factory=list)

    def keep_grad(self, index: int) -> Any:
        """A hook for output `index` that keeps its gradient. It holds the list, not the call:
        the call holds the output, whose hook this is, so a hook holding the call would make
        a cycle (output -> hook -> call -> output) that only the cyclic garbage collector
        frees, with the microbatch's activations and gradients in it."""
        grads = self.grads

        def hook(grad: torch.Tensor) -> None:
            grads[index] = grad
        return hook


class CallRecorder:
    """Records the calls of a module's parameter-owning submodules while `recording` is set."""

    def __init__(self, module: nn.Module) -> None:
        self.recording: list[Call] | None = None
        self._handles: list[RemovableHandle] = [
            sub.register_forward_hook(self._record) for sub in module.modules()
            if any(True for _ in sub.parameters(recurse=False))]

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.recording is None or not torch.is_grad_enabled():
            return
        outs = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                if isinstance(t, torch.Tensor) and t.requires_grad]
        # The tensors this call used: functional_call swaps them in for a retained version.
        params: list[torch.Tensor] = [p for p in module._parameters.values()
                                      if p is not None and p.requires_grad]
        if not outs or not params:
            return
        call = Call(module, outs, params, [None] * len(outs))
        for k, t in enumerate(outs):
            t.register_hook(call.keep_grad(k))
        self.recording.append(call)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def splittable(calls: Sequence[Call], trainable: int) -> bool:
    """No module ran twice, no parameter served two calls, and the calls used every one of
    the stage's `trainable` parameters. A parameter read outside a recorded call (a graph
    that torch.export captured reads its weights as attributes and calls no submodule; a
    functional op on a weight) would get its gradient from neither part: the input part
    skips weight gradients, the weight part knows only the calls."""
    modules = [id(c.module) for c in calls]
    params = [id(p) for c in calls for p in c.params]
    return (len(set(modules)) == len(modules) and len(set(params)) == len(params)
            and len(params) == trainable)


def input_part(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
               inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of the stage's inputs; the graph stays for the weight part."""
    got = torch.autograd.grad(list(roots), list(inputs), grads, retain_graph=True,
                              allow_unused=True)
    return [g if g is not None else torch.zeros_like(t) for g, t in zip(got, inputs)]


def weight_part(calls: Sequence[Call], roots: Sequence[torch.Tensor],
                grads: Sequence[torch.Tensor] | None) -> None:
    """Accumulates every recorded call's weight gradients into the parameters' `.grad`."""
    missed = [c for c in calls if any(g is None for g in c.grads)]
    if missed:  # outputs off the input path: from the roots, for their parameters only
        engine_backward(list(roots), grads, retain_graph=True,
                        inputs=[p for c in missed for p in c.params])
    for call in calls:
        if call not in missed:
            engine_backward(call.outputs, [g for g in call.grads if g is not None],
                            inputs=call.params)
