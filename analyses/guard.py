"""The guard's log of a run: each request's risk over its steps, and the actions taken (DESIGN.md §18.5).

``guard_requests`` gives, per request, the steps the guard scored, the highest risk and the step
it peaked at, the mean risk and the number of actions; ``guard_actions`` lists the actions
(``guard_events``) in order; ``guard_risk`` the risk per request and step, for a curve. A run
recorded without the guard has neither (empty relations). ``guard_cost`` is what the guard's own
computations cost, as the recorder stored it in the manifest.
"""

from __future__ import annotations

from typing import Any

import duckdb

from ._base import Source, connect, manifest_at, relation, run_info

__all__ = ["guard_requests", "guard_actions", "guard_risk", "guard_cost", "guard_cost_line", "COST_FIELDS"]

#: the manifest's ``guard_cost`` (DESIGN.md §18.5)
COST_FIELDS = ("seconds", "refill_seconds", "steps_scored", "generate_seconds", "share")


def guard_cost(source: Source, run_id: str) -> dict[str, Any] | None:
    """The manifest's ``guard_cost`` of ``run_id``: the guard's own seconds, its refills' recompute,
    the steps it scored, the generation's timed prefill and decode seconds and the guard's share of
    them; ``None`` for a run without it (no guard, a run recorded before it was logged, a manifest
    that cannot be read or an entry that is not five non-negative numbers: nothing is made up)."""
    cost = manifest_at(run_info(connect(source), run_id).get("path")).get("guard_cost")
    if not isinstance(cost, dict) or any(k not in cost for k in COST_FIELDS):
        return None
    numbers = [cost[k] for k in COST_FIELDS if not (k == "share" and cost[k] is None)]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in numbers):
        return None
    return {k: cost[k] for k in COST_FIELDS}


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


def guard_cost_line(cost: dict[str, Any]) -> str:
    """One sentence on the guard's cost (DESIGN.md §18.5) from the report's ``guard.cost``."""
    share = f", {cost['share']:.1%} of" if cost.get("share") is not None else " against"
    refill = f"; its refills' recompute {cost['refill_seconds']:.3f} s" if cost["refill_seconds"] else ""
    return (
        f"The guard's own computations took {cost['seconds']:.3f} s over {cost['steps_scored']} scored steps"
        f"{share} the {cost['generate_seconds']:.3f} s of timed prefill and decode steps{refill}."
    )
