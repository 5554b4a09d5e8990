"""DuckDB views over a runs root, damaged files, schema versions and the readers."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runlog import (
    TABLE_NAMES,
    VIEW_NAMES,
    DamagedFileError,
    ManifestError,
    QueryError,
    RecorderError,
    RecorderWarning,
    RunExistsError,
    RunIdError,
    RunWriter,
    SchemaVersionError,
    check_run,
    list_runs,
    load_run,
    open_runs,
    query,
    request_order,
    synthetic_tables,
    write_synthetic_run,
)
from runlog.manifest import read_manifest, write_manifest
from runlog.schema import KEYS, RUNS, SCHEMA_VERSION, TABLES, duckdb_type
from runlog.segments import file_metadata, segment_name, write_segment

CONFIG = {"policy": "h2o", "heavy": 16, "recent": 8, "gqa": "max", "sink": 4, "seed": 7, "backend": "torch"}


def _write_run(root, run_id, seed=0, **kw):
    return write_synthetic_run(
        root, run_id, layers=2, kv_heads=2, steps=12, prompt_len=40, seed=seed, fsync=False, **kw
    )


def _record_rows(run_dir, **rows):
    """Update the manifest's row counts and segment list after a test added or removed segments on
    purpose (as a writer of them would)."""
    manifest = read_manifest(run_dir)
    manifest["rows"].update(rows)
    manifest["segments"] = {p.name: pq.read_metadata(p).num_rows for p in Path(run_dir).glob("*.parquet")}
    write_manifest(run_dir, manifest)


def _sorted(table: pa.Table, name: str) -> pa.Table:
    return table.sort_by([(k, "ascending") for k in KEYS[name]])


def test_every_table_round_trips_through_writer_and_views(tmp_path):
    data = synthetic_tables(
        "run-rt", layers=2, kv_heads=2, q_heads=4, steps=10, prompt_len=30, heavy=8, recent=6, requests=2, seed=3
    )
    with RunWriter(
        tmp_path,
        "run-rt",
        config=CONFIG,
        model={"name": "tiny-llama", "layers": 2},
        rows_per_segment=50,
        fsync=False,
        prompt_len=30,
        new_tokens=10,
        requests=2,
    ) as run:
        for name, parts in data.items():
            for part in parts:  # as plain column dicts, in uneven batches
                for start in range(0, part.num_rows, 37):
                    chunk = part.slice(start, 37)
                    run.append(
                        name,
                        {
                            c: chunk[c] if chunk[c].null_count else chunk[c].to_numpy(zero_copy_only=False)
                            for c in chunk.column_names
                            if c != "run_id"
                        },
                    )
    con = open_runs(tmp_path)
    loaded = load_run(tmp_path / "run-rt")
    for name in TABLE_NAMES:
        expected = _sorted(pa.concat_tables(data[name]), name)
        from_sql = con.sql(f"SELECT * FROM {name}").to_arrow_table()
        assert from_sql.column_names == TABLES[name].names
        assert _sorted(from_sql, name).cast(TABLES[name]).equals(expected), name
        assert _sorted(loaded[name], name).equals(expected), name
    (row,) = con.execute("SELECT * FROM runs").fetchall()
    runs = dict(zip(RUNS.names, row))
    assert runs["run_id"] == "run-rt" and runs["status"] == "complete"
    assert runs["model"] == "tiny-llama" and runs["policy"] == "h2o" and runs["gqa"] == "max"
    assert (runs["heavy"], runs["recent"], runs["sink"], runs["seed"]) == (16, 8, 4, 7)
    assert (runs["prompt_len"], runs["new_tokens"], runs["requests"]) == (30, 10, 2)
    assert runs["created_at"] <= runs["finished_at"]
    assert json.loads(runs["config"]) == CONFIG
    assert loaded.manifest["rows"]["evictions"] == sum(t.num_rows for t in data["evictions"])


def test_views_exist_with_declared_columns_when_empty(tmp_path):
    for root in (tmp_path, tmp_path / "missing"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecorderWarning)
            con = open_runs(root)
        for view in VIEW_NAMES:
            cols = con.execute(f"DESCRIBE {view}").fetchall()
            schema = RUNS if view == "runs" else TABLES[view]
            assert [(c[0], c[1]) for c in cols] == [(f.name, duckdb_type(f.type)) for f in schema]
            assert con.execute(f"SELECT count(*) FROM {view}").fetchall() == [(0,)]
    # a run with only some tables: the others stay empty views
    _write_run(tmp_path, "run-partial", tables=["tokens"])
    con = open_runs(tmp_path)
    assert con.execute("SELECT count(*) FROM evictions").fetchall() == [(0,)]
    assert con.execute("SELECT count(*) FROM tokens").fetchall()[0][0] > 0


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_damaged_file_is_skipped_over_the_root_but_named_by_check_run(tmp_path, damage):
    _write_run(tmp_path, "run-good", seed=1)
    bad_run = _write_run(tmp_path, "run-bad", seed=2)
    bad = bad_run / segment_name("evictions", 0)
    raw = bad.read_bytes()
    bad.write_bytes(raw[: len(raw) // 2] if damage == "truncated" else b"")
    with pytest.warns(RecorderWarning, match=re.escape(str(bad))):
        con = open_runs(tmp_path)
    per_run = dict(con.execute("SELECT run_id, count(*) FROM evictions GROUP BY ALL").fetchall())
    assert set(per_run) == {"run-good"}
    assert con.execute("SELECT count(*) FROM tokens").fetchall()[0][0] > 0  # other tables intact
    problems = con.execute("SELECT path, run_id, table_name FROM problems ORDER BY path").fetchall()
    assert problems == [
        (str(bad), "run-bad", "evictions"),  # the file, and the run's short count
        (str(bad_run / "manifest.json"), "run-bad", "evictions"),
    ]
    integrity = dict(con.execute("SELECT run_id, integrity FROM runs").fetchall())
    assert integrity["run-good"] == "ok"
    assert "evictions-00000.parquet left out" in integrity["run-bad"]
    assert "run-good" in query(tmp_path, "SELECT DISTINCT run_id FROM evictions", fmt="csv")
    with pytest.raises(DamagedFileError, match=re.escape(str(bad))):
        check_run(bad_run)
    with pytest.raises(DamagedFileError, match=re.escape(str(bad))):
        load_run(bad_run)
    assert check_run(tmp_path / "run-good").rows["evictions"] == per_run["run-good"]


def test_newer_schema_version_is_an_error_naming_the_file(tmp_path):
    run_dir = _write_run(tmp_path, "run-new")
    table = pq.read_table(run_dir / segment_name("replay_steps", 0))
    newer = run_dir / segment_name("replay_steps", 1)
    write_segment(
        newer,
        "replay_steps",
        table.replace_schema_metadata(None).cast(TABLES["replay_steps"]),
        metadata={"h2o_lens.schema_version": str(SCHEMA_VERSION + 1)},
        fsync=False,
    )
    for call in (open_runs, list_runs):
        with pytest.raises(SchemaVersionError, match=re.escape(str(newer))):
            call(tmp_path)
    for call in (check_run, load_run):
        with pytest.raises(SchemaVersionError, match=re.escape(str(newer))):
            call(run_dir)


def test_column_added_in_a_later_segment_is_visible(tmp_path):
    run_dir = _write_run(tmp_path, "run-grow", tables=["replay_steps"])
    first = pq.read_table(run_dir / segment_name("replay_steps", 0))
    # a later segment adds a nullable column this version does not declare
    newer = first.append_column("entropy", pa.array([0.5] * first.num_rows, pa.float32()))
    meta = file_metadata("replay_steps", "run-grow", "{}")
    pq.write_table(newer.replace_schema_metadata(meta), run_dir / segment_name("replay_steps", 1))
    _record_rows(run_dir, replay_steps=2 * first.num_rows)
    con = open_runs(tmp_path)
    cols = [c[0] for c in con.execute("DESCRIBE replay_steps").fetchall()]
    assert cols == TABLES["replay_steps"].names + ["entropy"]
    counts = con.execute("SELECT count(*), count(entropy) FROM replay_steps").fetchall()
    assert counts == [(2 * first.num_rows, first.num_rows)]
    assert load_run(run_dir)["replay_steps"].column_names[-1] == "entropy"


def test_nullable_column_missing_from_old_segments_reads_as_null(tmp_path):
    run_dir = _write_run(tmp_path, "run-old", tables=["evictions"])
    path = run_dir / segment_name("evictions", 0)
    old = pq.read_table(path).drop_columns(["phase", "q_head"])
    pq.write_table(old.replace_schema_metadata(file_metadata("evictions", "run-old", "{}")), path)
    con = open_runs(tmp_path)
    assert con.execute("SELECT count(*), count(phase), count(q_head) FROM evictions").fetchall() == [
        (old.num_rows, 0, 0)
    ]


def test_foreign_file_and_missing_manifest_are_reported(tmp_path):
    run_dir = _write_run(tmp_path, "run-odd")
    foreign = run_dir / segment_name("tokens", 7)
    pq.write_table(pa.table({"x": [1, 2]}), foreign)  # no h2o_lens metadata
    (run_dir / "manifest.json").unlink()
    with pytest.warns(RecorderWarning):
        con = open_runs(tmp_path)
    assert con.execute("SELECT run_id, status FROM runs").fetchall() == [("run-odd", "unknown")]
    reasons = dict(con.execute("SELECT path, reason FROM problems").fetchall())
    assert "no manifest.json" in reasons[str(run_dir / "manifest.json")]
    assert "h2o_lens.schema_version" in reasons[str(foreign)]
    assert con.execute("SELECT count(*) FROM tokens").fetchall()[0][0] > 0  # the good segment
    with pytest.raises(ManifestError, match="no manifest.json"):
        check_run(run_dir)


def test_failed_run_carries_the_error(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with RunWriter(tmp_path, "run-fail", config=CONFIG, fsync=False) as run:
            run.append(
                "replay_steps",
                {
                    "request": 0,
                    "step": [5, 6],
                    "kl": [0.1, 0.2],
                    "top1_agree": [True, False],
                    "teacher_logprob": [-1, -2],
                },
            )
            raise ZeroDivisionError("division by zero")
    (row,) = list_runs(tmp_path)
    assert row["status"] == "failed" and row["error_type"] == "ZeroDivisionError"
    assert "division by zero" in row["error"]
    assert load_run(tmp_path / "run-fail")["replay_steps"].num_rows == 2  # buffered rows kept
    out = query(tmp_path, "SELECT status, error_type FROM runs", fmt="json")
    assert json.loads(out) == [{"status": "failed", "error_type": "ZeroDivisionError"}]


def test_run_writer_refuses_numeric_and_existing_ids(tmp_path):
    with pytest.raises(RunIdError, match="numeric"):
        RunWriter(tmp_path, "00123")
    _write_run(tmp_path, "run-taken")
    with pytest.raises(RunExistsError):
        RunWriter(tmp_path, "run-taken").start()
    run = RunWriter(tmp_path, config={"policy": "sink"}).start()
    assert re.fullmatch(r"\d{8}-\d{6}-sink-[0-9a-f]{4}", run.run_id)
    run.close()


def test_list_runs_statuses(tmp_path):
    _write_run(tmp_path, "run-a")
    _write_run(tmp_path, "run-b", status="failed")
    _write_run(tmp_path, "run-c", status="running")  # this process is alive: still running
    (tmp_path / "notes").mkdir()  # folders without a run are ignored
    (tmp_path / ".cache").mkdir()
    statuses = {r["run_id"]: r["status"] for r in list_runs(tmp_path)}
    assert statuses == {"run-a": "complete", "run-b": "failed", "run-c": "running"}


def test_query_formats_and_limits(tmp_path):
    _write_run(tmp_path, "run-q")
    table = query(tmp_path, "SELECT step, kl FROM replay_steps ORDER BY step", max_rows=3)
    lines = table.splitlines()
    assert lines[0].split() == ["step", "kl"] and lines[-1] == "(3 rows, truncated)"
    csv_text = query(tmp_path, "SELECT step FROM replay_steps ORDER BY step", fmt="csv", max_rows=2)
    assert csv_text.splitlines() == ["step", "40", "41"]
    rows = json.loads(query(tmp_path, "WITH s AS (SELECT * FROM runs) SELECT run_id, created_at FROM s", fmt="json"))
    assert rows[0]["run_id"] == "run-q" and rows[0]["created_at"].startswith("20")
    for bad in ("COPY (SELECT 1) TO 'x.csv'", "SELECT 1; SELECT 2", "DROP VIEW runs", "SELEC 1"):
        with pytest.raises(QueryError):
            query(tmp_path, bad)
    with pytest.raises(QueryError, match="unknown format"):
        query(tmp_path, "SELECT 1", fmt="xml")


# -- one bad run never hides or falsifies the others ----------------------------------------------


def _two_runs(tmp_path):
    good = _write_run(tmp_path, "run-good", seed=1)
    bad = _write_run(tmp_path, "run-bad", seed=2)
    return good, bad


def _others_still_work(tmp_path, good_rows: int | None = None):
    """Every view and query over the root works, and run-good's numbers are its own."""
    con = open_runs(tmp_path, warn=False)
    for view in VIEW_NAMES:
        con.execute(f"SELECT * FROM {view}").fetchall()  # every column of every file is read
    per_run = dict(con.execute("SELECT run_id, count(*) FROM evictions GROUP BY ALL").fetchall())
    assert per_run["run-good"] == (
        good_rows if good_rows is not None else check_run(tmp_path / "run-good").rows["evictions"]
    )
    assert {r["run_id"] for r in list_runs(tmp_path)} >= {"run-good"}
    assert "run-good" in query(tmp_path, "SELECT run_id FROM runs", fmt="csv")
    return con


def _damage_page(path, column: str, offset: int, length: int = 24) -> None:
    """Overwrite bytes inside one column chunk's data page; the footer stays intact."""
    chunk = pq.read_metadata(path).row_group(0)
    col = next(chunk.column(i) for i in range(chunk.num_columns) if chunk.column(i).path_in_schema == column)
    start = col.data_page_offset + offset
    assert start + length < col.data_page_offset + col.total_compressed_size
    raw = bytearray(path.read_bytes())
    raw[start : start + length] = bytes(b ^ 0x5A for b in raw[start : start + length])
    path.write_bytes(bytes(raw))
    pq.read_metadata(path)  # the footer still reads


@pytest.mark.parametrize("where", ["page header", "page values"])
def test_damaged_data_page_behind_an_intact_footer_is_left_out(tmp_path, where):
    good, bad_run = _two_runs(tmp_path)
    bad = bad_run / segment_name("evictions", 0)
    # the header garbles the page layout; the values only change numbers (caught by the checksum)
    _damage_page(bad, "score", 2 if where == "page header" else 200)
    con = _others_still_work(tmp_path)
    assert set(dict(con.execute("SELECT run_id, count(*) FROM evictions GROUP BY ALL").fetchall())) == {"run-good"}
    reasons = dict(con.execute("SELECT path, reason FROM problems WHERE run_id = 'run-bad'").fetchall())
    assert "footer is intact but the data cannot be read" in reasons[str(bad)]
    integrity = dict(con.execute("SELECT run_id, integrity FROM runs").fetchall())
    assert integrity["run-good"] == "ok"
    assert "evictions-00000.parquet left out (unreadable)" in integrity["run-bad"]
    assert "evictions: 0 of" in integrity["run-bad"]
    with pytest.raises(DamagedFileError, match=re.escape(str(bad))):
        check_run(bad_run)


def _writer(**over):
    return {"pid": 1, "hostname": "elsewhere", "boot_id": None, "start_ticks": None, **over}


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("writer", "pid 123 on host a", "writer"),
        ("writer", _writer(pid=2**70), "writer"),
        ("seed", 2**64, "seed"),
        ("heavy", 2**40, "heavy"),
        ("max_logit_diff", 10**400, "max_logit_diff"),
        ("name", "caf\udce9 run", "name"),
        ("config", {"policy": "h2o", "heavy": "16", "gqa": "s\ud800m"}, "config"),
        ("rows", {"evictions": -3}, "rows"),
        ("status", ["complete"], "status"),
        ("created_at", "yesterday", "created_at"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.isidentifier() else "",
)
def test_manifest_field_of_the_wrong_type_marks_only_its_run(tmp_path, field, value, named):
    _, bad_run = _two_runs(tmp_path)
    manifest = read_manifest(bad_run)
    manifest[field] = value
    manifest["status"] = "running" if field != "status" else value  # the writer is read for running runs
    write_manifest(bad_run, manifest)
    con = _others_still_work(tmp_path)
    row = dict(zip(RUNS.names, con.execute("SELECT * FROM runs WHERE run_id = 'run-bad'").fetchone()))
    assert named in row["integrity"] and "invalid" in row["integrity"]
    reasons = [r for (r,) in con.execute("SELECT reason FROM problems WHERE run_id = 'run-bad'").fetchall()]
    assert any(named in r and "expected" in r or "not valid Unicode" in r for r in reasons), reasons
    assert con.execute("SELECT count(*) FROM evictions WHERE run_id = 'run-bad'").fetchone()[0] > 0
    with pytest.warns(RecorderWarning, match=named):
        assert load_run(bad_run)["evictions"].num_rows > 0  # the rows themselves are fine


def test_deleted_segment_marks_the_run_wherever_its_numbers_appear(tmp_path):
    _, bad_run = _two_runs(tmp_path)
    gone = bad_run / segment_name("evictions", 0)
    recorded = read_manifest(bad_run)["rows"]["evictions"]
    gone.unlink()
    con = _others_still_work(tmp_path)
    assert (
        con.execute("SELECT integrity FROM runs WHERE run_id = 'run-bad'").fetchone()[0]
        == f"evictions: 0 of {recorded} rows"
    )
    (row,) = [r for r in list_runs(tmp_path) if r["run_id"] == "run-bad"]
    assert row["integrity"] == f"evictions: 0 of {recorded} rows"
    with pytest.raises(DamagedFileError, match="manifest records"):
        check_run(bad_run)


def test_rows_of_another_run_are_never_counted_under_it(tmp_path):
    good, bad_run = _two_runs(tmp_path)
    own = check_run(good).rows["evictions"]
    stray = bad_run / segment_name("evictions", 1)
    stray.write_bytes((good / segment_name("evictions", 0)).read_bytes())  # rows say run-good
    con = _others_still_work(tmp_path, good_rows=own)
    reasons = dict(con.execute("SELECT path, reason FROM problems").fetchall())
    assert "row(s) of run 'run-good'" in reasons[str(stray)]
    assert "rows of another run" in con.execute("SELECT integrity FROM runs WHERE run_id = 'run-bad'").fetchone()[0]
    with pytest.raises(RecorderError, match=re.escape(str(stray))):
        load_run(bad_run)


def test_manifest_claiming_another_runs_id_hides_nothing(tmp_path):
    _two_runs(tmp_path)
    manifest = read_manifest(tmp_path / "run-bad")
    manifest["run_id"] = "run-good"
    write_manifest(tmp_path / "run-bad", manifest)
    con = _others_still_work(tmp_path)
    runs = dict(con.execute("SELECT run_id, integrity FROM runs").fetchall())
    assert runs["run-good"] == "ok" and "differs from the folder" in runs["run-bad"]


def test_request_order_gives_a_requests_rows_in_position_order():
    """The rows of one request sorted by position, whatever order they were written in, against
    a plain sort of (position, row) pairs; a request the run does not have gives no rows."""
    rng = np.random.default_rng(3)
    request = rng.integers(0, 3, 40)
    position = np.zeros(40, dtype=np.int64)
    for r in range(3):
        sel = np.flatnonzero(request == r)
        position[sel] = rng.permutation(len(sel))
    tokens = {"request": request.tolist(), "position": position.tolist()}
    for r in range(3):
        want = [row for _, row in sorted((int(position[i]), i) for i in range(40) if request[i] == r)]
        assert request_order(tokens, r).tolist() == want
    assert request_order(tokens, 7).tolist() == []
