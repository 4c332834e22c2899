"""The code stays in pieces a reader can hold: no module over 500 lines and no function or method over 60 lines
(its ``def`` to its last line, docstring included) in the Python of ``operator/`` (every package), ``benchmarks/``
and ``hack/``; and no import cycle among the modules under ``operator/``.

What is over a limit today is named in ``LONG_MODULES`` and ``LONG_FUNCTIONS``, each with why. An entry that no
longer applies (the file is gone, or back within the limit) fails the test too, so the lists only shrink: whoever
splits a listed file removes its entries.

Read with ``ast`` (nothing is imported). The import graph has an edge for every ``import`` / ``from ... import``
statement that names a module under ``operator/``, at module level and inside functions alike:
``from pkg.sub import name`` is an edge to ``pkg.sub.name`` where that is a submodule, else to ``pkg.sub``; a
package's ``__init__`` is the package's own node."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "operator"
CHECKED = ("operator", "benchmarks", "hack")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

_SCRIPT = ("a GPU learning run or a TRL or veRL peer as one function (arguments, runs, result file); it runs "
           "only on a GPU or beside TRL, which nothing here can run to check a split")
_HARNESS = ("the local cluster harness that every cluster tier and benchmark starts through; not split yet (a "
            "change of its own, tested by the cluster tiers)")
_STAGER = "stages GPU wheels from a package index, which no test here reaches; not split yet"

#: Modules over ``MAX_MODULE_LINES``, repository-relative, with why.
LONG_MODULES: dict[str, str] = {
    "hack/localcluster.py": _HARNESS,
    "hack/realnodes.py": _HARNESS,
}
#: Functions over ``MAX_FUNCTION_LINES``, as ``path::qualified name``, with why.
LONG_FUNCTIONS: dict[str, str] = {
    "benchmarks/gpu_learning.py::main": _SCRIPT,
    "benchmarks/trl_learning_run.py::main": _SCRIPT,
    "benchmarks/trl_peer.py::main": _SCRIPT,
    "hack/demo.py::main": "the demo's narrated steps in order, one screen each; it runs only on real nodes",
    "hack/gpu-stage.py::main": _STAGER,
    "hack/localcluster.py::Cluster.up": _HARNESS,
    "hack/localcluster.py::Cluster.install_kueue": _HARNESS,
}


def _files() -> list[Path]:
    """Every ``.py`` file under the checked folders."""
    return sorted(p for top in CHECKED for p in (REPO / top).rglob("*.py"))


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, every ``.py`` of a package under ``operator/`` (a package is its ``__init__``)."""
    out: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


FILES = _files()
MODULES = _modules()


def _rel(path: Path, base: Path = REPO) -> str:
    return str(path.relative_to(base))


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


def _long_modules(files: list[Path], base: Path = REPO) -> dict[str, int]:
    """``path`` (relative to ``base``) -> lines, for the files over ``MAX_MODULE_LINES``."""
    sizes = {_rel(p, base): len(p.read_text().splitlines()) for p in files}
    return {k: n for k, n in sizes.items() if n > MAX_MODULE_LINES}


def _long_functions(files: list[Path], base: Path = REPO) -> dict[str, tuple[int, int]]:
    """``path::qualified name`` (the path relative to ``base``) -> (first line, lines), for the functions over
    ``MAX_FUNCTION_LINES``."""
    out = {}
    for path in files:
        for name, fn in _functions(_tree(path)):
            n = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out[f"{_rel(path, base)}::{name}"] = (fn.lineno, n)
    return out


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


def test_every_part_of_the_house_is_found() -> None:
    packages = {m.split(".")[0] for m in MODULES}
    assert {"rlhf_api", "rlhf_operator", "rlhf_runtime", "rlhf_testing"} <= packages, sorted(packages)
    tops = {_rel(p).split("/")[0] for p in FILES}
    assert tops == set(CHECKED), tops
    assert len(MODULES) > 50 and len(FILES) > len(MODULES), (len(MODULES), len(FILES))


def test_no_module_over_500_lines() -> None:
    long = [f"{k}: {n} lines" for k, n in _long_modules(FILES).items() if k not in LONG_MODULES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_60_lines() -> None:
    long = [f"{k.split('::')[0]}:{line} {k.split('::')[1]}: {n} lines"
            for k, (line, n) in _long_functions(FILES).items() if k not in LONG_FUNCTIONS]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_allow_lists_name_only_what_is_over_a_limit_and_say_why() -> None:
    stale = sorted(set(LONG_MODULES) - set(_long_modules(FILES)))
    stale += sorted(set(LONG_FUNCTIONS) - set(_long_functions(FILES)))
    assert not stale, "within the limits now (or gone): remove from the allow-list:\n" + "\n".join(stale)
    assert all(len(why) > 20 for why in [*LONG_MODULES.values(), *LONG_FUNCTIONS.values()])
    assert not [k for k in LONG_MODULES if k.startswith("operator/rlhf_runtime/")], "the runtime has no exceptions"


def test_no_import_cycle() -> None:
    graph = {m: _imported(m, p) for m, p in MODULES.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles among the modules under operator/:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_what_they_check(tmp_path: Path) -> None:
    """The helpers themselves: nested functions and methods by their qualified names, from ``def`` (decorators
    aside) to the last line; a module and a function one line over their limits, and none at them, by the keys the
    allow-lists use; a cycle through a submodule named by ``from pkg import name``."""
    src = tmp_path / "m.py"
    src.write_text("class C:\n    @staticmethod\n    def f():\n        '''doc'''\n\n        def g():\n            pass\n"
                   "        return g\n")
    found = {name: (fn.lineno, fn.end_lineno) for name, fn in _functions(_tree(src))}
    assert found == {"C.f": (3, 8), "C.f.g": (6, 7)}
    (tmp_path / "pkg").mkdir()
    at_limit, over = tmp_path / "pkg" / "at.py", tmp_path / "pkg" / "over.py"
    at_limit.write_text("def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1) + "\n" * (MAX_MODULE_LINES - 60))
    over.write_text("class K:\n    def f(self):\n" + "        x = 1\n" * MAX_FUNCTION_LINES
                    + "\n" * (MAX_MODULE_LINES - 61))
    assert _long_functions([at_limit, over], tmp_path) == {"pkg/over.py::K.f": (2, MAX_FUNCTION_LINES + 1)}
    assert _long_modules([at_limit, over], tmp_path) == {"pkg/over.py": MAX_MODULE_LINES + 1}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    files = {m: tmp_path / f"{m}.py" for m in ("r", "r.p", "r.p.s", "r.q")}
    files["r.p"].write_text("from r.p.s import x\n")  # the package __init__ imports its submodule
    files["r.p.s"].write_text("def f():\n    from r import q\n")  # inside a function, a submodule by name
    files["r.q"].write_text("import os\nfrom r.p import s, thing\n")  # a submodule and the package itself
    files["r"].write_text("")
    graph = {m: _imported(m, files[m], files) for m in files}
    assert graph == {"r": set(), "r.p": {"r.p.s"}, "r.q": {"r.p", "r.p.s"}, "r.p.s": {"r.q"}}
    assert _cycles(graph) == [["r.p", "r.p.s", "r.q", "r.p"]]
