"""Small formatting helpers shared by the Markdown and HTML renderers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "num",
    "worst",
    "PROVENANCE",
    "PROBLEM_COLUMNS",
    "SUMMARY",
    "FACT_COLUMNS",
    "EVIDENCE_COLUMNS",
    "VERDICT_TEXT",
    "CAUSAL_TEXT",
    "WHY_COLUMNS",
    "why_rows",
    "why_budgets",
]

PROVENANCE = (
    "run_id",
    "name",
    "status",
    "model",
    "policy",
    "heavy",
    "recent",
    "sink",
    "gqa",
    "seed",
    "backend",
    "prompt_len",
    "new_tokens",
    "requests",
    "source_run",
    "max_logit_diff",
    "created_at",
    "finished_at",
    "command",
    "integrity",
)
PROBLEM_COLUMNS = ("path", "table_name", "reason")
SUMMARY = (
    "evictions",
    "replay_steps",
    "coverage_mean",
    "coverage_p5",
    "coverage_min",
    "kl_mean",
    "kl_max",
    "top1_agreement",
    "near_zero_margin_share",
    "frozen_sets",
    "kv_sets",
    "stale_victims",
    "failures",
)
FACT_COLUMNS = (
    "kind",
    "value",
    "threshold",
    "step",
    "layer",
    "kv_head",
    "q_head",
    "position",
    "score",
    "margin",
    "dropped_mass",
    "note",
)
EVIDENCE_COLUMNS = (
    "label",
    "step",
    "layer",
    "kv_head",
    "q_head",
    "position",
    "text",
    "score",
    "margin",
    "age",
    "left_recent",
    "lag_eviction",
)
VERDICT_TEXT = {
    "budget": "budget: the evidence is larger than the cache: no choice of slots holds it",
    "scoring": "scoring: the evidence was evicted and fits the heavy slots; pinning it should bring the answer back",
    "scoring_lag": "scoring lag: the evidence was evicted right after the recent window, before it was read",
    "not_the_cache": "not the cache: the cache does not explain the failure",
    "implementation_error": "implementation error: the replay does not reproduce the run",
    "unknown": "unknown (run explain): the thresholds cannot tell; counterfactual re-runs decide (h2o-lens explain)",
}


#: the counterfactual verdicts (DESIGN.md §6.10)
CAUSAL_TEXT = {
    "scoring": "scoring: the evidence pinned, or the oracle, at the same slot count brings the answer back",
    "budget": "budget: even the oracle fails with this many slots",
    "not_the_cache": "not the cache: the full cache fails too, or pinning does not help and little mass was dropped",
    "implementation_error": "implementation error: the replay does not reproduce the run",
    "undecided": "undecided: a re-run the rules need could not run",
}
WHY_COLUMNS = ("variant", "slots", "answer", "right", "teacher_agreement", "kl_mean", "run_id", "error")


def why_rows(v: dict[str, Any]) -> list[dict[str, Any]]:
    """The counterfactual table of one explained request, answers cut to one short line."""
    rows = []
    for r in v.get("table") or []:
        ans = r.get("answer")
        rows.append(
            {
                **r,
                "answer": None if ans is None else " ".join(str(ans).split())[:60],
                # the recall variant's window lies inside its slots
                "slots": f"{r['slots']} (window {r['window']})" if r.get("window") is not None else r.get("slots"),
                "right": {True: "yes", False: "no", None: "–"}[r.get("right")],
                # the oracle's top-1 equals the teacher's token at k of n steps, fed the teacher's tokens
                "teacher_agreement": "{}/{}".format(*r["teacher_agreement"]) if r.get("teacher_agreement") else None,
            }
        )
    return rows


def why_budgets(v: dict[str, Any]) -> str:
    """One line: the minimal passing budget of the policy and of the oracle (a search that was not
    monotone: the counts it tried), and whether a recall window or a budget plan fixes the answer."""
    from .causal import describe_search

    def one(name: str) -> str:
        slots, ratio, mono = v["min_slots"].get(name), v["keep_ratio"].get(name), v["monotone"].get(name)
        if mono is False:
            probes = (v.get("budget_probes") or {}).get(name)
            if probes:
                return f"{name}: {describe_search(probes)}"
            return f"{name}: the pass test is not monotone in the budget (no minimal budget stated)"
        if slots is None:
            return f"{name}: –"
        return f"{name}: {slots} slots ({ratio:.0%} of the prompt)" if ratio is not None else f"{name}: {slots} slots"

    line = f"Minimal passing budget ({v['slots']} slots in the run): {one('policy')}; {one('oracle')}"
    recall, plan = v.get("recall"), v.get("plan")
    line += f". Recall window: {recall['text']}" if recall else ""
    return line + (f". Budget plan: {plan['text']}" if plan else "")


def num(value: Any, digits: int = 4) -> str:
    """A cell: floats to ``digits`` significant digits, None as an empty cell."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={num(v)}" for k, v in value.items())
    return str(value)


def worst(rows: Sequence[dict[str, Any]], key: str, n: int = 10, *, high: bool = False) -> list[dict[str, Any]]:
    """The ``n`` rows with the lowest (or highest) non-null ``key``."""
    have = [r for r in rows if r.get(key) is not None]
    return sorted(have, key=lambda r: r[key], reverse=high)[:n]
