"""Lint and format are part of the tests: ruff, configured in pyproject.toml, over the whole tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    if (
        shutil.which("ruff") is None
        and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0
    ):
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check_finds_nothing():
    res = _ruff("check", "--no-cache", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    res = _ruff("format", "--check", "--no-cache", ".")
    assert res.returncode == 0, "run `ruff format .`:\n" + res.stdout + res.stderr


def test_the_linter_catches_a_planted_finding(tmp_path):
    bad = tmp_path / "planted.py"
    bad.write_text("import os\n")
    res = _ruff("check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad))
    assert res.returncode == 1 and "F401" in res.stdout
