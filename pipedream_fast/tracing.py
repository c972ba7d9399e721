"""Turn an `nn.Module` into a `LayerChain`: an ordered list of blocks and the cuts between them.

The planner only ever cuts a model *between* blocks, so this module decides what a block is and,
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
  the blocks as on the model).
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
"""

from __future__ import annotations

import inspect
import linecache
import os
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_TORCH_DIR = os.path.dirname(torch.__file__)

LeafSpec = Iterable["type[nn.Module] | str"]


class TracingError(ValueError):
    """A model cannot be split into blocks (untraceable code, shared parameters, bad inputs)."""


class NeedsExampleInputs(TracingError):
    """torch.fx could not trace the model; capturing it with torch.export needs example
    inputs (a Pipeline then cuts the model at its first minibatch)."""
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
    captured_by: str = "fx"  # "sequential", "fx" or "export"
    # The model's inputs (a tensor, a tuple of positional arguments, a dict of keyword
    # arguments) as the first block's positional tensors; None: `positional_inputs`.
    input_flattener: Callable[[Any], tuple[Any, ...]] | None = field(default=None, repr=False)
    input_defaults: dict[str, Any] = field(default_factory=dict)  # fx: optional inputs

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


class _ModeBlock(nn.Module):
    """A block captured by torch.export: the graph of the training capture in train mode,
    the eval capture's otherwise (both read the same parameters and buffers)."""

    def __init__(self, train_graph: nn.Module, eval_graph: nn.Module) -> None:
        super().__init__()
        self.train_graph = train_graph
        self.eval_graph = eval_graph

    def forward(self, *values: Any) -> Any:
        return (self.train_graph if self.training else self.eval_graph)(*values)


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


# ---- which module a node belongs to ----------------------------------------------------------

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


def _is_stack(module: nn.Module) -> bool:
    """A container with two or more children of one class: a stack of repeated layers."""
    if not isinstance(module, _CONTAINERS):
        return False
    classes = [type(child) for child in module.children()]
    return any(classes.count(c) > 1 for c in set(classes))


def _opened(model: nn.Module, leaf_names: frozenset[str],
            leaf_types: tuple[type, ...]) -> frozenset[str]:
    """Qualified names of the modules that are looked through (see the grouping rule)."""
    opened = {""}
    for name, module in model.named_modules():
        if name in leaf_names or isinstance(module, leaf_types):
            continue
        if isinstance(module, _CONTAINERS):
            opened.add(name)
        if _is_stack(module):
            parts = name.split(".")
            opened.update(".".join(parts[:i]) for i in range(len(parts)))
    for name, module in model.named_modules():  # a leaf is never opened, wherever it sits
        if name in leaf_names or isinstance(module, leaf_types):
            opened.discard(name)
    return frozenset(opened)


def _key_function(model: nn.Module, leaves: Sequence[Any]) -> Callable[[fx.Node], str | None]:
    """node -> its block's module name; None for code of an opened module itself."""
    leaf_types, leaf_names = _split_leaves(leaves)
    missing = [n for n in leaf_names if n not in dict(model.named_modules())]
    if missing:
        raise TracingError(f"leaf_modules names {missing} are not submodules of "
                           f"{type(model).__name__}; use names from model.named_modules()")
    opened = _opened(model, leaf_names, leaf_types)

    def key(node: fx.Node) -> str | None:
        stack = node.meta.get("nn_module_stack") or {}
        for path, _cls in stack.values():  # outermost first
            if path not in opened:
                return str(path)
        return None

    return key


def _group(nodes: Sequence[fx.Node], key_of: Callable[[fx.Node], str | None],
           align: Sequence[str] | None = None) -> list[tuple[str, list[fx.Node]]]:
    """Consecutive nodes of one block key form a group; keyless nodes join the group before
    them (or the first). With `align` (another capture's keys), the groups are exactly those
    keys, in order: a node goes to the next group of its key at or after the current one,
    and stays in the current group when there is none (empty groups pass values through)."""
    if align is not None:
        groups: list[tuple[str, list[fx.Node]]] = [(k, []) for k in align]
        at = 0
        for node in nodes:
            key = key_of(node)
            if key is not None and align[at] != key:
                at = next((i for i in range(at + 1, len(align)) if align[i] == key), at)
            groups[at][1].append(node)
        return groups
    groups = []
    pending: list[fx.Node] = []
    for node in nodes:
        key = key_of(node)
        if key is None:
            (groups[-1][1] if groups else pending).append(node)
        elif groups and groups[-1][0] == key:
            groups[-1][1].append(node)
        else:
            groups.append((key, pending + [node]))
            pending = []
    return groups or [("model", pending)]


def _block_names(keys: Sequence[str]) -> list[str]:
    """Block names from group keys: a module whose calls form several blocks gets `#2`, ..."""
    seen: dict[str, int] = {}
    names = []
    for key in keys:
        seen[key] = seen.get(key, 0) + 1
        names.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
    return names


# ---- errors ------------------------------------------------------------------------------------

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


def _reason(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _untraceable(path: str, m: nn.Module, err: BaseException) -> TracingError:
    cls = type(m).__name__
    what = f"module {path!r} ({cls})" if path else f"the model's own forward ({cls})"
    if path:
        fix = (f"mark it as a leaf so it is kept whole and never traced: "
               f"trace(model, leaf_modules=[{path!r}]) or leaf_modules=[{cls}] "
               f"(pipedream-fast profile: --leaf {path})")
    else:
        fix = ("leaves cannot help with the root module: move the data-dependent code into a "
               "submodule and list that submodule in leaf_modules=, or pass an nn.Sequential")
    return TracingError(f"torch.fx cannot trace {what}{_failing_line(err)}: {_reason(err)}; "
                        f"{fix}")


# ---- torch.fx capture ----------------------------------------------------------------------------

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


def _trace_fx(model: nn.Module, leaves: Sequence[Any]) -> LayerChain:
    key_of = _key_function(model, leaves)
    tracer = _Tracer(*_split_leaves(leaves))
    fixed = _flag_defaults(model)
    try:
        graph = tracer.trace(model, concrete_args=fixed or None)
        _drop_fixed_inputs(graph, fixed)
    except TracingError:
        raise
    except Exception as err:  # noqa: BLE001 - the root forward itself failed to trace
        raise _untraceable("", model, err) from err
    body = _body(graph)
    if not body:
        raise TracingError(f"{type(model).__name__}.forward computes nothing to split")
    groups = _group(body, key_of)
    built = _build_blocks(model, graph, groups)
    structure = built.output_structure
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return LayerChain(
        blocks=[Block(name, module) for name, module in zip(_block_names([k for k, _ in groups]),
                                                             built.modules)],
        input_names=[n.name for n in placeholders], cuts=built.cut_names,
        unflatten_output=lambda values: fx.node.map_arg(structure, lambda n: values[
            built.output_position[n]]),
        captured_by="fx", input_defaults={n.name: n.args[0] for n in placeholders if n.args})


def _flag_defaults(model: nn.Module) -> dict[str, Any]:
    """Optional inputs defaulting to None or a bool (`attn_mask=None`, `is_causal=False`) are
    configuration, not data: traced as their defaults, as a call that leaves them out runs
    (a Proxy in `if attn_mask is not None` would take the wrong branch)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params
            if p.default is None or isinstance(p.default, bool)}


def _drop_fixed_inputs(graph: fx.Graph, fixed: dict[str, Any]) -> None:
    """Removes the placeholders of inputs traced as constants, with fx's checks on them."""
    checks = {"eq", "_assert", "_assert_is_none"}
    for node in list(graph.nodes):
        if node.op != "placeholder" or str(node.target).rsplit("_", 1)[0] not in fixed:
            continue
        found, todo = [], list(node.users)
        while todo:
            user = todo.pop()
            found.append(user)
            todo.extend(user.users)
        if all(u.op == "call_function" and getattr(u.target, "__name__", "") in checks
               for u in found):
            for user in reversed([n for n in graph.nodes if n in set(found)]):
                graph.erase_node(user)
            graph.erase_node(node)


# ---- torch.export capture ---------------------------------------------------------------------

_ASSERTIONS = {torch.ops.aten._assert_scalar.default, torch.ops.aten._assert_tensor_metadata.default,
               torch.ops.aten.sym_constrain_range_for_size.default,
               torch.ops.aten._assert_async.msg}


def _as_call(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inputs as (args, kwargs): a tuple/list is positional, a dict is keyword arguments."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _call_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Training never reads a key/value cache: a model that offers one (Hugging Face
    `use_cache`) is called without it, as its output would hold a cache object."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    if "use_cache" in params and "use_cache" not in kwargs:
        return {**kwargs, "use_cache": False}
    return kwargs


def _dynamic_shapes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Every dimension of every tensor input may vary (export keeps what must stay fixed)."""
    auto = torch.export.Dim.AUTO

    def spec(value: Any) -> Any:
        return {d: auto for d in range(value.dim())} if isinstance(value, torch.Tensor) else None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def _export_graph(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  training: bool) -> tuple[fx.GraphModule, pytree.TreeSpec]:
    """The model's ATen graph in one mode, unlifted (parameters and buffers read with
    get_attr under their original names, as the same tensor objects), and its output spec."""
    modes = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        program = torch.export.export(model, args, kwargs, strict=False,
                                      dynamic_shapes=_dynamic_shapes(model, args, kwargs))
    finally:
        for m, mode in modes.items():
            m.training = mode
    module = program.module()
    graph = module.graph
    for node in list(graph.nodes):
        if (node.op == "call_module" and node.target == "_guards_fn") or (
                node.op == "call_function" and node.target in _ASSERTIONS):
            graph.erase_node(node)
    return module, program.call_spec.out_spec


def _trace_export(model: nn.Module, example_inputs: Any, leaves: Sequence[Any],
                  fx_error: TracingError) -> LayerChain:
    key_of = _key_function(model, leaves)
    args, kwargs = _as_call(example_inputs)
    kwargs = _call_kwargs(model, kwargs)
    try:
        train_gm, out_spec = _export_graph(model, args, kwargs, training=True)
        eval_gm, _ = _export_graph(model, args, kwargs, training=False)
    except Exception as err:  # noqa: BLE001 - reported with the fx failure, as one message
        raise TracingError(
            f"cannot split {type(model).__name__}: torch.export failed{_failing_line(err)}: "
            f"{_reason(err)}; torch.fx failed too ({fx_error}). Mark the module that holds "
            f"the failing code as a leaf (leaf_modules=[...]) or pass an nn.Sequential"
        ) from err
    leaves_, _ = pytree.tree_flatten((args, kwargs))
    placeholders = [n for n in train_gm.graph.nodes if n.op == "placeholder"]
    tensor_inputs = [i for i, n in enumerate(placeholders)
                     if isinstance(n.meta.get("val"), torch.Tensor)]
    inputs_kept = [placeholders[i] for i in tensor_inputs]
    for gm in (train_gm, eval_gm):
        _fold_constant_inputs(gm.graph, leaves_)
    train_groups = _group(_body(train_gm.graph), key_of)
    keys = [k for k, _ in train_groups]
    train = _build_blocks(train_gm, train_gm.graph, train_groups)
    evals = _build_blocks(eval_gm, eval_gm.graph, _group(_body(eval_gm.graph), key_of, keys))
    in_spec = pytree.tree_flatten((args, kwargs))[1]
    modules = [_ModeBlock(t, e) for t, e in zip(train.modules, evals.modules)]

    def flatten(inputs: Any) -> tuple[Any, ...]:
        call_args, call_kwargs = _as_call(inputs)
        leaves_, spec = pytree.tree_flatten((call_args, _call_kwargs(model, call_kwargs)))
        if spec != in_spec:
            raise TracingError(f"{type(model).__name__} was captured with inputs shaped as "
                               f"{_describe(args, kwargs)}; these are {_describe(call_args, call_kwargs)}"
                               f": give every minibatch the same structure")
        return tuple(leaves_[i] for i in tensor_inputs)

    def unflatten(values: Sequence[Any]) -> Any:
        flat = fx.node.map_arg(train.output_structure,
                               lambda n: values[train.output_position[n]])
        return pytree.tree_unflatten(list(flat), out_spec)

    return LayerChain(blocks=[Block(n, m) for n, m in zip(_block_names(keys), modules)],
                      input_names=[n.name for n in placeholders if n in inputs_kept],
                      cuts=train.cut_names, unflatten_output=unflatten, captured_by="export",
                      input_flattener=flatten)


def _fold_constant_inputs(graph: fx.Graph, values: Sequence[Any]) -> None:
    """Non-tensor inputs (flags such as `use_cache`, `None` for a left-out argument) were
    fixed by the capture: their placeholders become constants."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, values):
        if isinstance(node.meta.get("val"), torch.Tensor):
            continue
        def fold(n: fx.Node, node: fx.Node = node, value: Any = value) -> Any:
            return value if n is node else n

        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, fold)
            user.kwargs = fx.node.map_arg(user.kwargs, fold)
        graph.erase_node(node)


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    parts = [f"{len(args)} positional"] if args else []
    if kwargs:
        parts.append("keywords " + ", ".join(sorted(kwargs)))
    return " and ".join(parts) or "no arguments"


# ---- from a graph and its groups to block modules -------------------------------------------------

def _is_size(node: fx.Node) -> bool:
    """A node computing a (symbolic) size rather than a tensor: recomputed where needed."""
    if node.op != "call_function":
        return False
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _body(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes
            if n.op not in ("placeholder", "output", "get_attr") and not _is_size(n)]


@dataclass
class _Built:
    modules: list[fx.GraphModule]
    cut_names: list[list[str]]
    output_structure: Any
    output_position: dict[fx.Node, int]


def _build_blocks(root: nn.Module, graph: fx.Graph,
                  groups: list[tuple[str, list[fx.Node]]]) -> _Built:
    """Block modules for `groups` of `graph`'s nodes, and the tensors crossing each cut."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    block_of: dict[fx.Node, int] = {n: -1 for n in placeholders}
    for index, (_, nodes) in enumerate(groups):
        for n in nodes:
            block_of[n] = index
    num_blocks = len(groups)

    # A value crosses cut k iff produced in a block <= k and last needed in a block > k
    # (sizes are recomputed from a block's own inputs, so their uses do not count).
    last_use: dict[fx.Node, int] = {}
    for node in block_of:
        uses = [num_blocks if u.op == "output" else block_of.get(u, -2)
                for u in node.users if not _is_size(u)]
        last_use[node] = max((u for u in uses if u >= 0), default=-1)
    ordered = placeholders + [n for _, nodes in groups for n in nodes]
    cuts = [[n for n in ordered if block_of[n] <= k < last_use[n]] for k in range(num_blocks)]

    out_nodes: list[fx.Node] = []
    fx.node.map_arg(output.args[0], lambda n: out_nodes.append(n) if n not in out_nodes else None)
    missing = [n for n in out_nodes if n not in cuts[-1]]
    cuts[-1] = out_nodes + [n for n in cuts[-1] if n not in out_nodes]
    if missing and any(n.op != "placeholder" for n in missing):
        raise AssertionError(f"outputs {missing} are not produced by any block")
    modules = []
    for index, (_, nodes) in enumerate(groups):
        inputs = placeholders if index == 0 else cuts[index - 1]
        modules.append(_block_graph_module(root, nodes, inputs, cuts[index], f"block_{index}",
                                           first=index == 0))
    return _Built(modules, [[n.name for n in cut] for cut in cuts], output.args[0],
                  {n: i for i, n in enumerate(cuts[-1])})


def _block_graph_module(model: nn.Module, nodes: list[fx.Node], inputs: list[fx.Node],
                        outputs: list[fx.Node], class_name: str, first: bool) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        if first and node.args:  # a model input with a default value
            env[node] = graph.placeholder(node.name, default_value=node.args[0])
        else:
            env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    _copy_written_inputs(model, graph, inputs, nodes, env)

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op == "get_attr":
                env[n] = graph.node_copy(n)  # parameters/buffers are read by each user block
            elif _is_size(n):
                env[n] = _recompute_size(graph, n, env)
            else:
                raise AssertionError(f"node {n.name} used before it is available")
        return env[n]

    for node in nodes:
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(lookup(n) for n in outputs))
    return fx.GraphModule(model, graph, class_name=class_name)


def _writes_first_argument(model: nn.Module, node: fx.Node) -> bool:
    """Whether `node` writes into its first argument (an in-place op or module)."""
    if node.op == "call_module":
        return bool(getattr(model.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).endswith("__")
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.arguments:
        alias = schema.arguments[0].alias_info
        return alias is not None and alias.is_write
    return bool(node.kwargs.get("inplace", False))


def _copy_written_inputs(model: nn.Module, graph: fx.Graph, inputs: list[fx.Node],
                         nodes: list[fx.Node], env: dict[fx.Node, fx.Node]) -> None:
    """A block input that the block writes into in place is copied first: a stage's inputs
    are autograd leaves, which must not be modified in place (ResNet's first ReLU)."""
    written = {n.args[0] for n in nodes if n.args and isinstance(n.args[0], fx.Node)
               and n.args[0] in inputs and _writes_first_argument(model, n)}
    for node in inputs:
        if node in written:
            env[node] = graph.call_function(torch.clone, (env[node],))


def _recompute_size(graph: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node]) -> fx.Node:
    """A symbolic size used in this block, rebuilt from the shapes of the block's own
    tensors: each symbol is read off a dimension that has exactly that size."""
    value = node.meta["val"]
    expr = value.node.expr
    sizes: dict[Any, fx.Node] = {}
    for symbol in sorted(expr.free_symbols, key=str):
        sizes[symbol] = _size_of(graph, symbol, env, node)
    if expr in sizes:
        return sizes[expr]
    symbols = list(sizes)
    return graph.call_function(_SizeExpression(expr, symbols), tuple(sizes[s] for s in symbols))


def _size_of(graph: fx.Graph, symbol: Any, env: dict[fx.Node, fx.Node], user: fx.Node) -> fx.Node:
    for original, copied in env.items():
        val = original.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for dim, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                return graph.call_function(torch.ops.aten.sym_size.int, (copied, dim))
    raise TracingError(f"the size {symbol} used by {user.name} is not a dimension of any "
                       f"tensor reaching its block; mark the module that computes it as a leaf")


class _SizeExpression:
    """A size computed from other sizes (e.g. `s0 * s1`), evaluated with sympy's lambdify."""

    def __init__(self, expr: Any, symbols: list[Any]) -> None:
        import sympy  # type: ignore[import-untyped]
        self.text = str(expr)
        self.fn = sympy.lambdify(symbols, expr, modules="math")
        self.__name__ = f"size_{self.text}"

    def __call__(self, *sizes: int) -> int:
        return int(self.fn(*sizes))

    def __repr__(self) -> str:
        return f"size({self.text})"


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
