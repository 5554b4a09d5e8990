"""Finding runs and validating their files before any SQL touches them.

One damaged file matched by a DuckDB glob fails the whole query (DESIGN.md
§7), so readers never glob: :func:`scan_root` lists the run folders, checks
every segment's footer, metadata and column types, then reads it in full
(decoding every page and verifying its checksum, so a damaged page behind an
intact footer is found here, not in the middle of a query) and counts its
rows per ``run_id``. The result is cached by path, size and modification
time. Good files are kept; the others become :class:`Problem` entries.

A run is checked as a whole too: the manifest's fields must have their
types, rows must carry the run's own id (the folder name), the segments the
manifest lists are the run's (one it does not list is left out and named;
DESIGN.md §5.1), the row counts it records must match the rows read, and
every value must keep the value contract (:mod:`runlog.contract`,
DESIGN.md §5.5). Whatever fails marks
the run: :attr:`RunEntry.integrity` (the ``runs.integrity`` column) says
what is wrong, the ``problems`` view names the file. A file or manifest of a
newer schema version is an error, not a problem: this code cannot read it
and must be upgraded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import gc
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .contract import Violation, file_facts
from .contract import check_run as check_contract
from .errors import DamagedFileError, ManifestError, RecorderError, RunIdError, SchemaError, SchemaVersionError
from .manifest import MANIFEST_NAME, check_manifest, effective_status, read_manifest, validate_run_id
from .recall_check import COLD_FOLDER, cut_short_store
from .schema import META_SCHEMA_VERSION, REPLAY_TABLES, RUNS, SCHEMA_VERSION, TABLE_NAMES, TABLES, schema_mismatches
from .segments import SEGMENT_RE

__all__ = [
    "Problem",
    "SegmentFile",
    "RunEntry",
    "Catalog",
    "inspect_file",
    "scan_run",
    "scan_root",
    "run_row",
    "replay_complete",
    "CACHE_NAME",
    "TOTALS",
]


@dataclasses.dataclass(frozen=True)
class Problem:
    """A file or run folder that readers skipped or found wrong, and why.

    ``kind`` is ``"rows"`` for a row count that differs from the manifest's, ``"unlisted"``
    for a segment the manifest does not list and ``"values"`` for a value that breaks the
    value contract (DESIGN.md §5.5).
    """

    path: str
    reason: str
    run_id: str | None = None
    table: str | None = None
    kind: str | None = None

    def __str__(self) -> str:
        return self.reason if self.reason.startswith(f"{self.path}: ") else f"{self.path}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class SegmentFile:
    """A validated segment: its table, row count, columns, schema version and rows per run id.

    ``totals`` holds ``(column, sum, non-null count)`` of the columns the runs table
    averages (:data:`TOTALS`), summed while the file is read through; the sum is
    None when no value is set. ``facts``: what the value contract checks (DESIGN.md §5.5).
    """

    path: Path
    table: str
    rows: int
    columns: tuple[str, ...]
    schema_version: int
    run_ids: tuple[tuple[str | None, int], ...] = ()
    totals: tuple[tuple[str, float | None, int], ...] = ()
    #: what the value contract needs of the file (:func:`runlog.contract.file_facts`)
    facts: dict[str, Any] | None = dataclasses.field(default=None, hash=False, compare=False)


@dataclasses.dataclass
class RunEntry:
    """A run folder and its manifest (None when missing or unreadable).

    ``notes`` says briefly what is wrong with the run's files (empty when
    nothing is); :attr:`integrity` is the ``runs.integrity`` value.
    """

    run_id: str
    path: Path
    manifest: dict[str, Any] | None
    status: str
    files: dict[str, list[SegmentFile]]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def integrity(self) -> str:
        return "; ".join(self.notes) if self.notes else "ok"


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
def _inspect_cached(path: str, size: int, mtime_ns: int, table: str) -> tuple[SegmentFile | None, RecorderError | None]:
    source = None
    try:
        source = pa.OSFile(path)  # a local file, opened as one: no filesystem lookup per file
        pf = pq.ParquetFile(source, page_checksum_verification=True)  # the footer, read once for all below
    except (OSError, pa.ArrowException, ValueError) as exc:
        if source is not None:
            source.close()
        return None, DamagedFileError(
            f"{path}: not a readable Parquet file ({size} bytes; {exc}). A writer killed mid-file "
            "or a partial copy leaves such files; move it away or delete it"
        )
    with source, pf:
        return _inspect_open(pf, path, table)


def _inspect_open(pf: pq.ParquetFile, path: str, table: str) -> tuple[SegmentFile | None, RecorderError | None]:
    md = pf.metadata
    schema = pf.schema_arrow
    metadata = md.metadata or {}
    raw = metadata.get(META_SCHEMA_VERSION.encode())
    try:
        version = int(raw) if raw is not None else None
    except ValueError:
        version = None
    if version is None:
        return None, SchemaError(
            f"{path}: no valid {META_SCHEMA_VERSION} metadata (found {raw!r}); the file was not "
            "written by recorders. Move it out of the run folder"
        )
    if version > SCHEMA_VERSION:
        return None, SchemaVersionError(
            f"{path}: written with log schema version {version}, this code reads versions "
            f"<= {SCHEMA_VERSION}; upgrade h2o-lens to open it"
        )
    mismatches = schema_mismatches(table, schema)
    if mismatches:
        return None, SchemaError(f"{path}: does not match the {table!r} schema: " + "; ".join(mismatches))
    try:
        rows, run_ids, totals, facts = _read_through(pf, table, metadata)
    except (OSError, pa.ArrowException, ValueError) as exc:
        return None, DamagedFileError(
            f"{path}: the footer is intact but the data cannot be read ({exc}). Damaged pages "
            "(a bad disk or copy); move the file away or delete it"
        )
    if rows != md.num_rows:
        return None, DamagedFileError(
            f"{path}: the footer announces {md.num_rows} rows but {rows} were read; move the file away or delete it"
        )
    return SegmentFile(Path(path), table, md.num_rows, tuple(schema.names), version, run_ids, totals, facts), None


#: Columns whose sum and non-null count :func:`_read_through` keeps per file (the runs table's means).
TOTALS: dict[str, tuple[str, ...]] = {
    "replay_steps": ("kl", "top1_agree"),
    "replay": ("dropped_mass",),
    "requests": ("correct",),
}


def _single_value(md: pq.FileMetaData | None, name: str) -> str | None:
    """The one value of column ``name`` when the footer's statistics show no other and no null."""
    if md is None or md.num_row_groups == 0:
        return None
    try:
        i = md.schema.names.index(name)
        value = None
        for g in range(md.num_row_groups):
            st = md.row_group(g).column(i).statistics
            if st is None or not st.has_min_max or st.null_count or st.min != st.max or value not in (None, st.min):
                return None
            value = st.min
    except (ValueError, IndexError, pa.ArrowException):
        return None
    return value if isinstance(value, str) else None


def _read_through(
    pf: pq.ParquetFile, table: str | None = None, metadata: dict[bytes, bytes] | None = None
) -> tuple[int, tuple[tuple[str | None, int], ...], tuple[tuple[str, float | None, int], ...], dict[str, Any] | None]:
    """Decode every page of an open file (verifying page checksums where the writer stored them);
    return its row count, its rows per ``run_id``, the :data:`TOTALS` of ``table`` and the
    facts the value contract checks (:func:`runlog.contract.file_facts`)."""
    counts: dict[str | None, int] = {}
    sums: dict[str, list] = {c: [None, 0] for c in TOTALS.get(table or "", ())}
    rows = 0
    batches = []
    md = pf.metadata
    one_run = _single_value(md, "run_id")  # the footer's statistics say every row has this run id
    for batch in pf.iter_batches(batch_size=131_072, use_threads=False):
        rows += batch.num_rows
        batches.append(batch)
        if one_run is not None:
            counts[one_run] = counts.get(one_run, 0) + batch.num_rows
        else:
            ids = batch.column(batch.schema.get_field_index("run_id"))
            for item in pc.value_counts(ids).to_pylist():
                counts[item["values"]] = counts.get(item["values"], 0) + item["counts"]
        for name, acc in sums.items():
            col = batch.column(batch.schema.get_field_index(name))
            n = len(col) - col.null_count
            if n:
                part = pc.sum(col.cast(pa.float64())).as_py()
                acc[0] = part if acc[0] is None else acc[0] + part
                acc[1] += n
    totals = tuple((name, acc[0], acc[1]) for name, acc in sums.items())
    facts = None
    if table in TABLES:
        data = batches[0] if len(batches) == 1 else pa.Table.from_batches(batches, schema=pf.schema_arrow)
        facts = file_facts(table, data, md, metadata)
    return rows, tuple(sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))), totals, facts


def inspect_file(path: str | os.PathLike, table: str | None = None) -> SegmentFile:
    """Validate one segment: footer, metadata, column types, then every page (cached by
    path, size and mtime).

    Raises
    ------
    DamagedFileError
        Missing footer, zero bytes, not Parquet, a page that cannot be decoded or
        whose checksum does not match.
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


# -- the root's catalog cache ---------------------------------------------------------

#: File of a runs root that keeps what :func:`scan_root` learnt about each file (DESIGN.md §7.4).
CACHE_NAME = ".h2o-lens-catalog.json"
_CACHE_FORMAT = 3  # 2: the value contract's facts per file; 3: the guard events and the run-wide checks
_ERRORS: dict[str, type[RecorderError]] = {e.__name__: e for e in (DamagedFileError, SchemaError, ManifestError)}


def _stat_key(st: os.stat_result) -> list[int]:
    """What identifies one version of a file: size, modification and change times, inode.

    Writers replace segments and manifests by renaming a new file into place (a new
    inode); an edit in place changes the size or the change time, which no tool can set.
    """
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


@functools.cache
def _declared_names(table: str) -> tuple[str, ...]:
    return tuple(TABLES[table].names)


class _RootCache:
    """What a scan learnt per file version, kept in ``<root>/.h2o-lens-catalog.json`` (DESIGN.md §7.4).

    Entries are keyed by ``<run_id>/<file name>`` and hold the file's :func:`_stat_key`:
    a file whose key differs is read again. A cache file that is missing, unreadable,
    of another format or schema version is ignored (and rewritten); it is written to a
    temporary file and renamed into place, so a reader never sees half of it, and two
    scans at once each leave a whole one. A root that cannot be written is scanned
    without keeping anything.
    """

    def __init__(self, root: Path) -> None:
        self.path = root / CACHE_NAME
        self.old: dict[str, list] = {}
        self.new: dict[str, list] = {}
        self.keys: dict[str, list[int]] = {}  # the stat key of every file seen in this scan
        self.dirty = False
        try:
            with open(self.path, "rb") as fh:
                data = json.loads(fh.read())
            if (
                isinstance(data, dict)
                and data.get("format") == _CACHE_FORMAT
                and data.get("schema_version") == SCHEMA_VERSION
                and isinstance(data.get("files"), dict)
            ):
                self.old = data["files"]
        except (OSError, ValueError, RecursionError):
            pass

    def _get(self, rel: str, key: list[int]) -> Any:
        entry = self.old.get(rel)
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == key:
            self.new[rel] = entry
            return entry[1]
        return None

    def _put(self, rel: str, key: list[int], value: Any) -> None:
        self.new[rel] = [key, value]
        self.dirty = True

    def segment(self, path: str, rel: str, table: str) -> SegmentFile:
        """:func:`inspect_file` through the cache."""
        try:
            st = os.stat(path)
        except OSError as exc:
            raise DamagedFileError(f"{path}: cannot be read ({exc})") from None
        key = self.keys[rel] = _stat_key(st)
        hit = self._get(rel, key)
        try:
            if isinstance(hit, dict) and hit.get("table") == table and hit.get("error") in _ERRORS:
                raise _ERRORS[hit["error"]](hit["message"])
            if isinstance(hit, list) and hit[0] == table:  # [table, rows, columns, version, run_ids, totals]
                _, rows, columns, version, run_ids, totals = hit
                return SegmentFile(  # without the contract's facts: the run's findings are cached (contract())
                    Path(path),
                    table,
                    int(rows),
                    _declared_names(table) if columns is None else tuple(columns),
                    int(version),
                    tuple((rid, int(n)) for rid, n in run_ids),
                    tuple((c, v, int(n)) for c, v, n in totals),
                )
        except (KeyError, IndexError, TypeError, ValueError):
            pass  # an entry of another shape: read the file again
        try:
            seg = inspect_file(path, table)
        except (DamagedFileError, SchemaError) as exc:
            self._put(rel, key, {"table": table, "error": type(exc).__name__, "message": str(exc)})
            raise
        columns = None if seg.columns == _declared_names(table) else list(seg.columns)
        totals = [list(x) for x in seg.totals]
        self._put(rel, key, [table, seg.rows, columns, seg.schema_version, [list(x) for x in seg.run_ids], totals])
        return seg

    def manifest(self, run_dir: Path) -> tuple[dict[str, Any], list[str]]:
        """``check_manifest(read_manifest(run_dir))`` through the cache."""
        rel = f"{run_dir.name}/{MANIFEST_NAME}"
        try:
            key = self.keys[rel] = _stat_key(os.stat(run_dir / MANIFEST_NAME))
        except OSError:
            return check_manifest(read_manifest(run_dir))  # missing: read_manifest says so
        hit = self._get(rel, key)
        if isinstance(hit, dict):
            if "error" in hit and hit["error"] in _ERRORS:
                raise _ERRORS[hit["error"]](hit["message"])
            if isinstance(hit.get("manifest"), dict) and isinstance(hit.get("issues"), list):
                return hit["manifest"], hit["issues"]
        try:
            manifest, issues = check_manifest(read_manifest(run_dir))
        except (ManifestError, DamagedFileError) as exc:
            self._put(rel, key, {"error": type(exc).__name__, "message": str(exc)})
            raise
        self._put(rel, key, {"manifest": manifest, "issues": list(issues)})
        return manifest, issues

    def contract(
        self, run_dir: Path, manifest: dict[str, Any] | None, files: dict[str, list[SegmentFile]]
    ) -> list[Violation]:
        """:func:`runlog.contract.check_run` through the cache: the findings are kept per run,
        keyed by the run folder and the versions of its manifest and of every file it reads. A
        run whose key differs is checked again, its files read through for their facts when this
        scan took them from the cache (once per run change, as at its first scan)."""
        names = [f"{run_dir.name}/{MANIFEST_NAME}"] + [
            f"{run_dir.name}/{f.path.name}" for fs in files.values() for f in fs
        ]
        if any(n not in self.keys for n in names):
            return check_contract(manifest, files, run_dir)
        signature = repr((str(run_dir), names, [self.keys[n] for n in names]))  # names and int keys: stable
        rel, key = f"{run_dir.name}/#contract", [hashlib.sha256(signature.encode()).hexdigest()[:24]]
        hit = self._get(rel, key)
        if isinstance(hit, list) and all(isinstance(v, list) and len(v) == 4 for v in hit):
            return [Violation(*v) for v in hit]
        read = {}
        for table, segs in files.items():
            read[table] = []
            for seg in segs:
                if seg.facts is None:
                    try:
                        seg = inspect_file(seg.path, table)
                    except RecorderError:
                        pass  # changed since: the next scan sees it
                read[table].append(seg)
        found = check_contract(manifest, read, run_dir)
        self._put(rel, key, [[v.path, v.table, v.reason, v.note] for v in found])
        return found

    def save(self) -> None:
        """Write the entries of this scan (files gone since are dropped), when anything changed."""
        if not self.new and not self.old or not self.dirty and self.new.keys() == self.old.keys():
            return  # nothing learnt (an empty root gets no file), or nothing changed
        data = {"format": _CACHE_FORMAT, "schema_version": SCHEMA_VERSION, "files": self.new}
        tmp = self.path.with_name(f"{CACHE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
            os.replace(tmp, self.path)
        except (OSError, ValueError):  # a read-only root, a full disk: scan without keeping
            with contextlib.suppress(OSError):
                tmp.unlink()


# -- one run and a whole root ----------------------------------------------------------


class _RunScan:
    """The problems and notes of one run's scan; :meth:`problem` raises instead in strict mode."""

    def __init__(self, run_id: str, strict: bool) -> None:
        self.run_id, self.strict = run_id, strict
        self.problems: list[Problem] = []
        self.notes: list[str] = []

    def problem(
        self,
        path: str,
        reason: str,
        note: str,
        table: str | None = None,
        error: type[RecorderError] | None = DamagedFileError,
        kind: str | None = None,
    ) -> None:
        if self.strict and error is not None:
            raise error(reason if reason.startswith(path) else f"{path}: {reason}")
        self.problems.append(Problem(path, reason, self.run_id, table, kind))
        self.notes.append(note)


def _scan_manifest(run_dir: Path, scan: _RunScan, cache: _RootCache | None) -> tuple[dict[str, Any] | None, str]:
    """The run's checked manifest (None when missing or unreadable) and its effective status."""
    manifest_path = str(run_dir / MANIFEST_NAME)
    try:
        manifest, issues = cache.manifest(run_dir) if cache else check_manifest(read_manifest(run_dir))
    except (ManifestError, DamagedFileError) as exc:
        note = "manifest missing" if isinstance(exc, ManifestError) else "manifest unreadable"
        scan.problem(manifest_path, str(exc), note, error=type(exc))
        return None, "unknown"
    for issue in issues:  # never fatal: the rows can still be read
        scan.problem(
            manifest_path, f"{issue}; the field is ignored", f"manifest field {issue.split()[1]} invalid", error=None
        )
    named = manifest.get("run_id")
    if isinstance(named, str) and named != scan.run_id:
        scan.problem(
            str(run_dir),
            f"the manifest's run_id {named!r} differs from the folder name {scan.run_id!r}; "
            f"rows are read as run {scan.run_id!r}. Rename the folder to {named!r} if it was moved",
            "manifest run_id differs from the folder",
            error=None,
        )
    return manifest, effective_status(manifest)


def _scan_segment(
    entry: os.DirEntry, table: str, listed: dict[str, Any] | None, scan: _RunScan, cache: _RootCache | None
) -> SegmentFile | None:
    """One listed segment of the run, validated; None (and a problem) when it is left out."""
    run_id = scan.run_id
    if table not in TABLE_NAMES:
        scan.problem(
            entry.path,
            f"unknown table {table!r}; expected one of {', '.join(TABLE_NAMES)}",
            f"{entry.name} left out (unknown table)",
            table,
            SchemaError,
        )
        return None
    try:
        seg = cache.segment(entry.path, f"{run_id}/{entry.name}", table) if cache else inspect_file(entry.path, table)
    except SchemaVersionError:
        raise
    except RecorderError as exc:
        if scan.strict:
            raise
        kind = "unreadable" if isinstance(exc, DamagedFileError) else "not a log segment"
        scan.problems.append(Problem(entry.path, str(exc), run_id, table))
        scan.notes.append(f"{entry.name} left out ({kind})")
        return None
    foreign = [(rid, n) for rid, n in seg.run_ids if rid != run_id]
    if foreign:
        shown = ", ".join(f"{n} row(s) of run {rid!r}" for rid, n in foreign[:3])
        scan.problem(
            entry.path,
            f"{entry.path}: holds {shown}; this folder is run {run_id!r}. The file "
            "is left out so no run counts rows that are not its own; move it to its run's "
            "folder",
            f"{entry.name} left out (rows of another run)",
            table,
            SchemaError,
        )
        return None
    if listed is not None and entry.name not in listed:
        scan.problem(
            entry.path,
            f"{entry.path}: the manifest does not list this segment; it was added after the run "
            "was written (or copied in), so it is left out and this run's numbers are read without it. "
            "Move it away if it does not belong to the run",
            f"{entry.name} left out (not in the manifest)",
            table,
            error=None,
            kind="unlisted",
        )
        return None
    if listed is not None and listed[entry.name] != seg.rows:
        scan.problem(
            entry.path,
            f"{entry.path}: the manifest lists this segment with {listed[entry.name]} rows, it holds "
            f"{seg.rows}; it was replaced after the run was written. It is left out",
            f"{entry.name} left out (rows differ from the manifest)",
            table,
            error=None,
            kind="rows",
        )
        return None
    return seg


def _scan_segments(
    run_dir: Path, manifest: dict[str, Any] | None, scan: _RunScan, cache: _RootCache | None
) -> tuple[dict[str, list[SegmentFile]], dict[str, list[str]]]:
    """The run's good segments per table, and per table the listed segments that are not there."""
    files: dict[str, list[SegmentFile]] = {}
    listed = (manifest or {}).get("segments")
    listed = listed if isinstance(listed, dict) else None
    superseded = (manifest or {}).get("superseded") or ()  # looked in only for unlisted files (rare)
    present: set[str] = set()
    for entry in sorted(os.scandir(run_dir), key=lambda e: e.name):
        m = SEGMENT_RE.fullmatch(entry.name)
        if not m:
            continue
        present.add(entry.name)
        unlisted = listed is not None and entry.name not in listed
        if m["tag"] is not None and (listed is None or unlisted) or unlisted and entry.name in superseded:
            continue  # a replay's segments it never switched to, or ones a later replay replaced
        seg = _scan_segment(entry, m["table"], listed, scan, cache)
        if seg is not None:
            files.setdefault(m["table"], []).append(seg)
    missing: dict[str, list[str]] = {}  # table -> segments the manifest lists that are not there
    gone = listed.keys() - present if listed is not None else ()
    for name in sorted(gone) if gone else ():
        if m := SEGMENT_RE.fullmatch(name):
            missing.setdefault(m["table"], []).append(name)
    return files, missing


def scan_run(
    run_dir: str | os.PathLike, *, strict: bool = False, _cache: _RootCache | None = None
) -> tuple[RunEntry, list[Problem]]:
    """Read a run's manifest, validate its segments and check the run as a whole.

    The run id is the folder name. With ``strict=True`` the first damaged
    file, missing manifest or file holding another run's rows raises (naming
    the file); otherwise each becomes a problem, the file is left out and the
    run is marked (:attr:`RunEntry.integrity`). Manifest fields of the wrong
    type, a manifest ``run_id`` that differs from the folder, row counts
    that differ from the manifest's, segments the manifest does not list (left
    out) and values that break the value contract (its tables against each
    other and the manifest too) are problems in both modes
    (the strict readers warn, :func:`runlog.check_run` raises).
    :class:`SchemaVersionError` always raises.
    """
    run_dir = Path(run_dir)
    scan = _RunScan(run_dir.name, strict)
    manifest, status = _scan_manifest(run_dir, scan, _cache)
    files, missing = _scan_segments(run_dir, manifest, scan, _cache)
    for v in _cache.contract(run_dir, manifest, files) if _cache else check_contract(manifest, files, run_dir):
        scan.problem(v.path, v.reason, v.note, v.table, error=None, kind="values")
    recorded = (manifest or {}).get("rows") or {}
    rows_read = {table: sum(f.rows for f in segs) for table, segs in files.items()}
    short = [(t, c, rows_read.get(t, 0)) for t, c in recorded.items() if rows_read.get(t, 0) != c]
    for table, count, read in sorted(short):
        gone = f" (missing: {', '.join(missing[table])})" if table in missing else ""
        scan.problem(
            str(run_dir / MANIFEST_NAME),
            f"table {table!r}: the manifest records {count} rows, {read} were read "
            f"from the readable segments{gone}; this run's {table} numbers are incomplete or wrong "
            "(a segment is missing, damaged or was added later)",
            f"{table}: {read} of {count} rows",
            table,
            error=None,
            kind="rows",
        )
    left = cut_short_store(run_dir) if status != "running" else []  # a live recording is still writing it
    if left:  # the recorder removes its disk store when the run ends (DESIGN.md §2.13)
        scan.problem(
            str(run_dir / COLD_FOLDER),
            f"the cold tier's disk store was cut short ({len(left)} file(s) left: the run ended while writing "
            "it); the run's recalls and cold totals are incomplete",
            "cold store cut short",
            error=None,
        )
    return RunEntry(scan.run_id, run_dir, manifest, status, files, scan.notes), scan.problems


def _is_run_folder(path: Path) -> bool:
    if (path / MANIFEST_NAME).exists():
        return True
    with os.scandir(path) as entries:
        return any(SEGMENT_RE.fullmatch(e.name) for e in entries)


def scan_root(root: str | os.PathLike, *, cache: bool = True) -> Catalog:
    """Scan every run folder ``<root>/<run_id>/`` (hidden folders are skipped).

    With ``cache`` (the default) what was learnt about each file version is kept in
    ``<root>/.h2o-lens-catalog.json`` (:data:`CACHE_NAME`), so a file is read in full
    once per version, not on every scan; the result is the same either way.

    The cycle collector is paused while the scan runs: it builds no cycles, and a collector
    pass over the cache's millions of objects, again and again as the scan allocates, took a
    third of a warm scan of 5,000 runs (DESIGN.md §7.4).
    """
    root = Path(root)
    if not root.is_dir():
        return Catalog(root, [], [Problem(str(root), "runs root does not exist or is not a folder")])
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _scan_root(root, cache)
    finally:
        if collecting:
            gc.enable()


def _scan_root(root: Path, cache: bool) -> Catalog:
    runs: list[RunEntry] = []
    problems: list[Problem] = []
    disk = _RootCache(root) if cache else None
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        path = Path(entry.path)
        try:
            if entry.name.startswith((".", "_")) or not entry.is_dir() or not _is_run_folder(path):
                continue
            validate_run_id(entry.name)
            run, run_problems = scan_run(path, _cache=disk)
        except RunIdError as exc:
            problems.append(Problem(str(path), f"skipped: {exc}"))
            continue
        except OSError as exc:  # an unreadable folder is one run's problem, not the root's
            problems.append(Problem(str(path), f"skipped: the run folder cannot be read ({exc})", entry.name))
            continue
        problems.extend(run_problems)
        runs.append(run)
    if disk is not None:
        disk.save()
    return Catalog(root, runs, problems)


def _kind(type_: pa.DataType) -> str:
    for kind, test in (
        ("timestamp", pa.types.is_timestamp),
        ("integer", pa.types.is_integer),
        ("floating", pa.types.is_floating),
        ("string", pa.types.is_string),
    ):
        if test(type_):
            return kind
    return "other"


#: ``(name, kind)`` of each ``runs`` column, kind as :func:`_coerce` reads it
_RUN_FIELDS = tuple((field.name, _kind(field.type)) for field in RUNS)


def _coerce(type_: pa.DataType | str, value: Any) -> Any:
    """A manifest value as the declared Python type (or a :func:`_kind`), or None when it does not fit."""
    kind = type_ if isinstance(type_, str) else _kind(type_)
    if value is None or isinstance(value, (dict, list)) and kind != "string":
        return None
    try:
        if kind == "timestamp":
            return dt.datetime.fromisoformat(str(value).rstrip("Z")).replace(tzinfo=None)
        if kind == "integer":
            return int(value) if not isinstance(value, bool) else None
        if kind == "floating":
            return float(value)
        if kind == "string":
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
    for name, kind in _RUN_FIELDS:
        value = manifest.get(name, config.get(name))
        if name == "run_id":
            value = run.run_id
        elif name == "status":
            value = run.status
        elif name == "model":
            value = (model.get("name") or model.get("id")) if isinstance(model, dict) else model
        elif name == "config":
            value = json.dumps(config, sort_keys=True) if manifest else None
        elif name == "cold":  # the manifest's object (the config's cold holds only the settings)
            value = json.dumps(manifest["cold"], sort_keys=True) if isinstance(manifest.get("cold"), dict) else None
        elif name == "plan":  # the config's (a plan is a setting; a manifest field of that name is not read)
            value = config.get("plan") if isinstance(config.get("plan"), dict) else None
        elif name == "path":
            value = str(run.path)
        elif name == "integrity":
            value = run.integrity
        row[name] = _coerce(kind, value)
    return row


def replay_complete(run_dir: str | os.PathLike, manifest: dict[str, Any] | None = None) -> bool:
    """Whether a run's replay is all there: the manifest records it (``replay``) and every
    replay segment it lists exists; for a manifest written before segments were listed, the
    ``replay_steps`` segments exist when the replay logged any step. A replay killed part way,
    or whose files went missing, is not complete (a sweep redoes it, DESIGN.md §12.3)."""
    run_dir = Path(run_dir)
    if manifest is None:
        try:
            manifest = read_manifest(run_dir)
        except RecorderError:
            return False
    summary = manifest.get("replay")
    if not isinstance(summary, dict):
        return False
    listed = manifest.get("segments")
    if isinstance(listed, dict):
        names = [n for n in listed if (m := SEGMENT_RE.fullmatch(n)) and m["table"] in REPLAY_TABLES]
        rows = manifest.get("rows") if isinstance(manifest.get("rows"), dict) else {}
        if any(rows.get(t) for t in REPLAY_TABLES) and not names:
            return False
        return all((run_dir / n).is_file() for n in names)
    steps = [
        e.name
        for e in os.scandir(run_dir)
        if (m := SEGMENT_RE.fullmatch(e.name)) and m["table"] == "replay_steps" and m["tag"] is None
    ]
    return bool(steps)
