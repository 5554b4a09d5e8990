"""Large runs roots: the synthetic root generator and the per-root catalog cache (DESIGN.md §7.4)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analyses import kv_footprint, run_curve_points, runs_table
from commands.cli import main
from runlog import catalog as catalog_module
from runlog import check_run, open_runs, scan_root, write_segment
from runlog.catalog import CACHE_NAME
from runlog.manifest import read_manifest, write_manifest
from runlog.store import create_views
from runlog.synthetic_root import POLICIES, make_root


def _cold_table(root: Path) -> pd.DataFrame:
    """The runs table of a scan that neither reads nor writes the catalog cache."""
    catalog_module._inspect_cached.cache_clear()
    con = duckdb.connect()
    create_views(con, scan_root(root, cache=False))
    return runs_table(con).df()


def _cached_table(root: Path) -> pd.DataFrame:
    catalog_module._inspect_cached.cache_clear()
    return runs_table(open_runs(root, warn=False)).df()


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True), check_exact=False, rtol=1e-9)


@pytest.fixture
def small_root(tmp_path) -> Path:
    return make_root(tmp_path / "runs", 24, seed=3, failed_every=5, interrupted_every=7)


@pytest.fixture
def no_full_reads(monkeypatch):
    """Fail any full read of a segment: what a scan returns then came from the cache."""
    catalog_module._inspect_cached.cache_clear()

    def refuse(*args, **kwargs):
        raise AssertionError("a segment was read in full")

    monkeypatch.setattr(catalog_module, "_read_through", refuse)


# -- the generator ------------------------------------------------------------------------------


def test_generator_writes_a_valid_root_with_the_mix_it_announces(small_root):
    cat = scan_root(small_root, cache=False)
    assert cat.problems == []
    assert [r.run_id for r in cat.runs] == [f"syn-{i:05d}" for i in range(24)]
    status = {r.run_id: r.status for r in cat.runs}
    interrupted = {f"syn-{i:05d}" for i in range(24) if i % 7 == 6}
    failed = {f"syn-{i:05d}" for i in range(24) if i % 5 == 4} - interrupted
    assert {k for k, v in status.items() if v == "interrupted"} == interrupted
    assert {k for k, v in status.items() if v == "failed"} == failed
    assert all(v == "complete" for k, v in status.items() if k not in interrupted | failed)
    table = _cold_table(small_root)
    assert set(table["policy"]) == set(POLICIES) and set(table["gqa"]) == {"sum", "max"}
    assert len(set(zip(table["heavy"], table["recent"]))) == 4
    assert (table["checked"] == 2).all() and table["kl_mean"].notna().all() and (table["evictions"] > 0).all()
    assert (table["integrity"] == "ok").all()
    check = check_run(small_root / "syn-00003")
    assert set(check.rows) >= {"tokens", "evictions", "steps", "replay", "replay_steps", "requests"}


def test_generator_is_deterministic_per_seed(tmp_path):
    a, b = make_root(tmp_path / "a", 3, seed=5), make_root(tmp_path / "b", 3, seed=5)
    for seg in sorted(a.glob("*/*.parquet")):
        assert pq.read_table(seg).equals(pq.read_table(b / seg.relative_to(a))), seg


def test_generator_refuses_bad_counts(tmp_path):
    with pytest.raises(ValueError, match="runs must be an int >= 1, got 0"):
        make_root(tmp_path, 0)


# -- the catalog cache --------------------------------------------------------------------------


def test_cache_gives_the_table_of_a_cold_scan_and_spares_the_full_reads(small_root, no_full_reads, monkeypatch):
    monkeypatch.undo()  # the first scan reads everything and writes the cache
    first = _cached_table(small_root)
    assert (small_root / CACHE_NAME).is_file()
    _same(first, _cold_table(small_root))
    monkeypatch.setattr(catalog_module, "_read_through", lambda *a, **k: pytest.fail("a segment was read in full"))
    catalog_module._inspect_cached.cache_clear()
    _same(_cached_table(small_root), first)


def test_a_new_segment_is_seen(small_root):
    """A segment added to a closed run is not its own (its manifest does not list it): reported and
    left out; one added to a run still being written (no list yet) is read and counted."""
    before = _cached_table(small_root).set_index("run_id")
    for run in ("syn-00002", "syn-00006"):  # complete; interrupted (its manifest lists nothing)
        seg = small_root / run / "evictions-00000.parquet"
        table = pq.read_table(seg).replace_schema_metadata(None)
        write_segment(small_root / run / "evictions-00001.parquet", "evictions", table, run_id=run, fsync=False)
    after = _cached_table(small_root)
    _same(after, _cold_table(small_root))
    after = after.set_index("run_id")
    assert after.loc["syn-00002", "evictions"] == before.loc["syn-00002", "evictions"]
    assert "not in the manifest" in after.loc["syn-00002", "integrity"]
    assert after.loc["syn-00006", "evictions"] == 2 * before.loc["syn-00006", "evictions"]


def test_a_status_change_is_seen(small_root):
    assert _cached_table(small_root).set_index("run_id").loc["syn-00006", "status"] == "interrupted"
    manifest = read_manifest(small_root / "syn-00006")
    manifest["status"] = "complete"
    write_manifest(small_root / "syn-00006", manifest)
    assert _cached_table(small_root).set_index("run_id").loc["syn-00006", "status"] == "complete"


def test_a_file_damaged_in_place_is_found_even_with_its_size_and_times_restored(small_root):
    _cached_table(small_root)
    seg = small_root / "syn-00001" / "replay_steps-00000.parquet"
    st = seg.stat()
    data = bytearray(seg.read_bytes())
    data[4:40] = bytes(36)  # the first page's header and data
    seg.write_bytes(bytes(data))
    os.utime(seg, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only ctime tells
    got = _cached_table(small_root)
    _same(got, _cold_table(small_root))
    assert "replay_steps-00000.parquet left out" in got.set_index("run_id").loc["syn-00001", "integrity"]


def test_a_truncated_file_is_found_and_the_verdict_is_cached(small_root, monkeypatch):
    _cached_table(small_root)
    seg = small_root / "syn-00004" / "tokens-00000.parquet"
    seg.write_bytes(seg.read_bytes()[:100])
    got = _cached_table(small_root)
    _same(got, _cold_table(small_root))
    assert "tokens-00000.parquet left out (unreadable)" in got.set_index("run_id").loc["syn-00004", "integrity"]
    _cached_table(small_root)  # writes the cache of this state
    monkeypatch.setattr(catalog_module, "_read_through", lambda *a, **k: pytest.fail("a segment was read in full"))
    catalog_module._inspect_cached.cache_clear()
    problems = open_runs(small_root, warn=False).sql("SELECT path FROM problems").fetchall()
    assert sorted(problems) == [(str(seg.with_name("manifest.json")),), (str(seg),)]  # the file, the row count


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b"[]", json.dumps({"format": 1, "schema_version": 1, "files": {"x": 1}}).encode(), None],
    ids=["empty", "not-json", "list", "odd-entries", "wrong-entries"],
)
def test_a_corrupt_cache_is_ignored_and_rewritten(small_root, content):
    good = _cached_table(small_root)
    cache = small_root / CACHE_NAME
    if content is None:  # every entry of the right key but a value of the wrong shape
        data = json.loads(cache.read_text())
        odd = (["evictions", "many", None, 1, [], []], [], {"table": "tokens", "error": "NoSuchError"})
        data["files"] = {k: [v[0], odd[i % 3]] for i, (k, v) in enumerate(data["files"].items())}
        content = json.dumps(data).encode()
    cache.write_bytes(content)
    _same(_cached_table(small_root), good)
    assert json.loads(cache.read_text())["format"] == catalog_module._CACHE_FORMAT
    entries = json.loads(cache.read_text())["files"]
    runs = [k for k in entries if k.endswith("/#contract")]  # one checked contract per run (DESIGN.md §5.5)
    assert len(entries) - len(runs) == sum(1 for _ in small_root.glob("*/*"))
    assert sorted(k.split("/")[0] for k in runs) == sorted(p.name for p in small_root.iterdir() if p.is_dir())


def test_an_empty_root_gets_no_cache_file(tmp_path):
    assert scan_root(tmp_path).runs == []
    assert list(tmp_path.iterdir()) == []


def test_cache_entries_of_files_gone_are_dropped(small_root):
    _cached_table(small_root)
    (small_root / "syn-00005" / "steps-00000.parquet").unlink()
    _cached_table(small_root)
    assert "syn-00005/steps-00000.parquet" not in json.loads((small_root / CACHE_NAME).read_text())["files"]


def test_a_root_that_cannot_keep_a_cache_is_scanned_all_the_same(small_root, monkeypatch):
    def refuse(self, *args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(Path, "write_text", refuse)
    _same(_cached_table(small_root), _cold_table(small_root))
    assert not (small_root / CACHE_NAME).exists()


def test_runs_table_means_match_the_segments(small_root):
    got = _cached_table(small_root).set_index("run_id")
    con = duckdb.connect()
    want = con.sql(
        f"SELECT run_id, avg(kl) AS kl, avg(top1_agree::INT) AS top1 FROM "
        f"read_parquet('{small_root}/*/replay_steps-*.parquet') GROUP BY run_id"
    ).df()
    for row in want.itertuples():
        assert got.loc[row.run_id, "kl_mean"] == pytest.approx(row.kl, rel=1e-9)
        assert got.loc[row.run_id, "top1_agreement"] == pytest.approx(row.top1, rel=1e-9)
    rq = pa.concat_tables(pq.read_table(p) for p in sorted(small_root.glob("*/requests-*.parquet"))).to_pandas()
    correct = rq.groupby("run_id")["correct"].sum()
    assert (got.loc[correct.index, "correct"] == correct).all()


# -- a generated root of 300 runs ---------------------------------------------------------------


def test_runs_command_lists_every_run_of_a_large_root(large_root, capsys):
    assert main(["runs", str(large_root), "--format", "json", "--max-rows", "1000"]) == 0
    rows = json.loads(capsys.readouterr().out)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert len(rows) == 300 and len({r["run_id"] for r in rows}) == 300
    assert sum(r["status"] == "failed" for r in rows) == len([i for i in range(300) if i % 97 == 96 and i % 89 != 88])
    assert sum(r["status"] == "interrupted" for r in rows) == len([i for i in range(300) if i % 89 == 88])


def test_sweep_curve_points_of_many_runs_match_each_run_alone(large_root):
    con = open_runs(large_root, warn=False)
    ids = [f"syn-{i:05d}" for i in range(300)][::-1]
    points = run_curve_points(con, ids).df()
    assert points["run_id"].tolist() == ids
    for run_id in ("syn-00000", "syn-00151", "syn-00299"):
        fp = kv_footprint(con, run_id).df()
        row = points.set_index("run_id").loc[run_id]
        assert row["kept_share"] == pytest.approx(fp["kept_share"].mean())
        assert row["page_share"] == pytest.approx(fp["page_share"].mean())
        kl = con.execute("SELECT avg(kl) FROM replay_steps WHERE run_id = ?", [run_id]).fetchall()[0][0]
        assert row["kl_mean"] == pytest.approx(kl)
    assert points["kept_share"].between(0, 1).all()


@pytest.mark.slow
def test_bench_runs_prints_its_timings_on_a_small_root(tmp_path, capsys):
    root = tmp_path / "runs"
    assert main(["bench", "runs", "--runs", "4", "--root", str(root), "--no-browser"]) == 0
    out = capsys.readouterr().out
    assert "synthetic root: 4 runs written" in out
    assert "h2o-lens runs (4 runs), no cache" in out and "h2o-lens runs (4 runs), catalog cache warm" in out
    assert "runs_table" in out and "for 4 rows" in out and "for 4 points" in out
    assert (root / CACHE_NAME).is_file()
