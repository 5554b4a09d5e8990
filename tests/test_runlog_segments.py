"""Segment writer: encodings, metadata, atomicity, and a writer killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runlog import (
    RunWriter,
    SegmentWriter,
    check_run,
    list_runs,
    list_segments,
    open_runs,
    query,
    segments,
    synthetic_tables,
)
from runlog.schema import META_CONFIG, META_SCHEMA_VERSION, SCHEMA_VERSION, to_arrow

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"policy": "h2o", "heavy": 8, "recent": 8, "gqa": "sum"}


def _evictions(n: int, start: int = 0) -> dict:
    idx = np.arange(start, start + n)
    return dict(
        request=0,
        step=idx // 6,
        layer=idx % 3,
        kv_head=(idx // 3) % 2,
        position=idx,
        score=np.sin(idx).astype(np.float32) ** 2,
        margin=np.cos(idx) ** 2,
        age=idx % 17,
        left_recent=idx % 5 == 0,
        phase="decode",
    )


def test_segments_use_zstd_byte_stream_split_and_carry_metadata(tmp_path):
    with SegmentWriter(tmp_path, run_id="run-a", config=CONFIG, fsync=False) as writer:
        writer.append("evictions", _evictions(1000))
    (path,) = tmp_path.glob("*.parquet")
    assert path.name == "evictions-00000.parquet"
    md = pq.read_metadata(path)
    assert md.metadata[META_SCHEMA_VERSION.encode()] == str(SCHEMA_VERSION).encode()
    assert json.loads(md.metadata[META_CONFIG.encode()]) == CONFIG
    schema = md.schema.to_arrow_schema()
    for i in range(md.num_columns):
        col = md.row_group(0).column(i)
        assert col.compression == "ZSTD"
        if pa.types.is_floating(schema.field(col.path_in_schema).type):
            assert "BYTE_STREAM_SPLIT" in col.encodings, col.path_in_schema
    con = duckdb.connect()
    kv = dict(con.execute("SELECT key, value FROM parquet_kv_metadata(?)", [str(path)]).fetchall())
    assert kv[b"h2o_lens.schema_version"] == str(SCHEMA_VERSION).encode()
    assert json.loads(kv[b"h2o_lens.config"]) == CONFIG
    enc = dict(
        con.execute(
            "SELECT path_in_schema, encodings FROM parquet_metadata(?) WHERE row_group_id = 0", [str(path)]
        ).fetchall()
    )
    assert "BYTE_STREAM_SPLIT" in enc["score"] and "BYTE_STREAM_SPLIT" in enc["margin"]


def test_threshold_counter_and_temp_cleanup(tmp_path):
    writer = SegmentWriter(tmp_path, rows_per_segment=100, fsync=False)
    writer.append("evictions", _evictions(250))
    assert [p.name for p in writer.segments] == ["evictions-00000.parquet", "evictions-00001.parquet"]
    writer.close()  # the last 50 buffered rows
    assert [pq.read_metadata(p).num_rows for p in list_segments(tmp_path)["evictions"]] == [100, 100, 50]
    (tmp_path / "evictions-00003.parquet.tmp").write_bytes(b"PAR1 half a file")
    again = SegmentWriter(tmp_path, fsync=False)
    assert [p.name for p in again.removed_temp_files] == ["evictions-00003.parquet.tmp"]
    again.append("evictions", _evictions(5))
    again.close()
    assert again.segments[0].name == "evictions-00003.parquet"
    with pytest.raises(ValueError, match="closed"):
        again.append("evictions", _evictions(5))


@settings(derandomize=True, max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 120), min_size=1, max_size=8), threshold=st.integers(1, 150))
def test_rows_come_back_in_order_whatever_the_batching(tmp_path_factory, sizes, threshold):
    run_dir = tmp_path_factory.mktemp("runs") / "run-prop"
    run_dir.mkdir()
    writer = SegmentWriter(run_dir, rows_per_segment=threshold, fsync=False)
    start = 0
    for n in sizes:
        writer.append("evictions", _evictions(n, start))
        start += n
    writer.close()
    segs = list_segments(run_dir).get("evictions", [])
    counts = [pq.read_metadata(p).num_rows for p in segs]
    assert all(c == threshold for c in counts[:-1]) and all(0 < c <= threshold for c in counts[-1:])
    back = pa.concat_tables([pq.read_table(p) for p in segs]) if segs else None
    expected = to_arrow("evictions", _evictions(start), run_id="run-prop")
    if start == 0:
        assert back is None
    else:
        assert back.replace_schema_metadata(None).equals(expected)


# -- a writer killed with SIGKILL ---------------------------------------------------------

WRITER = """
import sys
import numpy as np
from runlog import RunWriter
root, run_id = sys.argv[1], sys.argv[2]
n = 40_000
with RunWriter(root, run_id, config={"policy": "h2o", "heavy": 8, "recent": 8},
               rows_per_segment=4 * n) as run:
    step = 0
    while True:
        idx = np.arange(n)
        run.append("evictions", dict(request=0, step=np.full(n, step), layer=idx % 30,
                   kv_head=idx % 3, position=idx, score=np.random.rand(n), margin=np.random.rand(n),
                   age=idx % 100, left_recent=idx % 2 == 0))
        run.append("steps", dict(request=0, step=np.full(100, step), layer=np.arange(100) % 30,
                   kv_head=0, promoted=True))
        step += 1
"""


def _kill_writer_mid_segment(root: Path, run_id: str, segments_before: int) -> bool:
    """Start a writer, SIGKILL it while a segment is being written; return True if a .tmp was seen."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), run_id], env=env, stderr=subprocess.PIPE)
    run_dir = root / run_id
    deadline = time.monotonic() + 30
    saw_tmp = False
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            names = os.listdir(run_dir) if run_dir.exists() else []
            done = sum(n.endswith(".parquet") for n in names)
            if done >= segments_before and any(n.endswith(".parquet.tmp") for n in names):
                saw_tmp = True
                break
            time.sleep(0.0005)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    return saw_tmp


def test_sigkill_mid_write_leaves_only_openable_files(tmp_path):
    root = tmp_path / "runs"
    synthetic = synthetic_tables("done-run", steps=8)
    with RunWriter(root, "done-run", config=CONFIG, fsync=False) as run:
        for table, parts in synthetic.items():
            for part in parts:
                run.append(table, part)
    saw_tmp = _kill_writer_mid_segment(root, "killed-run", segments_before=2)
    run_dir = root / "killed-run"

    parquet = sorted(run_dir.glob("*.parquet"))
    assert len(parquet) >= 2
    for path in parquet:  # every visible file is complete and readable, by both readers
        assert pq.read_table(path).num_rows > 0
        duckdb.connect().execute("SELECT count(*) FROM read_parquet(?)", [str(path)]).fetchall()
    if saw_tmp:
        assert list(run_dir.glob("*.tmp"))  # the torn segment stayed invisible

    status = {r["run_id"]: r["status"] for r in list_runs(root)}
    assert status == {"done-run": "complete", "killed-run": "interrupted"}
    report = check_run(run_dir)
    assert report.status == "interrupted"
    assert report.rows["evictions"] == sum(pq.read_metadata(p).num_rows for p in run_dir.glob("evictions-*.parquet"))
    con = open_runs(root)
    rows = dict(con.execute("SELECT run_id, count(*) FROM evictions GROUP BY ALL").fetchall())
    assert rows["killed-run"] == report.rows["evictions"]
    assert rows["done-run"] == synthetic["evictions"][0].num_rows
    assert "interrupted" in query(root, "SELECT status FROM runs WHERE run_id = 'killed-run'")

    list_runs(root, mark=True)
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "interrupted"
    SegmentWriter(run_dir)  # a later writer cleans the leftovers
    assert not list(run_dir.glob("*.tmp"))


# -- a writer that fails mid-file (deterministic crash safety) ----------------------------


class _Killed(BaseException):
    """The process ends here: no cleanup code of the writer runs (as under SIGKILL)."""


def _torn_writer(calls):
    """Stands in for ``pq.write_table``: writes half a Parquet file to the path it gets, then the
    process is killed."""
    real = pq.write_table

    def write_table(table, where, **kwargs):
        calls.append(Path(where))
        real(table, where, **kwargs)
        data = Path(where).read_bytes()
        Path(where).write_bytes(data[: len(data) // 2])  # no footer: unreadable, like a killed writer
        raise _Killed("killed (simulated mid-file)")

    return write_table


@pytest.mark.parametrize("fsync", [False, True])
def test_writer_killed_mid_file_leaves_no_file_under_a_final_name(tmp_path, monkeypatch, fsync):
    from runlog import segments

    calls: list[Path] = []
    with SegmentWriter(tmp_path, run_id="run-a", config=CONFIG, fsync=fsync) as writer:
        writer.append("evictions", _evictions(300, 0))
    assert [p.name for p in list_segments(tmp_path)["evictions"]] == ["evictions-00000.parquet"]
    writer = SegmentWriter(tmp_path, run_id="run-a", config=CONFIG, fsync=fsync)
    writer.append("evictions", _evictions(200, 300))
    monkeypatch.setattr(segments.pq, "write_table", _torn_writer(calls))
    with pytest.raises(_Killed, match="mid-file"):
        writer.flush()
    monkeypatch.undo()
    # the bytes went to the temporary name, never to the name readers match
    assert [p.name for p in calls] == ["evictions-00001.parquet.tmp"]
    assert not (tmp_path / "evictions-00001.parquet").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evictions-00000.parquet", "evictions-00001.parquet.tmp"]
    assert [p.name for p in list_segments(tmp_path)["evictions"]] == ["evictions-00000.parquet"]
    # readers see exactly the complete segment
    con = duckdb.connect()
    n = con.execute("SELECT count(*) FROM read_parquet(?)", [str(tmp_path / "*.parquet")]).fetchone()[0]
    assert n == 300
    # the next writer removes the torn file and reuses the index
    again = SegmentWriter(tmp_path, run_id="run-a", config=CONFIG, fsync=fsync)
    assert [p.name for p in again.removed_temp_files] == ["evictions-00001.parquet.tmp"]
    again.append("evictions", _evictions(5, 300))
    again.close()
    assert again.segments[0].name == "evictions-00001.parquet"


def test_write_segment_renames_the_temporary_file_into_place(tmp_path, monkeypatch):
    """The final name appears only through ``os.replace`` of the finished temporary file."""
    from runlog import segments

    renames: list[tuple[str, str, bool]] = []
    real = os.replace

    def replace(src, dst):
        renames.append((Path(src).name, Path(dst).name, pq.read_metadata(src).num_rows == 7))
        assert not Path(dst).exists()  # nothing under the final name before the rename
        real(src, dst)

    monkeypatch.setattr(segments.os, "replace", replace)
    path = segments.write_segment(
        tmp_path / "evictions-00000.parquet", "evictions", to_arrow("evictions", _evictions(7), run_id="r"), fsync=False
    )
    assert renames == [("evictions-00000.parquet.tmp", "evictions-00000.parquet", True)]
    assert path.exists() and not list(tmp_path.glob("*.tmp"))


def test_nan_in_float_columns_stays_visible_to_duckdb(tmp_path):
    """Parquet min/max statistics leave NaN out, and DuckDB answers ``isnan`` and range filters from
    them: float columns carry no statistics, so a NaN margin is read as NaN."""
    cols = {
        "request": [0, 0, 0],
        "step": [3, 4, 5],
        "layer": [0, 0, 0],
        "kv_head": [0, 0, 0],
        "position": [0, 1, 2],
        "score": [0.5, 0.25, 0.125],
        "margin": [float("nan"), 0.5, float("nan")],
        "age": [3, 3, 3],
        "left_recent": [False, False, False],
        "phase": ["decode"] * 3,
    }
    path = tmp_path / segments.segment_name("evictions", 0)
    segments.write_segment(path, "evictions", to_arrow("evictions", cols, run_id="r"), run_id="r", fsync=False)
    got = (
        duckdb.connect()
        .sql(
            f"SELECT count(*) FILTER (WHERE isnan(margin)), count(*) FILTER (WHERE margin <= 1) "
            f"FROM read_parquet('{path}')"
        )
        .fetchall()
    )
    assert got == [(2, 1)]


def test_shipped_samples_show_their_nan_margins_to_duckdb():
    files = sorted((Path(__file__).resolve().parents[1] / "sample_runs").glob("*/evictions-*.parquet"))
    expected = sum(
        int(np.isnan(pq.read_table(f, columns=["margin"])["margin"].to_numpy(zero_copy_only=False)).sum())
        for f in files
    )
    assert expected > 0
    (got,) = (
        duckdb.connect()
        .execute(
            "SELECT count(*) FILTER (WHERE isnan(margin)) FROM read_parquet($files)", {"files": [str(f) for f in files]}
        )
        .fetchall()[0]
    )
    assert got == expected
