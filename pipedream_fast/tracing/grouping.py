"""The grouping rule: which modules are opened, which block each graph node belongs to, how
consecutive nodes form blocks (and how a second capture's nodes align with the first's), and
the blocks' names. Shared by the fx and the torch.export capture."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from pipedream_fast.tracing.errors import TracingError

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

LeafSpec = Iterable["type[nn.Module] | str"]


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
