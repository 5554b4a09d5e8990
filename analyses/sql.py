"""A sandboxed SQL console over a runs root.

What a statement may do, and how that is enforced (DuckDB 2.0; DESIGN.md §7):

* exactly one statement, of type SELECT (``WITH … SELECT``, ``VALUES``,
  ``DESCRIBE``/``SUMMARIZE`` count), split and classified by
  ``duckdb.extract_statements``;
* no writing inside it: the parsed tree (``json_serialize_sql``) may hold
  only SELECT, set-operation and CTE nodes, so a common table expression
  that inserts, updates, deletes or copies is refused;
* no SQL text run unchecked: a table function (``FROM f(...)``) must be one of
  :data:`TABLE_FUNCTIONS` (ranges, unnest, the file readers, read-only
  catalog listings), an allow-list, so ``query``/``query_table``,
  ``json_execute_serialized_sql`` and any state-changing table function are
  refused; the scalar functions that parse, plan or run SQL text
  (``json_serialize_sql``, ``json_serialize_plan``, ...) are refused too;
* the views live in a database opened read-only; the connection gets
  ``allowed_directories = [root]``, ``enable_external_access = false``,
  extension autoload and autoinstall off, and finally
  ``lock_configuration = true``: files outside the root cannot be read,
  nothing can be attached, installed or loaded, settings cannot change;
* a root holding a symbolic link to a place outside it is refused (DuckDB
  checks paths, not link targets).

Limits. Queries run in a worker process (``_sql_worker.py``) owned by the
:class:`Sandbox`, so that every limit is final:

* memory: the worker's data segment is capped by the kernel
  (``RLIMIT_DATA``, Linux) at its size after start-up plus ``memory_limit``;
  DuckDB's own ``memory_limit`` is a quarter to a half of it, so operators
  spill to the sandbox's temp folder (kept while the sandbox is open, at most
  ``spill_limit`` bytes) before the cap.
  DuckDB's limit alone does not hold for one scalar expression
  (``length(list(range(1e9::BIGINT)))`` grew past 18 GB under a 1 GB limit);
  under the cap such a query fails with an out-of-memory error;
* time: after ``timeout_s`` seconds the worker is killed and nothing is
  returned (a statement folded to a constant while planning, such as
  ``repeat('x', 4e8)``, cannot be interrupted from inside DuckDB); the next
  query starts a fresh worker;
* rows and bytes: at most ``max_rows`` rows come back, and a result whose
  Arrow buffers pass ``max_bytes`` is refused, not cut;
* threads: ``threads`` DuckDB worker threads.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pyarrow as pa

from runlog import RUNS, TABLES, open_runs
from runlog.query import FORMATS, format_rows

from .errors import ParameterError, SQLRefusedError, SQLSandboxError, SQLTimeoutError

__all__ = ["Sandbox", "check_sql", "run_sql", "format_result", "view_schemas", "parse_size", "TABLE_FUNCTIONS"]

_ALLOWED_NODES = frozenset({"SELECT_NODE", "SET_OPERATION_NODE", "RECURSIVE_CTE_NODE", "CTE_NODE"})
#: The table functions a statement may call: generators, the file readers (bounded by
#: ``allowed_directories``) and read-only listings. Anything else, e.g. ``query``,
#: ``query_table``, ``json_execute_serialized_sql`` or ``checkpoint``, is refused.
TABLE_FUNCTIONS = frozenset(
    {
        "range",
        "generate_series",
        "unnest",
        "repeat",
        "repeat_row",
        "glob",
        "sniff_csv",
        "read_parquet",
        "parquet_scan",
        "parquet_metadata",
        "parquet_schema",
        "parquet_kv_metadata",
        "parquet_file_metadata",
        "read_csv",
        "read_csv_auto",
        "read_json",
        "read_json_auto",
        "read_json_objects",
        "read_json_objects_auto",
        "read_ndjson",
        "read_ndjson_auto",
        "read_ndjson_objects",
        "read_text",
        "read_blob",
        "json_each",
        "json_tree",
        "duckdb_columns",
        "duckdb_views",
        "duckdb_tables",
        "duckdb_schemas",
        "duckdb_types",
        "duckdb_functions",
        "duckdb_keywords",
        "duckdb_settings",
        "pragma_table_info",
        "pragma_version",
    }
)
#: Scalar (or any) functions that take SQL text to parse, plan or run.
_SQL_TEXT_FUNCTIONS = frozenset(
    {
        "query",
        "query_table",
        "json_execute_serialized_sql",
        "json_serialize_sql",
        "json_deserialize_sql",
        "json_serialize_plan",
    }
)
_WORKER = Path(__file__).with_name("_sql_worker.py")
_START_TIMEOUT_S = 120.0
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_parser: duckdb.DuckDBPyConnection | None = None
_parser_lock = threading.Lock()


def parse_size(value: float | str, name: str = "size") -> int:
    """Bytes of ``value``: a positive number of bytes or a string such as ``"256MB"``/``"1GiB"``.

    Raises :class:`ParameterError` naming ``name`` for anything else (zero, negative, nan, inf).
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        if m is None or m.group(2) not in _UNITS:
            raise ParameterError(f"{name} must be a size such as 256MB, 1GB or 512MiB, got {value!r}")
        number = float(m.group(1)) * _UNITS[m.group(2)]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ParameterError(f"{name} must be a number of bytes or a size such as 256MB, got {value!r}")
    if not math.isfinite(number) or number < 1:
        raise ParameterError(f"{name} must be a finite size of at least 1 byte, got {value!r}")
    return int(number)


def _parse_tree(sql: str) -> dict[str, Any]:
    """DuckDB's parse tree of ``sql`` (``json_serialize_sql``), from a private in-memory connection."""
    global _parser
    with _parser_lock:
        if _parser is None:
            _parser = duckdb.connect(":memory:")
        raw = _parser.execute("SELECT json_serialize_sql($1)", [sql]).fetchall()[0][0]
    return json.loads(raw)


def _tree_facts(node: Any, nodes: set[str], functions: set[str], tables: set[str]) -> None:
    """Collect the query-node kinds, function names and table-function names of a parse tree."""
    if isinstance(node, dict):
        kind = node.get("type")
        if isinstance(kind, str) and kind.endswith("_NODE"):
            nodes.add(kind)
        name = node.get("function_name")
        if isinstance(name, str):
            functions.add(name.lower())
        if kind == "TABLE_FUNCTION" and isinstance(node.get("function"), dict):
            tables.add(str(node["function"].get("function_name", "")).lower())
        for value in node.values():
            _tree_facts(value, nodes, functions, tables)
    elif isinstance(node, list):
        for value in node:
            _tree_facts(value, nodes, functions, tables)


def check_sql(sql: str) -> str:
    """Return ``sql`` if the console may run it, else raise :class:`SQLRefusedError` saying why."""
    if not isinstance(sql, str) or not sql.strip():
        raise SQLRefusedError(
            "empty query: write one SELECT statement over the views "
            "runs, tokens, evictions, steps, replay, replay_steps, problems"
        )
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise SQLSandboxError(f"cannot parse the query: {exc}") from None
    if len(statements) != 1:
        raise SQLRefusedError(
            f"refused: {len(statements)} statements; the console runs exactly one SELECT statement per query"
        )
    kind = statements[0].type.name
    if kind != "SELECT":
        words = re.sub(r"--[^\n]*|/\*.*?\*/", " ", statements[0].query, flags=re.S).split()
        word = words[0].upper() if words else kind
        what = f"{word} statement" if word == kind else f"{word} statement ({kind})"
        raise SQLRefusedError(
            f"refused: {what}; the console is read-only and runs only SELECT / WITH … SELECT statements"
        )
    tree = _parse_tree(sql)
    if tree.get("error"):
        raise SQLRefusedError(f"refused: {tree.get('error_message', 'the statement cannot be checked')}")
    nodes: set[str] = set()
    functions: set[str] = set()
    tables: set[str] = set()
    _tree_facts(tree, nodes, functions, tables)
    writing = sorted(nodes - _ALLOWED_NODES)
    if writing:
        kinds = ", ".join(n.removesuffix("_QUERY_NODE").removesuffix("_NODE") for n in writing)
        raise SQLRefusedError(
            f"refused: the statement contains {kinds} (e.g. in a WITH clause); the console is read-only"
        )
    hidden = sorted(functions & _SQL_TEXT_FUNCTIONS)
    if hidden:
        raise SQLRefusedError(
            f"refused: {', '.join(f + '()' for f in hidden)} takes SQL text that cannot be "
            "checked here; write the query directly"
        )
    unknown = sorted(tables - TABLE_FUNCTIONS)
    if unknown:
        raise SQLRefusedError(
            f"refused: table function {', '.join(f + '()' for f in unknown)} is not "
            f"available in the console; allowed: {', '.join(sorted(TABLE_FUNCTIONS))}"
        )
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
                        "console reads only the root. Copy the run into the root instead of linking it"
                    )


def _failure(kind: str, type_name: str, message: str, root: Path, memory_limit: int) -> SQLSandboxError:
    """The error for a worker's answer ``kind`` (``memory``, ``bytes`` or ``error``)."""
    text = message.split("\n")[0]
    if kind == "memory":
        return SQLSandboxError(
            f"query stopped: it needs more than the sandbox's {_mb(memory_limit)} memory "
            f"limit ({text}); filter by run_id, step or layer, aggregate, or raise the limit"
        )
    if kind == "bytes":
        return SQLSandboxError(
            f"query refused: {text}; select fewer columns or rows, aggregate, or raise the byte cap (--max-bytes)"
        )
    if type_name == "PermissionException" or "disabled by configuration" in text:
        return SQLRefusedError(f"refused: {text}. Only files under the runs root {root} can be read")
    if "read-only" in text or "configuration has been locked" in text:
        return SQLRefusedError(f"refused: {text}")
    return SQLSandboxError(f"query failed: {text}")


def _duckdb_share(memory_limit: int) -> int:
    """DuckDB's own memory limit inside a worker capped at ``memory_limit``.

    A quarter to a half of the cap: the rest is room for allocations outside DuckDB's buffer
    manager and for its allocator's reserve (the cap counts mapped, not touched, memory), so
    operators spill to the temp folder before the kernel refuses an allocation.
    """
    return max(memory_limit // 4, memory_limit // 2 - 128 * 2**20)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 10**6 else f"{n:,} bytes"


def _check_timeout(timeout_s: Any) -> float:
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise ParameterError(
            f"the time limit (timeout_s, --timeout) must be a finite number of seconds > 0, got {timeout_s!r}"
        )
    return float(timeout_s)


class _Worker:
    """The process that runs a sandbox's statements (``_sql_worker.py``), and its two pipes."""

    def __init__(self, config: dict[str, Any], log: Path) -> None:
        self.log = log
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        try:
            with open(log, "ab") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-P", str(_WORKER), str(down_r), str(up_w)],
                    pass_fds=(down_r, up_w),
                    stdin=subprocess.DEVNULL,
                    stdout=err,
                    stderr=err,
                    close_fds=True,
                )
        except BaseException:
            for fd in (down_r, down_w, up_r, up_w):
                os.close(fd)
            raise
        os.close(down_r)
        os.close(up_w)
        self.inbox, self.out = Connection(up_r, writable=False), Connection(down_w, readable=False)
        try:
            self.out.send_bytes(json.dumps(config).encode())
            ready = self.receive(_START_TIMEOUT_S)
        except (EOFError, OSError):
            ready = None
        if ready is None or ready.get("kind") != "ready":
            self.kill()
            raise SQLSandboxError(f"the SQL worker process did not start: {self.log_tail()}")
        self.data_cap = ready.get("data_cap")

    def send(self, request: dict[str, Any]) -> None:
        self.out.send_bytes(json.dumps(request).encode())

    def receive(self, timeout_s: float) -> dict[str, Any] | None:
        """The next header, or None if none came within ``timeout_s``; raises EOFError if the worker ended."""
        if not self.inbox.poll(max(timeout_s, 0.0)):
            return None
        return json.loads(self.inbox.recv_bytes())

    def log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        code = self.proc.poll()
        return (f"exit code {code}; " if code is not None else "") + (lines[-1] if lines else "no message")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.inbox.close()
        self.out.close()

    def close(self) -> None:
        self.out.close()  # end of requests: the worker exits
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.inbox.close()


class Sandbox:
    """A locked, read-only DuckDB connection over the views of one runs root, in a worker process.

    Parameters
    ----------
    root : path-like
        Runs root; the only directory its statements may read.
    memory_limit : int or str
        Memory a statement may use, e.g. ``"1GB"`` (bytes as an int also work); enforced by the
        kernel on the worker process (module docstring).
    threads : int
        DuckDB worker threads.
    spill_limit : int or str
        Largest size of the temp folder that operators spill to.

    Reuse one sandbox for many queries (``run``); it reflects the runs that
    existed when it was opened. Close it (or use ``with``) to end the worker
    and remove its temp folder.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        memory_limit: int | str = "1GB",
        threads: int = 2,
        spill_limit: int | str = "4GB",
    ):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ParameterError(f"runs root {self.root} does not exist or is not a folder")
        self.memory_limit = parse_size(memory_limit, "the memory limit (memory_limit, --memory-limit)")
        if self.memory_limit < 16 * 2**20:
            raise ParameterError(f"memory_limit must be at least 16 MiB, got {memory_limit!r}")
        spill = parse_size(spill_limit, "spill_limit")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ParameterError(f"threads must be an int >= 1, got {threads!r}")
        _refuse_links_out(self.root)
        self._tmp = Path(tempfile.mkdtemp(prefix="h2o-lens-sql-"))
        try:
            path = self._tmp / "views.duckdb"
            writer = duckdb.connect(str(path))
            try:
                open_runs(self.root, con=writer, warn=False)
            finally:
                writer.close()
            (self._tmp / "spill").mkdir()
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self._config = {
            "db": str(path),
            "threads": threads,
            "temp_directory": str(self._tmp / "spill"),
            "temp_bytes": spill,
            "memory_bytes": self.memory_limit,
            "duckdb_memory_bytes": _duckdb_share(self.memory_limit),
            "allowed_directories": [str(self.root) + os.sep],
        }
        self._worker: _Worker | None = None
        self._lock = threading.Lock()

    def _ensure_worker(self) -> _Worker:
        if self._worker is None:
            self._worker = _Worker(self._config, self._tmp / "worker.log")
        return self._worker

    def _drop_worker(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def run(
        self, sql: str, *, max_rows: int = 10_000, timeout_s: float = 10.0, max_bytes: int | str = "64MB"
    ) -> pd.DataFrame:
        """Run one checked SELECT; ``df.attrs['truncated']`` says whether rows were cut at ``max_rows``.

        Nothing is returned after ``timeout_s``: the worker is killed at the deadline.

        Raises
        ------
        SQLRefusedError
            The statement is not allowed (the message says what and why).
        SQLTimeoutError
            It ran past ``timeout_s`` and was stopped.
        SQLSandboxError
            It failed (syntax, unknown column, ...), needed more than ``memory_limit`` or its
            result passed ``max_bytes``.
        """
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
            raise ParameterError(f"max_rows must be an int >= 0, got {max_rows!r}")
        timeout_s = _check_timeout(timeout_s)
        cap = parse_size(max_bytes, "the byte cap (max_bytes, --max-bytes)")
        check_sql(sql)
        with self._lock:
            if self._tmp is None:
                raise ParameterError("the sandbox is closed; open a new one")
            worker = self._ensure_worker()
            deadline = time.monotonic() + timeout_s
            try:
                worker.send({"sql": sql, "max_rows": max_rows, "max_bytes": cap})
                header = worker.receive(deadline - time.monotonic())
                if header is None or time.monotonic() > deadline:
                    self._drop_worker()
                    raise SQLTimeoutError(
                        f"query stopped after the {timeout_s:g} s time limit; narrow it "
                        "(filter by run_id, step or layer) or aggregate"
                    )
                payload = worker.inbox.recv_bytes() if header["kind"] == "rows" else None
            except (EOFError, ConnectionError):
                why = worker.log_tail()
                self._drop_worker()
                raise SQLSandboxError(
                    f"query stopped: the SQL worker process ended ({why}); it may have "
                    f"needed more than the {_mb(self.memory_limit)} memory limit"
                ) from None
            if header["kind"] == "memory":  # an allocation failed somewhere: start the next query afresh
                self._drop_worker()
        if payload is None:
            raise _failure(
                header["kind"], header.get("type", ""), header.get("message", ""), self.root, self.memory_limit
            )
        table = pa.ipc.open_stream(payload).read_all()
        df = table.to_pandas()
        df.attrs["truncated"] = bool(header["truncated"])
        return df

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_sql(
    root: str | os.PathLike,
    sql: str,
    *,
    max_rows: int = 10_000,
    timeout_s: float = 10.0,
    max_bytes: int | str = "64MB",
    memory_limit: int | str = "1GB",
    threads: int = 2,
) -> pd.DataFrame:
    """Run one read-only SELECT over the views of ``root`` in a fresh :class:`Sandbox` (limits: see there)."""
    check_sql(sql)  # refuse before opening anything
    _check_timeout(timeout_s)
    parse_size(max_bytes, "the byte cap (max_bytes, --max-bytes)")
    with Sandbox(root, memory_limit=memory_limit, threads=threads) as box:
        return box.run(sql, max_rows=max_rows, timeout_s=timeout_s, max_bytes=max_bytes)


def format_result(df: pd.DataFrame, fmt: str = "table") -> str:
    """Format a :func:`run_sql` result as an aligned ``table``, ``csv`` or ``json``."""
    if fmt not in FORMATS:
        raise ParameterError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    rows = [tuple(None if _missing(v) else v for v in row) for row in df.itertuples(index=False, name=None)]
    return format_rows([str(c) for c in df.columns], rows, fmt, truncated=bool(df.attrs.get("truncated", False)))


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
            "WHERE table_schema = 'main' ORDER BY table_name, ordinal_position"
        ).fetchall()
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
