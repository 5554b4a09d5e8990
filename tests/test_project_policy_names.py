"""One home per rule: only the registry (h2o_lens/policies/) switches on policy names (DESIGN.md §2.9).

Everything else reads a policy's attributes (``evicts``, ``scored``, ``kernels``, ``split`` ...)
from :func:`h2o_lens.policies.get`. The test reads the source of every layer and fails on a
comparison with a policy name (``policy == "full"``, ``name in ("h2o", "heavy")``) and on a
literal list made only of policy names (a hand-kept copy of part of the registry; a list of
column names such as ``("heavy", "recent", "sink")`` is not one).
"""

from __future__ import annotations

import ast
from pathlib import Path

from h2o_lens import policies

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("h2o_lens", "runlog", "recorders", "analyses", "app", "commands")
#: comparisons with a word that is a policy name but means something else there: (file, word)
NOT_POLICIES = {("h2o_lens/kernels/aot.py", "full")}


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def policy_name_switches(root: Path) -> list[str]:
    """``path:line: code`` of every comparison with a policy name and every literal list of
    two or more strings that are all policy names, outside the registry."""
    names = set(policies.names())
    found = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith("h2o_lens/policies/"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Compare):
                    words = {w for side in (node.left, *node.comparators) for w in _strings(side)} & names
                    if {(rel, w) for w in words} - NOT_POLICIES:
                        found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
                elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    words = _strings(node)
                    if len(words) == len(node.elts) >= 2 and set(words) <= names:
                        found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_registry_switches_on_policy_names():
    found = policy_name_switches(REPO)
    assert not found, (
        "policy names are switched on outside h2o_lens/policies/; read the policy's "
        "attributes from h2o_lens.policies.get(name) instead:\n" + "\n".join(found)
    )


def test_the_scan_finds_a_switch(tmp_path):
    """The scan is not blind: a hand-written switch and a copied list are both reported."""
    (tmp_path / "h2o_lens").mkdir()
    (tmp_path / "h2o_lens" / "bad.py").write_text(
        "def f(config):\n    return config.policy == 'full'\n\nSCORED = ('h2o', 'heavy')\n"
    )
    (tmp_path / "h2o_lens" / "policies").mkdir()
    (tmp_path / "h2o_lens" / "policies" / "ok.py").write_text("X = 'h2o' == 'h2o'\n")
    assert sorted(policy_name_switches(tmp_path)) == [
        "h2o_lens/bad.py:2: config.policy == 'full'",
        "h2o_lens/bad.py:4: ('h2o', 'heavy')",
    ]
