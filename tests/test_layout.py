"""The house's layout: no import circle in any package, and the testing kit
is imported by nobody but itself (and the tests).

Imports are read from the source with :mod:`ast` (module-level and
function-level alike; imports under ``if TYPE_CHECKING:`` never run and are
left out). An import names the deepest module of this tree it reaches:
``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # top-level package -> the folder that holds it
    "shadowcore": ROOT,
    "shadow_sim": ROOT / "backends",
    "shadow_vllm": ROOT / "backends",
    "shadow_gateway": ROOT / "backends",
    "shadow_policies": ROOT / "policies",
    "shadow_traces": ROOT,
}


def modules() -> dict[str, Path]:
    """Every module of every package, by dotted name (a package by its ``__init__``)."""
    out = {}
    for package, base in PACKAGES.items():
        for path in sorted((base / package).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imported_names(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of every import in the module: ``import a.b`` gives
    ``a.b``; ``from a.b import c`` gives ``a.b.c`` (the caller keeps what exists)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:
                yield f"{module}.{alias.name}", node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {in-tree module it imports: line of the first such import}."""
    known = modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges = graph.setdefault(name, {})
        for target, line in imported_names(name, path):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, line)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, {}))))
    return None


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 60 and graph["shadow_sim.backend"]  # the walk found the tree and its imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)) + f" -> {cycle[-1]}"


def test_cycle_finder_names_a_cycle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1}}) is None


def test_nothing_outside_the_kit_imports_the_kit() -> None:
    """Backends, policies, the core, benchmarks and tools never import
    :mod:`shadowcore.testing` (it is what plugin authors test with)."""
    offenders = []
    known = modules()
    extra = {f"script:{p.relative_to(ROOT)}": p for d in ("benchmarks", "tools") for p in (ROOT / d).rglob("*.py")}
    for name, path in {**known, **extra}.items():
        if name == "shadowcore.testing" or name.startswith("shadowcore.testing."):
            continue
        for target, line in imported_names(name, path):
            if target == "shadowcore.testing" or target.startswith("shadowcore.testing."):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not offenders, offenders
