"""Errors and warnings of the recorder storage layer.

Every message says what was found, what was expected and how to fix it, and
names the run folder or the file concerned.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from h2o_lens.errors import H2OLensError

__all__ = [
    "RecorderError",
    "RunIdError",
    "RunExistsError",
    "SchemaError",
    "SchemaVersionError",
    "DamagedFileError",
    "ManifestError",
    "QueryError",
    "ContractError",
    "ModelMismatchError",
    "StorageError",
    "storage_error",
    "free_bytes",
    "RecorderWarning",
]


class RecorderError(H2OLensError):
    """Base class of all errors raised by ``recorders``."""


class RunIdError(RecorderError, ValueError):
    """A run id is empty, numeric-looking or holds characters a folder name cannot."""


class RunExistsError(RecorderError, FileExistsError):
    """A new run was asked for in a folder that already holds a run."""


class SchemaError(RecorderError, ValueError):
    """Rows or a file do not match the declared log schema (unknown table or column, bad type)."""


class SchemaVersionError(RecorderError):
    """A file or manifest was written by a newer schema version than this code knows."""


class DamagedFileError(RecorderError):
    """A Parquet segment or a manifest cannot be read (truncated, empty, not Parquet)."""


class ManifestError(RecorderError):
    """A run folder has no readable ``manifest.json``."""


class QueryError(RecorderError, ValueError):
    """A query helper was given something other than one SELECT statement."""


class ContractError(RecorderError):
    """A run's values break the value contract (a range, a cross-table fact; DESIGN.md §5.5)."""


class ModelMismatchError(RecorderError):
    """The model given or found differs from the one a run was recorded with (DESIGN.md §5.1)."""


class StorageError(RecorderError, OSError):
    """Writing a file failed (a full disk, a quota, a read-only folder); the message names the
    file, the space it needed and the space free. ``errno`` and ``filename`` are those of the
    failed write."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem holding ``path`` (its nearest existing folder), None if unknown."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder if folder.is_dir() else folder.parent).free
    except OSError:
        return None


def storage_error(path: str | os.PathLike, exc: OSError, needed: int | None = None) -> StorageError:
    """A :class:`StorageError` for ``exc`` raised while writing ``path`` (about ``needed`` bytes).

    One line: the file, what the system said, for a full disk the space the file needed and the
    space free, and what to do.
    """
    if isinstance(exc, StorageError):
        return exc
    code = exc.errno
    what = os.strerror(code) if code else exc.strerror or str(exc) or type(exc).__name__
    msg = f"cannot write {os.fspath(path)}: {what}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path)
        need = f"the file needs about {_size(needed)}" if needed else "the file needs more space"
        msg += f" ({need}; {_size(free) if free is not None else 'an unknown amount'} free there)"
        msg += "; free some space or write to another disk"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        msg += "; write the runs to a folder you can write to"
    err = StorageError(msg)
    err.errno, err.strerror, err.filename = code, exc.strerror, os.fspath(path)
    return err


class RecorderWarning(UserWarning):
    """A damaged or foreign file was skipped while opening a runs root."""
