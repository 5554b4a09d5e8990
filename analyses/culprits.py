"""The culprit tokens of explained requests, read from the log (DESIGN.md §19).

:func:`recorders.culprits.explain_culprits` records its result as a counterfactual run of kind
``culprits``: the set restored (``config.pinned``), every probe of the search
(``counterfactual.search``) and one row per culprit in the ``culprits`` table, with when and why
it left the parent's cache. :func:`culprit_sets` reads them back per explained request;
:func:`why_left` says it in words (the explain table, the report and the dashboard's hover).
"""

from __future__ import annotations

from typing import Any

from runlog.schema import CULPRITS_KIND

from ._base import Source, connect, manifest_at, plain, relation

__all__ = ["culprit_sets", "why_left", "culprit_summary"]

_COLUMNS = ("position", "text", "rank", "step", "layer", "kv_head", "sets", "phase", "held", "score", "margin")


def culprit_sets(source: Source, run_id: str | None = None) -> dict[tuple[str, int], dict[str, Any]]:
    """``(parent run, request) -> search`` for every ``culprits`` re-run (of ``run_id`` when given).

    A search is ``{"run_id", "status", "found", "minimal", "stopped", "runs", "calls", "candidates",
    "culprits": [row ...], "tried": [positions]}``: ``culprits`` the rows of the ``culprits`` table
    (position, text, rank, step, layer, kv_head, sets, phase, held, score, margin, future_mass) when
    a set was found, else empty and ``tried`` the largest set tried.
    """
    con = connect(source)
    sql = """
        SELECT c.parent_run, c.request, c.run_id, c.status, r.path FROM counterfactuals c JOIN runs r USING (run_id)
        WHERE c.kind = $kind AND ($run IS NULL OR c.parent_run = $run) ORDER BY c.parent_run, c.request, c.created_at
    """
    found = relation(con, sql, kind=CULPRITS_KIND, run=run_id).fetchall()
    if not found:
        return {}
    ids = [r[2] for r in found]
    rows = relation(
        con,
        f"SELECT run_id, {', '.join(_COLUMNS)}, future_mass FROM culprits WHERE list_contains($ids, run_id) "
        "ORDER BY run_id, rank",
        ids=ids,
    ).df()
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for parent, request, rid, status, path in found:
        search = (manifest_at(path).get("counterfactual") or {}).get("search") or {}
        mine = rows[rows["run_id"] == rid].drop(columns="run_id")
        culprits = [{k: plain(v) for k, v in rec.items()} for rec in mine.to_dict("records")]
        out[(str(parent), int(request))] = {
            "run_id": rid,
            "status": status,
            "found": bool(search.get("found")) and status == "complete",
            "minimal": bool(search.get("minimal")),
            "stopped": search.get("stopped"),
            "runs": search.get("runs"),
            "calls": search.get("calls"),
            "candidates": search.get("candidates"),
            "culprits": culprits if search.get("found") else [],
            "tried": [] if search.get("found") else list(search.get("culprits") or []),
        }
    return out


def why_left(row: dict[str, Any]) -> str:
    """When and why a culprit left the parent's cache, in words."""
    where = "the recent window" if row.get("held") == "recent" else "its heavy slot"
    phase = "at the prefill" if row.get("phase") == "prefill" else f"at decode step {row.get('step')}"
    score = row.get("score")
    margin = row.get("margin")
    facts = []
    if score is not None:
        facts.append(f"score {score:.3g}")
    if margin is not None:
        facts.append(f"margin {margin:.3g}")
    sets = row.get("sets")
    tail = f"; evicted in {sets} layer/KV set{'s' if sets != 1 else ''}" if sets is not None else ""
    mass = row.get("future_mass")
    after = f"; teacher attention after: {mass:.3g}" if mass is not None else ""
    return f"left {where} {phase}" + (f" ({', '.join(facts)})" if facts else "") + tail + after


def culprit_summary(search: dict[str, Any] | None) -> str | None:
    """One line on a search: the set, 1-minimal or not, and its re-runs (None: no search)."""
    if not search:
        return None
    runs, calls = search.get("runs"), search.get("calls")
    runs = f"{runs} re-runs" + (f" in {calls} batches" if calls is not None and runs and calls < runs else "")
    if search.get("found"):
        names = ", ".join(f"{c['position']} {c.get('text')!r}" for c in search["culprits"])
        how = "1-minimal" if search.get("minimal") else f"not proven 1-minimal: stopped by {search.get('stopped')}"
        return f"{len(search['culprits'])} token(s): {names} ({how}, {runs})"
    if search.get("status") != "complete":
        return f"the search's re-run could not run ({search.get('status')})"
    tried = search.get("tried") or []
    why = f", stopped by {search.get('stopped')}" if search.get("stopped") else ""
    return (
        f"no set of evicted tokens restored brings the answer back ({runs}{why}; the largest tried held "
        f"{len(tried)} of {search.get('candidates')} candidates)"
    )
