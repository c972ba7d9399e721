"""The `LayerChain` container: blocks, the tensors crossing each cut, stages as block runs,
the model's inputs as the first block's arguments, and the checks run on a finished chain
(shared parameters, each cut's shapes on example inputs)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipedream_fast.recompute import recomputed
from pipedream_fast.tracing.errors import TracingError


@dataclass
class Block:
    """One unit the planner may place on a stage.

    `module(*tensors crossing the input cut)` returns a tuple of the tensors crossing the
    output cut (for the last block: the model's outputs, flattened).
    """

    name: str
    module: nn.Module


@dataclass
class CutTensor:
    """Shape and dtype of one tensor crossing a cut, recorded from example inputs."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class LayerChain:
    """A model as a chain of blocks; see the `pipedream_fast.tracing` docstring for how it
    is built."""

    blocks: list[Block]
    input_names: list[str]
    cuts: list[list[str]]  # cuts[k]: names of the tensors crossing the cut after block k
    unflatten_output: Callable[[Sequence[Any]], Any]
    cut_meta: list[list[CutTensor]] | None = field(default=None, repr=False)
    captured_by: str = "fx"  # "sequential", "fx" or "export"
    # The model's inputs (a tensor, a tuple of positional arguments, a dict of keyword
    # arguments) as the first block's positional tensors; None: `positional_inputs`.
    input_flattener: Callable[[Any], tuple[Any, ...]] | None = field(default=None, repr=False)
    input_defaults: dict[str, Any] = field(default_factory=dict)  # fx: optional inputs
    # Where the model returns another structure in eval mode (an auxiliary output only in
    # training): how the last block's eval outputs unflatten; None: as in training.
    unflatten_eval_output: Callable[[Sequence[Any]], Any] | None = field(default=None,
                                                                       repr=False)

    def __len__(self) -> int:
        return len(self.blocks)

    def cut_tensors(self, k: int) -> list[str]:
        """Names of the tensors crossing the cut after block `k` (0 <= k < len(self))."""
        if not 0 <= k < len(self.blocks):
            raise IndexError(f"cut {k} out of range: the chain has {len(self.blocks)} blocks, "
                             f"so cuts are numbered 0..{len(self.blocks) - 1}")
        return list(self.cuts[k])

    def flatten_inputs(self, inputs: Any) -> tuple[Any, ...]:
        """A minibatch's model inputs as the first block's arguments.

        Args:
            inputs: a tensor, a tuple/list of positional arguments, or a dict of keyword
                arguments (by the names of `forward`'s parameters; optional ones may be left
                out, as in a call of the model).
        Raises:
            TracingError: the inputs do not have the structure the model was captured with.
        """
        if self.input_flattener is not None:
            return self.input_flattener(inputs)
        return positional_inputs(inputs, self.input_names, self.input_defaults)

    def stage_module(self, start: int, stop: int,
                     recompute: Collection[int] = ()) -> nn.Module:
        """Blocks [start, stop) as one module.

        It takes the tensors crossing the cut before `start` (the model inputs when start == 0)
        and returns a tuple of those crossing the cut after block `stop - 1`; a stage that ends
        with the last block returns exactly what the model's `forward` returns. The blocks
        listed in `recompute` (indices in the chain) keep no activations in a training
        forward: their backward runs them again (`pipedream_fast.recompute`).
        """
        if not 0 <= start < stop <= len(self.blocks):
            raise IndexError(f"stage [{start}, {stop}) is not a non-empty block range of a "
                             f"{len(self.blocks)}-block chain")
        last = stop == len(self.blocks)
        return _Stage([b.module for b in self.blocks[start:stop]],
                      [b.name for b in self.blocks[start:stop]],
                      self.unflatten_output if last else None,
                      self.unflatten_eval_output if last else None,
                      frozenset(b - start for b in recompute if start <= b < stop))

    def __call__(self, *inputs: Any) -> Any:
        """Run the whole chain block by block; equals the original model's forward."""
        return self.stage_module(0, len(self.blocks))(*inputs)


def positional_inputs(inputs: Any, input_names: Sequence[str],
                      defaults: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """The first block's arguments for a chain captured by fx or from an nn.Sequential: a
    tensor, a tuple/list of them, or a dict by input name (a name left out takes its default)."""
    if isinstance(inputs, dict):
        unknown = [k for k in inputs if k not in input_names]
        missing = [n for n in input_names if n not in inputs and n not in (defaults or {})]
        if unknown or missing:
            raise TracingError(f"the model's inputs are {list(input_names)}; the dict given "
                               f"has {list(inputs)} ("
                               + (f"unknown: {unknown}" if unknown else f"missing: {missing}")
                               + ")")
        values = [inputs[n] if n in inputs else (defaults or {})[n] for n in input_names]
        return tuple(values)
    values = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    for name in input_names[len(values):]:  # trailing optional inputs take their defaults
        if name not in (defaults or {}):
            break
        values.append((defaults or {})[name])
    return tuple(values)


class _Stage(nn.Module):
    def __init__(self, modules: list[nn.Module], names: list[str],
                 final: Callable[[Sequence[Any]], Any] | None,
                 final_eval: Callable[[Sequence[Any]], Any] | None = None,
                 recompute: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(modules)
        self.block_names = names
        self._final = final
        self._final_eval = final_eval or final
        self.recompute = recompute  # positions in `blocks` whose activations are not kept

    def forward(self, *values: Any) -> Any:
        recomputing = self.recompute and self.training and torch.is_grad_enabled()
        for index, block in enumerate(self.blocks):
            if recomputing and index in self.recompute:
                values = recomputed(block, values)
            else:
                values = block(*values)
        final = self._final if self.training else self._final_eval
        return final(values) if final is not None else values


# ---- checks ---------------------------------------------------------------------------------

def shared_parameters(chain: LayerChain) -> dict[int, list[int]]:
    """Parameters used by several blocks (tied weights, such as an embedding and an output
    head): parameter id -> the blocks that use it, in order."""
    users: dict[int, list[int]] = {}
    for index, block in enumerate(chain.blocks):
        for param in block.module.parameters():
            users.setdefault(id(param), []).append(index)
    return {pid: blocks for pid, blocks in users.items() if len(blocks) > 1}


def check_no_shared_parameters(chain: LayerChain) -> None:
    """For front ends whose stages live in one process and cannot hold one tensor twice."""
    for blocks in shared_parameters(chain).values():
        a, b = chain.blocks[blocks[0]].name, chain.blocks[blocks[1]].name
        raise TracingError(
            f"a parameter is used by blocks {a!r} and {b!r}; stages of one process cannot "
            f"share weights. Use Pipeline (one process per rank), or wrap the code that uses it "
            f"into one submodule (listed in leaf_modules=) so both uses fall in one block")


def _record_cut_meta(chain: LayerChain, example_inputs: Any) -> list[list[CutTensor]]:
    values = chain.flatten_inputs(example_inputs)
    if len(values) != len(chain.input_names):
        raise TracingError(f"the model takes {len(chain.input_names)} inputs "
                           f"{chain.input_names} but {len(values)} example inputs were given")
    metas = []
    with torch.no_grad():
        for k, block in enumerate(chain.blocks):
            try:
                values = block.module(*values)
            except Exception as err:
                raise TracingError(f"block {k} ({block.name!r}) failed on the example inputs: "
                                   f"{type(err).__name__}: {err}") from err
            metas.append([CutTensor(name, tuple(v.shape), v.dtype)
                          for name, v in zip(chain.cuts[k], values) if isinstance(v, torch.Tensor)])
    return metas
