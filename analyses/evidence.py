"""When the evidence left the cache (DESIGN.md §6, §8.3).

An evidence span is every token of one request that carries the same label
in ``tokens.evidence``. A KV set (``layer, kv_head`` and, for ``gqa='none'``,
``q_head``) holds a position ``i`` at step ``t`` when ``i`` is in its
candidate set ``D_t``: ``i <= t`` and ``i`` was not evicted at a step before
``t`` (prefill evictions carry step ``prompt_len - 1``).

* deletion step of a span in a KV set: the step its last token was evicted
  (null while any token is still held);
* held at step ``a``: some token of the span is in ``D_a`` (``held_any``) or
  every token is (``held_all``). The default ``a`` is the answer step, the
  first generated position of the request.
"""

from __future__ import annotations

import duckdb

from ._base import Source, check_int, connect, has_rows, relation

__all__ = ["evidence_spans", "evidence_deletion", "evidence_held", "evidence_evictions", "evidence_recalls"]


def _sets_sql(con: duckdb.DuckDBPyConnection, run_id: str) -> str:
    """KV sets of a run: from ``steps`` (small), else from ``evictions``."""
    table = "steps" if has_rows(con, "steps", run_id) else "evictions"
    return f"SELECT DISTINCT request, layer, kv_head, coalesce(q_head, -1) AS qh FROM {table} WHERE run_id = $run"


_CONTEXT = """
    ev_tok AS (
        SELECT request, position, evidence AS label FROM tokens
        WHERE run_id = $run AND evidence IS NOT NULL
    ), spans AS (
        SELECT request, label, count(*) AS tokens, min(position) AS first_position,
               max(position) AS last_position
        FROM ev_tok GROUP BY ALL
    ), answer AS (
        SELECT request, coalesce(min(position) FILTER (WHERE NOT is_prompt),
                                 count(*) FILTER (WHERE is_prompt)) AS answer_step
        FROM tokens WHERE run_id = $run GROUP BY request
    )
"""


def evidence_spans(source: Source, run_id: str) -> duckdb.DuckDBPyRelation:
    """Evidence spans: ``request, label, tokens, first_position, last_position, answer_step``."""
    sql = (
        f"WITH {_CONTEXT} SELECT s.*, a.answer_step FROM spans s LEFT JOIN answer a USING (request) "
        "ORDER BY request, first_position"
    )
    return relation(connect(source), sql, run=run_id)


def _deletion_sql(con: duckdb.DuckDBPyConnection, run_id: str) -> str:
    return f"""
        WITH {_CONTEXT}, sets AS ({_sets_sql(con, run_id)}),
        hits AS (
            SELECT e.request, t.label, e.layer, e.kv_head, coalesce(e.q_head, -1) AS qh,
                   count(*) AS evicted_tokens, min(e.step) AS first_step, max(e.step) AS last_step
            FROM evictions e JOIN ev_tok t ON e.request = t.request AND e.position = t.position
            WHERE e.run_id = $run GROUP BY ALL
        ), deletion AS (
            SELECT s.request, s.label, h.layer, h.kv_head, nullif(h.qh, -1)::SMALLINT AS q_head,
                   s.tokens, coalesce(x.evicted_tokens, 0) AS evicted_tokens,
                   x.first_step AS first_token_evicted_step,
                   CASE WHEN x.evicted_tokens = s.tokens THEN x.last_step END AS deletion_step,
                   a.answer_step
            FROM spans s JOIN sets h USING (request)
            LEFT JOIN hits x ON x.request = s.request AND x.label = s.label AND x.layer = h.layer
                 AND x.kv_head = h.kv_head AND x.qh = h.qh
            LEFT JOIN answer a ON a.request = s.request
        )
    """


def evidence_deletion(source: Source, run_id: str) -> duckdb.DuckDBPyRelation:
    """Per evidence span and KV set: when its tokens left the cache.

    Returns
    -------
    relation
        ``request, label, layer, kv_head, q_head, tokens, evicted_tokens,
        first_token_evicted_step, deletion_step, answer_step``; ``deletion_step``
        is null while any token of the span is still held.
    """
    con = connect(source)
    sql = _deletion_sql(con, run_id) + " SELECT * FROM deletion ORDER BY request, label, layer, kv_head, q_head"
    return relation(con, sql, run=run_id)


def evidence_held(source: Source, run_id: str, *, at_step: int | None = None) -> duckdb.DuckDBPyRelation:
    """Share of KV sets still holding each evidence span at a step.

    ``at_step`` defaults to each request's answer step (first generated position).

    Returns
    -------
    relation
        ``request, label, at_step, sets, held_any, held_all, held_any_share,
        held_all_share, first_deletion_step, last_deletion_step``.
    """
    if at_step is not None:
        check_int("at_step", at_step)
    con = connect(source)
    sql = (
        _deletion_sql(con, run_id)
        + """
        , d AS (SELECT *, coalesce($at_step, answer_step) AS at_step FROM deletion)
        SELECT request, label, any_value(at_step) AS at_step, count(*) AS sets,
               count(*) FILTER (WHERE deletion_step IS NULL OR deletion_step >= at_step) AS held_any,
               count(*) FILTER (WHERE first_token_evicted_step IS NULL
                                OR first_token_evicted_step >= at_step) AS held_all,
               held_any / count(*) AS held_any_share, held_all / count(*) AS held_all_share,
               min(deletion_step) AS first_deletion_step, max(deletion_step) AS last_deletion_step
        FROM d GROUP BY request, label ORDER BY request, label
    """
    )
    return relation(con, sql, run=run_id, at_step=at_step)


def evidence_evictions(
    source: Source,
    run_id: str,
    *,
    request: int | None = None,
    before_step: int | None = None,
    lag_steps: int = 4,
    low_score_ratio: float = 0.5,
) -> duckdb.DuckDBPyRelation:
    """Eviction rows of evidence tokens, each flagged for scoring lag.

    A row is a *lag eviction* when the token was evicted in the decode phase
    at most ``lag_steps`` steps after it left the recent window
    (``age <= recent + lag_steps``) with a score at most ``low_score_ratio``
    times the lowest surviving score (``score <= ratio * (score + margin)``):
    it never gathered attention while the recent window protected it.

    Returns
    -------
    relation
        ``request, label, step, layer, kv_head, q_head, position, text, score,
        margin, age, left_recent, phase, threshold, lag_eviction``.
    """
    check_int("lag_steps", lag_steps)
    sql = """
        WITH ev_tok AS (
            SELECT request, position, evidence AS label, text FROM tokens
            WHERE run_id = $run AND evidence IS NOT NULL AND ($request IS NULL OR request = $request)
        ), run AS (SELECT recent, prompt_len FROM runs WHERE run_id = $run),
        rq AS (SELECT request, recent, prompt_len FROM requests WHERE run_id = $run)
        SELECT e.request, t.label, e.step, e.layer, e.kv_head, e.q_head, e.position, t.text,
               e.score, e.margin, e.age, e.left_recent, e.phase, e.score + e.margin AS threshold,
               coalesce(e.phase <> 'prefill', e.step > coalesce(q.prompt_len, run.prompt_len) - 1, true)
               AND e.age <= coalesce(b.recent, q.recent, run.recent) + $lag_steps
               AND e.score <= $ratio * (e.score + e.margin) AS lag_eviction
        FROM evictions e JOIN ev_tok t ON e.request = t.request AND e.position = t.position
        CROSS JOIN run LEFT JOIN rq q ON q.request = e.request
        LEFT JOIN set_budgets b  -- a budget plan's window of the set (DESIGN.md §5.6)
          ON b.run_id = $run AND b.request = e.request AND b.layer = e.layer
         AND b.kv_set = coalesce(e.q_head, e.kv_head)
        WHERE e.run_id = $run AND ($before IS NULL OR e.step < $before)
        ORDER BY e.request, e.step, e.layer, e.kv_head, e.q_head, e.position
    """
    return relation(
        connect(source),
        sql,
        run=run_id,
        request=request,
        before=before_step,
        lag_steps=lag_steps,
        ratio=float(low_score_ratio),
    )


def evidence_recalls(source: Source, run_id: str) -> duckdb.DuckDBPyRelation:
    """Per evidence span of a run with a cold tier (DESIGN.md §6.11): ``request, label, tokens,
    first_evicted`` (the first decode step a KV set lost one of its tokens), ``first_recalled`` (the
    first step a recall window held one of them, null: never), ``recall_lag`` (the one minus the other),
    ``positions_recalled`` and ``answer_step``. Empty for a run without recalls."""
    sql = f"""
        WITH {_CONTEXT},
        gone AS (
            SELECT t.request, t.label, min(e.step) AS first_evicted
            FROM evictions e JOIN ev_tok t ON e.request = t.request AND e.position = t.position
            WHERE e.run_id = $run GROUP BY ALL
        ), back AS (
            SELECT t.request, t.label, min(c.step) AS first_recalled, count(DISTINCT c.position) AS positions_recalled
            FROM recalls c JOIN ev_tok t ON c.request = t.request AND c.position = t.position
            WHERE c.run_id = $run GROUP BY ALL
        )
        SELECT s.request, s.label, s.tokens, g.first_evicted, b.first_recalled,
               b.first_recalled - g.first_evicted AS recall_lag,
               coalesce(b.positions_recalled, 0) AS positions_recalled, a.answer_step
        FROM spans s LEFT JOIN gone g USING (request, label) LEFT JOIN back b USING (request, label)
        LEFT JOIN answer a USING (request)
        WHERE EXISTS (SELECT 1 FROM runs WHERE run_id = $run AND cold IS NOT NULL)
        ORDER BY s.request, s.first_position
    """
    return relation(connect(source), sql, run=run_id)
