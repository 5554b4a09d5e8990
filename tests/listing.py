"""Test fixtures that add segments to a closed run list them, as the writer of those segments would."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from runlog.manifest import read_manifest, write_manifest
from runlog.segments import SEGMENT_RE


def relist(run_dir: Path) -> None:
    """List every segment file of ``run_dir`` in its manifest (``segments``) and set each table's
    ``rows`` to what its files hold (DESIGN.md §5.1)."""
    files = {p.name: pq.read_metadata(p).num_rows for p in sorted(Path(run_dir).glob("*.parquet"))}
    rows: dict[str, int] = {}
    for name, n in files.items():
        table = SEGMENT_RE.fullmatch(name)["table"]
        rows[table] = rows.get(table, 0) + n
    manifest = read_manifest(run_dir)
    manifest["segments"], manifest["rows"] = files, {**(manifest.get("rows") or {}), **rows}
    write_manifest(run_dir, manifest)
