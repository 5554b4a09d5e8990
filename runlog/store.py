"""DuckDB views over a runs root, and the readers of a single run.

:func:`open_runs` returns a DuckDB connection with the views ``runs``,
``tokens``, ``evictions``, ``steps``, ``replay``, ``replay_steps`` (DESIGN.md
§5), ``problems`` and ``counterfactuals`` (re-runs linked to their parent,
DESIGN.md §6.10). The data views read an explicit list of validated files with
``union_by_name=true``: a damaged file is left out and reported, never
allowed to fail a query over all runs, and the run it belongs to is marked
in ``runs.integrity``. Every view exists, with the
declared columns, even when no run has written that table yet; columns added
by later versions appear after the declared ones.

:func:`check_run` and :func:`load_run` are strict: a damaged file raises an
error that names it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .catalog import Catalog, Problem, RunEntry, SegmentFile, run_row, scan_root, scan_run
from .errors import ContractError, DamagedFileError, RecorderWarning
from .manifest import mark_interrupted
from .plans import PLANS, SET_BUDGETS_VIEW, plan_rows
from .schema import RUNS, TABLE_NAMES, duckdb_type, table_schema

__all__ = ["open_runs", "create_views", "list_runs", "check_run", "load_run", "request_order", "RunCheck", "LoadedRun"]

_PROBLEM_COLUMNS = ("path", "run_id", "table_name", "reason")


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(value: Any, type_: pa.DataType) -> str:
    sql_type = duckdb_type(type_)
    if value is None or (isinstance(value, float) and math.isnan(value) and not pa.types.is_floating(type_)):
        return f"CAST(NULL AS {sql_type})"
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (int, float)):
        text = f"'{value!r}'" if isinstance(value, float) and not math.isfinite(value) else repr(value)
    elif isinstance(value, dt.datetime):
        text = "'" + value.isoformat(sep=" ") + "'"
    else:  # text that is not valid Unicode (a lone surrogate from a file name) is made readable
        text = "'" + str(value).encode("utf-8", "replace").decode("utf-8").replace("'", "''") + "'"
    return f"CAST({text} AS {sql_type})"


def _values_view(name: str, schema: pa.Schema, rows: Iterable[dict[str, Any]]) -> str:
    """SQL of a view holding ``rows`` as literals (no table, no Python object behind it)."""
    rows = list(rows)
    if not rows:
        cols = ", ".join(f"CAST(NULL AS {duckdb_type(f.type)}) AS {_ident(f.name)}" for f in schema)
        return f"CREATE OR REPLACE VIEW {_ident(name)} AS SELECT {cols} WHERE false"
    values = ",\n".join("(" + ", ".join(_literal(r.get(f.name), f.type) for f in schema) + ")" for r in rows)
    names = ", ".join(_ident(f.name) for f in schema)
    return f"CREATE OR REPLACE VIEW {_ident(name)} AS SELECT * FROM (VALUES {values}) AS t({names})"


#: Schema holding the tables behind the views (out of ``main``, which lists the views).
CATALOG_SCHEMA = "h2o_lens_catalog"
_FILES = pa.schema(
    [
        pa.field("run_id", pa.string()),
        pa.field("table_name", pa.string()),
        pa.field("path", pa.string()),
        pa.field("rows", pa.int64()),
    ]
)
_TOTALS = pa.schema(
    [
        pa.field("run_id", pa.string()),
        pa.field("table_name", pa.string()),
        pa.field("column_name", pa.string()),
        pa.field("total", pa.float64()),
        pa.field("n", pa.int64()),
    ]
)


def _readable(value: Any) -> Any:
    """Text that is not valid Unicode (a lone surrogate from a file name) made readable."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


_NOT_FITTING = (pa.ArrowException, OverflowError, TypeError, ValueError, UnicodeError)


def _column(values: list[Any], type_: pa.DataType) -> pa.Array:
    """``values`` as an array of ``type_``; text made readable, a value that does not fit is null."""
    if not pa.types.is_floating(type_) and not pa.types.is_string(type_):  # NaN is no value of these
        values = [None if isinstance(v, float) and math.isnan(v) else v for v in values]
    try:
        return pa.array(values, type=type_)
    except _NOT_FITTING:
        out = []
        for v in values:
            v = _readable(v)
            try:
                pa.array([v], type=type_)
                out.append(v)
            except _NOT_FITTING:
                out.append(None)
        return pa.array(out, type=type_)


def _rows_table(
    con: duckdb.DuckDBPyConnection, name: str, schema: pa.Schema, rows: Iterable[dict[str, Any]] | dict[str, list]
) -> None:
    """Store ``rows`` (dicts, or lists per column) as the table ``h2o_lens_catalog.<name>``.

    A table in the database (not literals in a view's SQL, which DuckDB binds again on
    every query, nor a Python object) keeps thousands of runs quick and lives in a
    database file as well as in memory.
    """
    if not isinstance(rows, dict):
        rows = list(rows)
        rows = {f.name: [r.get(f.name) for r in rows] for f in schema}
    data = pa.Table.from_arrays([_column(rows[f.name], f.type) for f in schema], schema=schema)
    con.execute(f"CREATE SCHEMA IF NOT EXISTS {CATALOG_SCHEMA}")
    temp = f"_h2o_lens_rows_{id(data)}"
    con.register(temp, data)
    try:
        con.execute(f"CREATE OR REPLACE TABLE {CATALOG_SCHEMA}.{_ident(name)} AS SELECT * FROM {_ident(temp)}")
    finally:
        con.unregister(temp)


def _table_view(table: str, files: list[SegmentFile]) -> str:
    schema = table_schema(table)
    if not files:
        return _values_view(table, schema, [])
    names = tuple(schema.names)
    layouts = {f.columns for f in files}
    present = {c for cols in layouts for c in cols}
    cols = [
        _ident(f.name) if f.name in present else f"CAST(NULL AS {duckdb_type(f.type)}) AS {_ident(f.name)}"
        for f in schema
    ]
    extras: list[str] = []
    for f in files:  # columns added by later versions, in order of appearance
        if f.columns != names:
            extras += [c for c in f.columns if c not in names and c not in extras]
    cols += [_ident(c) for c in extras]
    paths = ", ".join("'" + str(f.path).replace("'", "''") + "'" for f in files)
    # files of exactly the declared columns line up by position: DuckDB then reads one
    # footer to bind a query instead of every file's (the common case of a large root)
    union = "" if layouts == {names} else ", union_by_name = true"
    return f"CREATE OR REPLACE VIEW {_ident(table)} AS SELECT {', '.join(cols)} FROM read_parquet([{paths}]{union})"


#: counterfactual re-runs with their parent, outcome and mean KL (DESIGN.md §6.10). ``correct`` is the
#: answer checker's verdict, for a teacher-forced run (the oracle) whether every token was its top-1.
COUNTERFACTUALS_VIEW = """
CREATE OR REPLACE VIEW counterfactuals AS
SELECT r.parent_run, r.counterfactual_request AS request, r.counterfactual_kind AS kind,
       r.counterfactual_slots AS slots, r.counterfactual_slots / r.prompt_len AS keep_ratio,
       r.run_id, r.status, r.error, q.answer,
       coalesce(q.correct, g.all_top1) AS correct, k.kl_mean, k.top1_agreement, r.created_at
FROM runs r
LEFT JOIN requests q ON q.run_id = r.run_id AND q.request = 0
LEFT JOIN (SELECT run_id, bool_and(top1_id = token_id) AS all_top1
           FROM run_logits WHERE request = 0 GROUP BY run_id) g ON g.run_id = r.run_id
LEFT JOIN (SELECT run_id, avg(kl) AS kl_mean, avg(top1_agree::INT) AS top1_agreement
           FROM replay_steps WHERE request = 0 GROUP BY run_id) k ON k.run_id = r.run_id
WHERE r.parent_run IS NOT NULL
"""


#: runs with a cold tier (DESIGN.md §2.13): what the tier moved, per generated token, and how much of
#: the teacher's attention to evicted positions its window held (after a replay)
COLD_VIEW = """
CREATE OR REPLACE VIEW cold_runs AS
SELECT r.run_id, c.store, c.recall, c.every, c."select", c.evicted, c.recalled, c.bytes_written, c.bytes_read,
       q.generated, c.bytes_read / nullif(q.generated, 0) AS bytes_read_per_token,
       c.recalled / nullif(q.generated, 0) AS recalled_per_token, c.recall_hit_rate,
       e.evidence_evicted, e.evidence_recalled, e.evidence_recall_lag
FROM runs r,
     LATERAL (SELECT json_extract_string(r.cold, '$.store') AS store,
                     json_extract(r.cold, '$.recall')::INTEGER AS recall,
                     json_extract(r.cold, '$.every')::INTEGER AS every,
                     json_extract_string(r.cold, '$.select') AS "select",
                     json_extract(r.cold, '$.evicted')::BIGINT AS evicted,
                     json_extract(r.cold, '$.recalled')::BIGINT AS recalled,
                     json_extract(r.cold, '$.bytes_written')::BIGINT AS bytes_written,
                     json_extract(r.cold, '$.bytes_read')::BIGINT AS bytes_read,
                     json_extract(r.cold, '$.recall_hit_rate')::DOUBLE AS recall_hit_rate) c
LEFT JOIN (SELECT run_id, sum(new_tokens) AS generated FROM requests GROUP BY run_id) q ON q.run_id = r.run_id
LEFT JOIN (SELECT run_id, count(evidence_first_evicted) AS evidence_evicted,
                  count(evidence_first_recalled) AS evidence_recalled,
                  median(evidence_recall_lag) AS evidence_recall_lag
           FROM cold_requests GROUP BY run_id) e ON e.run_id = r.run_id
WHERE r.cold IS NOT NULL
"""


#: per request of a run with a cold tier (DESIGN.md §6.11): what its windows brought in, and when its
#: evidence first left the policy's slots and first came back into a window (decode steps, the
#: ``evictions``/``recalls`` step; null: never)
COLD_REQUESTS_VIEW = """
CREATE OR REPLACE VIEW cold_requests AS
WITH ev_tok AS (
    SELECT t.run_id, t.request, t.position FROM tokens t JOIN runs r ON r.run_id = t.run_id
    WHERE r.cold IS NOT NULL AND t.evidence IS NOT NULL
), gone AS (
    SELECT e.run_id, e.request, min(e.step) AS evidence_first_evicted
    FROM evictions e JOIN ev_tok USING (run_id, request, position) GROUP BY ALL
), back AS (
    SELECT c.run_id, c.request, min(c.step) AS evidence_first_recalled,
           count(DISTINCT c.position) AS evidence_positions_recalled
    FROM recalls c JOIN ev_tok USING (run_id, request, position) GROUP BY ALL
), brought AS (
    SELECT run_id, request, count(*) FILTER (WHERE bytes_read > 0) AS recalled, sum(bytes_read) AS kv_bytes_read
    FROM recalls GROUP BY ALL
), spans AS (
    SELECT run_id, request, count(*) AS evidence_tokens FROM ev_tok GROUP BY ALL
)
SELECT q.run_id, q.request, q.new_tokens, coalesce(b.recalled, 0) AS recalled,
       coalesce(b.kv_bytes_read, 0) AS kv_bytes_read,
       coalesce(b.kv_bytes_read, 0) / nullif(q.new_tokens, 0) AS kv_bytes_read_per_token,
       coalesce(s.evidence_tokens, 0) AS evidence_tokens, g.evidence_first_evicted, k.evidence_first_recalled,
       coalesce(k.evidence_positions_recalled, 0) AS evidence_positions_recalled,
       k.evidence_first_recalled - g.evidence_first_evicted AS evidence_recall_lag
FROM requests q JOIN runs r ON r.run_id = q.run_id
LEFT JOIN brought b ON b.run_id = q.run_id AND b.request = q.request
LEFT JOIN spans s ON s.run_id = q.run_id AND s.request = q.request
LEFT JOIN gone g ON g.run_id = q.run_id AND g.request = q.request
LEFT JOIN back k ON k.run_id = q.run_id AND k.request = q.request
WHERE r.cold IS NOT NULL
"""


def create_views(con: duckdb.DuckDBPyConnection, catalog: Catalog) -> None:
    """Create or replace the views of ``catalog`` in ``con``.

    Besides the views, the schema ``h2o_lens_catalog`` holds the tables behind ``runs``
    and ``problems``, ``files`` (each readable segment: ``run_id, table_name, path,
    rows``) and ``totals`` (per segment, the sum and non-null count of the columns the
    runs table averages, :data:`runlog.catalog.TOTALS`), both read during the scan.
    """
    _rows_table(con, "runs", RUNS, (run_row(r) for r in catalog.runs))
    con.execute(f"CREATE OR REPLACE VIEW runs AS SELECT * FROM {CATALOG_SCHEMA}.runs")
    for table in TABLE_NAMES:
        con.execute(_table_view(table, catalog.files(table)))
    con.execute(COUNTERFACTUALS_VIEW)
    con.execute(COLD_REQUESTS_VIEW)
    con.execute(COLD_VIEW)  # reads cold_requests
    _rows_table(con, "plans", PLANS, plan_rows(catalog.runs))  # DESIGN.md §5.6
    con.execute(SET_BUDGETS_VIEW)
    problem_schema = pa.schema([pa.field(c, pa.string()) for c in _PROBLEM_COLUMNS])
    _rows_table(
        con,
        "problems",
        problem_schema,
        ({"path": p.path, "run_id": p.run_id, "table_name": p.table, "reason": p.reason} for p in catalog.problems),
    )
    con.execute(f"CREATE OR REPLACE VIEW problems AS SELECT * FROM {CATALOG_SCHEMA}.problems")
    files = [(r.run_id, f) for r in catalog.runs for segs in r.files.values() for f in segs]
    _rows_table(
        con,
        "files",
        _FILES,
        {
            "run_id": [rid for rid, _ in files],
            "table_name": [f.table for _, f in files],
            "path": [str(f.path) for _, f in files],
            "rows": [f.rows for _, f in files],
        },
    )
    totals = [(rid, f.table, t) for rid, f in files for t in f.totals]
    _rows_table(
        con,
        "totals",
        _TOTALS,
        {
            "run_id": [rid for rid, _, _ in totals],
            "table_name": [table for _, table, _ in totals],
            "column_name": [t[0] for _, _, t in totals],
            "total": [t[1] for _, _, t in totals],
            "n": [t[2] for _, _, t in totals],
        },
    )


def open_runs(
    root: str | os.PathLike, *, con: duckdb.DuckDBPyConnection | None = None, warn: bool = True
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the views of every run under ``root``.

    Parameters
    ----------
    root : path-like
        Runs root, ``<root>/<run_id>/manifest.json`` and segments.
    con : DuckDBPyConnection, optional
        Connection to (re)create the views in, e.g. to refresh after new
        segments were written; default a new in-memory database.
    warn : bool
        Emit a :class:`RecorderWarning` per skipped file or folder. The
        ``problems`` view lists them either way.

    Raises
    ------
    SchemaVersionError
        A file or manifest was written by a newer schema version.
    """
    catalog = scan_root(root)
    if con is None:
        con = duckdb.connect(":memory:")
        con.execute("SET parquet_metadata_cache = true")
    create_views(con, catalog)
    if warn:
        for problem in catalog.problems:
            warnings.warn(str(problem), RecorderWarning, stacklevel=2)
    return con


def list_runs(root: str | os.PathLike, *, mark: bool = False) -> list[dict[str, Any]]:
    """The runs under ``root`` as ``runs``-view rows, oldest first.

    A ``running`` run whose writer process is gone has status
    ``interrupted``; with ``mark=True`` its manifest is rewritten as such.
    """
    catalog = scan_root(root)
    if mark:
        for run in catalog.runs:
            if run.status == "interrupted" and run.manifest and run.manifest["status"] == "running":
                mark_interrupted(run.path)
    rows = [run_row(r) for r in catalog.runs]
    return sorted(rows, key=lambda r: (r["created_at"] or dt.datetime.min, r["run_id"]))


# -- one run, strict -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunCheck:
    """Result of :func:`check_run`: a run whose every file was read in full."""

    run_id: str
    status: str
    rows: dict[str, int]
    files: tuple[Path, ...]
    leftover_temp_files: tuple[Path, ...]


@dataclasses.dataclass
class LoadedRun:
    """A run in memory: its manifest, status and one table per written table."""

    run_id: str
    status: str
    manifest: dict[str, Any]
    tables: dict[str, pa.Table]

    def __getitem__(self, table: str) -> pa.Table:
        return self.tables[table]


def _read_segment(seg: SegmentFile) -> pa.Table:
    try:
        return pq.read_table(seg.path)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise DamagedFileError(
            f"{seg.path}: footer is valid but the data cannot be read ({exc}); move it away or delete it"
        ) from None


def _strict_run(run_dir: str | os.PathLike) -> tuple[RunEntry, list[Problem]]:
    run, problems = scan_run(run_dir, strict=True)
    if problems:  # manifest field types, the folder/run_id note and row counts are not fatal
        warnings.warn("; ".join(str(p) for p in problems), RecorderWarning, stacklevel=3)
    return run, problems


def check_run(run_dir: str | os.PathLike) -> RunCheck:
    """Read every file of one run in full; raise on the first damaged one.

    Raises
    ------
    ManifestError, DamagedFileError, SchemaError, SchemaVersionError
        Each names the file concerned; :class:`DamagedFileError` also when the
        rows read differ from the row counts the manifest records, or a segment is not
        listed in the manifest.
    ContractError
        A value breaks the value contract (DESIGN.md §5.5).
    """
    run, problems = _strict_run(run_dir)
    counts = [p for p in problems if p.kind in ("rows", "unlisted")]
    if counts:
        raise DamagedFileError(str(counts[0]))
    values = [p for p in problems if p.kind == "values"]
    if values:
        raise ContractError(str(values[0]))
    rows: dict[str, int] = {}
    files: list[Path] = []
    for table, segs in run.files.items():
        for seg in segs:
            rows[table] = rows.get(table, 0) + _read_segment(seg).num_rows
            files.append(seg.path)
    temps = tuple(sorted(Path(run_dir).glob("*.tmp")))
    return RunCheck(run.run_id, run.status, rows, tuple(files), temps)


def _conform(table: str, parts: list[pa.Table]) -> pa.Table:
    """Concatenate segments of any version <= current into the declared column order."""
    schema = table_schema(table)
    data = pa.concat_tables([p.replace_schema_metadata(None) for p in parts], promote_options="default")
    columns, fields = [], []
    for field in schema:
        if field.name in data.column_names:
            columns.append(data[field.name])
        else:
            columns.append(pa.nulls(data.num_rows, field.type))
        fields.append(field)
    for name in data.column_names:
        if name not in schema.names:
            columns.append(data[name])
            fields.append(data.schema.field(name))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def request_order(tokens: Mapping[str, Any], request: int) -> np.ndarray:
    """Row indices of ``request``'s tokens in position order (empty when it has none).

    ``tokens``: the tokens table as columns (``LoadedRun["tokens"].to_pydict()``, or arrays), at
    least ``request`` and ``position``. ``np.asarray(tokens["token_id"])[order]`` is then the
    request's prompt followed by its generated tokens, as the model saw them.
    """
    sel = np.flatnonzero(np.asarray(tokens["request"]) == request)
    return sel[np.argsort(np.asarray(tokens["position"])[sel], kind="stable")]


def load_run(run_dir: str | os.PathLike, tables: Iterable[str] | None = None) -> LoadedRun:
    """Load one run into memory (rows in write order), strictly.

    Tables the run never wrote come back empty with the declared schema.

    Raises
    ------
    ManifestError, DamagedFileError, SchemaError, SchemaVersionError
        Each names the file concerned. Row counts that differ from the
        manifest's are a :class:`RecorderWarning` (:func:`check_run` raises).
    """
    run, _ = _strict_run(run_dir)
    out = {}
    for table in tables or TABLE_NAMES:
        segs = run.files.get(table, [])
        parts = [_read_segment(s) for s in segs] or [table_schema(table).empty_table()]
        out[table] = _conform(table, parts)
    assert run.manifest is not None
    return LoadedRun(run.run_id, run.status, run.manifest, out)
