"""From a captured graph and its groups of nodes to block modules: which tensors cross each
cut, one `fx.GraphModule` per block, inputs written in place copied first, and symbolic
sizes recomputed in each block from its own inputs' shapes (sizes never cross a cut). A model
captured in both modes gets blocks that run the graph of their current mode (`ModeBlock`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from pipedream_fast.tracing.errors import TracingError


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
    kind = (bool if isinstance(value, torch.SymBool) else
            float if isinstance(value, torch.SymFloat) else int)
    return graph.call_function(_SizeExpression(expr, symbols, kind),
                               tuple(sizes[s] for s in symbols))


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


class ModeBlock(nn.Module):
    """A block of a model whose training and eval graphs differ (`F.dropout(x, p,
    self.training)`, stochastic depth, `if self.training:`): the training capture's graph in
    train mode, the eval capture's otherwise. Both read the same parameters and buffers.

    `eval_graph` is None where the eval capture could not be cut like the training one (a
    different number of tensors crossing a cut): evaluating then raises rather than running
    the training graph, whose random masks would give wrong results silently."""

    def __init__(self, train_graph: nn.Module, eval_graph: nn.Module | None,
                 why_no_eval: str = "") -> None:
        super().__init__()
        self.train_graph = train_graph
        self.eval_graph = eval_graph
        self.why_no_eval = why_no_eval

    def forward(self, *values: Any) -> Any:
        if self.training:
            return self.train_graph(*values)
        if self.eval_graph is None:
            raise TracingError(self.why_no_eval)
        return self.eval_graph(*values)


def mode_blocks(model_name: str, train: _Built, evals: _Built) -> list[nn.Module]:
    """One `ModeBlock` per block of the two captures, aligned block by block. Where a cut
    carries a different number of tensors in the two modes, the blocks cannot be swapped one
    for the other: training keeps working and evaluation is refused with the reason."""
    counts = [(k, len(t), len(e)) for k, (t, e) in enumerate(zip(train.cut_names,
                                                                  evals.cut_names))
              if len(t) != len(e)]
    if not counts:
        return [ModeBlock(t, e) for t, e in zip(train.modules, evals.modules)]
    k, in_train, in_eval = counts[0]
    why = (f"{model_name} computes something else in eval mode than in training (it reads "
           f"self.training), and its eval graph cannot be cut where the training graph is: "
           f"{in_train} tensors cross cut {k} in training, {in_eval} in eval mode. Evaluate "
           f"it outside the pipeline: load pipe.state_dict() into the model and call "
           f"model.eval()")
    return [ModeBlock(t, None, why) for t in train.modules]


class _SizeExpression:
    """A size computed from other sizes (`s0 * s1`, `FloorDiv(s0, 2)`, `ToFloat(s0) / 8`),
    evaluated with torch's own sympy interpreter, which knows every function its symbolic
    shapes emit. An integer size stays an int, a float size a float (`SymFloat`), a
    condition a bool. Results are kept per input sizes: shapes repeat, the interpreter is slow."""

    _CACHE_LIMIT = 4096

    def __init__(self, expr: Any, symbols: list[Any], kind: type) -> None:
        self.expr = expr
        self.symbols = symbols
        self.kind = kind  # int, float or bool: the type of the size it computes
        self.text = str(expr)
        self.cache: dict[tuple[Any, ...], Any] = {}
        self.__name__ = f"size_{self.text}"

    def __call__(self, *sizes: Any) -> Any:
        found = self.cache.get(sizes)
        if found is None:
            found = self._evaluate(sizes)
            if len(self.cache) >= self._CACHE_LIMIT:
                self.cache.clear()
            self.cache[sizes] = found
        return found

    def _evaluate(self, sizes: tuple[Any, ...]) -> Any:
        from torch.utils._sympy.interp import sympy_interp
        from torch.utils._sympy.reference import PythonReferenceAnalysis
        value = sympy_interp(PythonReferenceAnalysis, dict(zip(self.symbols, sizes)), self.expr)
        if self.kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise TracingError(f"the size {self.text} came out as {value} for input sizes "
                                   f"{dict(zip(map(str, self.symbols), sizes))}, not a whole "
                                   f"number")
            return int(value)
        return self.kind(value)

    def __repr__(self) -> str:
        return f"size({self.text})"
