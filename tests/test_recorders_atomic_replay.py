"""A replay switches the run to its tables in one manifest rename (DESIGN.md §6.1): a failure or a
kill at any point leaves the earlier replay, or none, never a mix, and nothing half-written.

A tiny random llama saved in a folder records two requests; the failures are injected where the
replay writes (``pq.write_table`` of a segment, the manifest's rename).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from tiny import save_tiny

import recorders
from h2o_lens import H2OConfig
from h2o_lens.models import load_model
from recorders.replay import replay
from runlog import StorageError, open_runs, read_manifest, replay_complete
from runlog import segments as segments_module

REPO = Path(__file__).resolve().parents[1]


class _Killed(BaseException):
    """The process ends here: no cleanup code runs (as under SIGKILL)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = save_tiny(tmp_path_factory.mktemp("model") / "m")
    return load_model(folder, progress=False)


def _record(model, root, *, replayed: bool = True):
    model, tok = model
    enc = tok(
        ["the lab code is 4419 and the cable goes to port 7", "say something"],
        return_tensors="pt",
        padding=True,
        return_token_type_ids=False,
    )
    with (
        torch.no_grad(),
        recorders.record(model, H2OConfig(heavy=4, recent=4), out=root, tokenizer=tok, fsync=False) as rec,
    ):
        model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if replayed:
        replay(rec.run_dir, model=model, progress=False)
    return rec.run_dir


def _state(root, run_dir):
    """What a reader sees of the run: its files, its manifest's replay, its KL rows and integrity."""
    con = open_runs(root, warn=False)
    kl = con.execute("SELECT request, step, kl FROM replay_steps ORDER BY ALL").fetchall()
    (integrity,) = con.execute("SELECT integrity FROM runs").fetchone()
    manifest = read_manifest(run_dir)
    return {
        "files": sorted(p.name for p in run_dir.iterdir()),
        "replay": manifest.get("replay"),
        "segments": manifest.get("segments"),
        "kl": kl,
        "integrity": integrity,
    }


def _fail_at(monkeypatch, table: str, error: BaseException):
    """Make writing the first segment of ``table`` leave half a file, then raise ``error``."""
    real = segments_module.pq.write_table

    def write_table(data, where, **kwargs):
        real(data, where, **kwargs)
        if str(where).rsplit("/", 1)[-1].startswith(f"{table}-"):
            raw = open(where, "rb").read()
            open(where, "wb").write(raw[: len(raw) // 2])
            raise error

    monkeypatch.setattr(segments_module.pq, "write_table", write_table)


def test_a_full_disk_at_the_oracle_segment_leaves_the_previous_replay(model, tmp_path, monkeypatch):
    run_dir = _record(model, tmp_path)
    before = _state(tmp_path, run_dir)
    assert before["kl"] and before["integrity"] == "ok"
    _fail_at(monkeypatch, "oracle", OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(StorageError, match=r"cannot write .*oracle-00000\.\w+\.parquet: No space left on device"):
        replay(run_dir, model=model[0], progress=False)
    monkeypatch.undo()
    assert _state(tmp_path, run_dir) == before  # the same files, manifest, rows: nothing of the failed replay
    assert replay_complete(run_dir)


def test_a_full_disk_during_a_first_replay_leaves_none(model, tmp_path, monkeypatch):
    run_dir = _record(model, tmp_path, replayed=False)
    before = _state(tmp_path, run_dir)
    _fail_at(monkeypatch, "oracle", OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(StorageError):
        replay(run_dir, model=model[0], progress=False)
    monkeypatch.undo()
    after = _state(tmp_path, run_dir)
    assert after == before and after["kl"] == [] and after["replay"] is None  # no half replay shown as one
    assert not replay_complete(run_dir)


def test_a_kill_as_the_new_tables_are_written_leaves_the_previous_replay(model, tmp_path, monkeypatch):
    run_dir = _record(model, tmp_path)
    before = _state(tmp_path, run_dir)
    _fail_at(monkeypatch, "replay", _Killed())  # the first table a replay writes
    with pytest.raises(_Killed):
        replay(run_dir, model=model[0], progress=False)
    monkeypatch.undo()
    after = _state(tmp_path, run_dir)
    assert after["kl"] == before["kl"] and after["replay"] == before["replay"] and after["integrity"] == "ok"
    assert replay_complete(run_dir)


_KILL_AT_SWITCH = """
import importlib, os, signal, sys
from h2o_lens.models import load_model
module = importlib.import_module("recorders.replay")
module.write_manifest = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # killed at the switch
model, _ = load_model(sys.argv[2], progress=False)
module.replay(sys.argv[1], model=model, progress=False)
"""


@pytest.mark.slow  # more than a few seconds on an idle 2-core machine (docs/TESTING.md)
def test_a_kill_at_the_switch_is_invisible_and_the_next_replay_clears_it(model, tmp_path):
    run_dir = _record(model, tmp_path)
    before = _state(tmp_path, run_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    folder = model[0].config._name_or_path
    proc = subprocess.run([sys.executable, "-c", _KILL_AT_SWITCH, str(run_dir), folder], env=env, timeout=600)
    assert proc.returncode == -signal.SIGKILL
    after = _state(tmp_path, run_dir)
    assert set(after["files"]) > set(before["files"])  # the killed replay's segments are there...
    assert {k: after[k] for k in ("kl", "replay", "integrity")} == {k: before[k] for k in ("kl", "replay", "integrity")}
    replay(run_dir, model=model[0], progress=False)  # ...until the next replay, which removes them
    final = _state(tmp_path, run_dir)
    assert {f for f in final["files"] if f.endswith(".parquet")} == set(final["segments"])
    assert final["kl"] == before["kl"] and final["integrity"] == "ok"
    rows = {p.name: pq.read_metadata(p).num_rows for p in run_dir.glob("*.parquet")}
    assert rows == final["segments"]
