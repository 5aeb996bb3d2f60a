"""Layering: the import graph between the parts of the package has no cycle.

The nodes are the subpackages of ``paged_transformers`` (``core``, ``integration``, ``compilation``,
``quantization``, ``distributed``, ``entrypoints``, ``bench``, and ``kernels`` / ``patches``, which live at the top
of the repo but install as ``paged_transformers.kernels`` / ``paged_transformers.patches``), each top-level module
(``sampling_params``, ``config``, ``outputs``, ...) and the package's own ``__init__``. An edge ``A -> B`` is any
import statement in a file of ``A`` that names a module of ``B``: at module level or inside a function, absolute or
relative. The files are parsed, never imported, so the check is cheap and sees imports that a run would not reach.

Two rules: no cycle between nodes (a cycle is reported with the file and line of every import that makes one of its
edges), and ``core`` imports neither ``integration`` nor ``entrypoints`` (the engine is below the transformers
integration and the entry points built on it).
"""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "paged_transformers"
FOLDERS = {PACKAGE: REPO / PACKAGE, f"{PACKAGE}.kernels": REPO / "kernels", f"{PACKAGE}.patches": REPO / "patches"}
ROOT_NODE = "__init__"
FORBIDDEN = {("core", "integration"), ("core", "entrypoints")}


def module_files() -> dict[str, Path]:
    """Every module of the package, by dotted name (``paged_transformers.core.engine``), to its file;
    a package's ``__init__.py`` under the package's own name."""
    modules = {}
    for prefix, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if prefix != PACKAGE and not parts:
                continue  # kernels/ and patches/ have no __init__.py of their own
            modules[".".join((prefix, *parts))] = path
    return modules


def node_of(module: str) -> str:
    """The graph node a dotted module name belongs to: the first name below ``paged_transformers``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT_NODE


def imported_modules(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """The package modules that ``path`` (the module ``module``) imports, with the line of each import.

    ``from X import name`` counts as importing ``X.name`` when that is a module, else ``X``; relative imports are
    resolved against the module's package. Imports of anything outside the package are left out.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found.append((child if child in known else source, node.lineno))
    return [(name, line) for name, line in found if name == PACKAGE or name.startswith(PACKAGE + ".")]


def import_graph() -> dict[tuple[str, str], list[str]]:
    """Every edge between two different nodes, to the ``file:line`` of each import that makes it."""
    modules = module_files()
    known = set(modules)
    edges = defaultdict(set)
    for module, path in modules.items():
        for target, line in imported_modules(module, path, known):
            if node_of(module) != node_of(target):
                edges[(node_of(module), node_of(target))].add(f"{path.relative_to(REPO)}:{line}")
    by_place = lambda where: (where.rpartition(":")[0], int(where.rpartition(":")[2]))  # noqa: E731
    return {edge: sorted(where, key=by_place) for edge, where in edges.items()}


def strongly_connected(edges) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm): each holds a cycle."""
    successors = defaultdict(set)
    for a, b in edges:
        successors[a].add(b)
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(successors[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted({n for edge in edges for n in edge}):
        if v not in index:
            visit(v)
    return components


def cycle_edges(edges) -> dict[tuple[str, str], list[str]]:
    """The edges that lie on some cycle (both ends in one strongly connected component), with their imports."""
    components = strongly_connected(edges)
    return {(a, b): where for (a, b), where in edges.items() if any({a, b} <= c for c in components)}


def describe(edges) -> str:
    """One line per edge, with every import that makes it."""
    return "\n".join(f"  {a} -> {b}: {', '.join(where)}" for (a, b), where in sorted(edges.items()))


def test_no_import_cycle_between_packages():
    cycles = cycle_edges(import_graph())
    assert not cycles, "import cycle between packages, made by these imports:\n" + describe(cycles)


@pytest.mark.parametrize("importer,imported", sorted(FORBIDDEN))
def test_core_does_not_import_upper_layers(importer, imported):
    where = import_graph().get((importer, imported), [])
    assert not where, f"{importer} must not import {imported}:\n  " + "\n  ".join(where)


def test_graph_sees_every_kind_of_import(tmp_path):
    """Relative, absolute, ``from package import module`` and imports inside functions all make edges."""
    source = (
        "from ..integration.compat import x\n"
        "import paged_transformers.bench.calls\n"
        "from .. import config\n"
        "def f():\n"
        "    from ..entrypoints import llm\n"
        "import torch\n"
    )
    path = tmp_path / "engine.py"
    path.write_text(source)
    known = {f"{PACKAGE}.config", f"{PACKAGE}.entrypoints.llm"}
    found = imported_modules(f"{PACKAGE}.core.engine", path, known)
    assert sorted(found, key=lambda f: f[1]) == [
        (f"{PACKAGE}.integration.compat", 1), (f"{PACKAGE}.bench.calls", 2), (f"{PACKAGE}.config", 3),
        (f"{PACKAGE}.entrypoints.llm", 5),
    ]
    assert {node_of(name) for name, _ in found} == {"integration", "bench", "config", "entrypoints"}


def test_cycles_are_found():
    edges = {("a", "b"): ["x:1"], ("b", "c"): ["y:2"], ("c", "a"): ["z:3"], ("c", "d"): ["w:4"]}
    assert set(cycle_edges(edges)) == {("a", "b"), ("b", "c"), ("c", "a")}
    assert cycle_edges({("a", "b"): ["x:1"], ("b", "c"): ["y:2"]}) == {}
