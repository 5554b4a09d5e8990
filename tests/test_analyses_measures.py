"""Each analysis against a plain numpy/pandas computation (or the simulator's ground truth)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from listing import relist
from logsim import h2o_log_from_attention, random_attention, sim_tables, tokens_for, write_run

import analyses
from analyses.errors import MissingColumnError, ParameterError, UnknownRunError
from runlog import load_run, open_runs, to_arrow, write_synthetic_run
from runlog.schema import META_SCHEMA_VERSION, SCHEMA_VERSION

N, P, HEAVY, RECENT, LAYERS, HQ, HKV = 48, 12, 4, 3, 2, 4, 2
EVIDENCE = {3: "fact", 4: "fact", 9: "key"}
DISAGREE = (20, 25)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    att = random_attention(np.random.default_rng(1), LAYERS, HQ, N)
    sims = {}
    steps = list(range(P - 1, N))
    kl = [0.01 * (i % 7) + (0.9 if s in DISAGREE else 0.0) for i, s in enumerate(steps)]
    rs = {
        "request": [0] * len(steps),
        "step": steps,
        "kl": kl,
        "top1_agree": [s not in DISAGREE for s in steps],
        "teacher_logprob": [-0.2] * len(steps),
    }
    for gqa in ("sum", "max", "none"):
        sims[gqa] = h2o_log_from_attention(att, prompt_len=P, heavy=HEAVY, recent=RECENT, kv_heads=HKV, gqa=gqa)
        write_run(
            root,
            f"sim-{gqa}",
            tokens=tokens_for(N, P, evidence=EVIDENCE),
            **sim_tables(sims[gqa]),
            replay_steps=rs,
            heavy=HEAVY,
            recent=RECENT,
            gqa=gqa,
        )
    write_synthetic_run(
        root, "syn", layers=4, kv_heads=2, steps=96, prompt_len=64, heavy=16, recent=16, requests=2, fsync=False
    )
    free = tokens_for(N, P)
    free["token_id"] = [t if i < 30 else t + 1 for i, t in enumerate(free["token_id"])]  # from 30 on
    write_run(root, "sim-full", tokens=free, policy="full", source_run="sim-sum")
    con = open_runs(root)
    return {"root": root, "con": con, "att": att, "sims": sims}


def _table(world, run: str, table: str) -> pd.DataFrame:
    return load_run(world["root"] / run, [table])[table].to_pandas()


def _p(x: pd.Series, q: float) -> float:
    return float(np.percentile(x.to_numpy(np.float64), q))


# -- coverage ------------------------------------------------------------------------------------


def test_head_coverage_matches_pandas(world):
    rp = _table(world, "sim-sum", "replay")
    rp["coverage"] = 1.0 - rp["dropped_mass"].astype(np.float64)
    ref = rp.groupby(["layer", "q_head", "kv_head"])["coverage"].agg(
        n="count", mean="mean", min="min", p1=lambda x: _p(x, 1), p5=lambda x: _p(x, 5), max="max"
    )
    got = analyses.head_coverage(world["con"], "sim-sum").df().set_index(["layer", "q_head", "kv_head"])
    pd.testing.assert_frame_equal(got[ref.columns].astype(float), ref.astype(float), rtol=1e-9)
    overall = analyses.coverage_stats(analyses.dropped_mass(world["con"], "sim-sum"), by=()).df()
    assert overall["p5"][0] == pytest.approx(_p(rp["coverage"], 5))


def test_dropped_mass_is_the_teacher_weight_outside_the_candidate_set(world):
    """The fixture's replay equals Σ_{i<=t, i∉D_t} a_full: the definition the coverage reads."""
    sim, att = world["sims"]["sum"], world["att"]
    rp = pd.DataFrame(sim.replay)
    row = rp.iloc[-1]
    d = sim.sets[(0, int(row.layer), int(row.kv_head), -1, int(row.step))]
    t = int(row.step)
    expect = sum(att[int(row.layer), int(row.q_head), t, i] for i in range(t + 1) if i not in d)
    assert row.dropped_mass == pytest.approx(expect)


def _query_spans(rp: pd.DataFrame, tok: pd.DataFrame) -> pd.DataFrame:
    lab = pd.concat(
        [
            tok.assign(span=np.where(tok.is_prompt, "prompt", "answer")),
            tok.dropna(subset=["evidence"]).assign(span=lambda d: "evidence:" + d.evidence),
        ]
    )
    return rp.merge(lab[["request", "position", "span"]], left_on=["request", "step"], right_on=["request", "position"])


def _key_spans(rp: pd.DataFrame, tok: pd.DataFrame, sets: dict, gqa: str) -> pd.DataFrame:
    """Evidence slices from the simulator's own candidate sets D_t (not from the logs)."""
    rows = []
    spans = tok.dropna(subset=["evidence"]).groupby("evidence")["position"].apply(list)
    for r in rp.itertuples():
        qh = int(r.q_head) if gqa == "none" else -1  # the simulator keys a set per query head
        d = sets[(r.request, r.layer, r.kv_head, qh, r.step)]
        for label, pos in spans.items():
            lost = any(i not in d for i in pos if i <= r.step)
            rows.append((f"evidence:{label}:{'dropped' if lost else 'held'}", r.dropped_mass))
    return pd.DataFrame(rows, columns=["span", "dropped_mass"])


@pytest.mark.parametrize("gqa", ["sum", "none"])
def test_coverage_by_span_matches_pandas(world, gqa):
    """Query-token spans, and evidence spans by the keys each row's KV set still holds."""
    run = f"sim-{gqa}"
    rp = _table(world, run, "replay")
    tok = _table(world, run, "tokens")
    j = pd.concat([_query_spans(rp, tok)[["span", "dropped_mass"]], _key_spans(rp, tok, world["sims"][gqa].sets, gqa)])
    j["coverage"] = 1.0 - j["dropped_mass"].astype(np.float64)
    ref = j.groupby("span")["coverage"].agg(n="count", mean="mean", p5=lambda x: _p(x, 5))
    got = analyses.coverage_by_span(world["con"], run, by_head=False).df().set_index("span")
    # evidence sits before the replayed steps: it appears through the keys, held and dropped
    assert {"prompt", "answer", "evidence:fact:held", "evidence:fact:dropped", "evidence:key:dropped"} <= set(got.index)
    assert set(got.index) == set(ref.index)
    pd.testing.assert_frame_equal(got[ref.columns].astype(float), ref.loc[got.index].astype(float), rtol=1e-9)
    # lost evidence costs coverage in this fixture
    assert got.loc["evidence:fact:dropped", "mean"] < got.loc["evidence:fact:held", "mean"]


def test_dropped_mass_series_and_layer_buckets(world):
    rp = _table(world, "sim-sum", "replay")
    ref = rp.groupby(["request", "step"])["dropped_mass"].agg(["mean", "max"])
    got = analyses.dropped_mass_series(world["con"], "sim-sum").df().set_index(["request", "step"])
    np.testing.assert_allclose(got[["mean", "max"]].to_numpy(), ref.to_numpy(), rtol=1e-6)
    by = analyses.dropped_mass_by_layer(world["con"], "sim-sum", bucket=8).df()
    rp["b"] = rp.step // 8 * 8
    ref2 = rp.groupby(["layer", "b"])["dropped_mass"].mean().to_numpy()
    np.testing.assert_allclose(by["mean"].to_numpy(), ref2, rtol=1e-6)


# -- divergence ------------------------------------------------------------------------------------


def test_divergence_summary_and_first_divergence(world):
    got = analyses.divergence_summary(world["con"], "sim-sum").df().iloc[0]
    rs = _table(world, "sim-sum", "replay_steps")
    assert got.first_divergence_step == DISAGREE[0]
    assert got.top1_agreement == pytest.approx(rs.top1_agree.mean())
    assert got.kl_mean == pytest.approx(rs.kl.astype(float).mean())
    assert got.disagreements == len(DISAGREE)
    high = analyses.divergence_summary(world["con"], "sim-sum", kl_high=0.055).df().iloc[0]
    assert high.first_divergence_step == rs.step[rs.kl >= 0.055].min()


def test_free_generation_against_the_paired_full_run(world):
    assert analyses.paired_runs(world["con"], "sim-sum") == ["sim-full"]
    got = analyses.free_generation(world["con"], "sim-sum").df().iloc[0]
    assert got.first_diff_position == 30 and got.prompt_mismatches == 0
    assert got.compared == N - P and got.agreement == pytest.approx((30 - P) / (N - P))
    assert analyses.free_generation(world["con"], "syn") is None


# -- evidence ----------------------------------------------------------------------------------------


def test_evidence_deletion_and_held_share_match_the_candidate_sets(world):
    sim = world["sims"]["sum"]
    ev = pd.DataFrame(sim.evictions)
    spans = {"fact": [3, 4], "key": [9]}
    got = analyses.evidence_deletion(world["con"], "sim-sum").df()
    for row in got.itertuples():
        steps = [
            ev[(ev.layer == row.layer) & (ev.kv_head == row.kv_head) & (ev.position == p)].step
            for p in spans[row.label]
        ]
        gone = [int(s.iloc[0]) for s in steps if len(s)]
        assert row.evicted_tokens == len(gone)
        expect = max(gone) if len(gone) == len(spans[row.label]) else None
        assert (None if pd.isna(row.deletion_step) else row.deletion_step) == expect
    held = analyses.evidence_held(world["con"], "sim-sum").df().set_index("label")
    for label, positions in spans.items():
        sets = [sim.sets[(0, layer, kv, -1, P)] for layer in range(LAYERS) for kv in range(HKV)]
        assert held.loc[label, "at_step"] == P
        assert held.loc[label, "held_any_share"] == pytest.approx(
            np.mean([any(p in d for p in positions) for d in sets])
        )
        assert held.loc[label, "held_all_share"] == pytest.approx(
            np.mean([all(p in d for p in positions) for d in sets])
        )
    later = analyses.evidence_held(world["con"], "sim-sum", at_step=N - 1).df().set_index("label")
    assert later.loc["fact", "at_step"] == N - 1


# -- promotion, freezing, margins --------------------------------------------------------------------


def _windows(st: pd.DataFrame, window: int) -> pd.DataFrame:
    st = st.copy()
    st["win"] = (st.step - st.groupby("request").step.transform("min")) // window
    keys = ["request", "layer", "kv_head", "win"]

    def last(col):
        return lambda g: g.dropna(subset=[col]).sort_values("step")[col].iloc[-1]

    g = st.groupby(keys)
    out = pd.DataFrame(
        {
            "start_step": g.step.min(),
            "end_step": g.step.max(),
            "exits": g.promoted.count(),
            "promoted": g.promoted.sum(),
            "threshold": g.apply(last("min_heavy_score"), include_groups=False),
            "heavy_age": g.apply(last("heavy_age_mean"), include_groups=False),
        }
    ).reset_index()
    out["promotion_rate"] = out.promoted / out.exits
    return out


def test_promotion_windows_match_pandas(world):
    st = _table(world, "syn", "steps")
    ref = _windows(st, 10)
    got = analyses.promotion_windows(world["con"], "syn", window=10).df()
    cols = ["start_step", "end_step", "exits", "promoted", "promotion_rate", "threshold", "heavy_age"]
    np.testing.assert_allclose(got[cols].to_numpy(float), ref[cols].to_numpy(float), rtol=1e-6)


def test_freeze_onset_matches_a_pandas_implementation(world):
    window, max_rate, slope, min_windows = 8, 0.2, 0.5, 2
    w = _windows(_table(world, "syn", "steps"), window)
    onsets = {}
    for key, g in w.groupby(["request", "layer", "kv_head"]):
        g = g.sort_values("win")
        age_slope = g.heavy_age.diff() / g.end_step.diff()
        frozen = (
            (g.promotion_rate <= max_rate) & (g.threshold > g.threshold.shift()) & (age_slope >= slope)
        ).to_numpy()
        onset = None
        for k in range(len(g) - min_windows, -1, -1):
            if frozen[k:].all():
                onset = int(g.start_step.iloc[k])
            else:
                break
        onsets[key] = onset
    got = analyses.freeze_onset(
        world["con"], "syn", window=window, max_rate=max_rate, min_age_slope=slope, min_windows=min_windows
    ).df()
    mine = {
        (r.request, r.layer, r.kv_head): None if pd.isna(r.onset_step) else int(r.onset_step) for r in got.itertuples()
    }
    assert mine == onsets
    assert any(v is not None for v in onsets.values()) and any(v is None for v in onsets.values())
    series = analyses.freeze_series(world["con"], "syn", window=window, max_rate=max_rate).df()
    assert {"age_slope", "frozen", "promotion_rate", "threshold"} <= set(series.columns)


def test_margin_sensitivity_matches_pandas(world):
    ev = _table(world, "sim-sum", "evictions")
    for relative, thr in ((False, 0.05), (True, 0.02)):
        lim = thr * (ev.score + ev.margin) if relative else thr
        ev["near"] = ev.margin <= lim
        ref = ev.groupby(["layer", "kv_head"]).near.agg(["count", "sum", "mean"])
        got = analyses.margin_sensitivity(world["con"], "sim-sum", threshold=thr, relative=relative).df()
        np.testing.assert_allclose(
            got[["evictions", "near_zero", "near_zero_share"]].to_numpy(float), ref.to_numpy(float)
        )
    only = analyses.margin_sensitivity(world["con"], "sim-sum", phase="decode").df()
    assert only.evictions.sum() == (ev.phase == "decode").sum()


# -- kept sets ---------------------------------------------------------------------------------------


def test_kept_overlap_matches_the_simulated_sets(world):
    a, b = world["sims"]["sum"], world["sims"]["max"]
    got = analyses.kept_overlap(world["con"], "sim-sum", "sim-max").df()
    assert len(got) == LAYERS * HKV * (N - P)
    for r in got.itertuples():
        da, db = a.sets[(0, r.layer, r.kv_head, -1, r.step)], b.sets[(0, r.layer, r.kv_head, -1, r.step)]
        assert (r.size_a, r.size_b, r.intersection, r.union_size) == (len(da), len(db), len(da & db), len(da | db))
        assert r.jaccard == pytest.approx(len(da & db) / len(da | db))
    assert (got.jaccard < 1).any()  # sum and max disagree somewhere on this fixture


def test_union_bound_matches_the_per_query_head_union(world):
    s, none = world["sims"]["sum"], world["sims"]["none"]
    group = HQ // HKV
    got = analyses.union_bound(world["con"], "sim-sum", "sim-none").df()
    assert len(got) == LAYERS * HKV * (N - P)
    for r in got.itertuples():
        union = frozenset().union(
            *(none.sets[(0, r.layer, r.kv_head, q, r.step)] for q in range(r.kv_head * group, (r.kv_head + 1) * group))
        )
        d = s.sets[(0, r.layer, r.kv_head, -1, r.step)]
        assert (r.kept, r.union_size, r.held) == (len(d), len(union), len(d & union))
        assert r.recall == pytest.approx(len(d & union) / len(union))
    both = analyses.gqa_overlap(world["con"], "sim-sum", "sim-max", "sim-none").df()
    assert {"jaccard", "qhead_union_size", "recall_sum", "recall_max"} <= set(both.columns)
    assert len(both) == len(got)
    with pytest.raises(ParameterError):
        analyses.union_bound(world["con"], "sim-sum", "sim-max")


# -- stale heavy hitters ---------------------------------------------------------------------------------


def test_stale_victims_bound_the_true_recent_gain(world):
    sim = world["sims"]["sum"]
    got = analyses.stale_victims(world["con"], "sim-sum", window=4, max_rate=0.05).df()
    ev = pd.DataFrame(sim.evictions)
    heavy = ev[(ev.phase == "decode") & ~ev.left_recent.astype(bool)]
    assert len(got) == len(heavy)
    checked = 0
    for r in got.itertuples():
        if pd.isna(r.ref_step) or r.ref_step < r.entry_step:
            assert not r.stale
            continue
        before = sim.scores[(0, r.layer, r.kv_head, -1, int(r.ref_step))]
        assert r.position in before  # a heavy slot at the reference step
        true_gain = r.score - before[r.position]
        assert true_gain <= r.gain_bound + 1e-4
        assert r.stale == (r.gain_bound <= 0.05 * r.span)
        checked += 1
    assert checked > 0


def test_stale_holders_bound_the_lowest_heavy_slot(world):
    sim = world["sims"]["sum"]
    got = analyses.stale_holders(world["con"], "sim-sum", window=4).df()
    checked = 0
    for r in got[got.promotions == 0].itertuples():
        now = sim.scores[(0, r.layer, r.kv_head, -1, r.step)]
        heavy = {p: s for p, s in now.items() if p <= r.step - RECENT}
        lowest = min(heavy, key=lambda p: (heavy[p], p))
        before = sim.scores[(0, r.layer, r.kv_head, -1, int(r.ref_step))]
        assert lowest in before
        assert heavy[lowest] - before[lowest] <= r.gain_bound + 1e-4
        checked += 1
    assert checked > 0


# -- oracle ------------------------------------------------------------------------------------------


def test_oracle_agreement_needs_its_columns(world):
    assert not analyses.oracle_available(world["con"])
    with pytest.raises(MissingColumnError, match="teacher_future_mass"):
        analyses.oracle_agreement(world["con"], "sim-sum")


def test_oracle_agreement_matches_pandas(tmp_path, world):
    sim, att = world["sims"]["sum"], world["att"]
    write_run(tmp_path, "orc", tokens=tokens_for(N, P), heavy=HEAVY, recent=RECENT)
    ev = pd.DataFrame(sim.evictions)
    group = HQ // HKV
    agg = att.reshape(LAYERS, HKV, group, N, N).sum(2)  # (L, Hkv, N, N) summed over the group
    future = [float(agg[r.layer, r.kv_head, r.step + 1 :, r.position].sum()) for r in ev.itertuples()]
    past = [float(agg[r.layer, r.kv_head, r.position : r.step + 1, r.position].sum()) for r in ev.itertuples()]
    cols = {k: ev[k].tolist() for k in ev.columns if k != "q_head"}
    table = to_arrow("evictions", cols, run_id="orc")
    pq.write_table(
        table.replace_schema_metadata({META_SCHEMA_VERSION: str(SCHEMA_VERSION)}),
        tmp_path / "orc" / "evictions-00000.parquet",
    )
    keys = ("request", "step", "layer", "kv_head", "position")
    oracle = to_arrow(
        "oracle",
        {**{k: ev[k].tolist() for k in keys}, "teacher_future_mass": future, "teacher_score": past},
        run_id="orc",
    )
    pq.write_table(
        oracle.replace_schema_metadata({META_SCHEMA_VERSION: str(SCHEMA_VERSION)}),
        tmp_path / "orc" / "oracle-00000.parquet",
    )
    relist(tmp_path / "orc")
    con = open_runs(tmp_path)
    assert analyses.oracle_available(con)
    got = analyses.oracle_agreement(con, "orc", eps=0.5).df().set_index(["layer", "kv_head"])
    ev["future"] = np.float32(future)
    ev["teacher"] = np.float32(past)
    for (layer, kv), g in ev.groupby(["layer", "kv_head"]):
        row = got.loc[(layer, kv)]
        assert row.evictions == len(g)
        assert row.agreement == pytest.approx((g.future <= 0.5).mean())
        assert row.regret == pytest.approx(g.future.sum(), rel=1e-5)
        spearman = lambda x, y: x.rank().corr(y.rank())  # noqa: E731 (average ranks for ties)
        assert row.rank_corr_future == pytest.approx(spearman(g.score, g.future))
        assert row.rank_corr_score == pytest.approx(spearman(g.score, g.teacher))


# -- contracts ---------------------------------------------------------------------------------------------


def test_relations_are_lazy_and_compose(world):
    con = world["con"]
    a = analyses.head_coverage(con, "sim-sum")
    b = analyses.head_coverage(con, "sim-max").select("layer, q_head, p5 AS p5_max")
    both = a.join(b, ["layer", "q_head"])  # two relations binding the same marker names
    assert len(both.df()) == LAYERS * HQ
    assert "$" in a.sql_query()  # values stay bound markers, never formatted into the SQL


def test_parameters_and_unknown_runs_are_refused(world):
    con = world["con"]
    with pytest.raises(UnknownRunError, match="nope"):
        analyses.kept_overlap(con, "nope", "sim-max")
    for call in (
        lambda: analyses.promotion_windows(con, "syn", window=0),
        lambda: analyses.freeze_onset(con, "syn", max_rate=2.0),
        lambda: analyses.margin_sensitivity(con, "syn", phase="both"),
        lambda: analyses.coverage_stats(analyses.dropped_mass(con, "syn"), by=("nope",)),
        lambda: analyses.Thresholds(dropped_mass_high=3.0),
        lambda: analyses.Thresholds.from_mapping({"nope": 1}),
    ):
        with pytest.raises(ParameterError):
            call()


def test_analyses_never_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, analyses, analyses.bench; "
        "bad = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
