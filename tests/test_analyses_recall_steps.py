"""When a request's evidence first came back into a recall window (DESIGN.md §6.11): the
``cold_requests`` view, ``cold_runs``' summary of it and :func:`analyses.evidence_recalls`, on a
real recording of a tiny model with a planted evidence span, checked against the ``recalls`` and
``evictions`` rows read directly."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import save_tiny

from analyses import evidence_recalls
from commands.cli import main
from runlog import open_runs

FILLER = "the quick brown fox jumps over the lazy dog and keeps running through the field "
PROMPT = "The code is 4419. " + FILLER * 2 + "What is the code?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model") / "m")


def _record(tiny: Path, out: Path, cold: str, heavy: int, recent: int, prompt: str = PROMPT) -> str:
    argv = ["record", "--model", str(tiny), "--out", str(out), "--prompt", prompt, "--evidence", "code=4419",
            "--max-new-tokens", "10", "--heavy", str(heavy), "--recent", str(recent), "--cold", cold]  # fmt: skip
    assert main(argv) == 0
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir.name


def _direct(con, run_id: str) -> tuple:
    """The first eviction and the first recall of an evidence position, read from the rows."""
    ev = "SELECT position FROM tokens WHERE run_id = $run AND evidence IS NOT NULL"
    ((gone,),) = con.execute(f"SELECT min(step) FROM evictions WHERE run_id = $run AND position IN ({ev})",
                          {"run": run_id}).fetchall()  # fmt: skip
    ((back,),) = con.execute(f"SELECT min(step) FROM recalls WHERE run_id = $run AND position IN ({ev})",
                          {"run": run_id}).fetchall()  # fmt: skip
    return gone, back


def test_the_first_recall_of_the_evidence_is_measured_per_request(tiny, tmp_path):
    # a window of 56 in B = 64: the policy keeps 8 slots, the window holds nearly all that left
    run_id = _record(tiny, tmp_path, "cpu:56", 56, 8)
    con = open_runs(tmp_path, warn=False)
    gone, back = _direct(con, run_id)
    assert gone is not None and back is not None and back > gone
    row = con.execute("SELECT * FROM cold_requests WHERE run_id = ?", [run_id]).df().iloc[0]
    assert (row.evidence_first_evicted, row.evidence_first_recalled) == (gone, back)
    assert row.evidence_recall_lag == back - gone and row.evidence_tokens == 4 and row.evidence_positions_recalled > 0
    ((recalled, kv_bytes),) = con.execute(
        "SELECT count(*) FILTER (WHERE bytes_read > 0), sum(bytes_read) FROM recalls WHERE run_id = ?", [run_id]
    ).fetchall()
    assert (row.recalled, row.kv_bytes_read) == (recalled, kv_bytes) and row.kv_bytes_read_per_token == kv_bytes / 10
    (runs,) = con.execute("SELECT evidence_evicted, evidence_recalled, evidence_recall_lag FROM cold_runs").fetchall()
    assert runs == (1, 1, back - gone)
    (span,) = evidence_recalls(con, run_id).df().to_dict("records")
    assert (span["first_evicted"], span["first_recalled"], span["recall_lag"]) == (gone, back, back - gone)


def test_evidence_that_never_left_reads_null(tiny, tmp_path):
    # the evidence closes the prompt: a recent window of 24 holds it for the 10 new tokens
    run_id = _record(tiny, tmp_path, "cpu:2", 6, 24, FILLER * 2 + "The code is 4419.")
    con = open_runs(tmp_path, warn=False)
    assert _direct(con, run_id) == (None, None)
    (row,) = con.execute(
        "SELECT evidence_tokens, evidence_first_evicted, evidence_first_recalled, evidence_recall_lag, recalled "
        "FROM cold_requests WHERE run_id = ?",
        [run_id],
    ).fetchall()
    assert row[:4] == (4, None, None, None) and row[4] > 0  # other entries were recalled
    (runs,) = con.execute("SELECT evidence_evicted, evidence_recalled, evidence_recall_lag FROM cold_runs").fetchall()
    assert runs == (0, 0, None)
    (span,) = evidence_recalls(con, run_id).fetchall()
    assert span[3:6] == (None, None, None)
