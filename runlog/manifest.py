"""Run ids and ``manifest.json``: what a run is and whether its writer still lives.

The manifest is written atomically when a run starts (status ``running``,
with the writer's pid, host, boot id and process start time) and rewritten
when it ends (``complete``, or ``failed`` with the error). A reader that
finds a ``running`` manifest whose writer process is gone (same host and
boot, pid dead or reused by a process with another start time) reports the
run as ``interrupted``; :func:`mark_interrupted` rewrites it as such.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import errno
import json
import math
import os
import re
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from .errors import DamagedFileError, ManifestError, RecorderError, RunIdError, SchemaVersionError, storage_error
from .schema import RUNS, SCHEMA_VERSION

__all__ = [
    "MANIFEST_NAME",
    "STATUSES",
    "validate_run_id",
    "sanitize_run_id",
    "new_run_id",
    "process_identity",
    "writer_alive",
    "new_manifest",
    "write_manifest",
    "read_manifest",
    "check_manifest",
    "effective_status",
    "mark_interrupted",
    "listed_segments",
    "config_dict",
    "utc_now",
    "iso_utc",
]

MANIFEST_NAME = "manifest.json"
STATUSES = ("running", "complete", "failed", "interrupted")

_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_NUMERIC_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def validate_run_id(run_id: Any) -> str:
    """Return ``run_id`` if it can name a run folder, else raise :class:`RunIdError`.

    A run id is 1-128 characters from ``[A-Za-z0-9._-]``, starts with a letter
    or digit and must not look like a number: readers would cast a numeric
    folder name to an integer and lose leading zeros (DESIGN.md §7).
    """
    if not isinstance(run_id, str):
        raise RunIdError(f"run id must be a string, got {run_id!r} ({type(run_id).__name__})")
    if _NUMERIC_RE.fullmatch(run_id):
        raise RunIdError(
            f"run id {run_id!r} is numeric; numeric folder names are read back as "
            f"numbers. Use a name with a letter, e.g. 'run-{run_id}'"
        )
    if not _RUN_ID_RE.fullmatch(run_id):
        raise RunIdError(
            f"run id {run_id!r} is not a valid folder name; use 1-128 characters "
            "from A-Z a-z 0-9 . _ - starting with a letter or digit, "
            "or pass the name through sanitize_run_id()"
        )
    return run_id


def sanitize_run_id(name: str) -> str:
    """Turn a free-form name into a run id (invalid characters become ``-``).

    Raises :class:`RunIdError` when nothing usable is left or the result is
    numeric: a numeric id is refused, never silently renamed.
    """
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name).strip())
    cleaned = re.sub(r"-{2,}", "-", cleaned).lstrip("._-")[:128].rstrip("-")
    if not cleaned:
        raise RunIdError(
            f"name {name!r} holds no letter or digit usable as a run id; pass a name such as 'h2o-needle-test'"
        )
    return validate_run_id(cleaned)


def utc_now() -> dt.datetime:
    """Current time, naive UTC (the convention of every timestamp in the logs)."""
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


def new_run_id(policy: str = "run", *, now: dt.datetime | None = None) -> str:
    """A fresh run id such as ``20261129-153012-h2o-a1b2`` (UTC time, policy, 4 hex digits)."""
    stamp = (now or utc_now()).strftime("%Y%m%d-%H%M%S")
    return sanitize_run_id(f"{stamp}-{policy}-{secrets.token_hex(2)}")


# -- writer process identity ---------------------------------------------------


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of ``pid``, or None if unknown."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    return fields[0], int(fields[19])


def _started_at(start_ticks: int) -> str | None:
    """Wall-clock start of a process from its start ticks and the boot time, ISO UTC."""
    try:
        btime = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        seconds = btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError):
        return None
    return iso_utc(dt.datetime.fromtimestamp(seconds, dt.UTC).replace(tzinfo=None))


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """Who writes a run: pid, hostname, boot id and process start time.

    ``start_ticks`` (clock ticks since boot, from ``/proc/<pid>/stat``) tells a
    live writer from a reused pid; ``started_at`` is the same instant in UTC.
    """
    pid = os.getpid() if pid is None else pid
    stat = _proc_stat(pid)
    return {
        "pid": pid,
        "hostname": socket.gethostname(),
        "boot_id": _boot_id(),
        "start_ticks": stat[1] if stat else None,
        "started_at": _started_at(stat[1]) if stat else None,
    }


def writer_alive(writer: Mapping[str, Any]) -> bool | None:
    """Whether the process described by ``writer`` still runs.

    Returns None when it cannot be told (another host). A zombie counts as
    dead; a pid whose start time differs was reused by another process.
    """
    if writer.get("hostname") != socket.gethostname():
        return None
    boot = _boot_id()
    if writer.get("boot_id") and boot and writer["boot_id"] != boot:
        return False
    pid = writer.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    stat = _proc_stat(pid)
    if stat is None:
        if Path("/proc/self/stat").exists():
            return False
        try:  # no procfs: only the pid can be checked
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state, start = stat
    if state in ("Z", "X"):
        return False
    expected = writer.get("start_ticks")
    return expected is None or expected == start


# -- manifest files ---------------------------------------------------------------


def config_dict(config: Any) -> dict[str, Any]:
    """A JSON-ready dict from a mapping, a dataclass or None."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"run config must be a mapping or a dataclass, got {type(config).__name__}")
    out = dict(config)
    try:
        json.dumps(out)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"run config must be JSON-serialisable: {exc}") from exc
    return out


def iso_utc(value: dt.datetime) -> str:
    return value.isoformat(timespec="microseconds") + "Z"


def new_manifest(run_id: str, *, config: Any = None, model: Any = None, **info: Any) -> dict[str, Any]:
    """The manifest of a run that starts now (status ``running``).

    ``model`` is a model id string or a dict with at least ``name``; ``info``
    holds other fields of the ``runs`` view (``name``, ``source_run``,
    ``prompt_len``, ...), stored top-level.
    """
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": validate_run_id(run_id),
        "status": "running",
        "created_at": iso_utc(utc_now()),
        "finished_at": None,
        "writer": process_identity(),
        "config": config_dict(config),
        "model": model if isinstance(model, (str, type(None))) else dict(model),
        **info,
    }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(run_dir: str | os.PathLike, manifest: Mapping[str, Any], *, in_place_if_full: bool = False) -> Path:
    """Write ``manifest.json`` atomically (temp file, fsync, rename, fsync folder).

    Raises :class:`~runlog.errors.StorageError` when the file cannot be written (the old
    manifest is left as it was, the temporary file removed). ``in_place_if_full``: on a disk
    too full for the temporary file, rewrite the existing file in place instead (its blocks
    are reused): how a run is marked ``failed`` on a full disk. Not atomic: a kill during it
    leaves a manifest the readers call unreadable, which a sweep redoes like a failed run.
    """
    run_dir = Path(run_dir)
    target = run_dir / MANIFEST_NAME
    tmp = run_dir / f"{MANIFEST_NAME}.{os.getpid()}.{secrets.token_hex(3)}.tmp"
    data = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        _fsync_dir(run_dir)
    except OSError as exc:  # a full disk: the old manifest stays, no temporary file is left
        with contextlib.suppress(OSError):
            tmp.unlink()
        if in_place_if_full and exc.errno in (errno.ENOSPC, errno.EDQUOT) and _fits_in_place(target, len(data)):
            try:
                with open(target, "r+b") as fh:
                    fh.write(data)
                    fh.truncate()
                    fh.flush()
                    os.fsync(fh.fileno())
                return target
            except OSError:
                pass
        raise storage_error(target, exc, len(data)) from exc
    return target


def _fits_in_place(path: Path, size: int) -> bool:
    """Whether ``size`` bytes fit in the blocks ``path`` already holds (rewriting it needs none)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return size <= max(st.st_size, getattr(st, "st_blocks", 0) * 512)


def read_manifest(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read a run's manifest.

    Raises
    ------
    ManifestError
        No ``manifest.json`` in ``run_dir``.
    DamagedFileError
        The manifest is not valid JSON or not an object.
    SchemaVersionError
        The manifest was written by a newer schema version.
    """
    path = Path(run_dir) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(
            f"run folder {str(run_dir)!r} has no {MANIFEST_NAME}; "
            "it was not written by recorders or its writer died at start"
        ) from None
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise DamagedFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise DamagedFileError(f"{path}: expected a JSON object, got {type(manifest).__name__}")
    version = manifest.get("schema_version")
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{path}: written with log schema version {version}, this code reads versions "
            f"<= {SCHEMA_VERSION}; upgrade h2o-lens to open it"
        )
    return manifest


# -- field types ----------------------------------------------------------------------

_INT_BITS = {pa.int16(): 16, pa.int32(): 32, pa.int64(): 64}
#: checked apart or not read from the file
_OWN_FIELDS = ("run_id", "status", "model", "config", "path", "integrity", "cold", "plan")
_WRITER_INTS = {"pid": 32, "start_ticks": 64}  # bits


def _clean_text(value: Any, where: str, issues: list[str]) -> Any:
    """``value`` with every string that is not valid Unicode (lone surrogates) made readable."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            issues.append(f"{where} holds text that is not valid Unicode (a lone surrogate escape)")
            return value.encode("utf-8", "replace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {
            _clean_text(k, f"{where} key", issues): _clean_text(v, f"{where}.{k}", issues) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_clean_text(v, f"{where}[{i}]", issues) for i, v in enumerate(value)]
    return value


def _is_int(value: Any, bits: int = 64, minimum: int | None = None) -> bool:
    low = -(2 ** (bits - 1)) if minimum is None else minimum
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 2 ** (bits - 1)


def _field_issue(field: pa.Field, value: Any) -> str | None:
    """Why ``value`` cannot fill the ``runs`` column ``field``, or None when it can (or is null)."""
    type_ = field.type
    if value is None:
        return None
    if pa.types.is_string(type_):
        ok, want = isinstance(value, str), "a string"
    elif pa.types.is_integer(type_):
        bits = _INT_BITS.get(type_, 64)
        ok, want = _is_int(value, bits), f"an integer that fits in {bits} bits"
    elif pa.types.is_floating(type_):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and isinstance(value, int):
            ok = math.isfinite(float(value)) if abs(value) < 2**1023 else False
        want = "a number"
    elif pa.types.is_timestamp(type_):
        want = "an ISO 8601 time such as '2026-11-29T18:48:11.699089Z'"
        try:
            ok = isinstance(value, str) and bool(dt.datetime.fromisoformat(value.rstrip("Z")))
        except ValueError:
            ok = False
    else:
        return None
    if ok:
        return None
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return f"is {shown} ({type(value).__name__}), expected {want}"


def _writer_issue(writer: Any) -> str | None:
    if not isinstance(writer, dict):
        return f"is {type(writer).__name__}, expected an object with pid, hostname, boot_id, start_ticks"
    for key, bits in _WRITER_INTS.items():
        value = writer.get(key)
        if value is not None and not _is_int(value, bits):
            return f"{key} is {value!r}, expected an integer that fits in {bits} bits"
    for key in ("hostname", "boot_id", "started_at"):
        if writer.get(key) is not None and not isinstance(writer.get(key), str):
            return f"{key} is {writer.get(key)!r}, expected a string"
    return None


def _rows_issue(rows: Any, what: str = "table name") -> str | None:
    if not isinstance(rows, dict):
        return f"is {type(rows).__name__}, expected an object of {what} to row count"
    for table, count in rows.items():
        if not _is_int(count, 64, minimum=0):
            return f"{table!r} is {count!r}, expected a row count (integer >= 0)"
    return None


def _names_issue(names: Any) -> str | None:
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return f"is {type(names).__name__}, expected a list of segment file names"
    return None


def check_manifest(manifest: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Check the types of a manifest's fields; return a clean copy and one message per bad field.

    Each message starts with ``field <name> `` (``config.<name>`` inside the config).

    A field that does not have its expected type (the ``runs`` column type for
    the fields of that view, an object for ``writer``, ``config``, ``rows``)
    is left out of the copy, so one bad value never stops a reader. Text that
    is not valid Unicode is made readable (``?``) and reported.
    """
    issues: list[str] = []
    out = _clean_text(dict(manifest), "manifest", issues)
    issues = ["field " + i.removeprefix("manifest.") for i in issues]

    def drop(key: str, why: str, container: dict[str, Any] = out, where: str = "") -> None:
        issues.append(f"field {where}{key} {why}")
        container.pop(key, None)

    checks = {
        "writer": _writer_issue,
        "rows": _rows_issue,
        "segments": lambda v: _rows_issue(v, "segment file name"),
        "superseded": _names_issue,
    }
    for key, check in checks.items():
        if key in out and out[key] is not None and (why := check(out[key])):
            drop(key, why)
    if out.get("status") is not None and out["status"] not in STATUSES:
        drop("status", f"is {out['status']!r}, expected one of {', '.join(STATUSES)}")
    if out.get("run_id") is not None and not isinstance(out["run_id"], str):
        drop("run_id", f"is {out['run_id']!r}, expected a string")
    if out.get("schema_version") is not None and not _is_int(out["schema_version"], 32):
        drop("schema_version", f"is {out['schema_version']!r}, expected an integer")
    if out.get("config") is not None and not isinstance(out["config"], dict):
        drop("config", f"is {type(out['config']).__name__}, expected an object")
    for where, holder in (("", out), ("config.", out.get("config") or {})):  # a cold tier (DESIGN.md §2.13)
        if holder.get("cold") is not None and not isinstance(holder["cold"], dict):
            drop("cold", f"is {type(holder['cold']).__name__}, expected an object", holder, where)
    plan = (out.get("config") or {}).get("plan")  # a budget plan (DESIGN.md §2.14)
    if plan is not None and not isinstance(plan, dict):
        drop("plan", f"is {type(plan).__name__}, expected an object", out["config"], "config.")
    model = out.get("model")
    if model is not None and not (
        isinstance(model, str)
        or isinstance(model, dict)
        and all(isinstance(model.get(k), (str, type(None))) for k in ("name", "id"))
    ):
        drop("model", "is neither a model id string nor an object with a string name")
    command = out.get("command")
    if command is not None and not (isinstance(command, str) or isinstance(command, list)):
        drop("command", f"is {type(command).__name__}, expected a string or a list")
    config = out.get("config") or {}
    for field in RUNS:
        if field.name in _OWN_FIELDS:
            continue
        if why := _field_issue(field, out.get(field.name)):
            drop(field.name, why)
        if why := _field_issue(field, config.get(field.name)):
            drop(field.name, why, config, "config.")
    return out, issues


def effective_status(manifest: Mapping[str, Any]) -> str:
    """The manifest's status, or ``interrupted`` for a ``running`` run whose writer is gone."""
    status = manifest.get("status", "unknown")
    writer = manifest.get("writer")
    if (
        status == "running"
        and isinstance(writer, Mapping)
        and _writer_issue(dict(writer)) is None
        and writer_alive(writer) is False
    ):
        return "interrupted"
    return status if isinstance(status, str) else "unknown"


def mark_interrupted(run_dir: str | os.PathLike) -> bool:
    """Rewrite a ``running`` manifest whose writer is gone as ``interrupted``.

    Returns True when the manifest was rewritten.
    """
    manifest = read_manifest(run_dir)
    if manifest.get("status") != "running" or effective_status(manifest) != "interrupted":
        return False
    manifest["status"] = "interrupted"
    manifest["error"] = manifest.get("error") or "writer process ended without closing the run"
    write_manifest(run_dir, manifest)
    return True


def listed_segments(run_dir: str | os.PathLike) -> dict[str, int] | None:
    """The segments the manifest of ``run_dir`` lists (file name -> rows), or None when it lists
    none (a manifest written before the listing, a run still being written, or no readable
    manifest): then the untagged segment files of the folder are the run's (DESIGN.md §5.1)."""
    try:
        listed = read_manifest(run_dir).get("segments")
    except (RecorderError, OSError):
        return None
    return listed if isinstance(listed, dict) else None
