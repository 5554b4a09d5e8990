"""Crash-safe Parquet segments.

Rows are appended per table as column batches; when a table's buffer holds
``rows_per_segment`` rows (and at close) it becomes one closed segment
``<table>-00000.parquet`` in the run folder. A segment is written under
``<name>.parquet.tmp`` (a name the readers never match), closed, fsynced,
renamed, and the folder is fsynced: a process killed at any moment leaves
only complete files plus, at worst, one ``*.tmp`` that the next writer
removes (DESIGN.md §7).

Encoding: zstd, byte-stream-split for float columns, delta for int64 columns,
dictionary for the rest; every page carries a CRC-32 checksum. Every file carries the key-value metadata
``h2o_lens.schema_version``, ``h2o_lens.config``, ``h2o_lens.table`` and
``h2o_lens.run_id``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .contract import META_MODEL
from .errors import SchemaError, storage_error
from .manifest import listed_segments
from .schema import META_CONFIG, META_RUN_ID, META_SCHEMA_VERSION, META_TABLE, SCHEMA_VERSION, table_schema, to_arrow

__all__ = [
    "SEGMENT_RE",
    "DEFAULT_ROWS_PER_SEGMENT",
    "ROW_GROUP_SIZE",
    "segment_name",
    "list_segments",
    "clean_temp_files",
    "write_options",
    "write_segment",
    "SegmentWriter",
]

#: a segment: ``<table>-NNNNN.parquet``, or ``<table>-NNNNN.<tag>.parquet`` for the segments of one
#: replay (they count only once a manifest lists them, DESIGN.md §6.1)
SEGMENT_RE = re.compile(r"(?P<table>[a-z][a-z_]*)-(?P<index>\d{5,})(?:\.(?P<tag>[0-9a-z]+))?\.parquet")
DEFAULT_ROWS_PER_SEGMENT = 262_144
ROW_GROUP_SIZE = 131_072  # DuckDB scans row groups in parallel
ZSTD_LEVEL = 3


def segment_name(table: str, index: int, tag: str | None = None) -> str:
    """File name of segment ``index`` of ``table``: ``evictions-00012.parquet``
    (``replay-00000.<tag>.parquet`` with a ``tag``)."""
    return f"{table}-{index:05d}.{tag}.parquet" if tag else f"{table}-{index:05d}.parquet"


def list_segments(run_dir: str | os.PathLike, *, current: bool = True) -> dict[str, list[Path]]:
    """Closed segments of a run folder, per table name, in segment order.

    With ``current`` (the default) the segments the readers count: those the manifest lists
    when it lists them (DESIGN.md §5.1), else the untagged ones. ``current=False``: every
    segment file in the folder, tagged ones included.
    """
    found: dict[str, list[tuple[str, int, Path]]] = {}
    try:
        entries = list(os.scandir(run_dir))
    except FileNotFoundError:
        return {}
    listed = listed_segments(run_dir) if current else None
    for entry in entries:
        m = SEGMENT_RE.fullmatch(entry.name)
        if not m or not entry.is_file():
            continue
        if current and (entry.name not in listed if listed is not None else m["tag"] is not None):
            continue
        found.setdefault(m["table"], []).append((m["tag"] or "", int(m["index"]), Path(entry.path)))
    return {t: [p for *_, p in sorted(v)] for t, v in sorted(found.items())}


def clean_temp_files(run_dir: str | os.PathLike) -> list[Path]:
    """Remove ``*.tmp`` leftovers of a killed writer; return what was removed."""
    removed = []
    for entry in os.scandir(run_dir):
        if entry.name.endswith(".tmp") and entry.is_file():
            with contextlib.suppress(FileNotFoundError):  # another writer's cleanup got there first
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def write_options(schema: pa.Schema) -> dict[str, Any]:
    """Keyword arguments of ``pq.write_table`` for a declared schema.

    Derived from the column types: byte-stream-split for floats, delta for
    int64 (steps and positions: sorted or nearly so), dictionary for the rest
    (small ints, flags, strings). Min/max statistics are written for every
    column but the floating-point ones: Parquet statistics leave NaN out, and
    DuckDB answers ``isnan(x)`` and range filters from them, so a column whose
    NaN carries a meaning (``margin``: nothing eligible survived) would read as
    having none.
    """
    encoding = {}
    for field in schema:
        if pa.types.is_floating(field.type):
            encoding[field.name] = "BYTE_STREAM_SPLIT"
        elif pa.types.is_int64(field.type):
            encoding[field.name] = "DELTA_BINARY_PACKED"
    return {
        "compression": "zstd",
        "compression_level": ZSTD_LEVEL,
        "use_dictionary": [f.name for f in schema if f.name not in encoding],
        "column_encoding": encoding,
        "row_group_size": ROW_GROUP_SIZE,
        "write_statistics": [f.name for f in schema if not pa.types.is_floating(f.type)],
        "write_page_checksum": True,  # readers verify every page (runlog.catalog)
    }


def _fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_metadata(table: str, run_id: str | None, config_json: str, model: str | None = None) -> dict[str, str]:
    """Key-value metadata carried by every segment (``model``: the run's model tag,
    :func:`runlog.contract.model_tag`)."""
    meta = {META_SCHEMA_VERSION: str(SCHEMA_VERSION), META_CONFIG: config_json, META_TABLE: table}
    if run_id is not None:
        meta[META_RUN_ID] = run_id
    if model is not None:
        meta[META_MODEL] = model
    return meta


def write_segment(
    path: str | os.PathLike,
    table: str,
    data: pa.Table,
    *,
    config_json: str = "{}",
    run_id: str | None = None,
    metadata: Mapping[str, str] | None = None,
    fsync: bool = True,
    model: str | None = None,
) -> Path:
    """Write one closed segment atomically.

    Parameters
    ----------
    path : path-like
        Final name, ``<run_dir>/<table>-NNNNN.parquet``.
    table : str
        Declared table name; ``data`` must have exactly its schema.
    data : pyarrow.Table
    config_json : str
        Run configuration, stored as ``h2o_lens.config``.
    metadata : mapping, optional
        Extra key-value metadata (overrides the defaults; tests use it).
    fsync : bool
        fsync the file and the folder (turn off only for throwaway data).
    model : str, optional
        The run's model tag (:func:`runlog.contract.model_tag`), stored as ``h2o_lens.model``.

    Raises
    ------
    StorageError
        Writing failed (a full disk, say): the temporary file is removed and the error names
        the segment, the space it needed and the space free.
    """
    path = Path(path)
    schema = table_schema(table)
    if not data.schema.equals(schema):
        raise SchemaError(
            f"segment {path.name}: table schema differs from the declared "
            f"{table!r} schema; build it with schema.to_arrow()"
        )
    meta = file_metadata(table, run_id, config_json, model)
    meta.update(metadata or {})
    data = data.replace_schema_metadata(meta)
    tmp = path.with_name(path.name + ".tmp")
    try:
        pq.write_table(data, tmp, **write_options(schema))
        if fsync:
            _fsync_path(tmp)
        os.replace(tmp, path)
        if fsync:
            _fsync_path(path.parent)
    except OSError as exc:  # a full disk, a quota: no half-written file stays, and the error says so
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise storage_error(path, exc, _encoded_size(data, schema)) from exc
    return path


def _encoded_size(data: pa.Table, schema: pa.Schema) -> int | None:
    """Bytes ``data`` takes as a segment file (encoded in memory: what a failed write needed)."""
    try:
        sink = pa.BufferOutputStream()
        pq.write_table(data, sink, **write_options(schema))
        return sink.tell()
    except (pa.ArrowException, OSError, ValueError):
        return None


class SegmentWriter:
    """Buffers rows per table and writes them as closed segments.

    Parameters
    ----------
    run_dir : path-like
        Existing run folder. Leftover ``*.tmp`` files are removed; segment
        numbering continues after the segments already there.
    run_id : str, optional
        Fills the ``run_id`` column; defaults to the folder name.
    config : mapping, optional
        Run configuration, stored in every file's metadata as JSON.
    rows_per_segment : int
        Buffered rows of one table that trigger a segment.
    fsync : bool
        Make each segment durable before it becomes visible.
    tag : str, optional
        Name the segments ``<table>-NNNNN.<tag>.parquet``: files the readers count only once a
        manifest lists them (a replay's, switched to in one manifest rename; DESIGN.md §6.1).
    model : str, optional
        The run's model tag (:func:`runlog.contract.model_tag`), stored in every file.

    ``files`` maps the name of every segment written to its rows (the manifest's ``segments``).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        run_id: str | None = None,
        config: Mapping[str, Any] | None = None,
        rows_per_segment: int = DEFAULT_ROWS_PER_SEGMENT,
        fsync: bool = True,
        tag: str | None = None,
        model: str | None = None,
    ) -> None:
        if isinstance(rows_per_segment, bool) or not isinstance(rows_per_segment, int) or rows_per_segment < 1:
            raise ValueError(f"rows_per_segment must be a positive int, got {rows_per_segment!r}")
        if tag is not None and not re.fullmatch(r"[0-9a-z]+", tag):
            raise ValueError(f"tag must be lower-case letters and digits, got {tag!r}")
        self.run_dir = Path(run_dir)
        self.run_id = run_id or self.run_dir.name
        self.config_json = json.dumps(dict(config or {}), sort_keys=True, default=str)
        self.rows_per_segment = rows_per_segment
        self.fsync = fsync
        self.tag = tag
        self.model = model
        self.removed_temp_files = clean_temp_files(self.run_dir)
        self._next: dict[str, int] = {}
        for entry in os.scandir(self.run_dir):  # numbering continues after the segments of the same tag
            m = SEGMENT_RE.fullmatch(entry.name)
            if m and m["tag"] == tag:
                self._next[m["table"]] = max(self._next.get(m["table"], 0), int(m["index"]) + 1)
        self._buffers: dict[str, list[pa.Table]] = {}
        self._buffered: dict[str, int] = {}
        self.rows_written: dict[str, int] = {}
        self.files: dict[str, int] = {}
        self.segments: list[Path] = []
        self.closed = False

    def append(self, table: str, columns: Mapping[str, Any] | pa.Table) -> None:
        """Buffer one batch of rows of ``table``.

        ``columns`` maps column names to arrays of shape (n,) or scalars (see
        :func:`runlog.schema.to_arrow`), or is a table of the declared schema.
        """
        if self.closed:
            raise ValueError(f"segment writer of {self.run_dir} is closed; open a new one")
        if isinstance(columns, pa.Table):
            batch = (
                columns
                if columns.schema.equals(table_schema(table))
                else to_arrow(table, {n: columns[n] for n in columns.column_names}, run_id=self.run_id)
            )
        else:
            batch = to_arrow(table, columns, run_id=self.run_id)
        if batch.num_rows == 0:
            return
        self._buffers.setdefault(table, []).append(batch)
        self._buffered[table] = self._buffered.get(table, 0) + batch.num_rows
        if self._buffered[table] >= self.rows_per_segment:
            self._flush_table(table, keep_tail=True)

    def flush(self, table: str | None = None) -> list[Path]:
        """Write every buffered row of ``table`` (or of every table) as segments."""
        written = []
        for name in [table] if table else list(self._buffers):
            written += self._flush_table(name, keep_tail=False)
        return written

    def _flush_table(self, table: str, *, keep_tail: bool) -> list[Path]:
        """Write full segments; with ``keep_tail`` the rows short of a segment stay buffered."""
        batches = self._buffers.pop(table, [])
        self._buffered.pop(table, None)
        if not batches:
            return []
        data = pa.concat_tables(batches).combine_chunks()
        size = self.rows_per_segment
        full = data.num_rows - data.num_rows % size if keep_tail else data.num_rows
        written = [self._write(table, data.slice(start, size)) for start in range(0, full, size)]
        if full < data.num_rows:
            self._buffers[table] = [data.slice(full)]
            self._buffered[table] = data.num_rows - full
        return written

    def write_table(self, table: str, data: pa.Table) -> Path:
        """Write ``data`` (declared schema) as one segment now, bypassing the buffer."""
        return self._write(table, data)

    def _write(self, table: str, data: pa.Table) -> Path:
        index = self._next.get(table, 0)
        path = write_segment(
            self.run_dir / segment_name(table, index, self.tag),
            table,
            data,
            config_json=self.config_json,
            run_id=self.run_id,
            fsync=self.fsync,
            model=self.model,
        )
        self._next[table] = index + 1
        self.rows_written[table] = self.rows_written.get(table, 0) + data.num_rows
        self.files[path.name] = data.num_rows
        self.segments.append(path)
        return path

    def close(self) -> None:
        """Flush every buffer; later appends raise."""
        if not self.closed:
            self.flush()
            self.closed = True

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
