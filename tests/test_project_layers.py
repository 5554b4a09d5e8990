"""The dependency direction of the packages (docs/DESIGN.md §1), read from the source.

``commands → app → analyses → runlog → h2o_lens``, and ``recorders → runlog``
beside ``analyses``: a module may import its own layer and the layers below it,
never one above, lazily (inside a function) or not, and never by a module path
in a string (``importlib.import_module``). ``analyses`` and ``recorders`` are
siblings over ``runlog``: neither imports the other (the analyses and the
dashboard read logs through ``runlog`` alone, never the model drivers; the
drivers never read a measure). Only ``commands`` may import from every layer,
and ``runlog`` never imports torch or transformers.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: rank of each top-level package; a module may import packages of rank <= its own, except a sibling's
LAYERS = {"h2o_lens": 0, "runlog": 1, "recorders": 2, "analyses": 2, "app": 3, "commands": 4}
#: packages of one rank that never import each other (nor does ``app`` import ``recorders``)
SIBLINGS = {"analyses": {"recorders"}, "recorders": {"analyses"}, "app": {"recorders"}}
_MODULE_PATH = re.compile(r"^({})(\.[A-Za-z_][A-Za-z0-9_]*)*$".format("|".join(LAYERS)))


def _modules() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / p for p in out if p.split("/")[0] in LAYERS]


def _package(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level package)`` of every import in ``path``, module paths in strings included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    own = _package(path)
    docs = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: stays inside the own package
                found.append((node.lineno, own))
            elif node.module:
                found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if _MODULE_PATH.match(node.value) and "." in node.value:
                found.append((node.lineno, node.value.split(".")[0]))
    return [(line, pkg) for line, pkg in found if pkg in LAYERS]


def upward_imports(paths: list[Path]) -> list[str]:
    bad = []
    for path in paths:
        rank = LAYERS[_package(path)]
        for line, pkg in imported_packages(path):
            if LAYERS[pkg] > rank:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {pkg} (layer {LAYERS[pkg]} > {rank})")
    return bad


def sibling_imports(paths: list[Path]) -> list[str]:
    """Imports between ``analyses`` and ``recorders`` (either way), and of ``recorders`` by ``app``."""
    return [
        f"{path.relative_to(ROOT)}:{line} imports {pkg}, a sibling of {_package(path)}"
        for path in paths
        for line, pkg in imported_packages(path)
        if pkg in SIBLINGS.get(_package(path), ())
    ]


def test_no_module_imports_a_layer_above_its_own():
    paths = _modules()
    assert len(paths) > 50, "the module list is suspiciously short"
    assert upward_imports(paths) == []


def test_analyses_and_recorders_are_siblings_neither_imports_the_other():
    paths = _modules()
    assert {"analyses", "recorders", "app"} <= {_package(p) for p in paths}
    assert sibling_imports(paths) == []


@pytest.mark.parametrize(
    "package, source, bad",
    [
        ("recorders", "def f():\n    from analyses import connect\n", True),
        ("analyses", "from recorders.counterfactual import explain_request\n", True),
        ("app", "import importlib\nimportlib.import_module('recorders.replay')\n", True),
        ("analyses", "from runlog import load_run\n", False),
        ("recorders", "from runlog import load_run\n", False),
    ],
)
def test_the_checker_sees_a_sibling_import_either_way(tmp_path, package, source, bad):
    pkg = tmp_path / package
    pkg.mkdir()
    mod = pkg / "planted.py"
    mod.write_text(source)
    globals()["ROOT"], saved = tmp_path, ROOT
    try:
        assert bool(sibling_imports([mod])) == bad
        assert upward_imports([mod]) == []  # one rank: only the sibling rule sees it
    finally:
        globals()["ROOT"] = saved


def _torch_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    heavy = ("torch", "transformers", "triton")
    return [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] in heavy]


def test_runlog_never_imports_torch():
    paths = [p for p in _modules() if _package(p) == "runlog"]
    assert len(paths) >= 10
    assert [bad for p in paths for bad in _torch_imports(p)] == []
    # nor through a module of the runtime: every runlog module imported, torch stays unloaded
    names = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in paths)
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted({'torch', 'transformers', 'triton'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_commands_is_the_only_layer_that_reaches_every_other():
    reached = {pkg for path in _modules() if _package(path) == "commands" for _, pkg in imported_packages(path)}
    assert reached == set(LAYERS), f"commands reaches {sorted(reached)}"


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import recorders\n", ["recorders"]),
        ("def f():\n    from analyses import connect\n", ["analyses"]),
        ("import importlib\nimportlib.import_module('app.launch')\n", ["app"]),
        ("X = {'record': 'recorders.recorder'}\n", ["recorders"]),
        ('"""Mentions recorders.recorder in prose."""\nfrom .config import H2OConfig\n', ["h2o_lens"]),
    ],
)
def test_the_checker_sees_every_kind_of_import(tmp_path, source, expected):
    pkg = tmp_path / "h2o_lens"
    pkg.mkdir()
    mod = pkg / "planted.py"
    mod.write_text(source)
    globals()["ROOT"], saved = tmp_path, ROOT
    try:
        assert [p for _, p in imported_packages(mod)] == expected
        assert bool(upward_imports([mod])) == (expected != ["h2o_lens"])
    finally:
        globals()["ROOT"] = saved
