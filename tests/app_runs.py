"""The runs root every dashboard test reads: one run for each case the app must handle."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from listing import relist

from runlog import to_arrow, write_segment, write_synthetic_run
from runlog.manifest import read_manifest, write_manifest

REPO = Path(__file__).resolve().parent.parent
PAGES = ("runs", "overview", "tokens", "heads", "dynamics", "evictions", "compare", "report", "sql")
TITLES = {
    "runs": "Runs",
    "overview": "Overview",
    "tokens": "Tokens",
    "heads": "Heads",
    "dynamics": "Dynamics",
    "evictions": "Evictions",
    "compare": "Compare",
    "report": "Report",
    "sql": "SQL console",
}
SHAPE = dict(layers=4, kv_heads=2, steps=48, prompt_len=64, heavy=16, recent=16, fsync=False)
OUTSIDE = "example.invalid"  # a crafted link points there; nothing may link to or load from it
HOSTILE = {
    "name": f"![pixel](http://{OUTSIDE}/name.png) <img src=http://{OUTSIDE}/tag.png>",
    "error": f"boom [click](http://{OUTSIDE}/error) ![e](http://{OUTSIDE}/error.png) :red[red]",
    "policy": f"[h2o](http://{OUTSIDE}/policy)",
    "model": f"![m](http://{OUTSIDE}/model.png)",
}


def _link(root: Path, run_id: str, **fields: object) -> None:
    manifest = read_manifest(root / run_id)
    manifest.update(fields)
    write_manifest(root / run_id, manifest)


def _copy_tokens(root: Path, source: str, target: str) -> None:
    """Give ``target`` exactly the tokens of ``source`` (a paired run reads the same tokens)."""
    for old in (root / target).glob("tokens-*.parquet"):
        old.unlink()
    for i, seg in enumerate(sorted((root / source).glob("tokens-*.parquet"))):
        table = pq.read_table(seg).replace_schema_metadata(None)
        table = table.set_column(
            table.schema.get_field_index("run_id"), "run_id", pa.array([target] * table.num_rows, pa.string())
        )
        write_segment(
            root / target / f"tokens-{i:05d}.parquet",
            "tokens",
            to_arrow("tokens", table.to_pydict(), run_id=target),
            run_id=target,
            fsync=False,
        )


def build_runs_root(root: Path) -> Path:
    """A runs root with every case the dashboard must handle.

    * ``h2o-sum``: two requests, answer checker says request 0 failed;
    * ``h2o-max``: the same tokens under ``gqa='max'``, paired through ``source_run``;
    * ``cut-short``: interrupted (its writer died), no replay;
    * ``damaged``: its replay segment is truncated (no footer);
    * ``bad-manifest``: its manifest is not JSON (status unknown, no settings);
    * ``hostile``: failed; its manifest fields and evidence label hold Markdown images, links and
      HTML pointing outside, its ``writer`` is a string and its seed overflows int64.
    """
    root.mkdir(parents=True, exist_ok=True)
    write_synthetic_run(root, "h2o-sum", requests=2, **SHAPE)
    write_segment(
        root / "h2o-sum" / "requests-00000.parquet",
        "requests",
        to_arrow(
            "requests",
            {
                "request": [0, 1],
                "prompt_len": [64, 64],
                "new_tokens": [48, 48],
                "answer": ["Paris", "blue"],
                "correct": [False, True],
            },
            run_id="h2o-sum",
        ),
        run_id="h2o-sum",
        fsync=False,
    )
    relist(root / "h2o-sum")
    write_synthetic_run(root, "h2o-max", gqa="max", seed=1, requests=2, **SHAPE)
    _link(root, "h2o-max", source_run="h2o-sum")
    _copy_tokens(root, "h2o-sum", "h2o-max")
    write_synthetic_run(root, "cut-short", status="running", seed=3, tables=["tokens", "evictions", "steps"], **SHAPE)
    manifest = read_manifest(root / "cut-short")
    manifest["writer"]["start_ticks"] = -1  # the writer process is gone: reads as interrupted
    write_manifest(root / "cut-short", manifest)
    write_synthetic_run(root, "damaged", seed=2, **SHAPE)
    seg = next((root / "damaged").glob("replay-*.parquet"))
    seg.write_bytes(seg.read_bytes()[: seg.stat().st_size // 2])
    write_synthetic_run(root, "bad-manifest", seed=6, **SHAPE)
    (root / "bad-manifest" / "manifest.json").write_text("{not json")
    write_synthetic_run(root, "hostile", seed=7, **SHAPE)
    _link(root, "hostile", status="failed", writer="pid 1 somewhere", seed=2**70, **HOSTILE)
    seg = root / "hostile" / "tokens-00000.parquet"
    tokens = pq.read_table(seg).replace_schema_metadata(None)
    labels = [HOSTILE["name"] if v is not None else None for v in tokens["evidence"].to_pylist()]
    tokens = tokens.set_column(tokens.schema.get_field_index("evidence"), "evidence", pa.array(labels, pa.string()))
    write_segment(seg, "tokens", tokens, run_id="hostile", fsync=False)
    return root
