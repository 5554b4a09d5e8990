"""Stale heavy hitters: slots held on old attention (DESIGN.md §6.8, §8.3).

A heavy hitter is *stale* when it keeps a slot on a high cumulative score
while it receives little attention now. The logs do not hold per-position
scores over time, but two facts bound the attention a heavy slot received:
scores only grow, and every heavy slot scores at least the threshold
``m(u) = steps.min_heavy_score`` after step ``u``. For a window of ``W``
steps (default: the run's ``recent``; ``u`` is the last logged step at or
before ``t - W``):

*Stale victim.* A heavy-slot eviction (``left_recent`` false, decode phase)
of position ``p`` at step ``t`` with score ``s``. ``p`` entered the heavy
set at ``entry = max(p + recent, prompt_len - 1)``; if ``entry <= u`` it was
a heavy slot at ``u``, so the online attention it received over ``(u, t]``
is at most ``gain_bound = s - m(u)``. It is stale when
``gain_bound <= max_rate * (t - u)``: on average at most ``max_rate``
aggregated attention per step for the last ``t - u >= W`` steps, while it
held a slot for ``t - entry`` steps.

*Stale holder.* At step ``t`` the kept set provably holds a stale heavy
hitter when no token was promoted in ``(u, t]`` (so every heavy slot at
``t`` was already one at ``u``) and ``m(t) - m(u) <= max_rate * (t - u)``:
the slot with the lowest score at ``t`` gained at most ``m(t) - m(u)``.

Both relations are unordered (they can hold millions of rows): aggregate
or order them where they are used. Both are lower bounds on staleness from the run's own online scores; the
teacher's attention per position would sharpen them (see :mod:`.oracle`).
"""

from __future__ import annotations

import duckdb

from ._base import Source, check_int, check_positive, connect, relation, run_info

__all__ = ["stale_victims", "stale_holders"]


def _window(con: duckdb.DuckDBPyConnection, run_id: str, window: int | None) -> int:
    if window is not None:
        return check_int("window", window, 1)
    recent = run_info(con, run_id).get("recent")
    if recent is None:  # budgets differ per request (keep ratio) or per set (a plan): the widest recent window
        recent = con.execute(
            "SELECT max(recent) FROM (SELECT recent FROM requests WHERE run_id = $run"
            " UNION ALL SELECT recent FROM set_budgets WHERE run_id = $run)",
            {"run": run_id},
        ).fetchall()[0][0]
    return max(1, int(recent)) if recent else 1


_STEPS = """
    st AS (
        SELECT request, layer, kv_head, coalesce(q_head, -1) AS qh, step, min_heavy_score AS m,
               sum(coalesce(promoted, false)::INT) OVER (
                   PARTITION BY request, layer, kv_head, q_head ORDER BY step
                   ROWS UNBOUNDED PRECEDING) AS cum_promoted
        FROM steps WHERE run_id = $run AND min_heavy_score IS NOT NULL
    )
"""


def stale_victims(
    source: Source, run_id: str, *, window: int | None = None, max_rate: float = 0.01
) -> duckdb.DuckDBPyRelation:
    """Heavy-slot evictions flagged stale (see the module docstring).

    Returns
    -------
    relation
        ``request, step, layer, kv_head, q_head, position, score, margin, age,
        entry_step, residency, ref_step, ref_threshold, gain_bound, span,
        stale`` for every decode-phase eviction with ``left_recent`` false.
    """
    con = connect(source)
    w = _window(con, run_id, window)
    check_positive("max_rate", max_rate)
    sql = f"""
        WITH run AS (SELECT recent, prompt_len FROM runs WHERE run_id = $run),
        plen AS (
            SELECT request, count(*) FILTER (WHERE is_prompt) AS prompt_len
            FROM tokens WHERE run_id = $run GROUP BY request
        ), rq AS (SELECT request, recent FROM requests WHERE run_id = $run), {_STEPS},
        v AS (
            SELECT e.request, e.step, e.layer, e.kv_head, e.q_head, coalesce(e.q_head, -1) AS qh,
                   e.position, e.score, e.margin, e.age,
                   greatest(e.position + coalesce(b.recent, q.recent, run.recent),
                            coalesce(p.prompt_len, run.prompt_len) - 1) AS entry_step,
                   e.step - $w AS ref_target
            FROM evictions e CROSS JOIN run LEFT JOIN plen p ON p.request = e.request
            LEFT JOIN rq q ON q.request = e.request
            LEFT JOIN set_budgets b  -- a budget plan's window of the set (DESIGN.md §5.6)
              ON b.run_id = $run AND b.request = e.request AND b.layer = e.layer
             AND b.kv_set = coalesce(e.q_head, e.kv_head)
            WHERE e.run_id = $run AND NOT e.left_recent
              AND e.step > coalesce(p.prompt_len, run.prompt_len) - 1
        ), keys AS (
            SELECT DISTINCT request, layer, kv_head, qh, ref_target FROM v
        ), ref AS (  -- one ASOF lookup per (KV set, step), not per eviction
            SELECT k.*, st.step AS ref_step, st.m AS ref_threshold
            FROM keys k ASOF LEFT JOIN st
              ON k.request = st.request AND k.layer = st.layer AND k.kv_head = st.kv_head
             AND k.qh = st.qh AND k.ref_target >= st.step
        )
        SELECT v.request, v.step, v.layer, v.kv_head, v.q_head, v.position, v.score, v.margin, v.age,
               v.entry_step, v.step - v.entry_step AS residency, r.ref_step, r.ref_threshold,
               v.score - r.ref_threshold AS gain_bound, v.step - r.ref_step AS span,
               coalesce(r.ref_step >= v.entry_step
                        AND v.score - r.ref_threshold <= $rate * (v.step - r.ref_step), false) AS stale
        FROM v LEFT JOIN ref r USING (request, layer, kv_head, qh, ref_target)
    """
    return relation(con, sql, run=run_id, w=w, rate=float(max_rate))


def stale_holders(
    source: Source, run_id: str, *, window: int | None = None, max_rate: float = 0.01
) -> duckdb.DuckDBPyRelation:
    """Per logged step and KV set: does the kept set provably hold a stale heavy hitter?

    Returns
    -------
    relation
        ``request, step, layer, kv_head, q_head, threshold, ref_step,
        gain_bound, span, promotions, stale_holder``; steps with no logged
        step ``W`` or more before them are left out.
    """
    con = connect(source)
    w = _window(con, run_id, window)
    check_positive("max_rate", max_rate)
    sql = f"""
        WITH {_STEPS}
        SELECT a.request, a.step, a.layer, a.kv_head, nullif(a.qh, -1)::SMALLINT AS q_head,
               a.m AS threshold, b.step AS ref_step, a.m - b.m AS gain_bound,
               a.step - b.step AS span, a.cum_promoted - b.cum_promoted AS promotions,
               (a.cum_promoted = b.cum_promoted AND a.m - b.m <= $rate * (a.step - b.step))
                   AS stale_holder
        FROM st a ASOF JOIN st b
          ON a.request = b.request AND a.layer = b.layer AND a.kv_head = b.kv_head AND a.qh = b.qh
         AND a.step - $w >= b.step
    """
    return relation(con, sql, run=run_id, w=w, rate=float(max_rate))
