"""Storage layer of the H2O Lens eviction recorder: log format v1 (DESIGN.md §5).

Writing::

    from runlog import RunWriter
    with RunWriter("runs", config={"policy": "h2o", "heavy": 64, "recent": 64},
                   model="HuggingFaceTB/SmolLM2-135M-Instruct") as run:
        run.append("evictions", {"request": 0, "step": steps, "layer": layer, ...})

Reading::

    from runlog import open_runs, query
    con = open_runs("runs")
    con.sql("SELECT layer, count(*) FROM evictions GROUP BY layer")

This package needs numpy, pyarrow and duckdb only, never torch: logs open on
machines without torch or a model. The model drivers that write the logs
(record, replay) live one layer up, in :mod:`recorders`; the synthetic runs of
the benchmarks (:mod:`runlog.synthetic`) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .catalog import Catalog, Problem, SegmentFile, inspect_file, replay_complete, scan_root
from .errors import (
    ContractError,
    DamagedFileError,
    ManifestError,
    ModelMismatchError,
    QueryError,
    RecorderError,
    RecorderWarning,
    RunExistsError,
    RunIdError,
    SchemaError,
    SchemaVersionError,
    StorageError,
)
from .manifest import (
    MANIFEST_NAME,
    STATUSES,
    mark_interrupted,
    new_run_id,
    read_manifest,
    sanitize_run_id,
    validate_run_id,
)
from .query import query
from .recorded_model import check_model, model_source
from .run import RunWriter
from .schema import KEYS, RANGES, RUNS, SCHEMA_VERSION, TABLE_NAMES, TABLES, VIEW_NAMES, empty_table, to_arrow
from .segments import SegmentWriter, list_segments, write_segment
from .store import LoadedRun, RunCheck, check_run, list_runs, load_run, open_runs, request_order

__all__ = [
    # schema
    "SCHEMA_VERSION",
    "TABLES",
    "TABLE_NAMES",
    "RUNS",
    "VIEW_NAMES",
    "KEYS",
    "RANGES",
    "empty_table",
    "to_arrow",
    # writing
    "RunWriter",
    "SegmentWriter",
    "write_segment",
    "list_segments",
    "new_run_id",
    "sanitize_run_id",
    "validate_run_id",
    "read_manifest",
    "mark_interrupted",
    "MANIFEST_NAME",
    "STATUSES",
    # reading
    "open_runs",
    "list_runs",
    "query",
    "check_run",
    "load_run",
    "request_order",
    "scan_root",
    "inspect_file",
    "replay_complete",
    "check_model",
    "model_source",
    "Catalog",
    "Problem",
    "SegmentFile",
    "RunCheck",
    "LoadedRun",
    # errors
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
    "RecorderWarning",
]

#: the synthetic-run generators of the benchmarks: loaded on first access
_LAZY = {
    "write_synthetic_run": ".synthetic",
    "synthetic_tables": ".synthetic",
}
__all__ += list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'runlog' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
