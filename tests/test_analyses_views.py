"""The dashboard's aggregations (analyses.views) against plain pandas/numpy on small runs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from listing import relist

import analyses
from analyses import views
from analyses.errors import ParameterError
from runlog import load_run, open_runs, to_arrow, write_segment, write_synthetic_run
from runlog.manifest import read_manifest, write_manifest

SHAPE = dict(layers=3, kv_heads=2, steps=40, prompt_len=48, heavy=12, recent=12, fsync=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("views") / "runs"
    write_synthetic_run(root, "a", requests=2, **SHAPE)
    write_segment(
        root / "a" / "requests-00000.parquet",
        "requests",
        to_arrow(
            "requests",
            {"request": [0, 1], "prompt_len": [48, 48], "new_tokens": [40, 40], "correct": [True, False]},
            run_id="a",
        ),
        run_id="a",
        fsync=False,
    )
    relist(root / "a")
    write_synthetic_run(root, "b", gqa="max", seed=4, **SHAPE)
    manifest = read_manifest(root / "b")
    manifest["source_run"] = "a"
    write_manifest(root / "b", manifest)
    write_synthetic_run(root, "c", seed=5, tables=["tokens", "evictions"], **SHAPE)
    seg = next((root / "c").glob("evictions-*.parquet"))
    seg.write_bytes(seg.read_bytes()[:100])
    return {"root": root, "con": open_runs(root, warn=False)}


def _t(world, run: str, table: str) -> pd.DataFrame:
    return load_run(world["root"] / run, [table])[table].to_pandas()


def test_runs_table_headline_numbers_match_pandas(world):
    got = views.runs_table(world["con"]).df().set_index("run_id")
    assert set(got.index) == {"a", "b", "c"}
    for run in ("a", "b"):
        ev, rs, rp = _t(world, run, "evictions"), _t(world, run, "replay_steps"), _t(world, run, "replay")
        row = got.loc[run]
        assert row["evictions"] == len(ev) and row["replay_steps"] == len(rs)
        assert row["kl_mean"] == pytest.approx(rs["kl"].astype(float).mean())
        assert row["top1_agreement"] == pytest.approx(rs["top1_agree"].mean())
        assert row["dropped_mass_mean"] == pytest.approx(rp["dropped_mass"].astype(float).mean())
    assert (got.loc["a", "checked"], got.loc["a", "correct"], got.loc["a", "correct_share"]) == (2, 1, 0.5)
    assert got.loc["b", "checked"] == 0 and pd.isna(got.loc["b", "correct_share"])
    assert got.loc["b", "source_run"] == "a" and got.loc["b", "gqa"] == "max"
    # run c: its evictions file is left out, so the file and the short row count are both problems
    assert got.loc["c", "problems"] == 2 and got.loc["c", "evictions"] == 0 and pd.isna(got.loc["c", "kl_mean"])
    assert got.loc["c", "integrity"] == (
        f"evictions-00000.parquet left out (unreadable); evictions: 0 of "
        f"{read_manifest(world['root'] / 'c')['rows']['evictions']} rows"
    )
    assert got.loc["a", "problems"] == 0 and got.loc["a", "integrity"] == "ok"
    names = dict(world["con"].sql("SELECT run_id, name FROM runs").fetchall())
    assert got["name"].to_dict() == names


def test_run_problems_name_the_damaged_file(world):
    probs = views.run_problems(world["con"], "c").df().sort_values("path", ignore_index=True)
    assert len(probs) == 2 and probs["path"][0].endswith("evictions-00000.parquet")
    assert probs["table_name"][0] == "evictions" and "Parquet" in probs["reason"][0]
    assert probs["path"][1].endswith("manifest.json") and "manifest records" in probs["reason"][1]
    assert views.run_problems(world["con"], "a").df().empty
    assert len(views.run_problems(world["con"]).df()) == 2


def test_kv_sets_and_step_range(world):
    sets = views.kv_sets(world["con"], "a").df()
    st = _t(world, "a", "steps")
    ref = st[["layer", "kv_head"]].drop_duplicates().sort_values(["layer", "kv_head"])
    assert sets[["layer", "kv_head"]].values.tolist() == ref.values.tolist()
    assert sets["q_head"].isna().all()
    rng = views.step_range(world["con"], "a").df().iloc[0]
    ev, tok = _t(world, "a", "evictions"), _t(world, "a", "tokens")
    steps = pd.concat([st["step"], ev["step"], _t(world, "a", "replay_steps")["step"]])
    assert (rng["first_step"], rng["last_step"]) == (steps.min(), steps.max())
    assert (rng["requests"], rng["tokens"]) == (2, len(tok))
    assert len(views.kv_sets(world["con"], "c").df()) == 0  # no steps, evictions unreadable


@pytest.mark.parametrize("at_step", [None, 60])
def test_token_evictions_match_pandas(world, at_step):
    ev, tok = _t(world, "a", "evictions"), _t(world, "a", "tokens")
    ev, tok = ev[ev.request == 1], tok[tok.request == 1]
    if at_step is not None:
        ev = ev[ev.step <= at_step]
    got = views.token_evictions(world["con"], "a", request=1, layer=2, kv_head=1, at_step=at_step).df()
    assert got["position"].tolist() == sorted(tok["position"])
    sets = 3 * 2
    one = ev[(ev.layer == 2) & (ev.kv_head == 1)].groupby("position")["step"].min()
    per = ev.groupby("position").agg(n=("step", "size"), first=("step", "min"))
    got = got.set_index("position")
    assert (got["sets"] == sets).all()
    pd.testing.assert_series_equal(
        got["evicted_step"].dropna().astype(int), one.astype(int), check_names=False, check_index_type=False
    )
    n = per["n"].reindex(got.index, fill_value=0)
    assert got["evicted_sets"].tolist() == n.tolist()
    assert np.allclose(got["evicted_share"], n / sets)
    assert got["first_evicted_step"].dropna().astype(int).tolist() == per["first"].tolist()
    assert got.loc[got["evidence"].notna()].index.tolist() == sorted(tok.loc[tok.evidence.notna(), "position"])


def test_token_evictions_window_and_no_set(world):
    got = views.token_evictions(world["con"], "a", first=10, last=19).df()
    assert got["position"].tolist() == list(range(10, 20)) and got["evicted_step"].isna().all()
    with pytest.raises(ParameterError, match="request"):
        views.token_evictions(world["con"], "a", request=-1)


def test_token_lifetime_matches_pandas(world):
    ev = _t(world, "a", "evictions")
    for position in (0, 20, 70):
        got = views.token_lifetime(world["con"], "a", position).df()
        assert len(got) == 6 and got[["layer", "kv_head"]].values.tolist() == [
            [l, h] for l in range(3) for h in range(2)
        ]
        mine = ev[(ev.request == 0) & (ev.position == position)].set_index(["layer", "kv_head"])
        for row in got.itertuples():
            key = (row.layer, row.kv_head)
            if key in mine.index:
                ref = mine.loc[key]
                assert not row.kept and row.evicted_step == ref["step"] and row.age == ref["age"]
                assert row.score == pytest.approx(ref["score"]) and row.margin == pytest.approx(ref["margin"])
            else:
                assert row.kept and pd.isna(row.evicted_step)


@pytest.mark.parametrize(
    "filters",
    [
        {},
        {"layer": 1},
        {"layer": 0, "kv_head": 1, "phase": "decode"},
        {"step_min": 60, "step_max": 70},
        {"margin_max": 0.1, "request": 1},
        {"phase": "prefill"},
    ],
)
def test_evictions_filtered_matches_pandas(world, filters):
    ev, tok = _t(world, "a", "evictions"), _t(world, "a", "tokens")
    ref = ev.merge(tok[["request", "position", "text", "evidence"]], on=["request", "position"], how="left")
    for col, op in (
        ("request", "=="),
        ("layer", "=="),
        ("kv_head", "=="),
        ("phase", "=="),
        ("step_min", ">="),
        ("step_max", "<="),
        ("margin_max", "<="),
    ):
        if col in filters:
            name = {"step_min": "step", "step_max": "step", "margin_max": "margin"}.get(col, col)
            v = filters[col]
            ref = ref[ref[name] == v] if op == "==" else ref[ref[name] >= v] if op == ">=" else ref[ref[name] <= v]
    ref = ref.sort_values(["request", "step", "layer", "kv_head", "position"]).reset_index(drop=True)
    got = views.evictions_filtered(world["con"], "a", **filters).df()
    assert len(got) == len(ref) > 0
    for col in ("request", "step", "layer", "kv_head", "position", "age", "phase", "text", "left_recent"):
        assert got[col].tolist() == ref[col].tolist(), col
    assert np.allclose(got["margin"], ref["margin"])
    head, total = views.capped(views.evictions_filtered(world["con"], "a", **filters), 7)
    assert total == len(ref) and len(head) == min(7, len(ref))
    assert head["position"].tolist() == ref["position"].head(7).tolist()


def test_margin_histogram_matches_numpy(world):
    ev = _t(world, "a", "evictions")
    x = ev.loc[ev.layer == 1, "margin"].astype(np.float64).to_numpy()
    got = views.margin_histogram(world["con"], "a", bins=12, log=False, layer=1).df()
    counts, edges = np.histogram(x, bins=12, range=(x.min(), x.max()))
    ref = pd.DataFrame({"bin": np.arange(12), "lo": edges[:-1], "hi": edges[1:], "evictions": counts})
    ref = ref[ref.evictions > 0].reset_index(drop=True)
    assert got["bin"].tolist() == ref["bin"].tolist() and got["evictions"].tolist() == ref["evictions"].tolist()
    assert np.allclose(got["lo"], ref["lo"]) and np.allclose(got["hi"], ref["hi"])

    logs = views.margin_histogram(world["con"], "a", bins=10, log=True, phase="decode").df()
    m = ev.loc[ev.phase == "decode", "margin"].astype(np.float64).to_numpy()
    pos = np.log10(m[m > 0])
    counts, edges = np.histogram(pos, bins=10, range=(pos.min(), pos.max()))
    bins = logs[logs.bin >= 0]
    assert bins["evictions"].sum() == (m > 0).sum() and logs.loc[logs.bin < 0, "evictions"].sum() == (m <= 0).sum()
    assert bins["evictions"].tolist() == counts[counts > 0].tolist()
    assert np.allclose(np.log10(bins["lo"]), edges[:-1][counts > 0])
    assert views.margin_histogram(world["con"], "a", layer=9).df().empty
    with pytest.raises(ParameterError, match="bins"):
        views.margin_histogram(world["con"], "a", bins=0)
    with pytest.raises(ParameterError, match="phase"):
        views.margin_histogram(world["con"], "a", phase="both")


def test_head_dropped_mass_matches_pandas(world):
    rp = _t(world, "a", "replay")
    ref = rp[(rp.layer == 2) & (rp.q_head == 5)].sort_values(["request", "step"])
    got = views.head_dropped_mass(world["con"], "a", layer=2, q_head=5).df()
    assert got["step"].tolist() == ref["step"].tolist() and got["request"].tolist() == ref["request"].tolist()
    assert np.allclose(got["dropped_mass"], ref["dropped_mass"]) and np.allclose(
        got["coverage"], 1 - ref["dropped_mass"]
    )
    one = views.head_dropped_mass(world["con"], "a", layer=2, q_head=5, request=1).df()
    assert set(one["request"]) == {1}


def test_where_filters_with_values_not_sql(world):
    rel = analyses.freeze_series(world["con"], "a", window=8)
    df = rel.df()
    got = views.where(rel, layer=1, kv_head=0, q_head=None).df()
    ref = df[(df.layer == 1) & (df.kv_head == 0) & df.q_head.isna()]
    assert len(got) == len(ref) > 0
    ev = views.evictions_filtered(world["con"], "a")
    assert views.where(ev, phase="decode' OR '1'='1").df().empty  # a value, never SQL text
    assert len(views.where(ev, phase="decode").df()) == (_t(world, "a", "evictions")["phase"] == "decode").sum()
    with pytest.raises(ParameterError, match="column 'nope'"):
        views.where(rel, nope=1)


def test_gqa_partner_follows_source_run(world):
    assert views.gqa_partner(world["con"], "a") == ("a", "b")
    assert views.gqa_partner(world["con"], "b") == ("a", "b")
    assert views.gqa_partner(world["con"], "c") is None


def test_console_examples_run_in_the_sandbox(world):
    examples = views.console_examples("a")
    assert len(examples) >= 4
    for name, sql in examples.items():
        df = analyses.run_sql(world["root"], sql, max_rows=100)
        assert len(df.columns) > 0, name
    quoted = views.console_examples("it's")["Evictions per layer and KV head"]
    assert "run_id = 'it''s'" in quoted and analyses.check_sql(quoted)
