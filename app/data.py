"""Cached loaders: each calls :mod:`analyses` on a fresh cursor and returns small frames.

Results are cached per runs root version (see :class:`app.state.Root`), so
revisiting a page is instant and a new or changed run invalidates them.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

import analyses
from analyses import tiers, views
from analyses.guard import guard_actions, guard_requests, guard_risk
from analyses.guard import guard_cost as analyses_guard_cost

from .state import MAX_ROWS, Root, cursor

_cache = st.cache_data(show_spinner=False, max_entries=256)


@_cache
def runs(root: Root) -> pd.DataFrame:
    """Every run with headline numbers (:func:`analyses.views.runs_table`)."""
    with cursor(root) as cur:
        return views.runs_table(cur).df()


def with_effective_split(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with ``heavy, recent, sink`` replaced by the split each policy runs with
    (:func:`analyses.effective_split`: a ``local`` run configured 17 + 18 runs 0 + 35) and the
    configured values kept as ``heavy_set, recent_set``; rows whose split is not known (a keep
    ratio, a kvpress press) keep their heavy and recent and show no sink."""
    out = runs.copy()
    out["heavy_set"], out["recent_set"] = out["heavy"], out["recent"]
    out["sink"] = out.get("sink")  # None where the view has no sink column
    split = [
        analyses.effective_split(p, h, r, k)
        for p, h, r, k in zip(out["policy"], out["heavy"], out["recent"], out["sink"])
    ]
    for i, name in enumerate(("heavy", "recent")):
        out[name] = pd.array([s[i] if s is not None else v for s, v in zip(split, out[name])], dtype="Int64")
    # without a known split the configured sink means nothing (only the sink policy uses it)
    out["sink"] = pd.array([s[2] if s is not None else None for s in split], dtype="Int64")
    return out


def policy_colour(policy: str | None) -> str | None:
    """One run's policy colour, a kvpress press's included (:func:`analyses.policy_colour`)."""
    return analyses.policy_colour(policy)


def policy_colours() -> dict[str, str]:
    """``{policy: "#rrggbb"}`` from the policy registry (:func:`analyses.policy_colours`)."""
    return analyses.policy_colours()


@_cache
def problems(root: Root, run_id: str | None = None) -> pd.DataFrame:
    """Files the readers skipped: ``path, run_id, table_name, reason``."""
    with cursor(root) as cur:
        return views.run_problems(cur, run_id).df()


@_cache
def run_shape(root: Root, run_id: str) -> dict[str, Any]:
    """Steps, requests, tokens and KV sets of a run."""
    with cursor(root) as cur:
        rng = views.step_range(cur, run_id).df().iloc[0].to_dict()
        sets = views.kv_sets(cur, run_id).df()
    out = {k: (None if pd.isna(v) else int(v)) for k, v in rng.items()}
    out["layers"] = sorted(int(v) for v in sets["layer"].unique())
    out["kv_heads"] = sorted(int(v) for v in sets["kv_head"].unique())
    out["q_heads"] = sorted(int(v) for v in sets["q_head"].dropna().unique())
    out["sets"] = len(sets)
    return out


@_cache
def replay_series(root: Root, run_id: str) -> pd.DataFrame:
    with cursor(root) as cur:
        return analyses.replay_series(cur, run_id).df()


@_cache
def dropped_mass_series(root: Root, run_id: str) -> pd.DataFrame:
    with cursor(root) as cur:
        return analyses.dropped_mass_series(cur, run_id).df()


@_cache
def divergence(root: Root, run_id: str) -> pd.DataFrame:
    with cursor(root) as cur:
        return analyses.divergence_summary(cur, run_id).df()


@_cache
def guard_log(root: Root, run_id: str) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The guard's requests, actions and risk per step of a run (:mod:`analyses.guard`); empty
    without the guard."""
    with cursor(root) as cur:
        return guard_requests(cur, run_id).df(), guard_actions(cur, run_id).df(), guard_risk(cur, run_id).df()


@_cache
def guard_cost(root: Root, run_id: str) -> dict[str, Any] | None:
    """What the guard's own computations cost in a run (:func:`analyses.guard.guard_cost`)."""
    with cursor(root) as cur:
        return analyses_guard_cost(cur, run_id)


@_cache
def attributions(root: Root, run_id: str) -> list[dict[str, Any]]:
    """Verdicts of the failed requests, most severe first (:func:`analyses.attribute`)."""
    with cursor(root) as cur:
        return [a.to_dict() for a in analyses.attribute(cur, run_id)]


@_cache
def head_coverage(root: Root, run_id: str) -> pd.DataFrame:
    with cursor(root) as cur:
        return analyses.head_coverage(cur, run_id).df()


@_cache
def head_series(root: Root, run_id: str, layer: int, q_head: int) -> pd.DataFrame:
    with cursor(root) as cur:
        return views.head_dropped_mass(cur, run_id, layer=layer, q_head=q_head).df()


@_cache
def gqa_pair(root: Root, run_id: str) -> tuple[str, str] | None:
    with cursor(root) as cur:
        return views.gqa_partner(cur, run_id)


def _jaccard_summary(rel) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Jaccard statistics of an overlap relation per (layer, KV head) and per step."""
    by_set = analyses.coverage_stats(rel, by=("layer", "kv_head"), value="jaccard").df()
    by_step = analyses.coverage_stats(rel, by=("step",), value="jaccard").df()
    return by_set, by_step


@_cache
def gqa_overlap(root: Root, sum_run: str, max_run: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Jaccard of the sum and max kept sets: per (layer, KV head) and per step."""
    with cursor(root) as cur:
        return _jaccard_summary(analyses.gqa_overlap(cur, sum_run, max_run))


@_cache
def kept_overlap(root: Root, run_a: str, run_b: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Jaccard of two runs' kept sets: per (layer, KV head) and per step."""
    with cursor(root) as cur:
        return _jaccard_summary(analyses.kept_overlap(cur, run_a, run_b))


@_cache
def union_bound(root: Root, run_id: str, none_run: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """How much of ``none_run``'s per-query-head union the shared KV sets of ``run_id`` hold
    (:func:`analyses.union_bound`): recall per (layer, KV head) and per step."""
    with cursor(root) as cur:
        rel = analyses.union_bound(cur, run_id, none_run)
        by_set = analyses.coverage_stats(rel, by=("layer", "kv_head"), value="recall").df()
        by_step = analyses.coverage_stats(rel, by=("step",), value="recall").df()
        return by_set, by_step


@_cache
def free_generation(root: Root, run_a: str, run_b: str) -> pd.DataFrame | None:
    with cursor(root) as cur:
        rel = analyses.free_generation(cur, run_a, run_b)
        return None if rel is None else rel.df()


@_cache
def freezing(root: Root, run_id: str, window: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Freeze onset per KV set, mean promotion rate per KV set and the windowed series."""
    with cursor(root) as cur:
        onset = analyses.freeze_onset(cur, run_id, window=window).df()
        series = analyses.freeze_series(cur, run_id, window=window)
        rate = analyses.coverage_stats(
            series, by=("request", "layer", "kv_head", "q_head"), value="promotion_rate"
        ).df()
        return onset, rate, series.df()


@_cache
def tokens(
    root: Root,
    run_id: str,
    request: int,
    layer: int | None,
    kv_head: int | None,
    q_head: int | None,
    at_step: int | None,
    first: int,
    last: int,
) -> pd.DataFrame:
    with cursor(root) as cur:
        return views.token_evictions(
            cur,
            run_id,
            request=request,
            layer=layer,
            kv_head=kv_head,
            q_head=q_head,
            at_step=at_step,
            first=first,
            last=last,
        ).df()


@_cache
def lifetime(root: Root, run_id: str, request: int, position: int) -> pd.DataFrame:
    with cursor(root) as cur:
        return views.token_lifetime(cur, run_id, position, request=request).df()


@_cache
def evidence(root: Root, run_id: str) -> pd.DataFrame:
    with cursor(root) as cur:
        return analyses.evidence_held(cur, run_id).df()


@_cache
def evictions(root: Root, run_id: str, filters: tuple[tuple[str, Any], ...]) -> tuple[pd.DataFrame, int]:
    """Filtered eviction rows, at most :data:`~app.state.MAX_ROWS`, and how many matched."""
    with cursor(root) as cur:
        return views.capped(views.evictions_filtered(cur, run_id, **dict(filters)), MAX_ROWS)


@_cache
def margin_histogram(root: Root, run_id: str, filters: tuple[tuple[str, Any], ...], log: bool) -> pd.DataFrame:
    with cursor(root) as cur:
        return views.margin_histogram(cur, run_id, log=log, **dict(filters)).df()


@_cache
def margin_sensitivity(root: Root, run_id: str, phase: str | None) -> pd.DataFrame:
    with cursor(root) as cur:
        return analyses.margin_sensitivity(cur, run_id, phase=phase).df()


@_cache
def report_data(root: Root, run_id: str) -> dict[str, Any]:
    with cursor(root) as cur:
        return analyses.report_data(cur, run_id)


@_cache
def budget_distribution(root: Root) -> pd.DataFrame:
    """Minimal passing budgets of the root's explained requests (:func:`analyses.budget_distribution`)."""
    with cursor(root) as cur:
        return analyses.budget_distribution(cur)


@_cache
def recalled(root: Root, run_id: str, request: int, first: int, last: int) -> pd.DataFrame:
    """Positions of a request the cold tier's recall window held, when and where
    (:func:`analyses.tiers.recalled_tokens`); empty without a cold tier."""
    with cursor(root) as cur:
        return tiers.recalled_tokens(cur, run_id, request=request, first=first, last=last).df()


@_cache
def cold(root: Root, run_id: str) -> dict[str, Any] | None:
    """A cold-tier run's hot slots, cold bytes and recall counts (:func:`analyses.tiers.cold_overview`)."""
    with cursor(root) as cur:
        return tiers.cold_overview(cur, run_id)


@_cache
def set_slots(root: Root, run_id: str) -> tuple[pd.DataFrame, str]:
    """Slots per layer and KV set and their source (:func:`analyses.tiers.set_slots`)."""
    with cursor(root) as cur:
        return tiers.set_slots(cur, run_id)


@_cache
def plan_evidence(path: str) -> pd.DataFrame:
    """A plan file's concentration per layer and KV set (:func:`analyses.tiers.plan_evidence`)."""
    return tiers.plan_evidence(path)


@_cache
def schemas(root: Root) -> dict[str, list[dict[str, str]]]:
    return analyses.view_schemas(root.path)


def clear() -> None:
    """Forget every cached result and the connection (after runs changed on disk)."""
    st.cache_data.clear()
    st.cache_resource.clear()
