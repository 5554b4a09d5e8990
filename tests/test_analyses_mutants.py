"""Freezing, margins, span coverage and layer buckets on small hand-built logs.

Each expected value is recomputed here from the logged rows (plain Python, numpy or pandas),
and the small cases also carry the values worked out by hand. The tests pin the documented
defaults (a call without the parameter must give the recomputed value at the documented
default, and the case is checked to give another answer at a neighbouring value) and the
parameter checks (the error names the parameter and the value received).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest
from logsim import tokens_for, write_run

import analyses
from analyses.errors import ParameterError
from runlog import load_run, open_runs

# -- hand-built logs ---------------------------------------------------------------------------------


def _steps(sets: dict[tuple[int, int], list[tuple[int, bool | None, float, float]]]) -> dict[str, list]:
    """``steps`` columns from ``{(layer, kv_head): [(step, promoted, min_heavy_score, heavy_age_mean)]}``."""
    cols: dict[str, list] = {k: [] for k in ("request", "step", "layer", "kv_head", "promoted")}
    cols |= {"min_heavy_score": [], "heavy_age_mean": []}
    for (layer, kv), rows in sets.items():
        for step, promoted, thr, age in rows:
            for name, value in zip(cols, (0, step, layer, kv, promoted, thr, age), strict=True):
                cols[name].append(value)
    return cols


def _small_freeze_case() -> dict[tuple[int, int], list]:
    """24 steps, windows of 4 steps (6 windows), three KV sets.

    * (0, 0): promotes at every step in windows 0-2, never in 3-5; threshold and heavy age rise
      (age 1 per step) throughout: windows 3, 4, 5 frozen, onset step 12.
    * (0, 1): never promotes, threshold rises, age 1 per step except in window 5 where the heavy
      set is renewed (age +1 over 4 steps, slope 0.25): windows 1-4 frozen, window 5 not, no onset.
    * (1, 0): never promotes, age 1 per step, threshold flat through window 3, then rising:
      windows 4, 5 frozen, onset step 16.
    """
    a = [(t, t < 12, 1.0 + 0.125 * t, 2.0 + t) for t in range(24)]
    b = [(t, False, 1.0 + 0.125 * t, 2.0 + t if t < 20 else 21.0 + 0.25 * (t - 19)) for t in range(24)]
    c = [(t, False, 1.0 if t < 16 else 1.0 + 0.125 * t, 2.0 + t) for t in range(24)]
    return {(0, 0): a, (0, 1): b, (1, 0): c}


# (0, 1): heavy ages 2..21 for steps 0..19, then 21.25, 21.5, 21.75, 22.0: window 5 ends at
# age 22.0 after window 4's 21.0 (step 19): slope (22 - 21) / (23 - 19) = 0.25.
# (1, 0): threshold 1.0 up to step 15 (windows 0-3 all end at 1.0: not rising), then
# 1 + 0.125 t: window 4 ends at 3.375 > 1.0, window 5 at 3.875: windows 4, 5 frozen, onset 16.
SMALL_ONSETS = {(0, 0): 12, (0, 1): None, (1, 0): 16}
SMALL_FROZEN = {
    (0, 0): [False, False, False, True, True, True],
    (0, 1): [False, True, True, True, True, False],
    (1, 0): [False, False, False, False, True, True],
}
SMALL_SLOPES = {
    (0, 0): [None, 1.0, 1.0, 1.0, 1.0, 1.0],
    (0, 1): [None, 1.0, 1.0, 1.0, 1.0, 0.25],
    (1, 0): [None, 1.0, 1.0, 1.0, 1.0, 1.0],
}


def _default_freeze_case() -> dict[tuple[int, int], list]:
    """128 steps (8 windows of the default 16), three KV sets sensitive to each default.

    * (0, 0): never promotes, threshold rises, age 1 per step: frozen from window 1 on, so the
      onset moves with ``window`` and vanishes at ``min_age_slope`` above 1.
    * (0, 1): promotes every other step (rate 0.5), threshold and age rise: never frozen at
      ``max_rate`` 0.05, frozen at any ``max_rate`` >= 0.5.
    * (1, 1): never promotes, age 1 per step, threshold flat up to step 95 then rising: exactly
      the last two windows frozen, so the onset needs ``min_windows`` <= 2.
    """
    a = [(t, False, 1.0 + 0.125 * t, 3.0 + t) for t in range(128)]
    b = [(t, t % 2 == 0, 1.0 + 0.125 * t, 3.0 + t) for t in range(128)]
    c = [(t, False, 1.0 if t < 96 else 0.125 * t, 3.0 + t) for t in range(128)]
    return {(0, 0): a, (0, 1): b, (1, 1): c}


def _hand_windows(rows: list[tuple[int, bool | None, float, float]], window: int) -> list[dict]:
    """Windows of one KV set, straight from the definition (rows of one request)."""
    first = min(r[0] for r in rows)
    out: dict[int, dict] = {}
    for step, promoted, thr, age in sorted(rows):
        w = out.setdefault((step - first) // window, {"start": step, "end": step, "exits": 0, "promoted": 0})
        w["end"] = step
        if promoted is not None:
            w["exits"] += 1
            w["promoted"] += int(promoted)
        if thr is not None:
            w["threshold"] = thr
        if age is not None:
            w["heavy_age"] = age
    wins = [out[k] for k in sorted(out)]
    for w in wins:
        w["rate"] = w["promoted"] / w["exits"] if w["exits"] else None
    return wins


def _hand_freeze(rows, window: int, max_rate: float, min_age_slope: float, min_windows: int):
    """(per-window slopes, per-window frozen flags, onset step or None) from the definition."""
    wins = _hand_windows(rows, window)
    slopes, frozen = [None], [False]
    for prev, w in zip(wins, wins[1:], strict=False):
        slope = (w["heavy_age"] - prev["heavy_age"]) / (w["end"] - prev["end"])
        slopes.append(slope)
        frozen.append(
            w["rate"] is not None
            and w["rate"] <= max_rate
            and w["threshold"] > prev["threshold"]
            and slope >= min_age_slope
        )
    onset = None
    for k in range(len(wins)):
        if all(frozen[k:]) and len(wins) - k >= min_windows:
            onset = wins[k]["start"]
            break
    return slopes, frozen, onset


def _as_f32(x: float | None) -> float | None:
    return None if x is None else float(np.float32(x))


def _f32(sets):
    """The rows as the log stores them (scores and ages are FP32)."""
    return {k: [(s, p, _as_f32(t), _as_f32(a)) for s, p, t, a in rows] for k, rows in sets.items()}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_run(root, "freeze-small", tokens=tokens_for(24, 4), steps=_steps(_small_freeze_case()))
    write_run(root, "freeze-default", tokens=tokens_for(128, 4), steps=_steps(_default_freeze_case()))
    write_run(root, "margins", tokens=tokens_for(16, 8), evictions=_margin_evictions())
    nan = [*MARGINS, (0, 3.0, math.nan, "prefill")]  # nothing eligible survived: NaN margin
    write_run(root, "nan-margins", tokens=tokens_for(16, 8), evictions=_margin_evictions(nan))
    write_run(
        root, "spans", tokens=tokens_for(8, 5, evidence={1: "fact"}), evictions=_span_evictions(), replay=_span_replay()
    )
    two = _span_replay()
    two = {
        k: v + [(1 if k == "request" else (x + 0.5 if k == "dropped_mass" else x)) for x in v] for k, v in two.items()
    }
    tokens = {k: v + v for k, v in tokens_for(8, 5).items()}
    tokens["request"] = [0] * 8 + [1] * 8
    write_run(root, "two-requests", tokens=tokens, replay=two)
    return {"root": root, "con": open_runs(root)}


# -- freeze onset ------------------------------------------------------------------------------------


def _keyed(df: pd.DataFrame, col: str) -> dict:
    out: dict = {}
    for r in df.itertuples():
        v = getattr(r, col)
        out.setdefault((r.layer, r.kv_head), []).append(None if v is None or pd.isna(v) else v)
    return out


def test_freeze_onset_small_case_from_first_principles(logs):
    case = _f32(_small_freeze_case())
    params = {"window": 4, "max_rate": 0.05, "min_age_slope": 0.5, "min_windows": 2}
    hand = {k: _hand_freeze(rows, **params) for k, rows in case.items()}
    # the recomputation agrees with the values worked out by hand in the case's docstring
    assert {k: h[2] for k, h in hand.items()} == SMALL_ONSETS
    assert {k: h[1] for k, h in hand.items()} == SMALL_FROZEN
    assert {k: h[0] for k, h in hand.items()} == SMALL_SLOPES

    got = analyses.freeze_onset(logs["con"], "freeze-small", **params).df()
    assert [(r.layer, r.kv_head) for r in got.itertuples()] == list(case)
    onsets = {(r.layer, r.kv_head): None if pd.isna(r.onset_step) else int(r.onset_step) for r in got.itertuples()}
    assert onsets == SMALL_ONSETS
    assert got.frozen.tolist() == [True, False, True]
    assert got.windows.tolist() == [6, 6, 6]
    frozen_windows = [None if pd.isna(v) else int(v) for v in got.frozen_windows]
    assert frozen_windows == [3, None, 2]
    last = [_hand_windows(rows, 4)[-1] for rows in case.values()]
    np.testing.assert_allclose(got.last_promotion_rate, [w["rate"] for w in last])
    np.testing.assert_allclose(got.last_threshold, [w["threshold"] for w in last])
    np.testing.assert_allclose(got.last_heavy_age, [w["heavy_age"] for w in last])

    series = analyses.freeze_series(logs["con"], "freeze-small", window=4, max_rate=0.05, min_age_slope=0.5).df()
    assert _keyed(series, "frozen") == SMALL_FROZEN
    assert _keyed(series, "age_slope") == SMALL_SLOPES
    assert _keyed(series, "start_step") == {k: [0, 4, 8, 12, 16, 20] for k in case}
    assert _keyed(series, "end_step") == {k: [3, 7, 11, 15, 19, 23] for k in case}
    rates = {k: [w["rate"] for w in _hand_windows(rows, 4)] for k, rows in case.items()}
    assert _keyed(series, "promotion_rate") == rates

    # min_windows 3 drops the two-window tail of (1, 0); min_windows 1 is allowed
    three = analyses.freeze_onset(logs["con"], "freeze-small", **(params | {"min_windows": 3})).df()
    assert [None if pd.isna(v) else int(v) for v in three.onset_step] == [12, None, None]
    one = analyses.freeze_onset(logs["con"], "freeze-small", **(params | {"min_windows": 1})).df()
    assert [None if pd.isna(v) else int(v) for v in one.onset_step] == [
        _hand_freeze(rows, **(params | {"min_windows": 1}))[2] for rows in case.values()
    ]


def test_window_of_one_step(logs):
    """``window=1`` is valid: every step is its own window."""
    case = _f32(_small_freeze_case())
    hand = {k: _hand_freeze(rows, 1, 0.05, 0.5, 2) for k, rows in case.items()}
    got = analyses.freeze_onset(logs["con"], "freeze-small", window=1, max_rate=0.05).df()
    assert {(r.layer, r.kv_head): None if pd.isna(r.onset_step) else int(r.onset_step) for r in got.itertuples()} == {
        k: h[2] for k, h in hand.items()
    }
    assert got.windows.tolist() == [24, 24, 24]
    series = analyses.freeze_series(logs["con"], "freeze-small", window=1).df()
    assert _keyed(series, "frozen") == {k: h[1] for k, h in hand.items()}
    pw = analyses.promotion_windows(logs["con"], "freeze-small", window=1).df()
    assert pw.start_step.tolist() == pw.end_step.tolist() == list(range(24)) * 3


def _onsets(case, **params):
    return {k: _hand_freeze(rows, **params)[2] for k, rows in case.items()}


DEFAULTS = {"window": 16, "max_rate": 0.05, "min_age_slope": 0.5, "min_windows": 2}


@pytest.mark.parametrize(
    ("name", "other"), [("window", 17), ("max_rate", 0.5), ("min_age_slope", 1.5), ("min_windows", 3)]
)
def test_freeze_defaults(logs, name, other):
    case = _f32(_default_freeze_case())
    expected = _onsets(case, **DEFAULTS)
    assert expected == {(0, 0): 16, (0, 1): None, (1, 1): 96}
    assert _onsets(case, **(DEFAULTS | {name: other})) != expected  # the case tells the default apart
    got = analyses.freeze_onset(logs["con"], "freeze-default").df()
    assert {(r.layer, r.kv_head): None if pd.isna(r.onset_step) else int(r.onset_step) for r in got.itertuples()} == (
        expected
    )
    series = analyses.freeze_series(logs["con"], "freeze-default").df()
    frozen = {k: _hand_freeze(rows, 16, 0.05, 0.5, 2)[1] for k, rows in case.items()}
    assert _keyed(series, "frozen") == frozen


def test_promotion_windows_default_window(logs):
    case = _f32(_default_freeze_case())
    got = analyses.promotion_windows(logs["con"], "freeze-default").df()
    for k, rows in case.items():
        wins = _hand_windows(rows, 16)
        assert len(wins) == 8 and len(_hand_windows(rows, 17)) == 8
        assert [w["start"] for w in _hand_windows(rows, 17)] != [w["start"] for w in wins]
        mine = got[(got.layer == k[0]) & (got.kv_head == k[1])]
        assert mine.start_step.tolist() == [w["start"] for w in wins]
        assert mine.end_step.tolist() == [w["end"] for w in wins]
        assert mine.exits.tolist() == [w["exits"] for w in wins]
        assert mine.promoted.tolist() == [w["promoted"] for w in wins]
        np.testing.assert_allclose(mine.promotion_rate, [w["rate"] for w in wins])
        np.testing.assert_allclose(mine.threshold, [w["threshold"] for w in wins])
        np.testing.assert_allclose(mine.heavy_age, [w["heavy_age"] for w in wins])


# -- margins -----------------------------------------------------------------------------------------

# (kv_head, score, margin, phase). With threshold 1e-3: relative limit 1e-3 * (score + margin).
MARGINS = [
    (0, 10.0, 0.005, "prefill"),  # near relative (limit 0.010005), not absolute
    (0, 0.1, 0.0005, "decode"),  # near absolute, not relative (limit 1.005e-4)
    (0, 1.0, 0.5, "decode"),  # near only with a threshold near 1
    (0, 2.0, 0.0, "decode"),  # a tie: near under every rule
    (0, 5.0, 0.002, "prefill"),  # near relative (limit 0.005002), not absolute
    (1, 0.2, 0.0008, "decode"),  # near absolute, not relative (limit 2.008e-4)
    (1, 4.0, 0.003, "prefill"),  # near relative (limit 0.004003), not absolute
]


def _margin_evictions(rows=MARGINS) -> dict[str, list]:
    n = len(rows)
    return {
        "request": [0] * n,
        "step": [8 + i for i in range(n)],
        "layer": [0] * n,
        "kv_head": [m[0] for m in rows],
        "position": list(range(n)),
        "score": [m[1] for m in rows],
        "margin": [m[2] for m in rows],
        "age": [8] * n,
        "left_recent": [False] * n,
        "phase": [m[3] for m in rows],
    }


def _margin_ref(root, threshold: float, relative: bool, phase: str | None = None, run: str = "margins"):
    ev = load_run(root / run, ["evictions"])["evictions"].to_pandas()
    ev = ev[~np.isnan(ev.margin)]
    if phase is not None:
        ev = ev[ev.phase == phase]
    m, s = ev.margin.to_numpy(np.float64), ev.score.to_numpy(np.float64)
    ev = ev.assign(near=m <= (threshold * (s + m) if relative else threshold), m64=m)
    g = ev.groupby(["layer", "kv_head"])
    return pd.DataFrame(
        {"evictions": g.size(), "near_zero": g.near.sum(), "near_zero_share": g.near.mean(), "median": g.m64.median()}
    ).reset_index()


def _margin_cols(df: pd.DataFrame) -> np.ndarray:
    return df[["layer", "kv_head", "evictions", "near_zero", "near_zero_share", "margin_median"]].to_numpy(float)


def test_margin_sensitivity_defaults_are_relative_one_per_mille(logs):
    root, con = logs["root"], logs["con"]
    ref = _margin_ref(root, 1e-3, True)
    assert ref.near_zero.tolist() == [3, 1]  # by hand: rows 1, 4, 5 of KV head 0 and row 7
    for other in (_margin_ref(root, 1e-3, False), _margin_ref(root, 1.001, True)):
        assert other.near_zero.tolist() != ref.near_zero.tolist()
    got = analyses.margin_sensitivity(con, "margins").df()
    np.testing.assert_allclose(_margin_cols(got), ref.to_numpy(float), rtol=1e-6)
    explicit = analyses.margin_sensitivity(con, "margins", threshold=1e-3, relative=True).df()
    np.testing.assert_allclose(_margin_cols(explicit), ref.to_numpy(float), rtol=1e-6)
    absolute = analyses.margin_sensitivity(con, "margins", relative=False).df()
    assert absolute.near_zero.tolist() == [2, 1]  # rows 2, 4 and row 6
    np.testing.assert_allclose(_margin_cols(absolute), _margin_ref(root, 1e-3, False).to_numpy(float), rtol=1e-6)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_margin_sensitivity_by_phase(logs, phase):
    ref = _margin_ref(logs["root"], 1e-3, True, phase)
    got = analyses.margin_sensitivity(logs["con"], "margins", phase=phase).df()
    np.testing.assert_allclose(_margin_cols(got), ref.to_numpy(float), rtol=1e-6)
    assert got.evictions.sum() == sum(1 for m in MARGINS if m[3] == phase and not math.isnan(m[2]))


def test_nan_margins_are_left_out(logs):
    """NaN margins (nothing eligible survived) are not near ties: float columns carry no Parquet
    statistics, from which DuckDB would fold ``isnan(margin)`` to false."""
    ref = _margin_ref(logs["root"], 1e-3, True, run="nan-margins")
    assert ref.evictions.tolist() == [5, 2]
    got = analyses.margin_sensitivity(logs["con"], "nan-margins").df()
    np.testing.assert_allclose(_margin_cols(got), ref.to_numpy(float), rtol=1e-6)


# -- coverage by span and by layer -------------------------------------------------------------------

# 8 tokens, prompt 0-4, evidence "fact" at position 1; replay at steps 4-7, layers 0 and 1, query
# heads 0 and 1 on KV head 0. Layer 0 evicts position 1 at step 5 (and position 2 at step 6);
# layer 1 evicts only position 3, which carries no label.


def _span_evictions() -> dict[str, list]:
    rows = [(5, 0, 1), (6, 0, 2), (6, 1, 3)]  # (step, layer, position)
    return {
        "request": [0] * 3,
        "step": [r[0] for r in rows],
        "layer": [r[1] for r in rows],
        "kv_head": [0] * 3,
        "position": [r[2] for r in rows],
        "score": [0.1] * 3,
        "margin": [0.2] * 3,
        "age": [r[0] - r[2] for r in rows],
        "left_recent": [False] * 3,
        "phase": ["decode"] * 3,
    }


def _span_replay() -> dict[str, list]:
    keys = [(t, layer, q) for t in range(4, 8) for layer in (0, 1) for q in (0, 1)]
    return {
        "request": [0] * len(keys),
        "step": [k[0] for k in keys],
        "layer": [k[1] for k in keys],
        "q_head": [k[2] for k in keys],
        "kv_head": [0] * len(keys),
        "dropped_mass": [0.03 * (t - 3) + 0.2 * layer + 0.01 * q + 0.001 * (t * t % 5) for t, layer, q in keys],
    }


def _spans_by_hand(root) -> pd.DataFrame:
    rp = load_run(root / "spans", ["replay"])["replay"].to_pandas()
    rows = []
    for r in rp.itertuples():
        rows.append(("prompt" if r.step < 5 else "answer", r))
        gone = 5 if r.layer == 0 else None  # the step "fact" left layer 0's set
        rows.append(("evidence:fact:" + ("dropped" if gone is not None and gone < r.step else "held"), r))
    df = pd.DataFrame(
        [
            {"span": s, "layer": r.layer, "q_head": r.q_head, "kv_head": r.kv_head, "c": 1.0 - float(r.dropped_mass)}
            for s, r in rows
        ]
    )
    g = df.groupby(["span", "layer", "q_head", "kv_head"]).c
    pct = lambda q: g.apply(lambda x: np.percentile(x.to_numpy(), q))  # noqa: E731
    return pd.DataFrame(
        {"n": g.size(), "mean": g.mean(), "min": g.min(), "p1": pct(1), "p5": pct(5), "max": g.max()}
    ).reset_index()


def test_coverage_by_span_is_per_head_by_default(logs):
    ref = _spans_by_hand(logs["root"])
    got = analyses.coverage_by_span(logs["con"], "spans").df()
    assert list(got.columns) == ["span", "layer", "q_head", "kv_head", "n", "mean", "min", "p1", "p5", "max"]
    got = got.sort_values(["span", "layer", "q_head", "kv_head"]).reset_index(drop=True)
    assert got[["span", "layer", "q_head", "kv_head"]].values.tolist() == (
        ref[["span", "layer", "q_head", "kv_head"]].values.tolist()
    )
    # by hand: layer 0 lost "fact" at step 5, so its steps 6 and 7 are dropped, 4 and 5 held
    dropped = got[got.span == "evidence:fact:dropped"]
    assert dropped.layer.tolist() == [0, 0] and dropped.n.tolist() == [2, 2]
    assert got[got.span == "prompt"].n.tolist() == [1, 1, 1, 1]
    assert got[got.span == "answer"].n.tolist() == [3, 3, 3, 3]
    cols = ["n", "mean", "min", "p1", "p5", "max"]
    np.testing.assert_allclose(got[cols].to_numpy(float), ref[cols].to_numpy(float), rtol=1e-6)


def test_dropped_mass_by_layer_defaults_to_one_step_buckets(logs):
    rp = load_run(logs["root"] / "spans", ["replay"])["replay"].to_pandas()
    ref = (
        rp.assign(m=rp.dropped_mass.astype(np.float64)).groupby(["layer", "step"]).m.agg(["mean", "max"]).reset_index()
    )
    got = analyses.dropped_mass_by_layer(logs["con"], "spans").df()
    assert got.step_start.tolist() == ref.step.tolist() == [4, 5, 6, 7] * 2
    np.testing.assert_allclose(
        got[["layer", "mean", "max"]].to_numpy(float), ref[["layer", "mean", "max"]].to_numpy(float)
    )
    two = analyses.dropped_mass_by_layer(logs["con"], "spans", bucket=2).df()
    assert two.step_start.tolist() == [4, 6] * 2


def test_dropped_mass_and_head_coverage_of_one_request(logs):
    rp = load_run(logs["root"] / "two-requests", ["replay"])["replay"].to_pandas()
    assert sorted(set(rp.request)) == [0, 1]
    for request in (0, 1):
        mine = rp[rp.request == request]
        got = analyses.dropped_mass(logs["con"], "two-requests", request=request).df()
        assert got.request.tolist() == [request] * len(mine) == [request] * 16
        got = got.sort_values(["step", "layer", "q_head"])
        np.testing.assert_allclose(got.dropped_mass, mine.sort_values(["step", "layer", "q_head"]).dropped_mass)
        np.testing.assert_allclose(got.coverage, 1.0 - got.dropped_mass.to_numpy(np.float64))
        heads = analyses.head_coverage(logs["con"], "two-requests", request=request).df()
        c = mine.assign(c=1.0 - mine.dropped_mass.astype(np.float64)).groupby(["layer", "q_head"]).c
        np.testing.assert_allclose(
            heads[["n", "mean", "min", "max"]].to_numpy(float), c.agg(["size", "mean", "min", "max"]).to_numpy(float)
        )
    assert len(analyses.dropped_mass(logs["con"], "two-requests").df()) == len(rp) == 32


def test_coverage_stats_quotes_column_names(logs):
    rel = logs["con"].sql('SELECT * FROM (VALUES (1, 0.25), (1, 0.75), (2, 0.5)) t("a""b", "v v")')
    got = analyses.coverage_stats(rel, by=('a"b',), value="v v").df()
    assert got['a"b'].tolist() == [1, 2] and got.n.tolist() == [2, 1]
    np.testing.assert_allclose(got[["mean", "min", "max"]].to_numpy(float), [[0.5, 0.25, 0.75], [0.5, 0.5, 0.5]])


def test_coverage_stats_names_the_missing_column_and_the_columns_it_has(logs):
    rel = analyses.dropped_mass(logs["con"], "spans")
    with pytest.raises(ParameterError) as err:
        analyses.coverage_stats(rel, by=("layer", "nope"))
    msg = str(err.value)
    assert "'nope'" in msg and ", ".join(rel.columns) in msg, msg


# -- parameter checks --------------------------------------------------------------------------------

BAD = [
    (analyses.promotion_windows, "freeze-small", "window", 0),
    (analyses.promotion_windows, "freeze-small", "window", -3),
    (analyses.freeze_series, "freeze-small", "window", 0),
    (analyses.freeze_series, "freeze-small", "window", -3),
    (analyses.freeze_onset, "freeze-small", "window", 0),
    (analyses.freeze_onset, "freeze-small", "max_rate", 1.5),
    (analyses.freeze_onset, "freeze-small", "max_rate", -0.25),
    (analyses.freeze_series, "freeze-small", "min_age_slope", -0.25),
    (analyses.freeze_onset, "freeze-small", "min_age_slope", -2.5),
    (analyses.freeze_onset, "freeze-small", "min_windows", 0),
    (analyses.freeze_onset, "freeze-small", "min_windows", -3),
    (analyses.margin_sensitivity, "margins", "threshold", -0.5),
    (analyses.margin_sensitivity, "margins", "phase", "both"),
    (analyses.margin_sensitivity, "margins", "phase", "PREFILL"),
    (analyses.dropped_mass_by_layer, "spans", "bucket", 0),
    (analyses.dropped_mass_by_layer, "spans", "bucket", -3),
    (analyses.dropped_mass, "spans", "request", -1),
    (analyses.dropped_mass, "spans", "request", "0"),
]


@pytest.mark.parametrize(("fn", "run", "name", "value"), BAD, ids=[f"{b[0].__name__}-{b[2]}={b[3]}" for b in BAD])
def test_bad_parameters_name_the_parameter_and_the_value(logs, fn, run, name, value):
    with pytest.raises(ParameterError) as err:
        fn(logs["con"], run, **{name: value})
    msg = str(err.value)
    assert re.search(rf"(?<!\w){name}(?!\w)", msg), msg
    assert repr(value) in msg, msg
