"""The synthetic-run generator: deterministic, schema-valid, H2O-shaped, fast."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runlog import TABLES, check_run, load_run, open_runs, synthetic_tables, write_synthetic_run

PROPS = settings(derandomize=True, max_examples=25, deadline=None)


def _cat(parts: list[pa.Table]) -> pa.Table:
    return pa.concat_tables(parts)


def test_same_seed_same_rows_other_seed_other_rows():
    a = synthetic_tables("run-s", seed=5, steps=20)
    b = synthetic_tables("run-s", seed=5, steps=20)
    c = synthetic_tables("run-s", seed=6, steps=20)
    for name in TABLES:
        assert _cat(a[name]).equals(_cat(b[name]))
        assert _cat(a[name]).schema.equals(TABLES[name])
    assert not _cat(a["evictions"]).equals(_cat(c["evictions"]))


@PROPS
@given(
    layers=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    steps=st.integers(0, 30),
    prompt_len=st.integers(1, 60),
    heavy=st.integers(1, 12),
    recent=st.integers(1, 12),
    k=st.integers(1, 3),
    requests=st.integers(1, 2),
)
def test_eviction_stream_obeys_h2o_bookkeeping(layers, kv_heads, group, steps, prompt_len, heavy, recent, k, requests):
    data = synthetic_tables(
        "run-p",
        layers=layers,
        kv_heads=kv_heads,
        q_heads=group * kv_heads,
        steps=steps,
        prompt_len=prompt_len,
        heavy=heavy,
        recent=recent,
        evictions_per_step=k,
        requests=requests,
        seed=1,
    )
    ev = _cat(data["evictions"]).to_pydict()
    budget = heavy + recent
    seen = prompt_len + steps * k
    per_head = max(0, seen - budget)  # every position beyond the budget evicts one
    assert len(ev["step"]) == requests * layers * kv_heads * per_head
    step, pos = np.array(ev["step"]), np.array(ev["position"])
    assert (np.array(ev["age"]) == step - pos).all()
    assert (np.array(ev["margin"]) >= 0).all()
    assert (pos <= step - recent).all()  # the recent window is never evicted
    prefill = np.array(ev["phase"]) == "prefill"
    assert (step[prefill] == prompt_len - 1).all()
    assert (step[~prefill] >= prompt_len).all()
    keys = list(zip(ev["request"], ev["layer"], ev["kv_head"], ev["position"]))
    assert len(set(keys)) == len(keys)  # an evicted position never returns
    assert len(_cat(data["replay"])) == requests * steps * layers * group * kv_heads
    assert len(_cat(data["replay_steps"])) == requests * steps
    tokens = _cat(data["tokens"])
    assert len(tokens) == requests * seen
    assert sum(tokens["is_prompt"].to_pylist()) == requests * prompt_len


def test_written_run_passes_check_and_reads_back(tmp_path):
    run_dir = write_synthetic_run(tmp_path, "run-w", requests=2, steps=16, rows_per_segment=300, fsync=False)
    report = check_run(run_dir)
    assert report.status == "complete" and report.rows["evictions"] > 300
    assert len([p for p in report.files if p.name.startswith("evictions-")]) > 1
    loaded = load_run(run_dir)
    assert loaded.manifest["model"]["layers"] == 4
    con = open_runs(tmp_path)
    promo = con.execute("SELECT avg(promoted::INT) FROM steps").fetchall()[0][0]
    assert 0.05 < promo < 0.95
    labels = con.execute("SELECT DISTINCT evidence FROM tokens WHERE evidence IS NOT NULL").fetchall()
    assert labels == [("needle",)]


@pytest.mark.parametrize(
    "bad", [dict(q_heads=5, kv_heads=2), dict(layers=0), dict(steps=-1), dict(tables=["evictionz"])]
)
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        synthetic_tables("run-x", **bad)


def test_a_million_eviction_rows_are_fast(tmp_path):
    start = time.perf_counter()
    run_dir = write_synthetic_run(
        tmp_path, "run-m", layers=10, kv_heads=2, steps=50_000, prompt_len=256, tables=["evictions"], fsync=False
    )
    elapsed = time.perf_counter() - start
    size = sum(p.stat().st_size for p in run_dir.glob("*.parquet"))
    rows = check_run(run_dir).rows["evictions"]
    assert rows > 1_000_000
    assert size / rows < 16  # bytes per eviction row
    assert elapsed < 15
