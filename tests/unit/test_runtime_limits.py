"""The runtime stays in pieces a reader can hold: no module over 500 lines, no function or method over 60 lines
(its ``def`` to its last line, docstring included), and no import cycle among ``rlhf_runtime``'s modules.

Read with ``ast`` (nothing is imported). The import graph has an edge for every ``import`` / ``from ... import``
statement that names an ``rlhf_runtime`` module, at module level and inside functions alike:
``from rlhf_runtime.pkg import name`` is an edge to ``rlhf_runtime.pkg.name`` where that is a submodule, else to
``rlhf_runtime.pkg``; a package's ``__init__`` is the package's own node."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "operator"
PACKAGE = ROOT / "rlhf_runtime"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, every ``.py`` under ``operator/rlhf_runtime`` (a package is its ``__init__``)."""
    out: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method under ``node``, nested ones too, with its qualified name (``Class.method``,
    ``outer.inner``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + child.name, child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def _imported(module: str, path: Path, modules: dict[str, Path] = MODULES) -> set[str]:
    """The modules of ``modules`` that ``module`` imports anywhere in its file (itself left out)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    out.add(f"{base}.{a.name}")  # a submodule
                elif base in modules:
                    out.add(base)
    out.discard(module)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan), in import order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(c), c[0]) for c in sorted(components)]


def _cycle_in(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest import path from ``start`` back to itself inside ``component`` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no cycle of its component")  # pragma: no cover


def test_the_package_is_found() -> None:
    assert "rlhf_runtime" in MODULES and len(MODULES) > 10, sorted(MODULES)


def test_no_module_over_500_lines() -> None:
    long = [f"{_rel(p)}: {n} lines" for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_60_lines() -> None:
    long = []
    for path in MODULES.values():
        for name, fn in _functions(_tree(path)):
            n = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if n > MAX_FUNCTION_LINES:
                long.append(f"{_rel(path)}:{fn.lineno} {name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_no_import_cycle() -> None:
    graph = {m: _imported(m, p) for m, p in MODULES.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles among rlhf_runtime modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_what_they_check(tmp_path: Path) -> None:
    """The helpers themselves: nested functions and methods by their qualified names, from ``def`` (decorators
    aside) to the last line; a cycle through a submodule named by ``from pkg import name``."""
    src = tmp_path / "m.py"
    src.write_text("class C:\n    @staticmethod\n    def f():\n        '''doc'''\n\n        def g():\n            pass\n"
                   "        return g\n")
    found = {name: (fn.lineno, fn.end_lineno) for name, fn in _functions(_tree(src))}
    assert found == {"C.f": (3, 8), "C.f.g": (6, 7)}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    files = {m: tmp_path / f"{m}.py" for m in ("r", "r.p", "r.p.s", "r.q")}
    files["r.p"].write_text("from r.p.s import x\n")  # the package __init__ imports its submodule
    files["r.p.s"].write_text("def f():\n    from r import q\n")  # inside a function, a submodule by name
    files["r.q"].write_text("import os\nfrom r.p import s, thing\n")  # a submodule and the package itself
    files["r"].write_text("")
    graph = {m: _imported(m, files[m], files) for m in files}
    assert graph == {"r": set(), "r.p": {"r.p.s"}, "r.p.s": {"r.q"}, "r.q": {"r.p", "r.p.s"}}
    assert _cycles(graph) == [["r.p", "r.p.s", "r.q", "r.p"]]
