"""KV footprint with page granularity against a plain pandas computation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import analyses
from analyses.curves import kv_footprint
from runlog import RunWriter, open_runs


def _run(root, run_id, evicted, last, sets, policy="h2o"):
    with RunWriter(
        root, run_id, config={"policy": policy, "heavy": 2, "recent": 2, "gqa": "sum"}, model="synthetic", fsync=False
    ) as w:
        w.append(
            "tokens",
            {
                "request": np.zeros(last + 1, np.int32),
                "position": np.arange(last + 1),
                "token_id": np.arange(last + 1, dtype=np.int32),
                "is_prompt": np.arange(last + 1) < 8,
            },
        )
        if sets:
            layer, head = zip(*sets)
            w.append(
                "steps",
                {
                    "request": np.zeros(len(sets), np.int32),
                    "step": np.full(len(sets), 7),
                    "layer": np.array(layer, np.int16),
                    "kv_head": np.array(head, np.int16),
                },
            )
        if evicted:
            layer, head, pos = (np.array(x) for x in zip(*evicted))
            w.append(
                "evictions",
                {
                    "request": np.zeros(len(pos), np.int32),
                    "step": pos + 4,
                    "layer": layer.astype(np.int16),
                    "kv_head": head.astype(np.int16),
                    "position": pos,
                    "score": np.zeros(len(pos), np.float32),
                    "margin": np.zeros(len(pos), np.float32),
                    "age": np.full(len(pos), 4),
                    "left_recent": np.ones(len(pos), bool),
                },
            )


def test_kv_footprint_matches_pandas(tmp_path):
    rng = np.random.default_rng(0)
    last, ps = 37, 8  # tokens 0..37; processed positions 0..36
    sets = [(layer, head) for layer in range(3) for head in range(2)]
    evicted = [(l, h, p) for l, h in sets for p in range(last) if rng.random() < 0.7]
    _run(tmp_path, "fp-run", evicted, last, sets)
    got = kv_footprint(open_runs(tmp_path), "fp-run", page_size=ps).df().iloc[0]
    ev = pd.DataFrame(evicted, columns=["layer", "kv_head", "position"])
    kept = len(sets) * last - len(ev)
    assert got.kept_share == pytest.approx(kept / (len(sets) * last))
    held = 0
    for l, h in sets:
        gone = set(ev[(ev.layer == l) & (ev.kv_head == h)].position)
        for page in range(int(np.ceil(last / ps))):
            members = [p for p in range(page * ps, min(last, (page + 1) * ps))]
            held += not all(p in gone for p in members)
    assert got.pages_held == held
    assert got.page_share == pytest.approx(held * ps / (np.ceil(last / ps) * ps * len(sets)))
    assert got.page_share >= got.kept_share  # pages never free more than tokens


def test_full_run_footprint_is_one(tmp_path):
    _run(tmp_path, "full-run", [], 20, [], policy="full")
    got = kv_footprint(open_runs(tmp_path), "full-run").df().iloc[0]
    assert got.kept_share == 1.0 and got.page_share == 1.0
    pts = analyses.curves.run_curve_points(open_runs(tmp_path), ["full-run"]).df()
    assert pts.run_id.tolist() == ["full-run"] and pts.kept_share.iloc[0] == 1.0


def test_curve_table_of_the_shipped_demo_runs_matches_pandas(tmp_path):
    """The demo's curves (README): one row per policy and keep ratio, each the mean over the demo
    tasks' runs, computed here from the runs' own ``requests`` tables and manifests."""
    import json
    import shutil
    from pathlib import Path

    import pyarrow.parquet as pq

    from analyses.curves import curve_runs, curve_table

    root = tmp_path / "sample_runs"
    shutil.copytree(Path(__file__).resolve().parents[1] / "sample_runs", root)
    runs = curve_runs(root)
    assert "delayed-recall-0-h2o-20-guard" not in runs and not any("-r0-" in r for r in runs)
    table = curve_table(root, runs).set_index(["policy", "keep_ratio"])
    rows = []
    for run in runs:
        manifest = json.loads((root / run / "manifest.json").read_text())
        correct = pd.concat([pq.read_table(p).to_pandas() for p in (root / run).glob("requests-*.parquet")])["correct"]
        m = manifest["model"]
        rows.append(
            {
                "policy": manifest["policy"],
                "keep_ratio": manifest.get("keep_ratio") or 1.0,
                "accuracy": correct.astype(float).mean(),
                "full_bytes": 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 4,
            }
        )
    want = pd.DataFrame(rows).groupby(["policy", "keep_ratio"]).mean()
    assert list(table.index.sort_values()) == list(want.index.sort_values())
    np.testing.assert_allclose(table.loc[want.index, "accuracy"], want["accuracy"])
    got_full = table["kv_bytes_per_token"] / table["kv_share"]  # one model: the full cache's bytes
    np.testing.assert_allclose(got_full.loc[want.index], want["full_bytes"])
    assert table.loc[("full", 1.0), "kv_share"] == 1.0 and (table["runs"] == 3).all()
