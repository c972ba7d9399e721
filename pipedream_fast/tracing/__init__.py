"""Turn an `nn.Module` into a `LayerChain`: an ordered list of blocks and the cuts between them.

The planner only ever cuts a model *between* blocks, so this package decides what a block is and,
for every cut, which tensors cross it. A pipeline stage is then just a run of blocks:

    inputs ─▶ [block 0] ─cut 0─▶ [block 1] ─cut 1─▶ [block 2] ─cut 2─▶ output
                    │                                  ▲
                    └──────── skip tensor s ───────────┘    s crosses cut 0 and cut 1

How the graph is captured
-------------------------
* An `nn.Sequential` maps directly: one block per child, each cut carries that child's output.
  Children are never traced, so any child works, traceable or not.
* Any other module is first traced with `torch.fx` (nothing is executed, no inputs needed,
  and each `torch.nn` layer stays a call of the module itself, so `train()`/`eval()` act on
  the blocks as on the model). Functional code that reads `self.training`
  (`F.dropout(x, p, self.training)`, stochastic depth, drop path) is frozen by the trace, so
  the model is traced in both modes and, where the graphs differ, each block runs the graph
  of its current mode (`blocks.ModeBlock`).
* Code that `torch.fx` cannot follow (an `assert` on a size, `if` on a shape, `**kwargs`,
  library code such as Hugging Face's masks) is captured with `torch.export` in non-strict
  mode from example inputs: Python runs for real, so asserts, shape checks and config reads
  simply execute, and what is recorded is the ATen graph. Its sizes are symbolic, so one
  graph serves any batch or sequence length. Such a graph fixes `self.training` branches
  (dropout, batch norm, `dropout_p=... if self.training`), so the model is captured twice,
  in training and in eval mode, and each block runs the graph of its current mode. Inputs
  are a tensor, a tuple of positional arguments or a dict of keyword arguments (optional
  arguments may be left out); outputs any pytree (tuples, dicts, `ModelOutput`s, `None`).

Grouping rule (both captures)
-----------------------------
Every graph node is attributed to the modules it ran in. Its block is the *outermost module
on that path that is not opened*. Opened are the root, containers (`nn.Sequential`,
`nn.ModuleList`, `nn.ModuleDict`), and every module holding a *stack* somewhere below it (a
container with two or more children of one class: `model.layers` of a Llama, `h` of a GPT):
so a decoder layer, a ResNet `layer1.0` or a ViT `blocks.3` is one block, and the
embedding, final norm and head are blocks of their own. `leaf_modules` are never opened.
Nodes of an opened module's own code (the root's loss, Llama's mask construction) join the
block that ran just before them (the first block if none ran yet). Parameters and buffers
are read in each block that uses them (shared, not copied). Sizes (symbolic integers) never
cross a cut: each block recomputes them from the shapes of its own inputs.

A tensor crosses cut k when it is produced in a block <= k (model inputs count as produced
before block 0) and is still needed by a block > k or by the output. Blocks pass such tensors
through unchanged, so every block's `forward` takes exactly the tensors crossing its input
cut, in order, and returns a tuple of exactly those crossing its output cut. A block whose
first operation writes into one of its inputs in place (`ReLU(inplace=True)` at the start of
a stage) works on a copy of it: a stage's inputs are autograd leaves.

Block modules share parameters with the original model (nothing is copied), so gradients of a
chain run land on the model's own parameters. A parameter used by two blocks (tied weights) is
held by both (`shared_parameters` lists them); the runtime sums its gradients across the
stages that hold it.

Modules
-------
`trace` (here) dispatches: an nn.Sequential maps directly, else `fx_capture`, else
`export_capture`. Both captures use `grouping` (which module a node belongs to) and `blocks`
(graph and groups -> block modules and cuts); `chain` is the `LayerChain` they return, and
`errors` the exceptions and the failing-line report.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pipedream_fast.tracing.chain import (Block, CutTensor, LayerChain, _record_cut_meta,
                                          check_no_shared_parameters, positional_inputs,
                                          shared_parameters)
from pipedream_fast.tracing.errors import NeedsExampleInputs, TracingError
from pipedream_fast.tracing.export_capture import _trace_export
from pipedream_fast.tracing.fx_capture import _trace_fx
from pipedream_fast.tracing.grouping import LeafSpec

__all__ = ["Block", "CutTensor", "LayerChain", "LeafSpec", "NeedsExampleInputs", "TracingError",
           "check_no_shared_parameters", "positional_inputs", "shared_parameters", "trace"]


def trace(model: nn.Module, example_inputs: Any = None, leaf_modules: LeafSpec = (), *,
          check: bool = True) -> LayerChain:
    """Split `model` into a `LayerChain`.

    Args:
        model: the module to split.
        example_inputs: one minibatch of inputs (a tensor, a tuple of positional arguments or
            a dict of keyword arguments), optional. When given, a model that torch.fx cannot
            trace is captured with torch.export instead, and the chain is run once on them
            under `no_grad` to check it and to record each cut's shapes in `cut_meta` (pass
            meta tensors for a meta-device model: nothing is then computed).
        leaf_modules: module classes or qualified names (`"layer2.1"`) that are never opened:
            each is one block at most (fx: one opaque call, which makes untraceable code work).
        check: run the chain on `example_inputs` (see above); False only captures with them.
    Raises:
        NeedsExampleInputs: fx failed and no example inputs were given.
        TracingError: neither capture works; names the module, the line and the fix.
    """
    leaves = tuple(leaf_modules)
    if isinstance(model, nn.Sequential):
        chain = _trace_sequential(model)
    else:
        try:
            chain = _trace_fx(model, leaves)
        except TracingError as fx_error:
            if example_inputs is None:
                raise NeedsExampleInputs(str(fx_error)) from fx_error
            chain = _trace_export(model, example_inputs, leaves, fx_error)
    if example_inputs is not None and check:
        chain.cut_meta = _record_cut_meta(chain, example_inputs)
    return chain


# ---- nn.Sequential: direct mapping ---------------------------------------------------------

def _trace_sequential(model: nn.Sequential) -> LayerChain:
    if len(model) == 0:
        raise TracingError("cannot split an empty nn.Sequential: it has no children")
    blocks = [Block(name, _SequentialBlock(child)) for name, child in model.named_children()]
    return LayerChain(blocks=blocks, input_names=["input"], cuts=[[b.name] for b in blocks],
                      unflatten_output=lambda values: values[0], captured_by="sequential")


class _SequentialBlock(nn.Module):
    """Wraps a Sequential child so that it returns a 1-tuple, per the Block contract."""

    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, *values: Any) -> tuple[Any]:
        return (self.child(*values),)
