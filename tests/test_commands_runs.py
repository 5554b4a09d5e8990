"""The commands layer: ``h2o-lens runs`` reads the one headline query of :mod:`analyses`."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest

from analyses import HEADLINE_COLUMNS
from commands.cli import main

SAMPLES = Path(__file__).resolve().parents[1] / "sample_runs"


def test_runs_prints_every_run_with_means_recomputed_from_the_segments(capsys):
    assert main(["runs", str(SAMPLES), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    by_id = {r["run_id"]: r for r in rows}
    folders = {p.name for p in SAMPLES.iterdir() if (p / "manifest.json").exists()}
    assert set(by_id) == folders
    assert list(rows[0]) == list(HEADLINE_COLUMNS)
    con = duckdb.connect()
    kl = dict(
        con.sql(
            f"SELECT run_id, avg(kl) FROM read_parquet('{SAMPLES}/*/replay_steps-*.parquet') GROUP BY run_id"
        ).fetchall()
    )
    ev = dict(
        con.sql(
            f"SELECT run_id, count(*) FROM read_parquet('{SAMPLES}/*/evictions-*.parquet') GROUP BY run_id"
        ).fetchall()
    )
    assert kl and ev
    for run_id, row in by_id.items():
        assert row["evictions"] == ev.get(run_id, 0)
        if run_id in kl:
            assert row["kl_mean"] == pytest.approx(kl[run_id], abs=5e-5)
        else:
            assert row["kl_mean"] is None


def test_runs_caps_the_rows_it_prints(capsys):
    assert main(["runs", str(SAMPLES), "--max-rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "(3 rows, truncated)" in out


def test_runs_of_a_missing_root_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    out = capsys.readouterr()
    assert (
        out.out == ""
        and out.err.strip() == f"h2o-lens: error: runs root {tmp_path / 'nowhere'} does not exist or is not a folder"
    )
