"""A run's recalls against its evictions (DESIGN.md §5.5): a cold tier recalls only what left.

The one check of the value contract that reads data again: a run with a ``recalls`` table has its
recall rows' keys joined with its evictions' (both tables' key columns only), once per version of
the run (the catalog keeps the findings). A recall row whose position the same request, layer and
KV set never evicted, or evicted only at or after the recall's step, is a finding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = ["check_recalls", "COLD_FOLDER", "cut_short_store"]

#: the folder of a run that holds its ``disk`` cold store while it records (DESIGN.md §2.13); the
#: recorder removes it when the run ends, so one still there was cut short
COLD_FOLDER = "cold"


def cut_short_store(run_dir: Any) -> list[str]:
    """The files of a disk cold store that a run left behind (killed while it wrote them)."""
    folder = os.path.join(os.fspath(run_dir), COLD_FOLDER)
    if not os.path.isdir(folder):
        return []
    return sorted(e.name for e in os.scandir(folder) if e.name.endswith(".bin"))


_KEY = ["request", "layer", "kv_head", "position"]


def _read(segs: Sequence[Any], columns: list[str]) -> pa.Table | None:
    parts = []
    for seg in segs:
        try:
            parts.append(pq.read_table(str(seg.path), columns=columns))
        except (OSError, pa.ArrowException):
            continue  # the catalog reports a file it cannot read
    return pa.concat_tables(parts) if parts else None


def _ints(table: pa.Table) -> pa.Table:
    return table.cast(pa.schema([(c, pa.int64()) for c in table.column_names]))


def check_recalls(files: Mapping[str, Sequence[Any]], run: str, violation) -> list[Any]:
    """Findings of the recall rows of a run that no earlier eviction explains."""
    segs = files.get("recalls") or ()
    recalls = _read(segs, [*_KEY, "step"]) if segs else None
    if recalls is None or not recalls.num_rows:
        return []
    evictions = _read(files.get("evictions") or (), [*_KEY, "step"])
    if evictions is None:
        evictions = pa.table({c: pa.array([], pa.int64()) for c in [*_KEY, "step"]})
    first = _ints(evictions).group_by(_KEY).aggregate([("step", "min")])
    joined = _ints(recalls).join(first, _KEY, join_type="left outer")
    never = pc.is_null(joined["step_min"])
    early = pc.fill_null(pc.less_equal(joined["step"], joined["step_min"]), False)
    out = []
    path = str(segs[-1].path)
    for mask, what in ((never, "never evicted"), (early, "evicted only at or after that step")):
        bad = joined.filter(mask)
        if bad.num_rows:
            row = bad.slice(0, 1).to_pylist()[0]
            out.append(
                violation(
                    path,
                    "recalls",
                    f"run {run}: {bad.num_rows} recalls row(s) bring back a position {what} by its request, "
                    f"layer and KV set (first: request {row['request']}, step {row['step']}, layer {row['layer']}, "
                    f"kv_head {row['kv_head']}, position {row['position']}); a cold tier recalls only what left",
                    f"recalls of positions {what}",
                )
            )
    return out
