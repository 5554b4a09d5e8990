"""Shared plumbing of the analyses: connections, bound relations, run facts.

Every analysis builds one SQL text with ``$name`` markers and binds the
values through :func:`relation`; nothing is ever formatted into the SQL.
DuckDB refuses two relations with the same marker name in one composed
query, so :func:`relation` gives every marker a name unique to its call:
relations from different analyses join and nest freely, and stay lazy
until they are materialised (``.df()``, ``.fetchall()``, ``.arrow()``).
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import os
import re
import threading
from typing import Any

import duckdb
import pandas as pd

from runlog import RecorderError, open_runs, read_manifest

from .errors import MissingColumnError, ParameterError, UnknownRunError

__all__ = [
    "Source",
    "connect",
    "relation",
    "first_row",
    "run_info",
    "manifest_at",
    "plain",
    "records",
    "columns",
    "require_columns",
    "has_rows",
    "sql_literal",
    "check_int",
    "check_fraction",
    "check_positive",
]

#: A DuckDB connection with the views of a runs root, or the runs root itself.
Source = duckdb.DuckDBPyConnection | str | os.PathLike

_MARKER = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")
_counter = itertools.count()
_lock = threading.Lock()


def connect(source: Source) -> duckdb.DuckDBPyConnection:
    """The connection of ``source``; a path is opened with :func:`runlog.open_runs`."""
    if isinstance(source, duckdb.DuckDBPyConnection):
        return source
    if isinstance(source, (str, os.PathLike)):
        return open_runs(source, warn=False)
    raise ParameterError(
        f"expected a DuckDB connection from runlog.open_runs or a runs root path, got {type(source).__name__}"
    )


def relation(con: duckdb.DuckDBPyConnection, sql: str, **params: Any) -> duckdb.DuckDBPyRelation:
    """A lazy relation over ``sql`` with ``$name`` markers bound to ``params``.

    Markers are renamed ``$name_<n>`` with ``n`` unique to this call, so the
    relation composes with any other built here.
    """
    used = set(_MARKER.findall(sql))
    missing = used - params.keys()
    if missing:
        raise ParameterError(f"no value given for SQL marker(s) {sorted(missing)}")
    with _lock:
        n = next(_counter)
    text = _MARKER.sub(lambda m: f"${m.group(1)}_{n}", sql)
    values = {f"{k}_{n}": v for k, v in params.items() if k in used}
    return con.sql(text, params=values or None)


def first_row(rel: duckdb.DuckDBPyRelation) -> tuple | None:
    """The first row of a relation, or None when it is empty."""
    rows = rel.limit(1).fetchall()
    return rows[0] if rows else None


def run_info(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, Any]:
    """The ``runs`` row of ``run_id`` as a dict, or :class:`UnknownRunError`."""
    if not isinstance(run_id, str):
        raise ParameterError(f"run_id must be a string, got {run_id!r}")
    rel = relation(con, "SELECT * FROM runs WHERE run_id = $run", run=run_id)
    row = first_row(rel)
    if row is None:
        known = [r[0] for r in con.sql("SELECT run_id FROM runs ORDER BY run_id LIMIT 20").fetchall()]
        raise UnknownRunError(
            f"run {run_id!r} is not in the runs view; known runs: "
            f"{', '.join(known) or 'none'}. Check the run id and the runs root"
        )
    return dict(zip(rel.columns, row))


def manifest_at(path: str | os.PathLike | None) -> dict[str, Any]:
    """The manifest of the run folder ``path`` (a ``runs`` row's ``path``), or ``{}`` when there is
    none or it cannot be read: what a reader takes from it is then absent, never made up."""
    if not path:
        return {}
    try:
        return read_manifest(path)
    except (RecorderError, OSError):
        return {}


def columns(con: duckdb.DuckDBPyConnection, view: str) -> list[str]:
    """Column names of a view (declared ones first, then later additions)."""
    return [
        r[0]
        for r in relation(
            con,
            "SELECT column_name FROM information_schema.columns WHERE table_name = $view ORDER BY ordinal_position",
            view=view,
        ).fetchall()
    ]


def require_columns(con: duckdb.DuckDBPyConnection, view: str, needed: tuple[str, ...], what: str) -> None:
    """Raise :class:`MissingColumnError` unless ``view`` has every column of ``needed``."""
    have = set(columns(con, view))
    missing = [c for c in needed if c not in have]
    if missing:
        raise MissingColumnError(
            f"{what} needs column(s) {', '.join(f'{view}.{c}' for c in missing)}, which these logs "
            f"lack; the recorder must write them (nullable additions to log schema v1)"
        )


def has_rows(con: duckdb.DuckDBPyConnection, view: str, run_id: str) -> bool:
    """Whether ``view`` holds at least one row of ``run_id``."""
    if view not in ("tokens", "evictions", "steps", "replay", "replay_steps"):
        raise ParameterError(f"unknown data view {view!r}")
    return bool(relation(con, f"SELECT 1 FROM {view} WHERE run_id = $run LIMIT 1", run=run_id).fetchall())


def plain(value: Any) -> Any:
    """A JSON-ready value: numpy scalars unwrapped, NaN/NA and infinities as None."""
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if hasattr(value, "item") and not isinstance(value, (list, dict, str)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """DataFrame rows as JSON-ready dicts."""
    return [{k: plain(v) for k, v in row.items()} for row in df.to_dict("records")]


def sql_literal(value: Any) -> str:
    """A value as a SQL literal, for SQL text shown to people (never executed here)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    return "'" + str(value).replace("'", "''") + "'"


def check_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ParameterError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ParameterError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_positive(name: str, value: Any, *, zero: bool = True) -> float:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (value >= 0 if zero else value > 0)
        and value == value
    )
    if not ok:
        raise ParameterError(f"{name} must be a number {'>=' if zero else '>'} 0, got {value!r}")
    return float(value)
