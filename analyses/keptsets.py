"""Kept sets rebuilt from evictions, and their overlap across runs (DESIGN.md §6, §8.3).

The candidate set of a KV set at step ``t`` is ``D_t = {i <= t : i not
evicted at a step < t}`` (prefill evictions carry step ``prompt_len - 1``).
Sizes and overlaps of such sets only need eviction counts: with ``s_A(i)``
the step ``i`` left set A (null if never),

* ``|D_t^A| = t + 1 - #{i : s_A(i) < t}``
* ``|D_t^A ∩ D_t^B| = t + 1 - #{i : min(s_A, s_B) < t}`` (gone from either)
* ``|D_t^A ∪ D_t^B| = t + 1 - #{i : max(s_A, s_B) < t}`` (gone from both)

so the overlap is computed from cumulative event counts (an ASOF join of
each grid step onto the last event step before it), never by expanding sets.
The grid is the steps both runs logged in ``steps``.

The per-query-head union of a ``gqa='none'`` run (one set per query head)
is the quality upper bound of GQA aggregation: position ``i`` leaves the
union of a group when every query head of the group evicted it, at the last
of those steps.
"""

from __future__ import annotations

import duckdb

from ._base import Source, connect, relation, run_info
from .errors import ParameterError

__all__ = ["kept_overlap", "union_bound", "gqa_overlap"]

_KEYS = "request, layer, kv_head"


def _overlap_sql(ea: str, eb: str, grid: str) -> str:
    """Overlap of two 'left the set' event relations over a grid (see the module docstring)."""
    return f"""
    WITH ea AS ({ea}), eb AS ({eb}), grid AS ({grid}),
    j AS (
        SELECT request, layer, kv_head, position, a.step AS sa, b.step AS sb
        FROM ea a FULL OUTER JOIN eb b USING (request, layer, kv_head, position)
    ), events AS (
        SELECT request, layer, kv_head, step,
               sum(da) AS da, sum(db) AS db, sum(di) AS di, sum(du) AS du
        FROM (
            SELECT {_KEYS}, sa AS step, 1 AS da, 0 AS db, 0 AS di, 0 AS du FROM j WHERE sa IS NOT NULL
            UNION ALL SELECT {_KEYS}, sb, 0, 1, 0, 0 FROM j WHERE sb IS NOT NULL
            UNION ALL SELECT {_KEYS}, least(sa, sb), 0, 0, 1, 0 FROM j
            UNION ALL SELECT {_KEYS}, greatest(sa, sb), 0, 0, 0, 1 FROM j
                      WHERE sa IS NOT NULL AND sb IS NOT NULL
        ) GROUP BY ALL
    ), cum AS (
        SELECT {_KEYS}, step, sum(da) OVER w AS ca, sum(db) OVER w AS cb, sum(di) OVER w AS ci,
               sum(du) OVER w AS cu
        FROM events WINDOW w AS (PARTITION BY {_KEYS} ORDER BY step ROWS UNBOUNDED PRECEDING)
    ), sized AS (
        SELECT g.request, g.step, g.layer, g.kv_head,
               (g.step + 1 - coalesce(c.ca, 0))::BIGINT AS size_a,
               (g.step + 1 - coalesce(c.cb, 0))::BIGINT AS size_b,
               (g.step + 1 - coalesce(c.ci, 0))::BIGINT AS intersection,
               (g.step + 1 - coalesce(c.cu, 0))::BIGINT AS union_size
        FROM grid g ASOF LEFT JOIN cum c
          ON g.request = c.request AND g.layer = c.layer AND g.kv_head = c.kv_head AND g.step > c.step
    )
    """


def _shared(con: duckdb.DuckDBPyConnection, run_id: str) -> None:
    if run_info(con, run_id).get("gqa") == "none":
        raise ParameterError(
            f"run {run_id!r} keeps one set per query head (gqa='none'); "
            "pass it as none_run and compare runs with shared KV sets"
        )


_EVICTED = "SELECT request, layer, kv_head, position, step FROM evictions WHERE run_id = {p} AND q_head IS NULL"
_GRID = "SELECT DISTINCT request, step, layer, kv_head FROM steps WHERE run_id = {p} AND q_head IS NULL"


def kept_overlap(source: Source, run_a: str, run_b: str) -> duckdb.DuckDBPyRelation:
    """Jaccard of the candidate sets of two runs on the same tokens, per step and KV set.

    Returns
    -------
    relation
        ``request, step, layer, kv_head, size_a, size_b, intersection,
        union_size, jaccard``.
    """
    con = connect(source)
    _shared(con, run_a)
    _shared(con, run_b)
    grid = _GRID.format(p="$a") + " INTERSECT " + _GRID.format(p="$b")
    sql = (
        _overlap_sql(_EVICTED.format(p="$a"), _EVICTED.format(p="$b"), grid)
        + f"""
        SELECT *, intersection / union_size AS jaccard FROM sized ORDER BY {_KEYS}, step
    """
    )
    return relation(con, sql, a=run_a, b=run_b)


def union_bound(source: Source, run_id: str, none_run: str) -> duckdb.DuckDBPyRelation:
    """How much of the per-query-head union of ``none_run`` the shared sets of ``run_id`` hold.

    Returns
    -------
    relation
        ``request, step, layer, kv_head, kept, union_size, held, recall,
        jaccard``: ``union_size`` is the size of the union of the group's
        per-query-head sets, ``held`` how many of those the shared set holds,
        ``recall = held / union_size``.
    """
    con = connect(source)
    _shared(con, run_id)
    if run_info(con, none_run).get("gqa") != "none":
        raise ParameterError(f"none_run {none_run!r} must be a gqa='none' run (one set per query head)")
    union_events = """
        WITH per_pos AS (
            SELECT request, layer, kv_head, position, max(step) AS step,
                   count(DISTINCT q_head) AS heads
            FROM evictions WHERE run_id = $none GROUP BY ALL
        ), groups AS (
            SELECT layer, kv_head, count(DISTINCT q_head) AS size FROM steps
            WHERE run_id = $none GROUP BY ALL
        )
        SELECT p.request, p.layer, p.kv_head, p.position, p.step
        FROM per_pos p JOIN groups g USING (layer, kv_head) WHERE p.heads = g.size
    """
    grid = (
        _GRID.format(p="$run") + " INTERSECT SELECT DISTINCT request, step, layer, kv_head "
        "FROM steps WHERE run_id = $none"
    )
    sql = (
        _overlap_sql(_EVICTED.format(p="$run"), union_events, grid)
        + f"""
        SELECT request, step, layer, kv_head, size_a AS kept, size_b AS union_size,
               intersection AS held, intersection / size_b AS recall,
               intersection / union_size AS jaccard
        FROM sized ORDER BY {_KEYS}, step
    """
    )
    return relation(con, sql, run=run_id, none=none_run)


def gqa_overlap(source: Source, sum_run: str, max_run: str, none_run: str | None = None) -> duckdb.DuckDBPyRelation:
    """Kept-set overlap of ``gqa='sum'`` and ``gqa='max'`` runs, with the union upper bound.

    Returns
    -------
    relation
        :func:`kept_overlap` columns (``size_a`` = sum run, ``size_b`` = max
        run), plus ``qhead_union_size, recall_sum, recall_max`` (see
        :func:`union_bound`) when ``none_run`` is given.
    """
    con = connect(source)
    for run, expected in ((sum_run, "sum"), (max_run, "max")):
        gqa = run_info(con, run).get("gqa")
        if gqa is not None and gqa != expected:
            raise ParameterError(
                f"run {run!r} aggregates with gqa={gqa!r}; pass a gqa={expected!r} "
                f"run as {expected}_run (kept_overlap compares any two runs)"
            )
    base = kept_overlap(con, sum_run, max_run)
    if none_run is None:
        return base
    keys = ["request", "step", "layer", "kv_head"]
    s = union_bound(con, sum_run, none_run).select(
        "request, step, layer, kv_head, union_size AS qhead_union_size, recall AS recall_sum"
    )
    m = union_bound(con, max_run, none_run).select("request, step, layer, kv_head, recall AS recall_max")
    return base.join(s, keys, how="left").join(m, keys, how="left").order("request, layer, kv_head, step")
