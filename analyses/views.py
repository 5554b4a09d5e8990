"""Aggregations behind the dashboard pages: small, bounded results from large logs.

Every function returns a lazy relation whose size does not grow with the
number of eviction rows (one row per run, per token of a window, per KV set,
per histogram bin), except :func:`evictions_filtered`, which the caller caps
with :func:`capped`. Values are bound, never formatted into the SQL.

A *KV set* is ``(layer, kv_head)`` plus ``q_head`` for ``gqa='none'`` runs
(one set per query head). A position leaves a KV set at most once (evicted
positions never return), so counting eviction rows per position counts sets.
"""

from __future__ import annotations

from typing import Any

import duckdb
import pandas as pd

from ._base import Source, check_int, check_positive, connect, first_row, has_rows, relation, run_info, sql_literal
from .errors import ParameterError

__all__ = [
    "runs_table",
    "runs_headline",
    "run_problems",
    "token_evictions",
    "token_lifetime",
    "evictions_filtered",
    "margin_histogram",
    "head_dropped_mass",
    "where",
    "capped",
    "gqa_partner",
    "kv_sets",
    "step_range",
    "console_examples",
]

_PHASES = (None, "prefill", "decode")


def runs_table(source: Source) -> duckdb.DuckDBPyRelation:
    """Every run with its settings and headline numbers, newest first.

    Returns
    -------
    relation
        ``run_id, name, status, model, policy, heavy, recent, sink, gqa, prompt_len,
        new_tokens, requests, created_at, source_run, max_logit_diff, error,
        evictions, replay_steps, kl_mean, top1_agreement, dropped_mass_mean,
        checked, correct, correct_share, problems, integrity``; ``checked``
        counts requests with an answer-checker verdict, ``correct`` those
        judged correct; ``problems`` counts what the readers found wrong with
        the run (files left out, manifest fields, row counts) and
        ``integrity`` says it in words (``'ok'`` when nothing): a run whose
        integrity is not ``'ok'`` has numbers that may be incomplete.
    """
    # counts, sums and non-null counts per segment were taken when the scan read each file
    # (recorders.create_views): no segment is opened here, however many runs the root holds
    sql = """
        WITH f AS (SELECT run_id, table_name, sum(rows) AS n FROM h2o_lens_catalog.files GROUP BY ALL),
        t AS (SELECT run_id, table_name || '.' || column_name AS col, sum(total) AS total, sum(n) AS n
              FROM h2o_lens_catalog.totals GROUP BY ALL),
        ev AS (SELECT run_id, n::BIGINT AS evictions FROM f WHERE table_name = 'evictions'),
        rs AS (SELECT f.run_id, f.n::BIGINT AS replay_steps, kl.total / nullif(kl.n, 0) AS kl_mean,
                      top1.total / nullif(top1.n, 0) AS top1_agreement
               FROM f LEFT JOIN t kl ON kl.run_id = f.run_id AND kl.col = 'replay_steps.kl'
               LEFT JOIN t top1 ON top1.run_id = f.run_id AND top1.col = 'replay_steps.top1_agree'
               WHERE f.table_name = 'replay_steps'),
        rp AS (SELECT run_id, total / nullif(n, 0) AS dropped_mass_mean FROM t WHERE col = 'replay.dropped_mass'),
        rq AS (SELECT run_id, n::BIGINT AS checked, total::HUGEINT AS correct FROM t WHERE col = 'requests.correct'),
        pr AS (SELECT run_id, count(*) AS problems FROM problems WHERE run_id IS NOT NULL
               GROUP BY run_id)
        SELECT r.run_id, r.name, r.status, r.model, r.policy, r.heavy, r.recent, r.sink, r.gqa, r.prompt_len,
               r.new_tokens, r.requests, r.created_at, r.source_run, r.max_logit_diff, r.error,
               coalesce(ev.evictions, 0) AS evictions, coalesce(rs.replay_steps, 0) AS replay_steps,
               rs.kl_mean, rs.top1_agreement, rp.dropped_mass_mean,
               coalesce(rq.checked, 0) AS checked, rq.correct,
               rq.correct / nullif(rq.checked, 0) AS correct_share,
               coalesce(pr.problems, 0) AS problems, r.integrity
        FROM runs r
        LEFT JOIN ev USING (run_id) LEFT JOIN rs USING (run_id) LEFT JOIN rp USING (run_id)
        LEFT JOIN rq USING (run_id) LEFT JOIN pr USING (run_id)
        ORDER BY r.created_at DESC NULLS LAST, r.run_id
    """
    return relation(connect(source), sql)


#: the columns of :func:`runs_headline`, in order
HEADLINE_COLUMNS = (
    "run_id",
    "name",
    "status",
    "policy",
    "heavy",
    "recent",
    "gqa",
    "prompt_len",
    "new_tokens",
    "evictions",
    "kl_mean",
    "top1_agreement",
    "dropped_mass_mean",
    "correct_share",
    "max_logit_diff",
    "integrity",
    "model",
)


def runs_headline(source: Source) -> duckdb.DuckDBPyRelation:
    """The headline numbers of every run, oldest first (``h2o-lens runs``, the job summaries).

    The columns :data:`HEADLINE_COLUMNS` of :func:`runs_table`, means rounded
    for reading (KL and dropped mass to 4 places, top-1 and correct share to 3).
    """
    rounded = {"kl_mean": 4, "dropped_mass_mean": 4, "top1_agreement": 3, "correct_share": 3}
    cols = ", ".join(f"round({c}, {rounded[c]}) AS {c}" if c in rounded else c for c in HEADLINE_COLUMNS)
    return runs_table(source).query(
        "runs_table", f"SELECT {cols} FROM runs_table ORDER BY created_at NULLS LAST, run_id"
    )


def run_problems(source: Source, run_id: str | None = None) -> duckdb.DuckDBPyRelation:
    """Files and folders the readers skipped: ``path, run_id, table_name, reason``.

    With ``run_id`` only that run's problems; otherwise all, root-level ones
    (no run) included.
    """
    sql = """
        SELECT path, run_id, table_name, reason FROM problems
        WHERE $run IS NULL OR run_id = $run ORDER BY run_id NULLS FIRST, path
    """
    return relation(connect(source), sql, run=run_id)


def _sets_table(con: duckdb.DuckDBPyConnection, run_id: str) -> str:
    """The view listing a run's KV sets: ``steps`` (small) when it has rows, else ``evictions``."""
    return "steps" if has_rows(con, "steps", run_id) else "evictions"


def kv_sets(source: Source, run_id: str) -> duckdb.DuckDBPyRelation:
    """The KV sets of a run: ``layer, kv_head, q_head`` (``q_head`` null unless ``gqa='none'``)."""
    con = connect(source)
    table = _sets_table(con, run_id)
    return relation(
        con,
        f"SELECT DISTINCT layer, kv_head, q_head FROM {table} WHERE run_id = $run ORDER BY layer, kv_head, q_head",
        run=run_id,
    )


def step_range(source: Source, run_id: str) -> duckdb.DuckDBPyRelation:
    """First and last step and the requests of a run, over all its tables.

    Returns
    -------
    relation
        One row: ``first_step, last_step, requests, tokens`` (nulls when the run is empty).
    """
    sql = """
        WITH s AS (
            SELECT step, request FROM steps WHERE run_id = $run
            UNION ALL SELECT step, request FROM replay_steps WHERE run_id = $run
            UNION ALL SELECT step, request FROM evictions WHERE run_id = $run
        ), t AS (SELECT request, position FROM tokens WHERE run_id = $run)
        SELECT (SELECT min(step) FROM s) AS first_step,
               coalesce((SELECT max(step) FROM s), (SELECT max(position) FROM t)) AS last_step,
               (SELECT count(DISTINCT request) FROM (SELECT request FROM s UNION ALL
                                                     SELECT request FROM t)) AS requests,
               (SELECT count(*) FROM t) AS tokens
    """
    return relation(connect(source), sql, run=run_id)


def token_evictions(
    source: Source,
    run_id: str,
    *,
    request: int = 0,
    layer: int | None = None,
    kv_head: int | None = None,
    q_head: int | None = None,
    at_step: int | None = None,
    first: int | None = None,
    last: int | None = None,
) -> duckdb.DuckDBPyRelation:
    """Per token of one request: when it left one KV set and how many sets dropped it.

    Parameters
    ----------
    layer, kv_head, q_head : int, optional
        The KV set whose eviction step is reported (``q_head`` only for
        ``gqa='none'`` runs); without ``layer`` and ``kv_head`` no set is chosen.
    at_step : int, optional
        Count only evictions at or before this step (the cache as of that
        step); default: the whole run.
    first, last : int, optional
        Window of positions (inclusive).

    Returns
    -------
    relation
        ``request, position, token_id, text, is_prompt, evidence, evicted_step,
        sets, evicted_sets, evicted_share, first_evicted_step``, one row per
        token, ordered by position. ``evicted_step`` is null when the chosen
        set kept the token (up to ``at_step``); ``sets`` is the run's KV set
        count.
    """
    check_int("request", request)
    for name, value in (
        ("layer", layer),
        ("kv_head", kv_head),
        ("q_head", q_head),
        ("at_step", at_step),
        ("first", first),
        ("last", last),
    ):
        if value is not None:
            check_int(name, value)
    con = connect(source)
    table = _sets_table(con, run_id)
    sql = f"""
        WITH tok AS (
            SELECT request, position, token_id, text, is_prompt, evidence FROM tokens
            WHERE run_id = $run AND request = $request
              AND ($first IS NULL OR position >= $first) AND ($last IS NULL OR position <= $last)
        ), sets AS (
            SELECT count(*) AS n FROM (SELECT DISTINCT layer, kv_head, q_head FROM {table}
                                       WHERE run_id = $run AND request = $request)
        ), ev AS (
            SELECT position,
                   min(step) FILTER (WHERE layer = $layer AND kv_head = $kv_head
                                     AND q_head IS NOT DISTINCT FROM $q_head) AS evicted_step,
                   count(*) AS evicted_sets, min(step) AS first_evicted_step
            FROM evictions
            WHERE run_id = $run AND request = $request AND ($at_step IS NULL OR step <= $at_step)
              AND ($first IS NULL OR position >= $first) AND ($last IS NULL OR position <= $last)
            GROUP BY position
        )
        SELECT t.request, t.position, t.token_id, t.text, t.is_prompt, t.evidence, ev.evicted_step,
               sets.n AS sets, coalesce(ev.evicted_sets, 0) AS evicted_sets,
               coalesce(ev.evicted_sets, 0) / nullif(sets.n, 0) AS evicted_share,
               ev.first_evicted_step
        FROM tok t CROSS JOIN sets LEFT JOIN ev USING (position)
        ORDER BY t.position
    """
    return relation(
        con,
        sql,
        run=run_id,
        request=request,
        layer=layer,
        kv_head=kv_head,
        q_head=q_head,
        at_step=at_step,
        first=first,
        last=last,
    )


def token_lifetime(source: Source, run_id: str, position: int, *, request: int = 0) -> duckdb.DuckDBPyRelation:
    """One token across every KV set: the step it was evicted, with score and margin then.

    Returns
    -------
    relation
        ``layer, kv_head, q_head, evicted_step, score, margin, age,
        left_recent, phase, kept``, one row per KV set of the request;
        ``kept`` is true (and the eviction columns null) where the set never
        evicted the token.
    """
    check_int("position", position)
    check_int("request", request)
    con = connect(source)
    table = _sets_table(con, run_id)
    sql = f"""
        WITH sets AS (
            SELECT DISTINCT layer, kv_head, q_head FROM {table} WHERE run_id = $run AND request = $request
        ), ev AS (
            SELECT layer, kv_head, q_head, step, score, margin, age, left_recent, phase FROM evictions
            WHERE run_id = $run AND request = $request AND position = $position
        )
        SELECT s.layer, s.kv_head, s.q_head, ev.step AS evicted_step, ev.score, ev.margin, ev.age,
               ev.left_recent, ev.phase, ev.step IS NULL AS kept
        FROM sets s LEFT JOIN ev ON s.layer = ev.layer AND s.kv_head = ev.kv_head
                                 AND s.q_head IS NOT DISTINCT FROM ev.q_head
        ORDER BY s.layer, s.kv_head, s.q_head
    """
    return relation(con, sql, run=run_id, request=request, position=position)


_FILTERED = """
    SELECT e.request, e.step, e.layer, e.kv_head, e.q_head, e.position, t.text, t.evidence,
           e.score, e.margin, e.age, e.left_recent, e.phase
    FROM evictions e
    LEFT JOIN (SELECT request, position, text, evidence FROM tokens WHERE run_id = $run) t
           ON t.request = e.request AND t.position = e.position
    WHERE e.run_id = $run AND ($request IS NULL OR e.request = $request)
      AND ($layer IS NULL OR e.layer = $layer) AND ($kv_head IS NULL OR e.kv_head = $kv_head)
      AND ($step_min IS NULL OR e.step >= $step_min) AND ($step_max IS NULL OR e.step <= $step_max)
      AND ($phase IS NULL OR e.phase = $phase)
      AND ($margin_max IS NULL OR e.margin <= $margin_max)
"""


def _filters(
    request: int | None,
    layer: int | None,
    kv_head: int | None,
    step_min: int | None,
    step_max: int | None,
    phase: str | None,
    margin_max: float | None,
) -> dict[str, Any]:
    for name, value in (
        ("request", request),
        ("layer", layer),
        ("kv_head", kv_head),
        ("step_min", step_min),
        ("step_max", step_max),
    ):
        if value is not None:
            check_int(name, value)
    if phase not in _PHASES:
        raise ParameterError(f"phase must be None, 'prefill' or 'decode', got {phase!r}")
    if margin_max is not None:
        margin_max = check_positive("margin_max", margin_max)
    return {
        "request": request,
        "layer": layer,
        "kv_head": kv_head,
        "step_min": step_min,
        "step_max": step_max,
        "phase": phase,
        "margin_max": margin_max,
    }


def evictions_filtered(
    source: Source,
    run_id: str,
    *,
    request: int | None = None,
    layer: int | None = None,
    kv_head: int | None = None,
    step_min: int | None = None,
    step_max: int | None = None,
    phase: str | None = None,
    margin_max: float | None = None,
) -> duckdb.DuckDBPyRelation:
    """Eviction rows of one run matching the filters, with the victim's text, ordered by request and step.

    Unbounded (a run can hold millions of rows): materialise it with :func:`capped`.

    Returns
    -------
    relation
        ``request, step, layer, kv_head, q_head, position, text, evidence,
        score, margin, age, left_recent, phase``.
    """
    params = _filters(request, layer, kv_head, step_min, step_max, phase, margin_max)
    sql = _FILTERED + " ORDER BY e.request, e.step, e.layer, e.kv_head, e.q_head, e.position"
    return relation(connect(source), sql, run=run_id, **params)


def margin_histogram(
    source: Source,
    run_id: str,
    *,
    bins: int = 40,
    log: bool = True,
    request: int | None = None,
    layer: int | None = None,
    kv_head: int | None = None,
    step_min: int | None = None,
    step_max: int | None = None,
    phase: str | None = None,
    margin_max: float | None = None,
) -> duckdb.DuckDBPyRelation:
    """Histogram of eviction margins under the filters of :func:`evictions_filtered`.

    ``bins`` equal-width bins span the smallest to the largest margin, in
    ``log10(margin)`` when ``log`` (then margins of exactly 0, ties, are
    counted in an extra row with ``bin = -1`` and ``lo = hi = 0``). NaN
    margins (nothing eligible survived) are left out.

    Returns
    -------
    relation
        ``bin, lo, hi, evictions``: the bin's margin interval ``[lo, hi)`` in
        margin units (the last bin includes ``hi``); empty bins are left out.
    """
    check_int("bins", bins, 1)
    params = _filters(request, layer, kv_head, step_min, step_max, phase, margin_max)
    sql = f"""
        WITH e AS ({_FILTERED}),
        v AS (
            SELECT CASE WHEN $log THEN log10(margin) ELSE margin END AS x FROM e
            WHERE margin IS NOT NULL AND NOT isnan(margin) AND (NOT $log OR margin > 0)
        ), r AS (
            SELECT min(x) AS lo, CASE WHEN max(x) > min(x) THEN (max(x) - min(x)) / $bins ELSE 1.0
                                 END AS width FROM v
        ), h AS (
            SELECT least(floor((x - r.lo) / r.width), $bins - 1)::INTEGER AS bin, count(*) AS evictions
            FROM v CROSS JOIN r GROUP BY bin
        )
        SELECT h.bin,
               CASE WHEN $log THEN pow(10, r.lo + h.bin * r.width) ELSE r.lo + h.bin * r.width END AS lo,
               CASE WHEN $log THEN pow(10, r.lo + (h.bin + 1) * r.width)
                    ELSE r.lo + (h.bin + 1) * r.width END AS hi,
               h.evictions
        FROM h CROSS JOIN r
        UNION ALL
        SELECT -1, 0.0, 0.0, count(*) FROM e WHERE $log AND margin <= 0 HAVING count(*) > 0
        ORDER BY bin
    """
    return relation(connect(source), sql, run=run_id, bins=bins, log=bool(log), **params)


def head_dropped_mass(
    source: Source, run_id: str, *, layer: int, q_head: int, request: int | None = None
) -> duckdb.DuckDBPyRelation:
    """Dropped mass of one query head over steps: ``request, step, dropped_mass, coverage``."""
    check_int("layer", layer)
    check_int("q_head", q_head)
    if request is not None:
        check_int("request", request)
    sql = """
        SELECT request, step, dropped_mass, 1.0::DOUBLE - dropped_mass AS coverage FROM replay
        WHERE run_id = $run AND layer = $layer AND q_head = $q_head
          AND ($request IS NULL OR request = $request)
        ORDER BY request, step
    """
    return relation(connect(source), sql, run=run_id, layer=layer, q_head=q_head, request=request)


def where(rel: duckdb.DuckDBPyRelation, **equals: Any) -> duckdb.DuckDBPyRelation:
    """Relation → relation: the rows whose columns equal the given values (None matches null)."""
    for name, value in equals.items():
        if name not in rel.columns:
            raise ParameterError(f"column {name!r} is not in the relation; it has {', '.join(rel.columns)}")
        col = duckdb.ColumnExpression(name)
        rel = rel.filter(col.isnull() if value is None else col == duckdb.ConstantExpression(value))
    return rel


def capped(rel: duckdb.DuckDBPyRelation, max_rows: int = 5_000) -> tuple[pd.DataFrame, int]:
    """The first ``max_rows`` rows of a relation as a DataFrame, and its total row count."""
    check_int("max_rows", max_rows)
    df = rel.limit(max_rows).df()
    if len(df) < max_rows:
        return df, len(df)
    row = first_row(rel.aggregate("count(*)"))
    return df, int(row[0]) if row else len(df)


def gqa_partner(source: Source, run_id: str) -> tuple[str, str] | None:
    """``(sum_run, max_run)`` when ``run_id`` and a run paired with it through ``runs.source_run``
    aggregate GQA groups with ``sum`` and ``max``; None otherwise."""
    con = connect(source)
    gqa = run_info(con, run_id).get("gqa")
    if gqa not in ("sum", "max"):
        return None
    want = "max" if gqa == "sum" else "sum"
    sql = """
        SELECT run_id FROM runs
        WHERE run_id <> $run AND gqa = $want
          AND (run_id = (SELECT source_run FROM runs WHERE run_id = $run) OR source_run = $run)
        ORDER BY run_id
    """
    row = first_row(relation(con, sql, run=run_id, want=want))
    if row is None:
        return None
    return (run_id, row[0]) if gqa == "sum" else (row[0], run_id)


def console_examples(run_id: str) -> dict[str, str]:
    """Example queries for the SQL console, about ``run_id`` (text shown to people, not run here)."""
    run = sql_literal(run_id)
    return {
        "Evictions per layer and KV head": (
            "SELECT layer, kv_head, count(*) AS evictions, median(margin) AS median_margin,\n"
            "       avg(left_recent::INT) AS left_recent_share\n"
            f"FROM evictions\nWHERE run_id = {run}\nGROUP BY ALL\nORDER BY layer, kv_head"
        ),
        "Steps where the run and the teacher disagree": (
            "SELECT step, kl, teacher_logprob\nFROM replay_steps\n"
            f"WHERE run_id = {run} AND NOT top1_agree\nORDER BY step"
        ),
        "Worst heads by dropped mass": (
            "SELECT layer, q_head, avg(dropped_mass) AS mean_dropped, max(dropped_mass) AS worst\n"
            f"FROM replay\nWHERE run_id = {run}\nGROUP BY ALL\nORDER BY mean_dropped DESC\nLIMIT 20"
        ),
        "Evidence tokens and when they left": (
            "SELECT t.position, t.text, t.evidence, e.layer, e.kv_head, e.step, e.score, e.margin\n"
            "FROM tokens t JOIN evictions e USING (run_id, request, position)\n"
            f"WHERE t.run_id = {run} AND t.evidence IS NOT NULL\nORDER BY e.step"
        ),
        "Runs": "SELECT run_id, status, policy, heavy, recent, gqa, prompt_len, new_tokens\n"
        "FROM runs\nORDER BY created_at DESC",
    }
