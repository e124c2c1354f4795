"""The import graph of ``softorder``, read from the sources with :mod:`ast` (nothing is imported).

The layering rules (issue 16's whiteboard):

* no cycles among module-level imports;
* ``softorder/core`` (the kernels) imports nothing of softorder outside ``softorder/core``, at
  module level or inside a function;
* the NumPy API (``softorder``, ``operations``, the ``_engine`` modules
  and everything they import at module level) imports no torch and no jax at
  module level;
* nothing outside ``softorder/baselines`` imports ``softorder.baselines`` at module level;
* the bridges (``softorder/bridges``, :mod:`softorder.dask`) import no private
  (underscore-prefixed) name of ``softorder._engine`` and read no private attribute of what
  they import from it: the engine's public functions take shapes and values, so a bridge
  needs no stand-ins;
* the bridges import nothing of ``softorder/core`` but ``softorder.core`` itself (for
  :func:`softorder.core.set_parallel`: the thread policy next to a framework's own threads);
  the kernels reach them through the engine. The exception is the JAX FFI handlers
  (``softorder/bridges/_jax_ffi.py``), which compile the CPU kernels into C functions.

An import inside a function runs only when the function is called (the bridges load optional
parts that way), so it is listed but only the core rule applies to it. Imports under
``if TYPE_CHECKING:`` never run and are ignored. As in import-linter, ``from a.b import c``
is an edge to ``a.b.c`` when that is a module and to ``a.b`` otherwise; the parent packages
that Python initialises on the way are not edges (every module would otherwise depend on
``softorder/__init__.py``).

Print the graph (both kinds of edge) with ``python tests/test_imports.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "softorder"

#: The modules of the NumPy API: no torch, no jax at module level, transitively.
NUMPY_API = (
    "softorder",
    "softorder.operations",
    "softorder._engine.autodiff",
    "softorder._engine.rules",
    "softorder._engine.layout",
    "softorder._engine.backend",
    "softorder._engine.backends.protocol",
    "softorder._engine.call",
    "softorder._engine.checks",
)

#: The adapters of frameworks: the PyTorch and JAX bridges and the dask wrapper.
BRIDGES = ("softorder.bridges", "softorder.dask")
#: Bridges that compile kernels themselves (XLA FFI handlers from the CPU kernels).
KERNEL_BRIDGES = ("softorder.bridges._jax_ffi",)


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str
    target: str  # a softorder module, or the top-level name of another package
    module_level: bool
    line: int

    def __str__(self) -> str:
        kind = "module level" if self.module_level else "in a function"
        return f"{self.source} -> {self.target} ({kind}, line {self.line})"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    """Every module of the package, by dotted name."""
    return {module_name(p): p for p in sorted(package.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """``(node, module_level)`` for each import statement that can run."""

    def walk(node, module_level):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, module_level
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    yield from walk(ast.Module(body=[other], type_ignores=[]), module_level)
            else:
                yield from walk(child, module_level)

    yield from walk(tree, True)


def _resolve(name: str, known: dict) -> str:
    """A softorder module (the longest known prefix) or the top-level name of a package."""
    if name.split(".")[0] != "softorder":
        return name.split(".")[0]
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts)


def edges(known: dict[str, pathlib.Path] | None = None) -> list[Edge]:
    """Every import of every module in ``known`` (default: the package)."""
    known = modules() if known is None else known
    found = []
    for source, path in known.items():
        is_package = path.name == "__init__.py"
        for node, module_level in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package holding ``source``
                    anchor = source.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                    for alias in node.names
                ]
            for target in dict.fromkeys(_resolve(t, known) for t in targets):
                if target != source:
                    found.append(Edge(source, target, module_level, node.lineno))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _internal_graph(found: list[Edge], module_level_only: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in found:
        if e.target.startswith("softorder") and (e.module_level or not module_level_only):
            graph.setdefault(e.source, set()).add(e.target)
    return graph


def _chain(found: list[Edge], start: str, bad: set[str]) -> list[str] | None:
    """A path of module-level imports from ``start`` to a package in ``bad``, or ``None``."""
    graph: dict[str, list[str]] = {}
    for e in found:
        if e.module_level:
            graph.setdefault(e.source, []).append(e.target)
    seen, queue = {start: [start]}, [start]
    while queue:
        v = queue.pop(0)
        for w in graph.get(v, ()):
            if w in bad:
                return [*seen[v], w]
            if w.startswith("softorder") and w not in seen:
                seen[w] = [*seen[v], w]
                queue.append(w)
    return None


# --------------------------------------------------------------------------------------------

EDGES = edges()


def test_the_walker_sees_both_kinds_of_import():
    listed = {(e.source, e.target, e.module_level) for e in EDGES}
    assert ("softorder._engine.layout", "softorder._engine.backend", True) in listed
    assert any(
        e.source.startswith("softorder.core.") and e.target.startswith("softorder.core.")
        for e in EDGES
        if e.module_level
    )
    assert ("softorder.bridges.torch", "torch", True) in listed
    # the PyTorch bridge loads the baselines only when a baseline method is asked for
    assert ("softorder.bridges.torch", "softorder.baselines", False) in listed
    assert len(modules()) > 30


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_cycles_among_module_level_imports():
    found = cycles(_internal_graph(EDGES, module_level_only=True))
    assert not found, f"module-level import cycles: {found}"


#: Cycles that close only through imports inside functions: each side loads the other only
#: when called. ``TopKCrossEntropyLoss(method="neuralsort")`` of the PyTorch bridge calls the
#: baselines, whose ``method="lapsum"`` calls the bridge.
KNOWN_CALL_TIME_CYCLES = [
    ["softorder.baselines", "softorder.baselines.api", "softorder.bridges.torch"]
]


def _is_ancestor(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def test_no_new_cycles_through_imports_in_functions():
    """Listed, not forbidden: a new one must be added above with its reason. A module that
    imports its own parent package inside a function (the public facade, e.g. to call the
    API it helps to build) closes no layering cycle and is left out.
    """
    lazy = [e for e in EDGES if e.module_level or not _is_ancestor(e.target, e.source)]
    found = cycles(_internal_graph(lazy, module_level_only=False))
    new = [c for c in found if c not in KNOWN_CALL_TIME_CYCLES]
    assert not new, f"import cycles (through imports inside functions): {new}"


def test_core_imports_nothing_above_it():
    upward = [
        str(e)
        for e in EDGES
        if e.source.startswith("softorder.core")
        and e.target.startswith("softorder")
        and not (e.target == "softorder.core" or e.target.startswith("softorder.core."))
    ]
    assert not upward, "softorder/core imports from above it:\n" + "\n".join(upward)


def test_numpy_api_imports_no_torch_and_no_jax():
    chains = [_chain(EDGES, m, {"torch", "jax", "jaxlib"}) for m in NUMPY_API]
    chains = [" -> ".join(c) for c in chains if c]
    assert not chains, "module-level imports of torch/jax from the NumPy API:\n" + "\n".join(chains)


def test_only_baselines_import_baselines_at_module_level():
    offending = [
        str(e)
        for e in EDGES
        if e.module_level
        and (e.target == "softorder.baselines" or e.target.startswith("softorder.baselines."))
        and not (e.source == "softorder.baselines" or e.source.startswith("softorder.baselines."))
    ]
    assert not offending, "\n".join(offending)


def _is_bridge(module: str) -> bool:
    return any(module == b or module.startswith(b + ".") for b in BRIDGES)


def _private_engine_uses(path: pathlib.Path) -> list[str]:
    """Private names of ``softorder._engine`` that the module at ``path`` imports, and private
    attributes it reads of what it imported from there.
    """
    tree = ast.parse(path.read_text(), str(path))
    found, bound = [], set()
    for node, _ in _imports(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("softorder._engine"):
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                inner = alias.name.split(".")[2:]  # below softorder._engine
                if alias.name.startswith("softorder._engine") and any(
                    part.startswith("_") for part in inner
                ):
                    found.append(f"line {node.lineno}: import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_bridges_use_only_public_names_of_the_engine():
    known = modules()
    bridges = [m for m in known if _is_bridge(m)]
    assert "softorder.bridges.jax" in bridges and "softorder.bridges.torch" in bridges
    found = [f"{m}: {use}" for m in bridges for use in _private_engine_uses(known[m])]
    assert not found, "private engine names used by the bridges:\n" + "\n".join(found)


def test_private_engine_uses_are_found(tmp_path):
    source = (
        "from softorder._engine.rules import _labels_in_rows, check_p_k\n"
        "from softorder._engine import layout\n"
        "def f():\n"
        "    import softorder._engine._secret\n"
        "    return layout._positions, layout.Layout\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    found = _private_engine_uses(path)
    assert [use.split(": ")[1] for use in found] == [
        "from softorder._engine.rules import _labels_in_rows",
        "import softorder._engine._secret",
        "layout._positions",
    ]


def test_bridges_reach_the_kernels_through_the_engine():
    offending = [
        str(e)
        for e in EDGES
        if _is_bridge(e.source)
        and e.source not in KERNEL_BRIDGES
        and e.target.startswith("softorder.core")
        and e.target != "softorder.core"
    ]
    assert not offending, "bridges importing kernels directly:\n" + "\n".join(offending)


def main() -> None:
    """Print every import of softorder by softorder, module-level ones first."""
    internal = [e for e in EDGES if e.target.startswith("softorder")]
    for module_level in (True, False):
        print("# module level" if module_level else "\n# inside functions")
        for e in sorted(internal, key=lambda e: (e.source, e.target)):
            if e.module_level == module_level:
                print(f"{e.source} -> {e.target}")
    for module_level_only in (True, False):
        found = cycles(_internal_graph(EDGES, module_level_only))
        label = "module-level" if module_level_only else "all"
        print(f"\n# cycles ({label} imports): {found or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
