"""Errors and warnings of the recorder storage layer.

Every message says what was found, what was expected and how to fix it, and
names the run folder or the file concerned.
"""

from __future__ import annotations

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


class RecorderWarning(UserWarning):
    """A damaged or foreign file was skipped while opening a runs root."""
