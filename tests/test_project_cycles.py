"""No import cycles inside the packages (docs/DESIGN.md §1), lazy imports included.

The layer test keeps imports pointing down between packages; this one reads every import of
every module of ``h2o_lens``, ``runlog``, ``recorders``, ``analyses``, ``app`` and ``commands`` (at the top,
inside functions, under ``TYPE_CHECKING``, and ``importlib.import_module`` of a module path
written in the source) into one graph of modules and fails on any cycle, naming its modules and
the lines that import. A lazy import only hides a cycle from the interpreter; the modules still
depend on each other, and the order they must load in is then an accident.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("h2o_lens", "runlog", "recorders", "analyses", "app", "commands")


def modules(root: Path, files: list[str] | None = None) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (path, is a package)}`` of the modules of :data:`PACKAGES` under ``root``
    (``files``: the paths to read, relative to ``root``; default every ``.py`` file there)."""
    if files is None:
        files = [str(p.relative_to(root)) for p in root.rglob("*.py")]
    out = {}
    for f in files:
        parts = Path(f).with_suffix("").parts
        if parts[0] not in PACKAGES:
            continue
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (root / f, package)
    return out


def _repo_modules() -> dict[str, tuple[Path, bool]]:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return modules(ROOT, files)


def _known(name: str, mods: dict) -> str | None:
    """The module ``name`` refers to: itself, or the nearest package above it that exists."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _relative(module: str, package: bool, level: int, name: str | None) -> str:
    base = module if package else module.rpartition(".")[0]
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{name}" if name else base


def imports(module: str, mods: dict[str, tuple[Path, bool]]) -> set[tuple[str, int]]:
    """``{(imported module, line)}`` of ``module``, every import statement of the file counted.

    ``from pkg import name`` counts ``pkg.name`` when that is a module, else ``pkg``. A call of
    ``import_module`` counts its literal argument; when the argument is not literal (a table of
    lazy exports), every string of the file that names a submodule relatively (``".runtime"``).
    """
    path, package = mods[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[tuple[str | None, int]] = set()
    table = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(_known(a.name, mods), node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            full = _relative(module, package, node.level, node.module) if node.level else node.module or ""
            for a in node.names:
                sub = f"{full}.{a.name}"
                found.add((sub if sub in mods else _known(full, mods), node.lineno))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
                if name.startswith("."):
                    level = len(name) - len(name.lstrip("."))
                    name = _relative(module, package, level, name.lstrip(".") or None)
                found.add((_known(name, mods), node.lineno))
            else:
                table = True
    if table:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("."):
                level = len(node.value) - len(node.value.lstrip("."))
                target = _relative(module, package, level, node.value.lstrip(".") or None)
                if target in mods:
                    found.add((target, node.lineno))
    return {(m, line) for m, line in found if m is not None and m != module}


def import_graph(mods: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line}}`` over ``mods``."""
    graph: dict[str, dict[str, int]] = {}
    for module in sorted(mods):
        edges: dict[str, int] = {}
        for target, line in sorted(imports(module, mods)):
            edges.setdefault(target, line)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each as one closed path
    ``[a, b, ..., a]`` through it (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph.get(w, {}))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(_closed_path(graph, set(comp)))
    return sorted(comps)


def _closed_path(graph: dict[str, dict[str, int]], comp: set[str]) -> list[str]:
    """A shortest path from the first module of ``comp`` back to itself, inside ``comp``."""
    first = min(comp)
    came: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in comp:
                    continue
                if w == first:
                    path = [v]
                    while path[-1] != first:
                        path.append(came[path[-1]])
                    return [first, *reversed(path[:-1]), first]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no closed path in {sorted(comp)}")


def describe(graph: dict[str, dict[str, int]], path: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {path[-1]}"


def test_no_import_cycle_inside_the_packages():
    mods = _repo_modules()
    assert {m.split(".")[0] for m in mods} == set(PACKAGES) and len(mods) > 50
    graph = import_graph(mods)
    found = [describe(graph, c) for c in cycles(graph)]
    assert found == [], "import cycles:\n" + "\n".join(found)


def test_the_graph_holds_lazy_and_table_imports():
    """The graph is read from the whole source, not from the top of each file: an import inside a
    function and a lazy export table give edges."""
    graph = import_graph(_repo_modules())
    assert "h2o_lens.runtime" in graph["h2o_lens.tasks.real"]  # inside a function
    assert {"h2o_lens.runtime", "h2o_lens.config"} <= set(graph["h2o_lens"])  # __getattr__ table
    assert "recorders.lifecycle" in graph["recorders"]
    assert "h2o_lens.speculative" in graph["h2o_lens.cache"]


PLANTED = {
    "top-level": ({"a": "from . import b\n", "b": "from .a import X\n"}, ["h2o_lens.a", "h2o_lens.b"]),
    "lazy": (
        {"a": "def f():\n    from h2o_lens import b\n", "b": "import h2o_lens.a\n"},
        ["h2o_lens.a", "h2o_lens.b"],
    ),
    "three": (
        {"a": "from .b import f\n", "b": "from .c import g\n", "c": "def g():\n    from . import a\n"},
        ["h2o_lens.a", "h2o_lens.b", "h2o_lens.c"],
    ),
    "import_module": (
        {"a": "import importlib\nM = importlib.import_module('h2o_lens.b')\n", "b": "from . import a\n"},
        ["h2o_lens.a", "h2o_lens.b"],
    ),
    "export table": (
        {
            "__init__": "import importlib\n_LAZY = {'f': '.a'}\n"
            "def __getattr__(n):\n    return importlib.import_module(_LAZY[n], __name__)\n",
            "a": "from h2o_lens import other\n",
        },
        ["h2o_lens", "h2o_lens.a"],
    ),
    "none": ({"a": "from . import b\n", "b": "import os\n"}, None),
}


@pytest.mark.parametrize("kind", list(PLANTED))
def test_a_planted_cycle_is_found_and_named(tmp_path, kind):
    files, expected = PLANTED[kind]
    pkg = tmp_path / "h2o_lens"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, source in files.items():
        (pkg / f"{name}.py").write_text(source)
    graph = import_graph(modules(tmp_path))
    found = cycles(graph)
    if expected is None:
        assert found == []
        return
    ((path),) = found
    assert sorted(set(path)) == expected and path[0] == path[-1]
    text = describe(graph, path)
    assert all(m in text for m in expected) and "line" in text
