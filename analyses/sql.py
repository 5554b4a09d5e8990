"""A sandboxed SQL console over a runs root.

What a statement may do, and how that is enforced (DuckDB 2.0; DESIGN.md §7):

* exactly one statement, of type SELECT (``WITH … SELECT``, ``VALUES``,
  ``DESCRIBE``/``SUMMARIZE`` count), split and classified by
  ``duckdb.extract_statements``;
* no writing inside it: the parsed tree (``json_serialize_sql``) may hold
  only SELECT, set-operation and CTE nodes, so a common table expression
  that inserts, updates, deletes or copies is refused, and so are the
  ``query``/``query_table`` functions that would run SQL text unparsed here;
* the views live in a database opened read-only; after they exist the
  connection gets ``allowed_directories = [root]``,
  ``enable_external_access = false``, extension autoload and autoinstall
  off, and finally ``lock_configuration = true``: files outside the root
  cannot be read, nothing can be attached, installed or loaded, settings
  cannot change;
* a root holding a symbolic link to a place outside it is refused (DuckDB
  checks paths, not link targets);
* at most ``max_rows`` rows come back, and a timer thread interrupts the
  statement after ``timeout_s`` seconds (DuckDB has no statement timeout).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pyarrow as pa

from recorders import TABLES, RUNS, open_runs
from recorders.query import FORMATS, format_rows

from .errors import ParameterError, SQLRefusedError, SQLSandboxError, SQLTimeoutError

__all__ = ["Sandbox", "check_sql", "run_sql", "format_result", "view_schemas"]

_ALLOWED_NODES = frozenset({"SELECT_NODE", "SET_OPERATION_NODE", "RECURSIVE_CTE_NODE", "CTE_NODE"})
_REFUSED_FUNCTIONS = frozenset({"query", "query_table"})
_parser: duckdb.DuckDBPyConnection | None = None
_parser_lock = threading.Lock()


def _parse_tree(sql: str) -> dict[str, Any]:
    """DuckDB's parse tree of ``sql`` (``json_serialize_sql``), from a private in-memory connection."""
    global _parser
    with _parser_lock:
        if _parser is None:
            _parser = duckdb.connect(":memory:")
        raw = _parser.execute("SELECT json_serialize_sql($1)", [sql]).fetchall()[0][0]
    return json.loads(raw)


def _tree_facts(node: Any, nodes: set[str], functions: set[str]) -> None:
    if isinstance(node, dict):
        kind = node.get("type")
        if isinstance(kind, str) and kind.endswith("_NODE"):
            nodes.add(kind)
        name = node.get("function_name")
        if isinstance(name, str):
            functions.add(name.lower())
        for value in node.values():
            _tree_facts(value, nodes, functions)
    elif isinstance(node, list):
        for value in node:
            _tree_facts(value, nodes, functions)


def check_sql(sql: str) -> str:
    """Return ``sql`` if the console may run it, else raise :class:`SQLRefusedError` saying why."""
    if not isinstance(sql, str) or not sql.strip():
        raise SQLRefusedError("empty query: write one SELECT statement over the views "
                              "runs, tokens, evictions, steps, replay, replay_steps, problems")
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise SQLSandboxError(f"cannot parse the query: {exc}") from None
    if len(statements) != 1:
        raise SQLRefusedError(f"refused: {len(statements)} statements; the console runs exactly one "
                              "SELECT statement per query")
    kind = statements[0].type.name
    if kind != "SELECT":
        words = re.sub(r"--[^\n]*|/\*.*?\*/", " ", statements[0].query, flags=re.S).split()
        word = words[0].upper() if words else kind
        what = f"{word} statement" if word == kind else f"{word} statement ({kind})"
        raise SQLRefusedError(f"refused: {what}; the console is read-only and runs only "
                              "SELECT / WITH … SELECT statements")
    tree = _parse_tree(sql)
    if tree.get("error"):
        raise SQLRefusedError(f"refused: {tree.get('error_message', 'the statement cannot be checked')}")
    nodes: set[str] = set()
    functions: set[str] = set()
    _tree_facts(tree, nodes, functions)
    writing = sorted(nodes - _ALLOWED_NODES)
    if writing:
        kinds = ", ".join(n.removesuffix("_QUERY_NODE").removesuffix("_NODE") for n in writing)
        raise SQLRefusedError(f"refused: the statement contains {kinds} (e.g. in a WITH clause); "
                              "the console is read-only")
    hidden = sorted(functions & _REFUSED_FUNCTIONS)
    if hidden:
        raise SQLRefusedError(f"refused: {', '.join(hidden)}() runs SQL text that cannot be checked; "
                              "write the query directly")
    return sql


def _refuse_links_out(root: Path) -> None:
    """Refuse a root holding a symbolic link to a place outside it (it would widen what is readable)."""
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            if path.is_symlink():
                target = path.resolve()
                if target != root and root not in target.parents:
                    raise SQLRefusedError(
                        f"refused: {path} links to {target}, outside the runs root {root}; the SQL "
                        "console reads only the root. Copy the run into the root instead of linking it")


def _refusal(exc: duckdb.Error, root: Path) -> SQLSandboxError:
    text = str(exc).split("\n")[0]
    if isinstance(exc, duckdb.PermissionException) or "disabled by configuration" in text:
        return SQLRefusedError(f"refused: {text}. Only files under the runs root {root} can be read")
    if "read-only" in text or "configuration has been locked" in text:
        return SQLRefusedError(f"refused: {text}")
    return SQLSandboxError(f"query failed: {text}")


class Sandbox:
    """A locked, read-only DuckDB connection over the views of one runs root.

    Parameters
    ----------
    root : path-like
        Runs root; the only directory its statements may read.
    memory_limit : str
        DuckDB memory limit of the connection.
    threads : int
        DuckDB worker threads.

    Reuse one sandbox for many queries (``run``); it reflects the runs that
    existed when it was opened.
    """

    def __init__(self, root: str | os.PathLike, *, memory_limit: str = "1GB", threads: int = 2):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ParameterError(f"runs root {self.root} does not exist or is not a folder")
        _refuse_links_out(self.root)
        tmp = tempfile.mkdtemp(prefix="h2o-lens-sql-")
        try:
            path = os.path.join(tmp, "views.duckdb")
            writer = duckdb.connect(path)
            try:
                open_runs(self.root, con=writer, warn=False)
            finally:
                writer.close()
            self.con = duckdb.connect(path, read_only=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        allowed = str(self.root) + os.sep
        try:
            for statement, value in (("SET memory_limit = $1", memory_limit), ("SET threads = $1", threads),
                                     ("SET allowed_directories = $1", [allowed])):
                self.con.execute(statement, [value])
        except duckdb.Error as exc:
            self.con.close()
            raise ParameterError(f"cannot configure the SQL sandbox (memory_limit={memory_limit!r}, "
                                 f"threads={threads!r}): {exc}") from None
        for statement in ("SET enable_external_access = false",
                          "SET autoload_known_extensions = false",
                          "SET autoinstall_known_extensions = false",
                          "SET lock_configuration = true"):
            self.con.execute(statement)

    def run(self, sql: str, *, max_rows: int = 10_000, timeout_s: float = 10.0) -> pd.DataFrame:
        """Run one checked SELECT; ``df.attrs['truncated']`` says whether rows were cut at ``max_rows``.

        Raises
        ------
        SQLRefusedError
            The statement is not allowed (the message says what and why).
        SQLTimeoutError
            It ran past ``timeout_s`` and was interrupted.
        SQLSandboxError
            It failed (syntax, unknown column, ...).
        """
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
            raise ParameterError(f"max_rows must be an int >= 0, got {max_rows!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ParameterError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        check_sql(sql)
        cur = self.con.cursor()
        fired = threading.Event()

        def stop() -> None:
            fired.set()
            cur.interrupt()

        timer = threading.Timer(float(timeout_s), stop)
        timer.daemon = True
        timer.start()
        try:
            reader = cur.sql(sql).to_arrow_reader(min(max(max_rows, 1), 65_536) + 1)
            batches, rows = [], 0
            for batch in reader:
                batches.append(batch)
                rows += batch.num_rows
                if rows > max_rows:
                    break
            table = pa.Table.from_batches(batches, schema=reader.schema)
        except duckdb.InterruptException:
            raise SQLTimeoutError(f"query stopped after the {timeout_s:g} s time limit; narrow it "
                                  "(filter by run_id, step or layer) or aggregate") from None
        except duckdb.Error as exc:
            if fired.is_set():
                raise SQLTimeoutError(f"query stopped after the {timeout_s:g} s time limit") from None
            raise _refusal(exc, self.root) from None
        finally:
            timer.cancel()
            cur.close()
        truncated = table.num_rows > max_rows
        df = table.slice(0, max_rows).to_pandas()
        df.attrs["truncated"] = truncated
        return df

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_sql(root: str | os.PathLike, sql: str, *, max_rows: int = 10_000,
            timeout_s: float = 10.0) -> pd.DataFrame:
    """Run one read-only SELECT over the views of ``root`` in a fresh :class:`Sandbox`."""
    check_sql(sql)  # refuse before opening anything
    with Sandbox(root) as box:
        return box.run(sql, max_rows=max_rows, timeout_s=timeout_s)


def format_result(df: pd.DataFrame, fmt: str = "table") -> str:
    """Format a :func:`run_sql` result as an aligned ``table``, ``csv`` or ``json``."""
    if fmt not in FORMATS:
        raise ParameterError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    rows = [tuple(None if _missing(v) else v for v in row)
            for row in df.itertuples(index=False, name=None)]
    return format_rows([str(c) for c in df.columns], rows, fmt,
                       truncated=bool(df.attrs.get("truncated", False)))


def _missing(value: Any) -> bool:
    try:
        return value is None or bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def view_schemas(root: str | os.PathLike) -> dict[str, list[dict[str, str]]]:
    """Each view's columns: ``{view: [{"name", "type", "doc"}, ...]}`` (for the dashboard)."""
    con = open_runs(root, warn=False)
    docs = {"runs": RUNS, **TABLES}
    out: dict[str, list[dict[str, str]]] = {}
    try:
        rows = con.execute(
            "SELECT table_name, column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = 'main' ORDER BY table_name, ordinal_position").fetchall()
    finally:
        con.close()
    for view, name, type_ in rows:
        schema = docs.get(view)
        doc = ""
        if schema is not None and name in schema.names:
            meta = schema.field(name).metadata or {}
            doc = meta.get(b"doc", b"").decode()
        out.setdefault(view, []).append({"name": name, "type": type_, "doc": doc})
    return out
