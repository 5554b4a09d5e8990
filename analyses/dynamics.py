"""Promotion, cache freezing and margin sensitivity (DESIGN.md §6, §8.1, §8.3).

A token that leaves the recent window is *promoted* when it survives (its
score beat the heavy threshold). As the heavy hitters keep accumulating,
the threshold ``min_heavy_score`` rises and later tokens cannot get in: the
cache *freezes*. The ``steps`` view logs, per step and KV set, whether the
exiting token was promoted, the threshold after the step and the mean age of
the heavy slots.

Windows are ``window`` steps (query positions) wide, counted from the first
logged step of each request. Freeze onset of a KV set: the start step of the
earliest window from which every window to the end of the run is *frozen*
(and at least ``min_windows`` of them). A window ``k`` is frozen when

* its promotion rate is at most ``max_rate``,
* its threshold (last ``min_heavy_score`` of the window) is above window
  ``k-1``'s, and
* the heavy slots age at ``min_age_slope`` or more per step:
  ``(heavy_age_k - heavy_age_{k-1}) / (end_step_k - end_step_{k-1})``; a heavy
  set that never changes ages exactly 1 per step.
"""

from __future__ import annotations

import duckdb

from ._base import Source, check_fraction, check_int, check_positive, connect, relation
from .errors import ParameterError

__all__ = ["promotion_windows", "freeze_series", "freeze_onset", "margin_sensitivity"]

_KEYS = "request, layer, kv_head, q_head"

_WINDOWS = """
    WITH st AS (
        SELECT request, layer, kv_head, q_head, step, promoted, min_heavy_score, heavy_age_mean,
               (step - min(step) OVER (PARTITION BY request)) // $window AS win
        FROM steps WHERE run_id = $run
    ), windows AS (
        SELECT request, layer, kv_head, q_head, win, min(step) AS start_step, max(step) AS end_step,
               count(promoted) AS exits, coalesce(sum(promoted::INT), 0) AS promoted,
               sum(promoted::INT) / nullif(count(promoted), 0) AS promotion_rate,
               arg_max(min_heavy_score, step) FILTER (WHERE min_heavy_score IS NOT NULL) AS threshold,
               arg_max(heavy_age_mean, step) FILTER (WHERE heavy_age_mean IS NOT NULL) AS heavy_age
        FROM st GROUP BY ALL
    )
"""

_SERIES = (
    _WINDOWS
    + """
    , lagged AS (
        SELECT *, lag(threshold) OVER h AS prev_threshold, lag(heavy_age) OVER h AS prev_heavy_age,
               lag(end_step) OVER h AS prev_end_step
        FROM windows WINDOW h AS (PARTITION BY request, layer, kv_head, q_head ORDER BY win)
    ), series AS (
        SELECT request, layer, kv_head, q_head, win, start_step, end_step, exits, promoted,
               promotion_rate, threshold, heavy_age,
               (heavy_age - prev_heavy_age) / nullif(end_step - prev_end_step, 0) AS age_slope,
               coalesce(promotion_rate <= $max_rate AND threshold > prev_threshold
                        AND (heavy_age - prev_heavy_age) / nullif(end_step - prev_end_step, 0)
                            >= $min_age_slope, false) AS frozen
        FROM lagged
    )
"""
)


def _check(window: int, max_rate: float, min_age_slope: float) -> None:
    check_int("window", window, 1)
    check_fraction("max_rate", max_rate)
    check_positive("min_age_slope", min_age_slope)


def promotion_windows(source: Source, run_id: str, *, window: int = 16) -> duckdb.DuckDBPyRelation:
    """Promotion rate per window of steps and KV set.

    Returns
    -------
    relation
        ``request, layer, kv_head, q_head, win, start_step, end_step, exits,
        promoted, promotion_rate, threshold, heavy_age``; ``promotion_rate`` =
        promoted / tokens leaving the recent window in the window.
    """
    check_int("window", window, 1)
    sql = _WINDOWS + f" SELECT * FROM windows ORDER BY {_KEYS}, win"
    return relation(connect(source), sql, run=run_id, window=window)


def freeze_series(
    source: Source, run_id: str, *, window: int = 16, max_rate: float = 0.05, min_age_slope: float = 0.5
) -> duckdb.DuckDBPyRelation:
    """The series behind freeze detection: :func:`promotion_windows` plus ``age_slope, frozen``."""
    _check(window, max_rate, min_age_slope)
    sql = _SERIES + f" SELECT * FROM series ORDER BY {_KEYS}, win"
    return relation(
        connect(source), sql, run=run_id, window=window, max_rate=float(max_rate), min_age_slope=float(min_age_slope)
    )


def freeze_onset(
    source: Source,
    run_id: str,
    *,
    window: int = 16,
    max_rate: float = 0.05,
    min_age_slope: float = 0.5,
    min_windows: int = 2,
) -> duckdb.DuckDBPyRelation:
    """Freeze onset step per KV set (null when the set never freezes for good).

    Returns
    -------
    relation
        ``request, layer, kv_head, q_head, windows, frozen, onset_step,
        frozen_windows, last_promotion_rate, last_threshold, last_heavy_age``.
    """
    _check(window, max_rate, min_age_slope)
    check_int("min_windows", min_windows, 1)
    sql = (
        _SERIES
        + f"""
        , tail AS (
            SELECT *, bool_and(frozen) OVER t AS frozen_to_end, count(*) OVER t AS windows_to_end
            FROM series
            WINDOW t AS (PARTITION BY request, layer, kv_head, q_head ORDER BY win DESC
                         ROWS UNBOUNDED PRECEDING)
        )
        SELECT {_KEYS}, count(*) AS windows,
               min(start_step) FILTER (WHERE frozen_to_end AND windows_to_end >= $min_windows)
                   AS onset_step,
               onset_step IS NOT NULL AS frozen,
               max(windows_to_end) FILTER (WHERE frozen_to_end) AS frozen_windows,
               arg_max(promotion_rate, win) AS last_promotion_rate,
               arg_max(threshold, win) AS last_threshold, arg_max(heavy_age, win) AS last_heavy_age
        FROM tail GROUP BY ALL ORDER BY {_KEYS}
    """
    )
    return relation(
        connect(source),
        sql,
        run=run_id,
        window=window,
        max_rate=float(max_rate),
        min_age_slope=float(min_age_slope),
        min_windows=min_windows,
    )


def margin_sensitivity(
    source: Source, run_id: str, *, threshold: float = 1e-3, relative: bool = True, phase: str | None = None
) -> duckdb.DuckDBPyRelation:
    """Share of evictions whose margin is near 0, per KV set (DESIGN.md §8.1).

    An eviction is *near a tie* when ``margin <= threshold`` or, with
    ``relative=True``, ``margin <= threshold * (score + margin)`` (relative
    to the lowest surviving score). NaN margins (nothing eligible survived)
    are left out. ``phase`` restricts to ``'prefill'`` or ``'decode'`` rows.

    Returns
    -------
    relation
        ``layer, kv_head, q_head, evictions, near_zero, near_zero_share,
        margin_median``.
    """
    check_positive("threshold", threshold)
    if phase not in (None, "prefill", "decode"):
        raise ParameterError(f"phase must be None, 'prefill' or 'decode', got {phase!r}")
    sql = """
        WITH e AS (
            SELECT layer, kv_head, q_head, margin,
                   margin <= CASE WHEN $relative THEN $threshold * (score + margin)
                                  ELSE $threshold END AS near
            FROM evictions
            WHERE run_id = $run AND NOT isnan(margin) AND ($phase IS NULL OR phase = $phase)
        )
        SELECT layer, kv_head, q_head, count(*) AS evictions, count(*) FILTER (WHERE near) AS near_zero,
               near_zero / count(*) AS near_zero_share, median(margin) AS margin_median
        FROM e GROUP BY ALL ORDER BY layer, kv_head, q_head
    """
    return relation(connect(source), sql, run=run_id, threshold=float(threshold), relative=bool(relative), phase=phase)
