"""The sandboxed SQL console: one read-only SELECT over the runs root, capped and timed."""
from __future__ import annotations

import json
import time

import pytest

from analyses import (Sandbox, SQLRefusedError, SQLSandboxError, SQLTimeoutError, check_sql,
                      format_result, run_sql, view_schemas)
from recorders import write_synthetic_run


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("sqlroot") / "runs"
    write_synthetic_run(root, "run-a", steps=8, prompt_len=32, fsync=False)
    return root


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    d = tmp_path_factory.mktemp("outside")
    (d / "secret.csv").write_text("a,b\n1,2\n")
    write_synthetic_run(d / "other-runs", "run-x", steps=4, prompt_len=16, fsync=False)
    return d


def test_select_runs_and_returns_typed_rows(root):
    df = run_sql(root, "SELECT layer, count(*) AS n FROM evictions GROUP BY layer ORDER BY layer")
    assert df.layer.tolist() == [0, 1, 2, 3] and str(df.n.dtype) == "int64"
    df = run_sql(root, "WITH x AS (SELECT * FROM runs) SELECT run_id FROM x")
    assert df.run_id.tolist() == ["run-a"]
    inside = next((root / "run-a").glob("tokens-*.parquet"))
    assert len(run_sql(root, f"SELECT * FROM read_parquet('{inside}')")) > 0  # files under the root


def test_row_cap_and_formats(root):
    df = run_sql(root, "SELECT * FROM range(50) t(i)", max_rows=7)
    assert len(df) == 7 and df.attrs["truncated"]
    assert "(7 rows, truncated)" in format_result(df, "table")
    assert format_result(df, "csv").splitlines()[:2] == ["i", "0"]
    assert json.loads(format_result(df, "json"))[6] == {"i": 6}
    assert not run_sql(root, "SELECT 1 AS x", max_rows=7).attrs["truncated"]


@pytest.mark.parametrize("sql, why", [
    ("COPY (SELECT 1) TO '{root}/x.csv'", "COPY"),
    ("COPY evictions TO '{outside}/x.parquet'", "COPY"),
    ("WITH x AS (COPY (SELECT 1 AS a) TO '{root}/y.csv') SELECT * FROM x", "COPY"),
    ("ATTACH '{outside}/x.duckdb' AS x", "ATTACH"),
    ("INSTALL httpfs", "INSTALL"),
    ("LOAD httpfs", "LOAD"),
    ("SET enable_external_access = true", "SET"),
    ("RESET lock_configuration", "RESET"),
    ("PRAGMA version", "PRAGMA"),
    ("EXPORT DATABASE '{outside}/dump'", "EXPORT"),
    ("SELECT 1; SELECT 2", "2 statements"),
    ("SELECT 1; DROP VIEW runs", "2 statements"),
    ("CREATE TABLE t AS SELECT 1", "CREATE"),
    ("DROP VIEW evictions", "DROP"),
    ("INSERT INTO runs SELECT * FROM runs", "INSERT"),
    ("WITH x AS (DELETE FROM runs RETURNING *) SELECT * FROM x", "DELETE"),
    ("SELECT * FROM query('SELECT 1')", "query()"),
    ("CALL pragma_version()", "CALL"),
])
def test_statements_that_escape_are_refused(root, outside, sql, why):
    sql = sql.format(root=root, outside=outside)
    with pytest.raises(SQLRefusedError, match="refused") as info:
        run_sql(root, sql)
    assert why in str(info.value)
    assert not (root / "x.csv").exists() and not (root / "y.csv").exists()


@pytest.mark.parametrize("call", ["read_csv('{outside}/secret.csv')", "read_text('{outside}/secret.csv')",
                                  "read_parquet('{outside}/other-runs/run-x/*.parquet')",
                                  "read_csv('{root}/../../outside0/secret.csv')", "glob('/etc/*')",
                                  "read_blob('/etc/hostname')"])
def test_files_outside_the_root_cannot_be_read(root, outside, call):
    with pytest.raises(SQLRefusedError, match="runs root"):
        run_sql(root, f"SELECT * FROM {call.format(root=root, outside=outside)}")


def test_configuration_is_locked_inside_a_reused_sandbox(root):
    with Sandbox(root) as box:
        assert not box.run("SELECT current_setting('enable_external_access') AS v").v[0]
        assert box.run("SELECT current_setting('lock_configuration') AS v").v[0]
        with pytest.raises(SQLRefusedError):
            box.run("SET lock_configuration = false")
        assert len(box.run("SELECT * FROM runs")) == 1


def test_runaway_query_is_interrupted(root):
    t = time.perf_counter()
    with pytest.raises(SQLTimeoutError, match="time limit"):
        run_sql(root, "SELECT count(*) FROM range(1000000000) a, range(1000000000) b "
                      "WHERE a.range + b.range = 7", timeout_s=0.5)
    assert time.perf_counter() - t < 5.0
    assert len(run_sql(root, "SELECT 1 AS x", timeout_s=5.0)) == 1  # the sandbox still works after


def test_errors_say_what_went_wrong(root):
    with pytest.raises(SQLSandboxError, match="nosuch"):
        run_sql(root, "SELECT nosuch FROM runs")
    with pytest.raises(SQLSandboxError, match="parse"):
        run_sql(root, "SELECT * FROM runs WHERE")
    with pytest.raises(SQLRefusedError, match="empty"):
        check_sql("  ")
    assert check_sql("FROM runs") == "FROM runs"


def test_view_schemas_lists_every_view_with_types_and_docs(root):
    schemas = view_schemas(root)
    assert {"runs", "tokens", "evictions", "steps", "replay", "replay_steps", "problems"} <= set(schemas)
    cols = {c["name"]: c for c in schemas["evictions"]}
    assert cols["margin"]["type"] == "FLOAT" and "surviving" in cols["margin"]["doc"]
    assert cols["step"]["type"] == "BIGINT"


def test_a_root_linking_outside_is_refused(tmp_path, outside):
    root = tmp_path / "linked"
    write_synthetic_run(root, "run-l", steps=4, prompt_len=16, fsync=False)
    (root / "run-l" / "escape").symlink_to(outside)
    with pytest.raises(SQLRefusedError, match="outside the runs root"):
        run_sql(root, "SELECT 1")
