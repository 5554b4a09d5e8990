"""Errors of the analysis layer.

Every message says what was received, what was expected and how to fix it,
naming the run, the view or the column concerned.
"""

from __future__ import annotations

from h2o_lens.errors import H2OLensError

__all__ = [
    "AnalysisError",
    "ParameterError",
    "UnknownRunError",
    "MissingColumnError",
    "SQLSandboxError",
    "SQLRefusedError",
    "SQLTimeoutError",
]


class AnalysisError(H2OLensError):
    """Base class of all errors raised by ``analyses``."""


class ParameterError(AnalysisError, ValueError):
    """A threshold, window or other parameter of an analysis is invalid."""


class UnknownRunError(AnalysisError, LookupError):
    """A run id is not in the ``runs`` view of the runs root."""


class MissingColumnError(AnalysisError, LookupError):
    """The logs lack a column an analysis needs (a later, nullable schema addition)."""


class SQLSandboxError(AnalysisError):
    """The SQL console refused a statement, stopped it, or the statement failed."""


class SQLRefusedError(SQLSandboxError, PermissionError):
    """The statement is not a single read-only SELECT over the runs root."""


class SQLTimeoutError(SQLSandboxError, TimeoutError):
    """The statement ran past its time limit and was interrupted."""
