"""Turn an `nn.Module` into a `LayerChain`: an ordered list of blocks and the cuts between them.

The planner only ever cuts a model *between* blocks, so this module decides what a block is and,
for every cut, which tensors cross it. A pipeline stage is then just a run of blocks:

    inputs ─▶ [block 0] ─cut 0─▶ [block 1] ─cut 1─▶ [block 2] ─cut 2─▶ output
                    │                                  ▲
                    └──────── skip tensor s ───────────┘    s crosses cut 0 and cut 1

Grouping rule
-------------
* An `nn.Sequential` maps directly: one block per child, each cut carries that child's output.
  Children are never traced, so any child works, traceable or not.
* Any other module is traced with `torch.fx` (nothing is executed, so meta-device models work).
  Every graph node is attributed to the module it came from. Its block is the *outermost
  non-container* module on that path: containers (`nn.Sequential`, `nn.ModuleList`,
  `nn.ModuleDict`) are looked through, so `layer1.0.conv1` belongs to block `layer1.0` when
  `layer1` is a Sequential. Nodes written in the root's own `forward` (an `add` for a skip, a
  `flatten`) join the block that ran just before them (the first block if none ran yet).
  Parameters read with `get_attr` are copied into each block that reads them.
* A tensor crosses cut k when it is produced in a block <= k (model inputs count as produced
  before block 0) and is still needed by a block > k or by the output. Blocks pass such
  tensors through unchanged, so every block's `forward` takes exactly the tensors crossing its
  input cut, in order, and returns a tuple of exactly those crossing its output cut.

Block modules share parameters with the original model (nothing is copied), so gradients of a
chain run land on the model's own parameters. A parameter used by two blocks (tied weights) is
held by both (`shared_parameters` lists them); the runtime sums its gradients across the
stages that hold it.
"""

from __future__ import annotations

import linecache
import os
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_TORCH_DIR = os.path.dirname(torch.__file__)

LeafSpec = Iterable["type[nn.Module] | str"]


class TracingError(ValueError):
    """A model cannot be split into blocks (untraceable code, shared parameters, bad inputs)."""


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
    """A model as a chain of blocks; see the module docstring for how it is built."""

    blocks: list[Block]
    input_names: list[str]
    cuts: list[list[str]]  # cuts[k]: names of the tensors crossing the cut after block k
    unflatten_output: Callable[[Sequence[Any]], Any]
    cut_meta: list[list[CutTensor]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.blocks)

    def cut_tensors(self, k: int) -> list[str]:
        """Names of the tensors crossing the cut after block `k` (0 <= k < len(self))."""
        if not 0 <= k < len(self.blocks):
            raise IndexError(f"cut {k} out of range: the chain has {len(self.blocks)} blocks, "
                             f"so cuts are numbered 0..{len(self.blocks) - 1}")
        return list(self.cuts[k])

    def stage_module(self, start: int, stop: int) -> nn.Module:
        """Blocks [start, stop) as one module.

        It takes the tensors crossing the cut before `start` (the model inputs when start == 0)
        and returns a tuple of those crossing the cut after block `stop - 1`; a stage that ends
        with the last block returns exactly what the model's `forward` returns.
        """
        if not 0 <= start < stop <= len(self.blocks):
            raise IndexError(f"stage [{start}, {stop}) is not a non-empty block range of a "
                             f"{len(self.blocks)}-block chain")
        final = self.unflatten_output if stop == len(self.blocks) else None
        return _Stage([b.module for b in self.blocks[start:stop]],
                      [b.name for b in self.blocks[start:stop]], final)

    def __call__(self, *inputs: Any) -> Any:
        """Run the whole chain block by block; equals the original model's forward."""
        return self.stage_module(0, len(self.blocks))(*inputs)


class _Stage(nn.Module):
    def __init__(self, modules: list[nn.Module], names: list[str],
                 final: Callable[[Sequence[Any]], Any] | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(modules)
        self.block_names = names
        self._final = final

    def forward(self, *values: Any) -> Any:
        for block in self.blocks:
            values = block(*values)
        return self._final(values) if self._final is not None else values


class _SequentialBlock(nn.Module):
    """Wraps a Sequential child so that it returns a 1-tuple, per the Block contract."""

    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, *values: Any) -> tuple[Any]:
        return (self.child(*values),)


def trace(model: nn.Module, example_inputs: Any = None, leaf_modules: LeafSpec = ()) -> LayerChain:
    """Split `model` into a `LayerChain`.

    `leaf_modules` lists module classes or qualified names (`"layer2.1"`) that are not traced
    into: each call becomes one opaque node, which is how untraceable code is made to work.
    `example_inputs` (a tensor or a tuple of them) is optional; when given, the chain is run
    once on it under `no_grad` to check it and to record each cut's shapes in `cut_meta`
    (pass meta tensors for a meta-device model: nothing is then computed).
    """
    leaves = tuple(leaf_modules)
    chain = _trace_sequential(model) if isinstance(model, nn.Sequential) else _trace_fx(model, leaves)
    if example_inputs is not None:
        chain.cut_meta = _record_cut_meta(chain, example_inputs)
    return chain


# ---- nn.Sequential: direct mapping ---------------------------------------------------------

def _trace_sequential(model: nn.Sequential) -> LayerChain:
    if len(model) == 0:
        raise TracingError("cannot split an empty nn.Sequential: it has no children")
    blocks = [Block(name, _SequentialBlock(child)) for name, child in model.named_children()]
    return LayerChain(blocks=blocks, input_names=["input"], cuts=[[b.name] for b in blocks],
                      unflatten_output=lambda values: values[0])


# ---- torch.fx: trace, attribute nodes to blocks, compute cuts -------------------------------

class _Tracer(fx.Tracer):
    """fx tracer that honours user leaves and names the module whose forward failed."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_names: frozenset[str]) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_names = leaf_names

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or isinstance(m, self.leaf_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except TracingError:
            raise  # already attributed to a more deeply nested module
        except Exception as err:  # noqa: BLE001 - any failure inside a forward is reported
            raise _untraceable(self.path_of_module(m), m, err) from err


def _failing_line(err: BaseException) -> str:
    """The deepest frame of the traceback outside torch itself: the user's code that failed."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not os.path.abspath(f.filename).startswith(_TORCH_DIR)
              and not os.path.abspath(f.filename) == os.path.abspath(__file__)]
    if not frames:
        return ""
    f = frames[-1]
    line = (f.line or linecache.getline(f.filename, f.lineno or 0)).strip()
    return f" at {os.path.basename(f.filename)}:{f.lineno}: `{line}`"


def _untraceable(path: str, m: nn.Module, err: BaseException) -> TracingError:
    cls = type(m).__name__
    what = f"module {path!r} ({cls})" if path else f"the model's own forward ({cls})"
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if path:
        fix = (f"mark it as a leaf so it is kept whole and never traced: "
               f"trace(model, leaf_modules=[{path!r}]) or leaf_modules=[{cls}] "
               f"(pipedream-fast profile: --leaf {path})")
    else:
        fix = ("leaves cannot help with the root module: move the data-dependent code into a "
               "submodule and list that submodule in leaf_modules=, or pass an nn.Sequential")
    return TracingError(f"torch.fx cannot trace {what}{_failing_line(err)}: "
                        f"{type(err).__name__}: {reason}; {fix}")


def _split_leaves(leaves: Sequence[Any]) -> tuple[tuple[type, ...], frozenset[str]]:
    types, names = [], []
    for leaf in leaves:
        if isinstance(leaf, str):
            names.append(leaf)
        elif isinstance(leaf, type) and issubclass(leaf, nn.Module):
            types.append(leaf)
        else:
            raise TracingError(f"leaf_modules entries must be nn.Module classes or qualified "
                               f"module names such as 'layer2.1', got {leaf!r}")
    return tuple(types), frozenset(names)


def _block_key(stack: dict[str, Any] | None, model: nn.Module, leaf_names: frozenset[str],
               leaf_types: tuple[type, ...]) -> str | None:
    """Outermost non-container module on a node's module path (None: the root's own code)."""
    if not stack:
        return None
    paths = [entry[0] for entry in stack.values()]  # values are (qualified name, class)
    for path in paths:
        sub = model.get_submodule(path)
        if path in leaf_names or isinstance(sub, leaf_types) or not isinstance(sub, _CONTAINERS):
            return path
    return paths[-1]


def _trace_fx(model: nn.Module, leaves: Sequence[Any]) -> LayerChain:
    leaf_types, leaf_names = _split_leaves(leaves)
    missing = [n for n in leaf_names if n not in dict(model.named_modules())]
    if missing:
        raise TracingError(f"leaf_modules names {missing} are not submodules of "
                           f"{type(model).__name__}; use names from model.named_modules()")
    tracer = _Tracer(leaf_types, leaf_names)
    try:
        graph = tracer.trace(model)
    except TracingError:
        raise
    except Exception as err:  # noqa: BLE001 - the root forward itself failed to trace
        raise _untraceable("", model, err) from err

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    if not body:
        raise TracingError(f"{type(model).__name__}.forward computes nothing to split")

    # Assign every body node to a block (see the module docstring for the rule).
    groups: list[tuple[str, list[fx.Node]]] = []
    pending: list[fx.Node] = []
    for node in body:
        key = _block_key(node.meta.get("nn_module_stack"), model, leaf_names, leaf_types)
        if key is None:
            (groups[-1][1] if groups else pending).append(node)
        elif groups and groups[-1][0] == key:
            groups[-1][1].append(node)
        else:
            groups.append((key, pending + [node]))
            pending = []
    if not groups:  # only root-level code: one block
        groups = [(type(model).__name__, pending)]
    elif pending:
        groups[-1][1].extend(pending)

    block_of: dict[fx.Node, int] = {n: -1 for n in placeholders}
    for index, (_, nodes) in enumerate(groups):
        for n in nodes:
            block_of[n] = index
    num_blocks = len(groups)

    # A value crosses cut k iff produced in a block <= k and last needed in a block > k.
    last_use: dict[fx.Node, int] = {}
    for node in block_of:
        uses = [num_blocks if u.op == "output" else block_of.get(u, -2) for u in node.users]
        last_use[node] = max((u for u in uses if u >= 0), default=-1)
    ordered = placeholders + body
    cuts = [[n for n in ordered if block_of[n] <= k < last_use[n]] for k in range(num_blocks)]

    out_nodes: list[fx.Node] = []
    fx.node.map_arg(output.args[0], lambda n: out_nodes.append(n) if n not in out_nodes else None)
    assert set(out_nodes) <= set(cuts[-1])
    cuts[-1] = out_nodes + [n for n in cuts[-1] if n not in out_nodes]
    position = {n: i for i, n in enumerate(cuts[-1])}
    structure = output.args[0]

    def unflatten_output(values: Sequence[Any]) -> Any:
        return fx.node.map_arg(structure, lambda n: values[position[n]])

    blocks = []
    names_seen: dict[str, int] = {}
    for index, (key, nodes) in enumerate(groups):
        inputs = placeholders if index == 0 else cuts[index - 1]
        module = _block_graph_module(model, nodes, inputs, cuts[index], f"block_{index}",
                                     first=index == 0)
        names_seen[key] = names_seen.get(key, 0) + 1
        name = key if names_seen[key] == 1 else f"{key}#{names_seen[key]}"
        blocks.append(Block(name, module))
    return LayerChain(blocks=blocks, input_names=[n.name for n in placeholders],
                      cuts=[[n.name for n in cut] for cut in cuts],
                      unflatten_output=unflatten_output)


def _block_graph_module(model: nn.Module, nodes: list[fx.Node], inputs: list[fx.Node],
                        outputs: list[fx.Node], class_name: str, first: bool) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        if first and node.args:  # a model input with a default value
            env[node] = graph.placeholder(node.name, default_value=node.args[0])
        else:
            env[node] = graph.placeholder(node.name)

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op != "get_attr":
                raise AssertionError(f"node {n.name} used before it is available")
            env[n] = graph.node_copy(n)  # parameters/buffers are copied into each user block
        return env[n]

    for node in nodes:
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(lookup(n) for n in outputs))
    return fx.GraphModule(model, graph, class_name=class_name)


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


def _as_tuple(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _record_cut_meta(chain: LayerChain, example_inputs: Any) -> list[list[CutTensor]]:
    values = _as_tuple(example_inputs)
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
