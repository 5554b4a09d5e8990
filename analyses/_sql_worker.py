"""The SQL console's worker process: one locked, read-only DuckDB connection under a kernel memory cap.

:class:`analyses.sql.Sandbox` starts it as ``python -P _sql_worker.py READ_FD WRITE_FD`` and
kills it when a query runs past its time limit. It imports only the standard library, duckdb
and pyarrow. Messages travel as ``multiprocessing.connection`` frames:

* in: the configuration (JSON), then one request per query (JSON: ``sql``, ``max_rows``,
  ``max_bytes``);
* out: a JSON header per message; ``{"kind": "ready", ...}`` once configured, then per query
  ``{"kind": "rows", "truncated": bool}`` followed by one Arrow IPC stream frame, or
  ``{"kind": "memory" | "bytes" | "error", "message": ..., "type": ...}``.

The memory cap is ``RLIMIT_DATA`` (Linux counts every private writable mapping): set after the
connection is open, at the data size then in use plus the sandbox's allowance, so a statement
that allocates outside DuckDB's buffer manager (a huge list or string built by one scalar
expression) fails with an out-of-memory error instead of growing.
"""

from __future__ import annotations

import json
import os
import sys
from multiprocessing.connection import Connection
from typing import Any

import duckdb
import pyarrow as pa

try:
    import resource
except ImportError:  # not on this platform: DuckDB's own limit only
    resource = None  # type: ignore[assignment]


def _send(conn: Connection, header: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(header).encode())


def _data_size() -> int | None:
    """Bytes of private writable memory mapped now (``VmData``), or None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _connect(cfg: dict[str, Any]) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(
        cfg["db"],
        read_only=True,
        config={
            "memory_limit": f"{cfg['duckdb_memory_bytes'] // 1024}KiB",
            "threads": cfg["threads"],
            "temp_directory": cfg["temp_directory"],
            "max_temp_directory_size": f"{cfg['temp_bytes'] // 1024}KiB",
        },
    )
    con.execute("SET allowed_directories = $1", [cfg["allowed_directories"]])
    for statement in (
        "SET enable_progress_bar = false",
        "SET enable_external_access = false",
        "SET autoload_known_extensions = false",
        "SET autoinstall_known_extensions = false",
        "SET lock_configuration = true",
    ):
        con.execute(statement)
    return con


def _cap_memory(allowance: int) -> int | None:
    """Cap the data segment at its present size plus ``allowance``; return the cap (None: not capped)."""
    base = _data_size()
    if resource is None or base is None or not hasattr(resource, "RLIMIT_DATA"):
        return None
    cap = base + allowance
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    return cap


def _table(con: duckdb.DuckDBPyConnection, sql: str, max_rows: int, max_bytes: int) -> tuple[pa.Table, bool] | str:
    """The first ``max_rows`` rows of ``sql`` and whether more exist, or a message when they pass ``max_bytes``."""
    reader = con.sql(sql).to_arrow_reader(min(max(max_rows, 1), 65_536) + 1)
    batches, rows, size = [], 0, 0
    for batch in reader:
        keep = min(batch.num_rows, max_rows - rows)
        kept = batch if keep == batch.num_rows else batch.slice(0, keep)
        size += kept.nbytes
        if size > max_bytes:
            return (
                f"the result passed the {max_bytes:,} byte cap within its first {rows + keep:,} rows "
                f"({size:,} bytes so far)"
            )
        batches.append(kept)
        rows += keep
        if keep < batch.num_rows:
            return pa.Table.from_batches(batches, schema=reader.schema), True
    return pa.Table.from_batches(batches, schema=reader.schema), False


def _answer(con: duckdb.DuckDBPyConnection, request: dict[str, Any], out: Connection) -> None:
    try:
        got = _table(con, request["sql"], request["max_rows"], request["max_bytes"])
        if isinstance(got, str):
            _send(out, {"kind": "bytes", "message": got})
            return
        table, truncated = got
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        payload = sink.getvalue()
    except (duckdb.OutOfMemoryException, MemoryError, pa.ArrowMemoryError) as exc:
        _send(out, {"kind": "memory", "message": str(exc).split("\n")[0], "type": type(exc).__name__})
        return
    except duckdb.Error as exc:
        _send(out, {"kind": "error", "message": str(exc), "type": type(exc).__name__})
        return
    _send(out, {"kind": "rows", "truncated": truncated})
    out.send_bytes(memoryview(payload))


def main(read_fd: int, write_fd: int) -> int:
    inbox, out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    cfg = json.loads(inbox.recv_bytes())
    con = _connect(cfg)
    con.sql("SELECT 1 AS x").to_arrow_table()  # warm up before the base size is taken
    cap = _cap_memory(cfg["memory_bytes"])
    _send(out, {"kind": "ready", "data_cap": cap, "pid": os.getpid()})
    while True:
        try:
            request = json.loads(inbox.recv_bytes())
        except EOFError:
            return 0
        _answer(con, request, out)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
