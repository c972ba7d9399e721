"""The torch.export capture (non-strict, from example inputs) for code torch.fx cannot follow:
the model is captured once in training and once in eval mode, non-tensor inputs are folded
into constants, and each block runs the graph of its current mode (`ModeBlock`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from pipedream_fast.tracing.blocks import _body, _build_blocks, mode_blocks
from pipedream_fast.tracing.chain import Block, LayerChain
from pipedream_fast.tracing.errors import FxUntraceable, TracingError, _failing_line, _reason
from pipedream_fast.tracing.grouping import _block_names, _group, _key_function

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
        eval_gm, eval_out_spec = _export_graph(model, args, kwargs, training=False)
    except Exception as err:  # noqa: BLE001 - reported with the fx failure, as one message
        raise TracingError(
            f"cannot split {type(model).__name__}: torch.export failed{_failing_line(err)}: "
            f"{_reason(err)}; {_fx_failure(fx_error)}. {_remedy(model, fx_error, err)}"
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
    modules = mode_blocks(type(model).__name__, train, evals)

    def flatten(inputs: Any) -> tuple[Any, ...]:
        call_args, call_kwargs = _as_call(inputs)
        leaves_, spec = pytree.tree_flatten((call_args, _call_kwargs(model, call_kwargs)))
        if spec != in_spec:
            raise TracingError(f"{type(model).__name__} was captured with inputs shaped as "
                               f"{_describe(args, kwargs)}; these are {_describe(call_args, call_kwargs)}"
                               f": give every minibatch the same structure")
        return tuple(leaves_[i] for i in tensor_inputs)

    def unflattener(built: Any, spec: pytree.TreeSpec) -> Callable[[Sequence[Any]], Any]:
        def unflatten(values: Sequence[Any]) -> Any:
            flat = fx.node.map_arg(built.output_structure,
                                   lambda n: values[built.output_position[n]])
            return pytree.tree_unflatten(list(flat), spec)
        return unflatten

    return LayerChain(blocks=[Block(n, m) for n, m in zip(_block_names(keys), modules)],
                      input_names=[n.name for n in placeholders if n in inputs_kept],
                      cuts=train.cut_names, unflatten_output=unflattener(train, out_spec),
                      unflatten_eval_output=unflattener(evals, eval_out_spec),
                      captured_by="export", input_flattener=flatten)


def _fx_failure(fx_error: TracingError) -> str:
    return (fx_error.failure if isinstance(fx_error, FxUntraceable) else str(fx_error)) \
        + " as well"


def _remedy(model: nn.Module, fx_error: TracingError, export_error: BaseException) -> str:
    """A fix that works for this failure. A leaf helps only torch.fx (torch.export traces
    through leaves), and only below the model's own forward."""
    if isinstance(fx_error, FxUntraceable) and fx_error.module_path:
        return f"For torch.fx, {fx_error.remedy}"
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) == "eager" and hasattr(
            model, "set_experts_implementation"):
        return ("Its experts run as a Python loop over the experts a batch hits "
                "(experts_implementation 'eager'), which no capture can follow: call "
                "model.set_experts_implementation('grouped_mm') (the default), which runs them "
                "as grouped matrix products that torch.export captures")
    return (f"Leaf modules cannot help: torch.fx fails in {type(model).__name__}'s own forward "
            f"and torch.export traces through leaves. Make the failing step "
            f"({_failing_line(export_error).strip() or 'see the cause above'}) tensor code "
            f"(torch.where, masking, torch.cond instead of Python decisions on tensor values), "
            f"or pass an nn.Sequential of the model's parts")


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
