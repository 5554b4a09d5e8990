"""Finding runs and validating their files before any SQL touches them.

One damaged file matched by a DuckDB glob fails the whole query (DESIGN.md
§7), so readers never glob: :func:`scan_root` lists the run folders, checks
every segment's footer, metadata and column types (cached by path, size and
modification time) and keeps the good files; the others become
:class:`Problem` entries. A file or manifest of a newer schema version is an
error, not a problem: this code cannot read it and must be upgraded.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import (DamagedFileError, ManifestError, RecorderError, RunIdError, SchemaError,
                     SchemaVersionError)
from .manifest import MANIFEST_NAME, effective_status, read_manifest, validate_run_id
from .schema import META_SCHEMA_VERSION, RUNS, SCHEMA_VERSION, TABLE_NAMES, schema_mismatches
from .segments import SEGMENT_RE

__all__ = ["Problem", "SegmentFile", "RunEntry", "Catalog", "inspect_file", "scan_run",
           "scan_root", "run_row"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """A file or run folder that readers skipped, and why."""

    path: str
    reason: str
    run_id: str | None = None
    table: str | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class SegmentFile:
    """A validated segment: its table, row count, columns and schema version."""

    path: Path
    table: str
    rows: int
    columns: tuple[str, ...]
    schema_version: int


@dataclasses.dataclass
class RunEntry:
    """A run folder and its manifest (None when missing or unreadable)."""

    run_id: str
    path: Path
    manifest: dict[str, Any] | None
    status: str
    files: dict[str, list[SegmentFile]]


@dataclasses.dataclass
class Catalog:
    """Everything a reader needs to build views over a runs root."""

    root: Path
    runs: list[RunEntry]
    problems: list[Problem]

    def files(self, table: str) -> list[SegmentFile]:
        """Good segments of ``table`` over all runs."""
        return [f for run in self.runs for f in run.files.get(table, [])]


# -- one file ---------------------------------------------------------------------

@functools.lru_cache(maxsize=65536)
def _inspect_cached(path: str, size: int, mtime_ns: int, table: str
                    ) -> tuple[SegmentFile | None, RecorderError | None]:
    try:
        md = pq.read_metadata(path)
        schema = md.schema.to_arrow_schema()
    except (OSError, pa.ArrowException, ValueError) as exc:
        return None, DamagedFileError(
            f"{path}: not a readable Parquet file ({size} bytes; {exc}). A writer killed mid-file "
            "or a partial copy leaves such files; move it away or delete it")
    raw = (md.metadata or {}).get(META_SCHEMA_VERSION.encode())
    try:
        version = int(raw) if raw is not None else None
    except ValueError:
        version = None
    if version is None:
        return None, SchemaError(
            f"{path}: no valid {META_SCHEMA_VERSION} metadata (found {raw!r}); the file was not "
            "written by recorders. Move it out of the run folder")
    if version > SCHEMA_VERSION:
        return None, SchemaVersionError(
            f"{path}: written with log schema version {version}, this code reads versions "
            f"<= {SCHEMA_VERSION}; upgrade h2o-lens to open it")
    mismatches = schema_mismatches(table, schema)
    if mismatches:
        return None, SchemaError(f"{path}: does not match the {table!r} schema: "
                                 + "; ".join(mismatches))
    return SegmentFile(Path(path), table, md.num_rows, tuple(schema.names), version), None


def inspect_file(path: str | os.PathLike, table: str | None = None) -> SegmentFile:
    """Validate one segment from its footer (cached by path, size and mtime).

    Raises
    ------
    DamagedFileError
        Missing footer, zero bytes, not Parquet.
    SchemaError
        No ``h2o_lens.schema_version`` metadata, or columns of the wrong type.
    SchemaVersionError
        Written by a newer schema version.
    """
    path = Path(path)
    if table is None:
        m = SEGMENT_RE.fullmatch(path.name)
        if not m:
            raise SchemaError(f"{path}: not a segment name (<table>-00000.parquet)")
        table = m["table"]
    try:
        st = path.stat()
    except OSError as exc:
        raise DamagedFileError(f"{path}: cannot be read ({exc})") from None
    seg, err = _inspect_cached(str(path), st.st_size, st.st_mtime_ns, table)
    if err is not None:
        raise type(err)(str(err))  # a fresh exception: the cached one keeps no traceback
    assert seg is not None
    return seg


# -- one run and a whole root ----------------------------------------------------------

def scan_run(run_dir: str | os.PathLike, *, strict: bool = False) -> tuple[RunEntry, list[Problem]]:
    """Read a run's manifest and validate its segments.

    With ``strict=True`` the first damaged file or missing manifest raises
    (naming the file); otherwise they become problems and are left out.
    :class:`SchemaVersionError` always raises.
    """
    run_dir = Path(run_dir)
    problems: list[Problem] = []
    folder_id = run_dir.name
    try:
        manifest: dict[str, Any] | None = read_manifest(run_dir)
        run_id = str(manifest.get("run_id") or folder_id)
        status = effective_status(manifest)
    except (ManifestError, DamagedFileError) as exc:
        if strict:
            raise
        manifest, run_id, status = None, folder_id, "unknown"
        problems.append(Problem(str(run_dir / MANIFEST_NAME), str(exc), folder_id))
    if run_id != folder_id:
        problems.append(Problem(str(run_dir), f"folder name {folder_id!r} differs from the "
                                f"manifest's run_id {run_id!r}, which its rows carry", run_id))
    files: dict[str, list[SegmentFile]] = {}
    for entry in sorted(os.scandir(run_dir), key=lambda e: e.name):
        m = SEGMENT_RE.fullmatch(entry.name)
        if not m:
            continue
        table = m["table"]
        if table not in TABLE_NAMES:
            if strict:
                raise SchemaError(f"{entry.path}: unknown table {table!r}; expected one of "
                                  f"{', '.join(TABLE_NAMES)}")
            problems.append(Problem(entry.path, f"unknown table {table!r}", run_id, table))
            continue
        try:
            files.setdefault(table, []).append(inspect_file(entry.path, table))
        except SchemaVersionError:
            raise
        except RecorderError as exc:
            if strict:
                raise
            problems.append(Problem(entry.path, str(exc), run_id, table))
    return RunEntry(run_id, run_dir, manifest, status, files), problems


def _is_run_folder(path: Path) -> bool:
    if (path / MANIFEST_NAME).exists():
        return True
    with os.scandir(path) as entries:
        return any(SEGMENT_RE.fullmatch(e.name) for e in entries)


def scan_root(root: str | os.PathLike) -> Catalog:
    """Scan every run folder ``<root>/<run_id>/`` (hidden folders are skipped)."""
    root = Path(root)
    runs: list[RunEntry] = []
    problems: list[Problem] = []
    if not root.is_dir():
        problems.append(Problem(str(root), "runs root does not exist or is not a folder"))
        return Catalog(root, runs, problems)
    seen: dict[str, Path] = {}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        path = Path(entry.path)
        if entry.name.startswith((".", "_")) or not entry.is_dir() or not _is_run_folder(path):
            continue
        try:
            validate_run_id(entry.name)
        except RunIdError as exc:
            problems.append(Problem(str(path), f"skipped: {exc}"))
            continue
        run, run_problems = scan_run(path)
        problems.extend(run_problems)
        if run.run_id in seen:
            problems.append(Problem(str(path), f"skipped: run_id {run.run_id!r} is already used by "
                                    f"{seen[run.run_id]}", run.run_id))
            continue
        seen[run.run_id] = path
        runs.append(run)
    return Catalog(root, runs, problems)


def _coerce(type_: pa.DataType, value: Any) -> Any:
    """A manifest value as the declared Python type, or None when it does not fit."""
    if value is None or isinstance(value, (dict, list)) and not pa.types.is_string(type_):
        return None
    try:
        if pa.types.is_timestamp(type_):
            return dt.datetime.fromisoformat(str(value).rstrip("Z")).replace(tzinfo=None)
        if pa.types.is_integer(type_):
            return int(value) if not isinstance(value, bool) else None
        if pa.types.is_floating(type_):
            return float(value)
        if pa.types.is_string(type_):
            return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return value


def run_row(run: RunEntry) -> dict[str, Any]:
    """The ``runs`` view row of a run: manifest fields first, then its config's."""
    manifest = run.manifest or {}
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    model = manifest.get("model")
    row: dict[str, Any] = {}
    for field in RUNS:
        name = field.name
        value = manifest.get(name, config.get(name))
        if name == "run_id":
            value = run.run_id
        elif name == "status":
            value = run.status
        elif name == "model":
            value = (model.get("name") or model.get("id")) if isinstance(model, dict) else model
        elif name == "config":
            value = json.dumps(config, sort_keys=True) if manifest else None
        elif name == "path":
            value = str(run.path)
        row[name] = _coerce(field.type, value)
    return row
