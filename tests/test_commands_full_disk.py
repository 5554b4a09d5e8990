"""A full disk is one line, a failed run with its error and no temporary file (DESIGN.md §5.1, §12.3).

On a real small filesystem (a tmpfs of a few KiB, mounted when the tests run as root; skipped
otherwise) and, everywhere, with the failure injected where the toolkit writes: a recording,
a sweep's cell and a sweep's outputs. A tiny random llama in a folder, as a user's model.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import save_tiny

from commands.cli import main
from runlog import read_manifest
from runlog import segments as segments_module

REPO = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over the lazy dog and keeps running through the field "
PROMPT = WORDS * 5 + "What does the fox do?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model") / "m")


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(kib)``: a tmpfs of ``kib`` KiB mounted under ``tmp_path`` (unmounted after)."""
    mounted = []

    def mount(kib: int) -> Path:
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a small tmpfs needs root")
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "commands.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=900
    )


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line.strip() for line in err.splitlines() if line.strip().startswith("h2o-lens: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def _temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def _record_args(tiny: Path, out: Path) -> list[str]:
    return ["record", "--model", str(tiny), "--out", str(out), "--prompt", PROMPT, "--max-new-tokens", "24",
            "--heavy", "4", "--recent", "4"]  # fmt: skip


def _assert_failed_with(out: Path, line: str) -> None:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["error_type"] == "StorageError"
    assert manifest["error"] in line  # the run says what the command said
    assert _temporaries(out) == []


@pytest.mark.slow  # more than a few seconds on an idle 2-core machine (docs/TESTING.md)
def test_record_on_a_full_disk_says_so_in_one_line_and_leaves_a_failed_run(tiny, small_disk):
    out = small_disk(12) / "runs"  # room for the manifest, not for the segments
    done = _cli(*_record_args(tiny, out), cwd=REPO)
    assert done.returncode == 2, done.stderr[-3000:]
    line = _one_error(done.stderr)
    assert "-00000.parquet: No space left on device (the file needs about " in line and " free there)" in line
    _assert_failed_with(out, line)


def test_record_with_a_write_refused_anywhere_says_so_in_one_line(tiny, tmp_path, monkeypatch, capsys):
    real = segments_module.pq.write_table

    def full(table, where, **kwargs):
        real(table, where, **kwargs)  # part of the file is written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segments_module.pq, "write_table", full)
    out = tmp_path / "runs"
    capsys.readouterr()
    assert main(_record_args(tiny, out)) == 2
    line = _one_error(capsys.readouterr().err)
    assert str(out) in line and "No space left on device (the file needs " in line
    _assert_failed_with(out, line)


def _tasks(folder: Path, n: int = 4) -> Path:
    path = folder / "tasks.jsonl"
    path.write_text(
        "".join(json.dumps({"name": f"r{i}", "prompt": WORDS * 6 + f"What is {i}?", "answer": str(i),
                            "max_new_tokens": 24}) + "\n" for i in range(n)),
        encoding="utf-8",
    )  # fmt: skip
    return path


@pytest.mark.slow  # more than a few seconds on an idle 2-core machine (docs/TESTING.md)
def test_a_sweep_cell_on_a_full_disk_is_failed_alike_in_the_summary_and_the_status(tiny, tmp_path, small_disk):
    out = small_disk(32) / "sweep"  # the plan and a cell's manifest fit, its eviction log does not
    done = _cli("sweep", "--tasks", str(_tasks(tmp_path)), "--model", str(tiny), "--out", str(out),
                "--policies", "h2o", "--ratios", "0.1", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "1 cells failed" in done.stdout, done.stdout
    status = _cli("sweep", "--status", str(out), cwd=tmp_path)
    assert status.stdout.splitlines()[-1] == "total: 1 cells: 0 done, 1 failed, 0 running, 0 to do", status.stdout
    (line,) = [x for x in status.stdout.splitlines() if x.strip().startswith("failed cell-")]
    assert "StorageError: cannot write" in line and "No space left on device" in line
    assert _temporaries(out) == []


@pytest.mark.slow  # more than a few seconds on an idle 2-core machine (docs/TESTING.md)
def test_sweep_outputs_on_a_full_disk_are_one_line_and_no_temporary_file(tiny, tmp_path, small_disk):
    out = small_disk(1024) / "sweep"  # the cells fit; the curves' page (plotly inlined, ~5 MB) does not
    done = _cli("sweep", "--tasks", str(_tasks(tmp_path, 2)), "--model", str(tiny), "--out", str(out),
                "--policies", "h2o", "--ratios", "0.5", "--no-replay", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    line = _one_error(done.stderr)
    assert f"cannot write {out / 'sweep.html'}: No space left on device (the file needs about " in line
    assert _temporaries(out) == [] and not (out / "sweep.html").exists()


def test_sweep_outputs_with_a_refused_rename_leave_no_temporary_file(tmp_path, monkeypatch):
    import pandas as pd

    from commands.jobs import write_sweep_outputs
    from runlog import StorageError

    table = pd.DataFrame({"policy": ["h2o-sum"], "keep_ratio": [0.5], "accuracy": [1.0]})
    table.attrs.update(policy_of={"h2o-sum": "h2o"}, x="keep_ratio")
    real = os.replace

    def refuse(src, dst, *args, **kwargs):
        if str(dst).endswith("sweep.csv"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(StorageError, match=r"cannot write .*sweep\.csv: No space left on device"):
        write_sweep_outputs(tmp_path, table, 16)
    assert _temporaries(tmp_path) == []
