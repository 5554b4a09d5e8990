"""One SELECT over the views of a runs root, formatted as text.

The connection holds views only; :func:`query` accepts exactly one SELECT
statement (a ``WITH ... SELECT`` counts). Sandboxing of the SQL (allowed
directories, no external access, timeouts) belongs to the caller that
exposes it to users.
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import io
import json
import math
import os
from typing import Any

import duckdb

from .errors import QueryError
from .store import open_runs

__all__ = ["FORMATS", "query", "check_select", "format_rows"]

FORMATS = ("table", "csv", "json")


def check_select(sql: str) -> str:
    """Return ``sql`` if it is exactly one SELECT statement, else raise :class:`QueryError`."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryError(f"cannot parse the query: {exc}") from None
    if len(statements) != 1:
        raise QueryError(f"expected exactly one SELECT statement, got {len(statements)}")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise QueryError(f"only SELECT statements are accepted, got {kind.name}")
    return sql


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(_plain(value))


def format_rows(columns: list[str], rows: list[tuple], fmt: str = "table", truncated: bool = False) -> str:
    """Format query rows as an aligned ``table``, ``csv`` or ``json`` (list of objects)."""
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([["" if v is None else _plain(v) for v in row] for row in rows])
        return buf.getvalue()
    if fmt == "json":
        return json.dumps([dict(zip(columns, map(_plain, row))) for row in rows], default=str)
    if fmt != "table":
        raise QueryError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.append(f"({len(rows)} rows{', truncated' if truncated else ''})")
    return "\n".join(lines) + "\n"


def query(
    root: str | os.PathLike,
    sql: str,
    fmt: str = "table",
    max_rows: int = 1000,
    *,
    con: duckdb.DuckDBPyConnection | None = None,
) -> str:
    """Run one SELECT over the views of ``root`` and format at most ``max_rows`` rows.

    Parameters
    ----------
    root : path-like
        Runs root (ignored when ``con`` is given).
    sql : str
        One SELECT statement over ``runs``, ``tokens``, ``evictions``,
        ``steps``, ``replay``, ``replay_steps``, ``problems``.
    fmt : {"table", "csv", "json"}
    max_rows : int
        Rows returned at most; the table format says when more existed.
    con : DuckDBPyConnection, optional
        A connection from :func:`open_runs` to reuse.
    """
    if fmt not in FORMATS:
        raise QueryError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
        raise QueryError(f"max_rows must be an int >= 0, got {max_rows!r}")
    check_select(sql)
    con = con if con is not None else open_runs(root, warn=False)
    cur = con.cursor()
    try:
        result = cur.execute(sql)
        columns = [d[0] for d in result.description]
        rows = result.fetchmany(max_rows + 1)
    except duckdb.Error as exc:
        raise QueryError(f"query failed: {exc}") from None
    finally:
        cur.close()
    return format_rows(columns, rows[:max_rows], fmt, truncated=len(rows) > max_rows)
