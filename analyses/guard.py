"""The guard's log of a run: each request's risk over its steps, and the actions taken (DESIGN.md §18.5).

``guard_requests`` gives, per request, the steps the guard scored, the highest risk and the step
it peaked at, the mean risk and the number of actions; ``guard_actions`` lists the actions
(``guard_events``) in order; ``guard_risk`` the risk per request and step, for a curve. A run
recorded without the guard has neither (empty relations).
"""

from __future__ import annotations

import duckdb

from ._base import Source, connect, relation

__all__ = ["guard_requests", "guard_actions", "guard_risk"]


def guard_requests(source: Source, run_id: str) -> duckdb.DuckDBPyRelation:
    """One row per request the guard scored: ``request, steps, max_risk, peak_step, mean_risk, actions``."""
    con = connect(source)
    return relation(
        con,
        """
        SELECT s.request,
               count(*) AS steps,
               max(s.risk) AS max_risk,
               arg_max(s.step, s.risk) AS peak_step,
               avg(s.risk) AS mean_risk,
               coalesce(max(e.actions), 0) AS actions
        FROM guard_steps s
        LEFT JOIN (
            SELECT request, count(*) AS actions FROM guard_events WHERE run_id = $run GROUP BY request
        ) e USING (request)
        WHERE s.run_id = $run
        GROUP BY s.request
        ORDER BY s.request
        """,
        run=run_id,
    )


def guard_actions(source: Source, run_id: str) -> duckdb.DuckDBPyRelation:
    """The guard's actions of ``run_id`` in order: ``request, step, risk, action, slots_before,
    slots_after, evicted``."""
    con = connect(source)
    return relation(
        con,
        """
        SELECT request, step, risk, action, slots_before, slots_after, evicted
        FROM guard_events WHERE run_id = $run ORDER BY request, step
        """,
        run=run_id,
    )


def guard_risk(source: Source, run_id: str) -> duckdb.DuckDBPyRelation:
    """The risk of each request at each step the guard scored: ``request, step, risk`` (the
    prefill's row, at step ``P − 1``, first)."""
    con = connect(source)
    return relation(
        con,
        "SELECT request, step, risk FROM guard_steps WHERE run_id = $run ORDER BY request, step",
        run=run_id,
    )
