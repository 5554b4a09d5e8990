"""Schema declaration, batch conversion, run ids and manifests (no DuckDB)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import recorders
import runlog
from runlog import manifest as mf
from runlog.errors import DamagedFileError, ManifestError, RunIdError, SchemaError, SchemaVersionError
from runlog.schema import KEYS, RUNS, SCHEMA_VERSION, TABLES, duckdb_type, schema_mismatches, to_arrow

REPO = Path(__file__).resolve().parents[1]
PROPS = settings(derandomize=True, max_examples=60, deadline=None)

# DESIGN.md §5: the minimum columns of each view.
DESIGN_COLUMNS = {
    "runs": "run_id status model policy heavy recent gqa prompt_len new_tokens created_at",
    "tokens": "run_id request position token_id text is_prompt evidence",
    "evictions": "run_id request step layer kv_head position score margin age left_recent",
    "steps": "run_id request step layer kv_head min_heavy_score promoted exiting_position",
    "replay": "run_id request step layer q_head kv_head dropped_mass",
    "replay_steps": "run_id request step kl top1_agree teacher_logprob",
}


@pytest.mark.parametrize("table", list(DESIGN_COLUMNS))
def test_declared_schema_holds_design_columns(table):
    schema = RUNS if table == "runs" else TABLES[table]
    assert set(DESIGN_COLUMNS[table].split()) <= set(schema.names)
    for field in schema:
        duckdb_type(field.type)  # every type has a SQL name
        assert field.metadata[b"doc"]


def test_declared_types():
    ev = TABLES["evictions"]
    assert ev.field("run_id").type == pa.string()
    assert ev.field("request").type == pa.int32()
    assert ev.field("step").type == ev.field("position").type == pa.int64()
    assert ev.field("layer").type == ev.field("kv_head").type == pa.int16()
    assert ev.field("score").type == ev.field("margin").type == pa.float32()
    assert ev.field("left_recent").type == pa.bool_()
    assert TABLES["tokens"].field("evidence").nullable
    # 2: the speculative tables (DESIGN.md §14); 3: the guard tables (DESIGN.md §18.5); 4: guard_steps.prefill;
    # 5: the culprits table (DESIGN.md §19); 6: the cold tier's recalls (DESIGN.md §2.13)
    assert SCHEMA_VERSION == 6
    for table, keys in KEYS.items():
        assert set(keys) <= set(TABLES[table].names)


def _evictions(n=4, **over):
    cols = dict(
        request=0,
        step=np.arange(n),
        layer=np.arange(n) % 3,
        kv_head=0,
        position=np.arange(n),
        score=np.linspace(0, 1, n),
        margin=np.zeros(n),
        age=0,
        left_recent=np.zeros(n, bool),
    )
    cols.update(over)
    return cols


def test_to_arrow_broadcasts_and_fills_nulls():
    t = to_arrow("evictions", _evictions(), run_id="run-a")
    assert t.schema.equals(TABLES["evictions"])
    assert t["run_id"].to_pylist() == ["run-a"] * 4
    assert t["phase"].null_count == 4
    masked = np.ma.masked_array([1, 2, 3, 4], mask=[0, 1, 0, 0])
    t = to_arrow("evictions", _evictions(q_head=masked), run_id="run-a")
    assert t["q_head"].to_pylist() == [1, None, 3, 4]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bogus": np.zeros(4)}, r"no column\(s\) bogus"),
        ({"layer": np.array([1, 2, 3, 40000])}, r"evictions\.layer.*int16"),
        ({"score": np.zeros(3)}, r"unequal lengths"),
        ({"position": pa.array([1, None, 3, 4], pa.int64())}, r"evictions\.position holds 1 nulls"),
        ({"step": None}, r"requires column 'step'"),
    ],
)
def test_to_arrow_rejects_bad_batches(change, message):
    with pytest.raises(SchemaError, match=message):
        to_arrow("evictions", _evictions(**change), run_id="run-a")


def test_unknown_table_and_schema_mismatch():
    with pytest.raises(SchemaError, match="unknown table 'eviction'"):
        to_arrow("eviction", {"step": [1]})
    bad = pa.schema([("run_id", pa.string()), ("step", pa.int32())])
    problems = schema_mismatches("replay_steps", bad)
    assert "column 'step' is int32, expected int64" in problems
    assert any("required column 'kl' is missing" in p for p in problems)


# -- run ids ----------------------------------------------------------------------------


@PROPS
@given(st.integers(min_value=-(10**12), max_value=10**12))
def test_numeric_run_ids_are_rejected(number):
    for text in (str(number), f"{abs(number):08d}"):
        with pytest.raises(RunIdError, match="numeric"):
            mf.validate_run_id(text)
        with pytest.raises(RunIdError):
            mf.sanitize_run_id(text)


@pytest.mark.parametrize("bad", ["", "1.5", "1e5", ".hidden", "a/b", "a b", "x" * 129, 12])
def test_invalid_run_ids(bad):
    with pytest.raises(RunIdError):
        mf.validate_run_id(bad)


@PROPS
@given(st.text(max_size=40))
def test_sanitize_gives_valid_id_or_clear_error(name):
    try:
        run_id = mf.sanitize_run_id(name)
    except RunIdError as exc:
        assert "run id" in str(exc) or "numeric" in str(exc)
    else:
        assert mf.validate_run_id(run_id) == run_id


def test_new_run_id_format():
    run_id = mf.new_run_id("h2o")
    assert re.fullmatch(r"\d{8}-\d{6}-h2o-[0-9a-f]{4}", run_id)
    assert mf.sanitize_run_id("My run: needle #3") == "My-run-needle-3"


# -- manifests and writer liveness --------------------------------------------------------


def test_manifest_roundtrip_and_newer_version(tmp_path):
    m = mf.new_manifest("run-a", config={"policy": "h2o"}, model="m", name="x")
    mf.write_manifest(tmp_path, m)
    assert mf.read_manifest(tmp_path) == json.loads(json.dumps(m))
    assert not list(tmp_path.glob("*.tmp"))
    m["schema_version"] = SCHEMA_VERSION + 1
    mf.write_manifest(tmp_path, m)
    with pytest.raises(SchemaVersionError, match=re.escape(str(tmp_path / "manifest.json"))):
        mf.read_manifest(tmp_path)


def test_missing_and_damaged_manifest(tmp_path):
    with pytest.raises(ManifestError, match="no manifest.json"):
        mf.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"status": "runn')
    with pytest.raises(DamagedFileError, match="manifest.json: not valid JSON"):
        mf.read_manifest(tmp_path)


def test_writer_alive_detects_dead_and_reused_pids():
    me = mf.process_identity()
    assert mf.writer_alive(me) is True
    assert mf.effective_status({"status": "running", "writer": me}) == "running"
    reused = dict(me, start_ticks=me["start_ticks"] + 1)
    assert mf.writer_alive(reused) is False
    assert mf.effective_status({"status": "running", "writer": reused}) == "interrupted"
    dead = dict(me, pid=2**22 + 12345)  # above the default pid_max
    assert mf.writer_alive(dead) is False
    assert mf.writer_alive(dict(me, hostname=me["hostname"] + "-elsewhere")) is None
    assert mf.effective_status({"status": "complete", "writer": reused}) == "complete"


def test_mark_interrupted_rewrites_only_dead_running_runs(tmp_path):
    m = mf.new_manifest("run-a")
    mf.write_manifest(tmp_path, m)
    assert mf.mark_interrupted(tmp_path) is False  # this process is alive
    m["writer"]["start_ticks"] += 1
    mf.write_manifest(tmp_path, m)
    assert mf.mark_interrupted(tmp_path) is True
    assert mf.read_manifest(tmp_path)["status"] == "interrupted"


def test_public_api_is_explicit():
    assert set(runlog.__all__) <= set(dir(runlog))
    assert "open_runs" in runlog.__all__ and "write_synthetic_run" in runlog.__all__
    assert set(recorders.__all__) == {"record", "record_teacher_forced", "replay", "check_lifecycle"}


def test_no_model_dependencies_imported():
    code = "import sys, runlog, recorders; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"
