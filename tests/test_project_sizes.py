"""Every module a newcomer reads in one sitting: no module over 800 lines and no function over
100 lines, outside the Triton kernels (``h2o_lens/kernels/``), whose launchers and ``@triton.jit``
bodies keep their one-file shape (DESIGN.md §1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("h2o_lens", "runlog", "recorders", "analyses", "app", "commands")
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100


def _modules() -> list[Path]:
    found = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return [p for p in found if "kernels" not in p.relative_to(ROOT).parts]


def _long_functions(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_the_walk_sees_the_packages():
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert {"h2o_lens/cache.py", "recorders/replay.py", "commands/cli.py"} <= names
    assert not any(n.startswith("h2o_lens/kernels/") for n in names)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_size(path: Path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_MODULE_LINES})"


def test_function_sizes():
    long = [f for p in _modules() for f in _long_functions(p)]
    assert not long, "functions over 100 lines:\n" + "\n".join(long)


def test_the_measure_counts_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "probe.py"
    path.write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n", encoding="utf-8")
    assert _long_functions(path, tmp_path) == [f"probe.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]
