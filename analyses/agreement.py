"""Oracle agreement: did the online scores evict what the future did not need? (DESIGN.md §8.3)

H2O ranks positions by online cumulative scores, renormalised over the kept
set; an oracle would rank them by the attention they receive in the future.
The teacher replay writes, for every eviction, a row of the ``oracle``
table (joined here to ``evictions`` on request, layer, KV set and position):

``teacher_future_mass`` (FLOAT)
    Σ over steps ``u > step`` of the full-cache teacher weight on the
    victim's position, aggregated over the KV set's query heads like the
    run's ``gqa`` (sum or max; the row's own query head for ``gqa='none'``),
    teacher-forced on the run's tokens: the attention the victim would still
    have received.
``teacher_score`` (FLOAT)
    The same aggregation over steps ``position <= u <= step``: the oracle
    counterpart of ``score`` (what an H2O scored on full attention would hold).

Definitions, per KV set:

* ``agreement``: share of evictions whose victim gets at most ``eps`` of
  future teacher attention in total (the oracle agrees it was dispensable);
* ``regret``: Σ ``teacher_future_mass`` over evictions;
* ``rank_corr_score``: Spearman correlation of ``score`` and ``teacher_score``
  over the set's evictions (how far renormalisation bent the online ranking);
* ``rank_corr_future``: Spearman correlation of ``score`` and
  ``teacher_future_mass`` (do low online scores predict little future use).
"""

from __future__ import annotations

import duckdb

from ._base import Source, check_positive, columns, connect, relation
from .errors import MissingColumnError

__all__ = ["ORACLE_COLUMNS", "oracle_available", "oracle_agreement"]

ORACLE_COLUMNS = ("teacher_future_mass", "teacher_score")


def _avg_rank(col: str) -> str:
    """Average rank of ``col`` within a KV set (ties share the mean of their ranks, as Spearman's)."""
    part = "PARTITION BY layer, kv_head, q_head"
    return f"(rank() OVER ({part} ORDER BY {col}) + (count(*) OVER ({part}, {col}) - 1) / 2.0)"


_JOIN = """
    FROM evictions e JOIN oracle o
      ON o.run_id = e.run_id AND o.request = e.request AND o.layer = e.layer AND o.kv_head = e.kv_head
     AND o.position = e.position AND coalesce(o.q_head, -1) = coalesce(e.q_head, -1)
"""


def oracle_available(source: Source, run_id: str | None = None) -> bool:
    """Whether the replay wrote ``oracle`` rows (for ``run_id``, or for any run)."""
    con = connect(source)
    if "teacher_future_mass" not in columns(con, "oracle"):
        return False
    if run_id is None:
        return bool(relation(con, "SELECT count(*) > 0 FROM oracle").fetchall()[0][0])
    return bool(relation(con, "SELECT count(*) > 0 FROM oracle WHERE run_id = $run", run=run_id).fetchall()[0][0])


def oracle_agreement(source: Source, run_id: str, *, eps: float = 0.05) -> duckdb.DuckDBPyRelation:
    """Agreement of the online evictions with the teacher's future attention, per KV set.

    Raises
    ------
    MissingColumnError
        The run has no ``oracle`` rows (``teacher_future_mass``): replay it first.

    Returns
    -------
    relation
        ``layer, kv_head, q_head, evictions, agreement, regret, worst_future_mass,
        worst_step, worst_position, rank_corr_future, rank_corr_score``.
    """
    con = connect(source)
    check_positive("eps", eps)
    if not oracle_available(con, run_id):
        raise MissingColumnError(
            f"oracle agreement of run {run_id!r} needs the replay's oracle table (teacher_future_mass, "
            "teacher_score); run `h2o-lens replay` on it first"
        )
    sql = f"""
        WITH e AS (
            SELECT e.layer, e.kv_head, e.q_head, e.step, e.position, e.score,
                   o.teacher_future_mass AS future, o.teacher_score AS teacher_score
            {_JOIN}
            WHERE e.run_id = $run
        ), r AS (
            SELECT *, {_avg_rank("score")} AS r_score, {_avg_rank("future")} AS r_future,
                   {_avg_rank("teacher_score")} AS r_teacher
            FROM e
        )
        SELECT layer, kv_head, q_head, count(*) AS evictions,
               avg((future <= $eps)::INT) AS agreement, sum(future) AS regret,
               max(future) AS worst_future_mass, arg_max(step, future) AS worst_step,
               arg_max(position, future) AS worst_position,
               corr(r_score, r_future) AS rank_corr_future,
               corr(r_score, r_teacher) AS rank_corr_score
        FROM r GROUP BY ALL ORDER BY layer, kv_head, q_head
    """
    return relation(con, sql, run=run_id, eps=float(eps))
