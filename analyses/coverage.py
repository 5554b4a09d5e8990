"""Dropped mass and attention coverage (DESIGN.md §6, §8.2).

The ``replay`` view holds, per step, layer and query head, the dropped mass
``m(t, l, q)``: the full-cache teacher weight of query ``t`` on positions not
in the candidate set ``D_t`` of the head's KV set, teacher-forced on the
run's own tokens. Coverage is ``1 - m``. A mean of 0.98 can hide the one
query that needed far evidence, so every summary gives min, P1 and P5 too,
and the slices by span show where in the sequence the loss happens.

Percentiles are ``quantile_cont`` (linear interpolation, as numpy's default).
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb

from ._base import Source, check_int, connect, relation
from .errors import ParameterError

__all__ = [
    "dropped_mass",
    "coverage_stats",
    "head_coverage",
    "coverage_by_span",
    "dropped_mass_series",
    "dropped_mass_by_layer",
]

_REPLAY = """
    SELECT request, step, layer, q_head, kv_head, dropped_mass, 1.0::DOUBLE - dropped_mass AS coverage
    FROM replay
    WHERE run_id = $run AND ($request IS NULL OR request = $request)
"""


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def dropped_mass(source: Source, run_id: str, *, request: int | None = None) -> duckdb.DuckDBPyRelation:
    """Replay rows of one run: dropped mass and coverage per step, layer and query head.

    Returns
    -------
    relation
        ``request, step, layer, q_head, kv_head, dropped_mass, coverage``, one
        row per (request, step, layer, q_head).
    """
    if request is not None:
        check_int("request", request)
    return relation(connect(source), _REPLAY, run=run_id, request=request)


def coverage_stats(
    rel: duckdb.DuckDBPyRelation, by: Sequence[str] = ("layer", "q_head", "kv_head"), value: str = "coverage"
) -> duckdb.DuckDBPyRelation:
    """Relation → relation: ``n, mean, min, p1, p5, max`` of ``value`` per group ``by``.

    ``by=()`` summarises the whole relation in one row.
    """
    for name in (*by, value):
        if name not in rel.columns:
            raise ParameterError(f"column {name!r} is not in the relation; it has {', '.join(rel.columns)}")
    keys = ", ".join(_ident(b) for b in by)
    v = _ident(value)
    sql = (
        f"SELECT {keys + ', ' if keys else ''}count({v}) AS n, avg({v}) AS mean, min({v}) AS min, "
        f"quantile_cont({v}, 0.01) AS p1, quantile_cont({v}, 0.05) AS p5, max({v}) AS max "
        f"FROM stats_input{' GROUP BY ' + keys + ' ORDER BY ' + keys if keys else ''}"
    )
    return rel.query("stats_input", sql)


def head_coverage(source: Source, run_id: str, *, request: int | None = None) -> duckdb.DuckDBPyRelation:
    """Coverage per (layer, q_head): ``layer, q_head, kv_head, n, mean, min, p1, p5, max`` over steps."""
    return coverage_stats(dropped_mass(source, run_id, request=request))


_SPANS = """
    WITH tok AS (
        SELECT request, position, is_prompt, evidence FROM tokens WHERE run_id = $run
    ), r AS (
        SELECT request, step, layer, q_head, kv_head, dropped_mass FROM replay WHERE run_id = $run
    ), lab AS (
        SELECT request, position, CASE WHEN is_prompt THEN 'prompt' ELSE 'answer' END AS span FROM tok
        UNION ALL
        SELECT request, position, 'evidence:' || evidence FROM tok WHERE evidence IS NOT NULL
    ), labels AS (
        SELECT DISTINCT request, evidence AS label FROM tok WHERE evidence IS NOT NULL
    ), lost AS (  -- first step after which a KV set no longer holds every token of a span
        SELECT e.request, t.evidence AS label, e.layer, e.kv_head, e.q_head, min(e.step) AS gone
        FROM evictions e JOIN tok t ON e.request = t.request AND e.position = t.position
        WHERE e.run_id = $run AND t.evidence IS NOT NULL
        GROUP BY ALL
    ), by_query AS (
        SELECT lab.span, r.* FROM r JOIN lab ON r.request = lab.request AND r.step = lab.position
    ), by_key AS (
        SELECT 'evidence:' || l.label || CASE WHEN lost.gone < r.step THEN ':dropped' ELSE ':held' END AS span,
               r.*
        FROM r JOIN labels l ON r.request = l.request
        LEFT JOIN lost ON lost.request = r.request AND lost.label = l.label AND lost.layer = r.layer
             AND lost.kv_head = r.kv_head AND (lost.q_head IS NULL OR lost.q_head = r.q_head)
    )
    SELECT span, request, step, layer, q_head, kv_head, dropped_mass, 1.0::DOUBLE - dropped_mass AS coverage
    FROM (SELECT * FROM by_query UNION ALL SELECT * FROM by_key)
"""


def coverage_by_span(source: Source, run_id: str, *, by_head: bool = True) -> duckdb.DuckDBPyRelation:
    """Coverage sliced by the span of the query token and by the evidence the keys hold.

    A replay row (step ``t``, layer, query head) belongs to

    * ``prompt`` or ``answer``: the token at position ``t`` is a prompt or a
      generated token; ``evidence:<label>`` when that token carries a label;
    * for every evidence label of its request, ``evidence:<label>:dropped``
      when its KV set no longer holds some token of the span at step ``t``
      (evicted at a step before ``t``: the teacher's weight on it is part of
      the row's dropped mass), else ``evidence:<label>:held``.

    Evidence sits in the prompt, before the decode steps that the replay
    covers, so the second kind is how evidence spans appear as slices: the
    coverage of the queries that lost the span against those that kept it.

    Returns
    -------
    relation
        ``span[, layer, q_head, kv_head], n, mean, min, p1, p5, max``.
    """
    rel = relation(connect(source), _SPANS, run=run_id)
    return coverage_stats(rel, ("span", "layer", "q_head", "kv_head") if by_head else ("span",))


def dropped_mass_series(source: Source, run_id: str) -> duckdb.DuckDBPyRelation:
    """Dropped mass over steps: mean and worst head per (request, step).

    Returns
    -------
    relation
        ``request, step, mean, max, p95, worst_layer, worst_q_head``.
    """
    sql = """
        SELECT request, step, avg(dropped_mass) AS mean, max(dropped_mass) AS max,
               quantile_cont(dropped_mass, 0.95) AS p95,
               arg_max(layer, dropped_mass) AS worst_layer, arg_max(q_head, dropped_mass) AS worst_q_head
        FROM replay WHERE run_id = $run
        GROUP BY request, step ORDER BY request, step
    """
    return relation(connect(source), sql, run=run_id)


def dropped_mass_by_layer(source: Source, run_id: str, *, bucket: int = 1) -> duckdb.DuckDBPyRelation:
    """Mean dropped mass per (layer, step bucket) over heads and requests.

    ``bucket`` steps share a column; ``step_start`` is the first step of the bucket.

    Returns
    -------
    relation
        ``layer, step_start, mean, max``.
    """
    check_int("bucket", bucket, 1)
    sql = """
        SELECT layer, (step // $bucket) * $bucket AS step_start, avg(dropped_mass) AS mean,
               max(dropped_mass) AS max
        FROM replay WHERE run_id = $run
        GROUP BY ALL ORDER BY layer, step_start
    """
    return relation(connect(source), sql, run=run_id, bucket=bucket)
