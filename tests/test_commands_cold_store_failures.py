"""A disk cold store that fails: killed mid-write, or on a full disk (DESIGN.md §2.13, §5.1).

A run whose store was cut short never reads as complete: a ``record --cold disk:...`` killed with
SIGKILL while its store is being written is ``interrupted`` (``runs.status``), and its store's
files stay in the run's folder, not in a stray temporary one. A full disk under the store (a real
small tmpfs when the tests run as root, else the failure injected at the store's allocation) is one
``h2o-lens: error:`` line, exit 2, and a run marked ``failed`` with a ``StorageError``.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_commands_full_disk import small_disk  # noqa: F401 (a fixture)
from tiny import save_tiny

from commands.cli import main
from h2o_lens import cold_store
from runlog import open_runs, read_manifest
from runlog.manifest import effective_status

REPO = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over the lazy dog and keeps running through the field "
PROMPT = WORDS * 4 + "What does the fox do?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model") / "m")


def _args(tiny: Path, out: Path, new_tokens: int, cold: str = "disk:4") -> list[str]:
    return ["record", "--model", str(tiny), "--out", str(out), "--prompt", PROMPT, "--max-new-tokens", str(new_tokens),
            "--heavy", "8", "--recent", "8", "--cold", cold]  # fmt: skip


def _run_dir(out: Path) -> Path:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    assert err.count("h2o-lens: error:") == 1, err[-3000:]  # it may follow a progress bar's last frame
    return "h2o-lens: error:" + err.split("h2o-lens: error:")[1].split("\n")[0]


def _runs_row(out: Path) -> tuple:
    con = open_runs(out)
    return con.execute("SELECT status, integrity FROM runs").fetchone()


def test_a_disk_store_killed_mid_write_leaves_the_run_interrupted_never_complete(tiny, tmp_path):
    out = tmp_path / "runs"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "commands.cli", *_args(tiny, out, 900)]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob("*/cold/*.bin")):  # the store is being written, in the run's folder
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the disk store never appeared"
            time.sleep(0.05)
        assert _runs_row(out) == ("running", "ok")  # a live recording's store is not cut short
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    run_dir = _run_dir(out)
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "running" and effective_status(manifest) == "interrupted"
    assert "cold" not in manifest  # the tier's totals are written at the end only
    assert list((run_dir / "cold").glob("*.bin"))  # what was cut short stays with its run
    status, integrity = _runs_row(out)
    assert status == "interrupted" and integrity == "cold store cut short"


def test_a_complete_disk_store_run_removes_its_store(tiny, tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(_args(tiny, out, 6)) == 0, capsys.readouterr().err
    run_dir = _run_dir(out)
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "complete" and manifest["cold"]["bytes_written"] > 0
    assert manifest["config"]["cold"]["directory"] is None  # explain's re-runs write their own store
    assert not (run_dir / "cold").exists()
    assert _runs_row(out) == ("complete", "ok")


def _assert_failed(out: Path, line: str) -> None:
    run_dir = _run_dir(out)
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["error_type"] == "StorageError", manifest
    assert manifest["error"] in line
    assert not (run_dir / "cold").exists()
    status, _integrity = _runs_row(out)
    assert status == "failed"


def test_a_full_disk_under_the_store_is_one_line_and_a_failed_run(tiny, tmp_path, monkeypatch, capsys):
    real = os.posix_fallocate
    calls = []

    def full(fd, offset, length):
        calls.append(length)
        if len(calls) > 1:  # the first layer's store fits, the second's does not
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(cold_store.os, "posix_fallocate", full)
    out = tmp_path / "runs"
    capsys.readouterr()
    assert main(_args(tiny, out, 24)) == 2
    line = _one_error(capsys.readouterr().err)
    assert "cold-L" in line and ".bin: No space left on device (the file needs more space;" in line, line
    _assert_failed(out, line)


@pytest.mark.slow  # a subprocess on a mounted tmpfs (docs/TESTING.md)
def test_a_store_on_a_real_full_disk_is_one_line_and_a_failed_run(tiny, small_disk):  # noqa: F811
    out = small_disk(160) / "runs"  # the manifest and the first segments fit, the store's growth does not
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "commands.cli", *_args(tiny, out, 400, "disk:8")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=900)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    line = _one_error(done.stderr)
    assert "No space left on device" in line, line
    _assert_failed(out, line)
