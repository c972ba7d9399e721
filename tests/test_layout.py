"""The package's layout holds (issue 33): its imports point one way (no module imports,
directly or through others, a module that imports it), and no class inherits through more
than two levels of the package's own classes (a rank is parts composed, not a chain of
mixins). Read from the source with `ast`, without importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pipedream_fast"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(name: str, path: Path) -> set[str]:
    """The package's modules `name` imports anywhere in its file (inside functions and
    `if TYPE_CHECKING:` too); `from pipedream_fast import x` counts as importing module x,
    not the package's `__init__` (which every submodule's import runs anyway)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in MODULES and m not in (name, "pipedream_fast")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_packages_imports_form_no_circle():
    graph = {name: imported(name, path) for name, path in MODULES.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_class_inherits_through_more_than_two_levels_of_the_packages_classes():
    bases: dict[str, list[str]] = {}  # class name -> the names of its bases
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, []).extend(
                    b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute)
                    else "" for b in node.bases)

    def depth(name: str, seen: frozenset[str] = frozenset()) -> int:
        own = [b for b in bases.get(name, []) if b in bases and b not in seen]
        return max((1 + depth(b, seen | {name}) for b in own), default=0)

    deep = {name: depth(name) for name in bases if depth(name) > 2}
    assert deep == {}, deep
    assert depth("LocalPipeline") == 1  # the check sees the package's own bases
