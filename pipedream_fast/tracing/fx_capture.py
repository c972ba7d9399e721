"""The torch.fx capture: trace the model without inputs (user leaves kept whole, optional
flag inputs traced as their defaults), and name the module and line fx could not follow."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from pipedream_fast.tracing.blocks import ModeBlock, _body, _build_blocks, mode_blocks
from pipedream_fast.tracing.chain import Block, LayerChain
from pipedream_fast.tracing.errors import FxUntraceable, TracingError, _failing_line, _reason
from pipedream_fast.tracing.grouping import _block_names, _group, _key_function, _split_leaves


def _untraceable(path: str, m: nn.Module, err: BaseException) -> FxUntraceable:
    cls = type(m).__name__
    what = f"module {path!r} ({cls})" if path else f"the model's own forward ({cls})"
    if path:
        fix = (f"mark it as a leaf so it is kept whole and never traced: "
               f"leaf_modules=[{path!r}] or leaf_modules=[{cls}] (Pipeline(...), trace(...); "
               f"pipedream-fast profile: --leaf {path})")
    else:
        fix = ("leaves cannot help with the root module: move the data-dependent code into a "
               "submodule and list that submodule in leaf_modules=, or pass an nn.Sequential")
    return FxUntraceable(f"torch.fx cannot trace {what}{_failing_line(err)}: {_reason(err)}",
                         fix, path)


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
    """Traced in training and in eval mode: fx runs the Python of `forward`, so every read of
    `self.training` (`F.dropout(x, p, self.training)`, torchvision's stochastic depth, timm's
    drop path, `if self.training:`) is frozen into the graph. Where the two graphs differ,
    each block runs the one of its current mode (`ModeBlock`)."""
    key_of = _key_function(model, leaves)
    fixed = _flag_defaults(model)
    graph = _fx_graph(model, leaves, fixed, training=True)
    body = _body(graph)
    if not body:
        raise TracingError(f"{type(model).__name__}.forward computes nothing to split")
    groups = _group(body, key_of)
    keys = [k for k, _ in groups]
    built = _build_blocks(model, graph, groups)
    modules: list[nn.Module] = list(built.modules)
    final_eval = None
    try:
        eval_graph = _fx_graph(model, leaves, fixed, training=False)
    except TracingError as err:  # training works: only evaluation is refused, saying why
        why = (f"{type(model).__name__} cannot be traced in eval mode ({err}); evaluate it "
               f"outside the pipeline: load pipe.state_dict() into the model and call "
               f"model.eval()")
        modules = [ModeBlock(m, None, why) for m in built.modules]
        eval_graph = graph
    if eval_graph.python_code("self").src != graph.python_code("self").src:
        evals = _build_blocks(model, eval_graph, _group(_body(eval_graph), key_of, keys))
        modules = mode_blocks(type(model).__name__, built, evals)
        final_eval = _unflattener(evals)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return LayerChain(
        blocks=[Block(name, module) for name, module in zip(_block_names(keys), modules)],
        input_names=[n.name for n in placeholders], cuts=built.cut_names,
        unflatten_output=_unflattener(built), unflatten_eval_output=final_eval,
        captured_by="fx", input_defaults={n.name: n.args[0] for n in placeholders if n.args})


def _unflattener(built: Any) -> Callable[[Sequence[Any]], Any]:
    structure, position = built.output_structure, built.output_position
    return lambda values: fx.node.map_arg(structure, lambda n: values[position[n]])


def _fx_graph(model: nn.Module, leaves: Sequence[Any], fixed: dict[str, Any], *,
              training: bool) -> fx.Graph:
    """The model's fx graph with every module in train (or eval) mode; modes restored after."""
    modes = {m: m.training for m in model.modules()}
    model.train(training)
    tracer = _Tracer(*_split_leaves(leaves))
    try:
        graph = tracer.trace(model, concrete_args=fixed or None)
        _drop_fixed_inputs(graph, fixed)
    except TracingError:
        raise
    except Exception as err:  # noqa: BLE001 - the root forward itself failed to trace
        raise _untraceable("", model, err) from err
    finally:
        for m, mode in modes.items():
            m.training = mode
    return graph


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
