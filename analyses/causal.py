"""Why did a request fail, decided by counterfactual re-runs (DESIGN.md §6.10).

:func:`recorders.counterfactual.explain_request` re-runs a failed request
with one thing changed and records each re-run as a run linked to its parent
(the ``counterfactuals`` view). This module reads those runs and decides:

``implementation_error``
    the parent's masked replay does not reproduce its logits (as in
    :mod:`.attribution`): nothing measured on it can be trusted.
``not_the_cache``
    the full cache fails too; or pinning the evidence does not bring the
    answer back and the dropped mass around the decision step is low.
``scoring``
    pinning the evidence or the oracle at the same slot count passes: the
    policy's scores lost what mattered. Sub-labels, from the parent's logs:
    ``delayed_reference`` when evidence was evicted at prefill or soon after
    leaving the recent window with a low score (:func:`.evidence_evictions`),
    ``stale_heavy`` when the kept set provably held stale heavy hitters
    before the decision step (:func:`.stale_holders`).
``budget``
    the oracle at the same slot count fails too: no attention-scoring
    policy keeps enough with this many slots.
``undecided``
    a counterfactual the rules need could not run (its error is listed).

Every verdict names the runs that decided it. The threshold rules of
:mod:`.attribution` stay as the fast estimate, without re-runs; both are
shown when they disagree. :func:`budget_distribution` turns the minimal
passing budgets of a root's explained requests into the share of requests
that pass at each keep ratio, per policy, with the oracle as the upper bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import duckdb
import pandas as pd

from runlog.counterfactual_reuse import judged_teacher_forced
from runlog.schema import COUNTERFACTUAL_KINDS, CULPRITS_KIND

from ._base import Source, connect, first_row, manifest_at, plain, relation, run_info
from .attribution import attribute
from .culprits import culprit_sets
from .evidence import evidence_evictions
from .stale import stale_holders
from .thresholds import Thresholds

__all__ = [
    "CAUSAL_VERDICTS",
    "SUB_LABELS",
    "CausalVerdict",
    "counterfactual_runs",
    "explained_requests",
    "causal_verdicts",
    "decide",
    "variant_table",
    "budget_distribution",
    "describe_search",
    "recall_verdict",
    "plan_verdict",
]

CAUSAL_VERDICTS = ("scoring", "budget", "not_the_cache", "implementation_error", "undecided")
SUB_LABELS = ("delayed_reference", "stale_heavy")
#: the variants of the counterfactual table, in display order
VARIANTS = COUNTERFACTUAL_KINDS
FULL, PINNED, ORACLE, POLICY_BUDGET, ORACLE_BUDGET, RECALL, PLAN = VARIANTS
BUDGET_KINDS = (POLICY_BUDGET, ORACLE_BUDGET)
#: the curve of the oracle's minimal budgets in :func:`budget_distribution`
ORACLE_CURVE = ORACLE
#: threshold verdicts that say the same as a causal one
_SAME = {"scoring_lag": "scoring"}


@dataclasses.dataclass(frozen=True)
class CausalVerdict:
    """The counterfactual verdict on one failed request, the runs behind it and the fast estimate.

    ``passes`` maps each variant that ran to its pass test (``None``: ran,
    no verdict); ``could_not_run`` each variant that raised to its error;
    ``min_slots`` and ``keep_ratio`` the minimal passing budget of the
    policy and of the oracle (``None``: not found, or the pass test was not
    monotone: ``monotone``); ``decided_by`` the run ids the verdict rests on.
    """

    run_id: str
    request: int
    verdict: str
    sub_label: str | None
    reason: str
    passes: dict[str, bool | None]
    could_not_run: dict[str, str]
    slots: int | None
    prompt_len: int | None
    min_slots: dict[str, int | None]
    keep_ratio: dict[str, float | None]
    monotone: dict[str, bool | None]
    runs: dict[str, str]
    decided_by: tuple[str, ...]
    estimate: str | None
    table: tuple[dict[str, Any], ...] = ()
    #: each search whose pass test was not monotone: every count it tried, ``[[slots, passed], ...]``
    #: ascending (:func:`describe_search` says it in words); a monotone search has no entry
    budget_probes: dict[str, list[list[Any]]] = dataclasses.field(default_factory=dict)
    #: the culprit search of the request, when one ran (:func:`analyses.culprits.culprit_sets`, DESIGN.md §19)
    culprits: dict[str, Any] | None = None
    #: the ``recall`` variant, when it ran (:func:`recall_verdict`): would a recall window have fixed it?
    recall: dict[str, Any] | None = None
    #: the ``plan`` variant, when it ran (:func:`plan_verdict`): would a budget plan have fixed it?
    plan: dict[str, Any] | None = None

    @property
    def agrees(self) -> bool | None:
        """Whether the threshold estimate says the same (None: no estimate)."""
        if self.estimate is None or self.estimate == "unknown":  # the estimate named no cause
            return None
        return _SAME.get(self.estimate, self.estimate) == self.verdict

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["decided_by"] = list(self.decided_by)
        out["table"] = [dict(r) for r in self.table]
        out["agrees"] = self.agrees
        out["counterfactual_runs"] = dict(self.runs)
        if not self.budget_probes:
            del out["budget_probes"]  # only a non-monotone search shows the counts it tried
        return out


def counterfactual_runs(source: Source, run_id: str | None = None) -> duckdb.DuckDBPyRelation:
    """Rows of the ``counterfactuals`` view (of one parent run when ``run_id`` is given), newest last."""
    sql = """
        SELECT c.*, r.prompt_len, r.path FROM counterfactuals c JOIN runs r USING (run_id)
        WHERE ($run IS NULL OR c.parent_run = $run)
        ORDER BY c.parent_run, c.request, c.kind, c.created_at
    """
    return relation(connect(source), sql, run=run_id)


def explained_requests(source: Source) -> duckdb.DuckDBPyRelation:
    """``parent_run, request, variants``: every request that has counterfactual runs."""
    sql = """
        SELECT parent_run, request, count(*) AS variants FROM counterfactuals
        GROUP BY parent_run, request ORDER BY parent_run, request
    """
    return relation(connect(source), sql)


def _bisection(path: str | None) -> dict[str, Any] | None:
    bis = (manifest_at(path).get("counterfactual") or {}).get("bisection")
    return bis if isinstance(bis, dict) else None


#: why an oracle run of an earlier version has no verdict (``runlog.counterfactual_reuse``)
NOT_JUDGED = (
    "recorded teacher-forced on the full run's tokens by an earlier version, not judged on its own answer: "
    "run `h2o-lens explain` again (without --cached) to judge it"
)


def _outcomes(rows: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """The latest run of each variant: status, correct, slots, run id, bisection, and for the
    oracle its teacher-forced agreement with the teacher's tokens."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows.to_dict("records"):
        rec = {k: plain(v) for k, v in row.items()}
        rec["bisection"] = rec["teacher_agreement"] = None
        if rec["kind"] == PLAN:
            cf = manifest_at(rec.get("path")).get("counterfactual") or {}
            rec.update({k: cf.get(k) for k in ("plan", "plan_total", "run_total")})
        if rec["kind"] in (ORACLE, RECALL, *BUDGET_KINDS):
            manifest = manifest_at(rec.get("path"))
            cf = manifest.get("counterfactual") or {}
            rec["bisection"] = cf.get("bisection") if isinstance(cf.get("bisection"), dict) else None
            rec["teacher_agreement"] = cf.get("teacher_agreement")
            rec["window"] = cf.get("window")
            rec["cold"] = (manifest.get("config") or {}).get("cold")
            if rec["kind"] != POLICY_BUDGET and judged_teacher_forced(manifest):
                rec.update(status="not_judged", correct=None, error=NOT_JUDGED, bisection=None)
        out[rec["kind"]] = rec
    same = out.get(ORACLE)
    if ORACLE_BUDGET not in out and same is not None and same.get("bisection"):
        # the oracle passed first at the run's own count: its run holds the search (no second run)
        out[ORACLE_BUDGET] = {**same, "kind": ORACLE_BUDGET}
    if same is not None:
        out[ORACLE] = {**same, "bisection": None}
    return dict(sorted(out.items(), key=lambda kv: VARIANTS.index(kv[0]) if kv[0] in VARIANTS else 99))


def decide(
    outcomes: Mapping[str, Mapping[str, Any]],
    *,
    implementation_error: bool = False,
    dropped_mass: float | None = None,
    dropped_mass_high: float = 0.1,
) -> tuple[str, str, tuple[str, ...]]:
    """The verdict from the counterfactual outcomes alone (rules in the module docstring).

    ``outcomes`` maps a variant to ``{"status", "correct", "run_id", "error"}``
    (``status`` ``complete`` when it ran). Returns (verdict, reason, run ids
    that decided it).
    """

    def ran(kind: str) -> bool:
        o = outcomes.get(kind)
        return o is not None and o.get("status") == "complete" and o.get("correct") is not None

    def ok(kind: str) -> bool:
        return ran(kind) and bool(outcomes[kind]["correct"])

    def rid(*kinds: str) -> tuple[str, ...]:
        return tuple(outcomes[k]["run_id"] for k in kinds if outcomes.get(k) and outcomes[k].get("run_id"))

    def missing(*kinds: str) -> str:
        parts = []
        for k in kinds:
            o = outcomes.get(k)
            parts.append(f"{k}: {(o or {}).get('error') or 'not run'}")
        return "; ".join(parts)

    if implementation_error:
        return "implementation_error", "the masked replay does not reproduce the run's logits", ()
    if not ran("full"):
        return "undecided", f"the full-cache re-run could not run ({missing('full')})", rid("full")
    if not ok("full"):
        return "not_the_cache", "the full cache fails too: no eviction caused this", rid("full")
    winners = [k for k in ("pinned", "oracle") if ok(k)]
    if winners:
        said = " and ".join("pinning the evidence" if k == "pinned" else "the oracle" for k in winners)
        return "scoring", f"{said} at the same slot count brings the answer back", rid("full", *winners)
    high = dropped_mass is not None and dropped_mass >= dropped_mass_high
    if ran("pinned") and dropped_mass is not None and not high:
        return (
            "not_the_cache",
            f"pinning the evidence does not help and the dropped mass is low ({dropped_mass:.3g} "
            f"< {dropped_mass_high:g})",
            rid("full", "pinned"),
        )
    if ran("oracle"):
        return "budget", "the oracle at the same slot count fails too", rid("full", "pinned", "oracle")
    return "undecided", f"the re-runs that decide could not run ({missing('pinned', 'oracle')})", rid("full")


def _group(con: duckdb.DuckDBPyConnection, run_id: str) -> int:
    """Query heads whose weights a KV set's score sums (1 for ``gqa`` max or none)."""
    info = run_info(con, run_id)
    if info.get("gqa") in ("max", "none"):
        return 1
    sql = """
        SELECT count(DISTINCT q_head) / greatest(count(DISTINCT kv_head), 1) FROM replay
        WHERE run_id = $run AND request = (SELECT min(request) FROM replay WHERE run_id = $run)
    """
    row = first_row(relation(con, sql, run=run_id))
    return max(1, int(row[0])) if row and row[0] else 1


def _sub_label(con: duckdb.DuckDBPyConnection, run_id: str, request: int, d: int | None, th: Thresholds) -> str | None:
    """``delayed_reference``, ``stale_heavy`` or None, from the parent's evidence evictions.

    An evidence eviction at prefill, or within ``lag_steps`` of leaving the recent
    window, is *unreferenced* when its score is at most ``low_score_ratio`` times what
    uniform attention would have given it over its life (``g · Σ 1/(s + 1)`` for the
    steps ``s`` from its position to the eviction, ``g`` the query heads a score sums):
    nothing had looked at it yet. At least ``lag_share`` of the evidence evictions
    unreferenced: ``delayed_reference``. Otherwise evidence that lost its slot while the
    heavy slots were held by older positions (``steps.heavy_age_mean`` above the
    victim's age), or a kept set provably holding stale heavy hitters
    (:func:`.stale_holders`): ``stale_heavy``.
    """
    ev = evidence_evictions(
        con, run_id, request=request, before_step=d, lag_steps=th.lag_steps, low_score_ratio=th.low_score_ratio
    ).df()
    info = run_info(con, run_id)
    recent = info.get("recent")
    if len(ev):
        g = _group(con, run_id)
        uniform = [
            g * sum(1.0 / (s + 1) for s in range(int(p), int(t) + 1)) for p, t in zip(ev["position"], ev["step"])
        ]
        window = ev["phase"].eq("prefill") | ev["lag_eviction"].astype(bool)
        if recent is not None:
            window |= ev["left_recent"].astype(bool) & (ev["age"] <= int(recent) + th.lag_steps)
        unreferenced = window & (ev["score"] <= th.low_score_ratio * pd.Series(uniform, index=ev.index))
        if unreferenced.mean() >= th.lag_share:
            return "delayed_reference"
        sql = """
            SELECT count(*) FILTER (WHERE s.heavy_age_mean > e.age) AS older, count(*) AS n
            FROM evidence_ev e JOIN steps s
              ON s.run_id = $run AND s.request = e.request AND s.step = e.step AND s.layer = e.layer
             AND s.kv_head = e.kv_head AND s.q_head IS NOT DISTINCT FROM e.q_head
        """
        con.register("evidence_ev", ev)
        try:
            row = first_row(relation(con, sql, run=run_id))
        finally:
            con.unregister("evidence_ev")
        if row and row[1] and row[0] / row[1] >= th.lag_share:
            return "stale_heavy"
    stale = stale_holders(con, run_id).filter(f"request = {int(request)}")
    if d is not None:
        stale = stale.filter(f"step <= {int(d)}")
    row = first_row(stale.aggregate("coalesce(bool_or(stale_holder), false)"))
    return "stale_heavy" if row and row[0] else None


def variant_table(outcomes: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    """One row per variant. ``right`` is its pass test; a row showing the teacher's (the full
    cache's) answer text is never marked wrong when the teacher is right: the same text gets
    the same checker's verdict, so a ``False`` there can only be a verdict on something else
    (an earlier version's teacher-forced oracle), and is shown as none. ``teacher_agreement``
    ``[k, n]``: the oracle's top-1 equals the teacher's token at k of its n steps."""
    full = outcomes.get(FULL) or {}
    teacher_text = full.get("answer") if full.get("status") == "complete" and full.get("correct") else None
    rows = []
    for kind in VARIANTS:
        o = outcomes.get(kind)
        if o is None:
            continue
        right = o.get("correct") if o.get("status") == "complete" else None
        if right is False and teacher_text is not None and _same_text(o.get("answer"), teacher_text):
            right = None
        rows.append(
            {
                "variant": kind,
                "slots": o.get("slots"),
                "keep_ratio": o["slots"] / o["prompt_len"] if o.get("slots") and o.get("prompt_len") else None,
                "answer": o.get("answer"),
                "right": right,
                "teacher_agreement": o.get("teacher_agreement"),
                "window": o.get("window"),
                "kl_mean": 0.0 if kind == FULL and o.get("status") == "complete" else o.get("kl_mean"),
                "run_id": o.get("run_id"),
                "status": o.get("status"),
                "error": o.get("error"),
            }
        )
    return tuple(rows)


def _same_text(a: Any, b: Any) -> bool:
    return isinstance(a, str) and isinstance(b, str) and a.strip() == b.strip()


def _budget(
    o: Mapping[str, Any] | None, prompt_len: int | None
) -> tuple[int | None, float | None, bool | None, list[list[Any]] | None]:
    """Minimal slots, keep ratio, monotone, and the counts tried when the search was not monotone."""
    if not o or o.get("status") != "complete":
        return None, None, None, None
    bis = o.get("bisection") or {}
    monotone = bis.get("monotone") if bis else None
    slots = bis.get("min_slots") if bis else o.get("slots")
    ratio = slots / prompt_len if slots is not None and prompt_len else None
    probes = sorted([int(s), bool(p)] for s, p in bis.get("probes") or []) if monotone is False else None
    return slots, ratio, monotone, probes


def recall_verdict(o: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Would a recall window have fixed the answer (the ``recall`` variant, DESIGN.md §6.11)?

    ``fixed`` True (some window within the slot count passes), False (the largest window fails
    too) or None (it could not run); ``window`` the smallest fixing window in slots (None: not
    fixed, or the pass test was not monotone in the window: ``monotone``); ``lo``, ``hi`` the
    windows searched; ``probes`` every window tried, ``[[window, passed], ...]``; ``text`` in words.
    """
    if o is None:
        return None
    slots = o.get("slots")
    if o.get("status") != "complete":
        why = o.get("error") or o.get("status")
        return {"fixed": None, "window": None, "slots": slots, "text": f"the recall variant could not run: {why}"}
    bis = o.get("bisection") or {}
    tier = o.get("cold") if isinstance(o.get("cold"), dict) else {}
    probes = sorted([int(w), bool(p)] for w, p in bis.get("probes") or [])
    smallest = bis.get("smallest_pass")
    fixed = smallest is not None if bis else o.get("correct")
    window = bis.get("min_slots") if bis else None
    out = {
        "fixed": fixed,
        "window": window,
        "slots": slots,
        "monotone": bis.get("monotone"),
        "lo": bis.get("lo"),
        "hi": bis.get("hi"),
        "resolution": bis.get("resolution"),
        "probes": probes,
        "store": tier.get("store"),
        "select": tier.get("select"),
        "run_id": o.get("run_id"),
    }
    where = f"{tier.get('store', 'cpu')} store, {tier.get('select', 'exact')} selection"
    if fixed and window is not None:
        step = bis.get("resolution") or 1
        within = "" if step <= 1 else f" (within {step} slots of the smallest)"
        text = f"recall fixes it: a window of {window} of the {slots} slots{within} ({where})"
    elif fixed:
        text = f"recall fixes it from some windows only: {describe_search(probes).replace('slots', 'window slots', 1)}"
    else:
        text = f"recall does not fix it within {slots} slots: the largest window, {bis.get('hi', '?')} slots, fails"
    out["text"] = text
    return out


def plan_verdict(o: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Would a budget plan have fixed the answer (the ``plan`` variant, DESIGN.md §6.12)?

    ``fixed`` True, False, or None (it could not run, or ran without a pass test); ``plan`` the
    plan's digest; ``plan_total`` and ``run_total`` the slots of every layer and KV set under the
    plan and in the run; ``text`` in words.
    """
    if o is None:
        return None
    out = {k: o.get(k) for k in ("plan", "plan_total", "run_total", "run_id")}
    if o.get("status") != "complete":
        why = o.get("error") or o.get("status")
        return {**out, "fixed": None, "text": f"the plan variant could not run: {why}"}
    fixed = o.get("correct")
    total, run_total = o.get("plan_total"), o.get("run_total")
    slots = f"{total:,} slots in all, the run {run_total:,}" if total is not None and run_total else "the run's total"
    name = f"plan {o.get('plan')}" if o.get("plan") else "the plan"
    if fixed is None:
        text = f"{name} ran ({slots}) but has no pass test"
    else:
        text = f"{name} {'fixes it' if fixed else 'does not fix it'} at the same total slots ({slots})"
    return {**out, "fixed": fixed, "text": text}


def describe_search(probes: Sequence[Sequence[Any]]) -> str:
    """A non-monotone budget search in words: every count it tried, pass or fail, and the smallest
    count from which every count tried passes (``probes``: ``[[slots, passed], ...]``)."""
    points = sorted((int(s), bool(p)) for s, p in probes)
    tried = ", ".join(f"{s} {'pass' if p else 'fail'}" for s, p in points)
    stable = None
    for s, p in reversed(points):
        if not p:
            break
        stable = s
    tail = f"; every count tried from {stable} slots on passes" if stable is not None else ""
    return f"not monotone in the budget: the search tried (slots) {tried}{tail}"


def causal_verdicts(
    source: Source,
    run_id: str,
    *,
    request: int | None = None,
    thresholds: Thresholds | Mapping[str, Any] | None = None,
    estimates: list[Any] | None = None,
) -> list[CausalVerdict]:
    """The counterfactual verdict of every explained request of ``run_id`` (request order).

    ``estimates``: the run's :func:`.attribute` result when already computed (the fast estimate).
    """
    con = connect(source)
    th = Thresholds.from_mapping(thresholds)
    info = run_info(con, run_id)
    rows = counterfactual_runs(con, run_id).df()
    if request is not None:
        rows = rows[rows["request"] == request]
    if not len(rows):
        return []
    found = estimates if estimates is not None else attribute(con, run_id, thresholds=th)
    by_request = {a.request: a for a in found}
    diff, tol = info.get("max_logit_diff"), th.logit_bound(info.get("logit_tolerance"))
    impl = diff is not None and diff > tol
    searches = culprit_sets(con, run_id) if (rows["kind"] == CULPRITS_KIND).any() else {}
    out = []
    for r in sorted(int(x) for x in rows["request"].unique()):
        outcomes = _outcomes(rows[(rows["request"] == r) & (rows["kind"] != CULPRITS_KIND)])
        est = by_request.get(r)
        dm = next((f.value for f in est.facts if f.kind == "dropped_mass"), None) if est else None
        verdict, reason, decided = decide(
            outcomes, implementation_error=impl, dropped_mass=dm, dropped_mass_high=th.dropped_mass_high
        )
        d = est.decision_step if est else None
        sub = _sub_label(con, run_id, r, d, th) if verdict == "scoring" else None
        plen = _prompt_len(con, run_id, r)
        slots = outcomes.get("pinned", outcomes.get("oracle", {})).get("slots")
        mins, ratios, mono, tried = {}, {}, {}, {}
        for name, kind in (("policy", "policy_budget"), ("oracle", "oracle_budget")):
            mins[name], ratios[name], mono[name], probes = _budget(outcomes.get(kind), plen)
            if probes:
                tried[name] = probes
        out.append(
            CausalVerdict(
                run_id,
                r,
                verdict,
                sub,
                reason,
                {k: o.get("correct") for k, o in outcomes.items() if o.get("status") == "complete"},
                {k: o.get("error") or o.get("status") for k, o in outcomes.items() if o.get("status") != "complete"},
                slots,
                plen,
                mins,
                ratios,
                mono,
                {k: o["run_id"] for k, o in outcomes.items()},
                decided,
                est.verdict if est else None,
                variant_table(outcomes),
                tried,
                searches.get((run_id, r)),
                recall_verdict(outcomes.get(RECALL)),
                plan_verdict(outcomes.get(PLAN)),
            )
        )
    return out


def _prompt_len(con: duckdb.DuckDBPyConnection, run_id: str, request: int) -> int | None:
    row = first_row(
        relation(
            con,
            "SELECT count(*) FILTER (WHERE is_prompt) FROM tokens WHERE run_id = $run AND request = $r",
            run=run_id,
            r=request,
        )
    )
    return int(row[0]) if row and row[0] else None


def budget_distribution(source: Source, *, ratios: list[float] | None = None) -> pd.DataFrame:
    """Share of explained requests that pass at each keep ratio, per policy (and the oracle).

    A request passes at keep ratio ``q`` when its minimal passing budget
    (``policy_budget`` of its parent's policy, ``oracle_budget`` for the
    oracle curve) is at most ``q``; a request whose budget was not found
    (not monotone, or the full cache fails) never passes.

    Returns
    -------
    DataFrame ``curve, keep_ratio, share, requests`` (one curve per parent
    policy, plus ``oracle``), ``keep_ratio`` on a grid of ``ratios``
    (default: every ratio seen, and 0 and 1).
    """
    con = connect(source)
    sql = """
        SELECT c.parent_run, c.request, c.kind, c.status, c.slots, r.prompt_len, p.policy, r.path
        FROM counterfactuals c JOIN runs r USING (run_id) LEFT JOIN runs p ON p.run_id = c.parent_run
        WHERE c.kind IN ($policy_budget, $oracle_budget)
           OR c.kind = $oracle AND NOT EXISTS (
               SELECT 1 FROM counterfactuals b WHERE b.parent_run = c.parent_run AND b.request = c.request
                 AND b.kind = $oracle_budget)
    """
    rows = relation(con, sql, policy_budget=POLICY_BUDGET, oracle_budget=ORACLE_BUDGET, oracle=ORACLE).df()
    need: dict[str, list[float | None]] = {}
    for row in rows.to_dict("records"):
        bis = _bisection(row["path"]) if row["status"] == "complete" else None
        if row["kind"] == ORACLE:
            if bis is None:  # no search noted on it (none ran)
                continue
            row["kind"] = ORACLE_BUDGET
        ratio = None
        if bis is not None and bis.get("min_slots") is not None and row["prompt_len"]:
            ratio = bis["min_slots"] / float(row["prompt_len"])
        curve = ORACLE_CURVE if row["kind"] == ORACLE_BUDGET else str(row["policy"])
        need.setdefault(curve, []).append(ratio)
    seen = sorted({q for v in need.values() for q in v if q is not None})
    grid = sorted(set(ratios) if ratios is not None else {0.0, 1.0, *seen})
    out = []
    for curve, values in sorted(need.items(), key=lambda kv: (kv[0] == ORACLE_CURVE, kv[0])):
        for q in grid:
            share = sum(1 for v in values if v is not None and v <= q + 1e-12) / len(values)
            out.append({"curve": curve, "keep_ratio": q, "share": share, "requests": len(values)})
    return pd.DataFrame(out, columns=["curve", "keep_ratio", "share", "requests"])
