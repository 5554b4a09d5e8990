"""The Markdown report: a readable summary of :func:`analyses.report.report_data`.

Text that comes from the logs (run names, evidence labels, token text,
errors, manifest fields) is shown as text: HTML is written as entities and
Markdown syntax is escaped, so a label such as ``<script>`` or
``![x](http://...)`` can neither run nor make a viewer fetch anything.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ._format import (
    CAUSAL_TEXT,
    EVIDENCE_COLUMNS,
    FACT_COLUMNS,
    PROBLEM_COLUMNS,
    PROVENANCE,
    SUMMARY,
    VERDICT_TEXT,
    WHY_COLUMNS,
    num,
    why_budgets,
    why_rows,
    worst,
)
from .guard import guard_cost_line

__all__ = ["render_markdown", "text"]

_SYNTAX = re.compile(r"([\\`*_{}\[\]()#+!|~])")


def text(value: Any) -> str:
    """``value`` as Markdown that renders as the same characters on one line (numbers as :func:`num`)."""
    if value is None or isinstance(value, (bool, int, float)):
        return num(value)
    raw = num(value) if not isinstance(value, str) else value
    raw = raw.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _SYNTAX.sub(r"\\\1", " ".join(raw.splitlines()))


def _cell(value: Any) -> str:
    return text(value)


def _fence(code: str) -> str:
    """A fenced block holding ``code`` verbatim (the fence is longer than any backtick run inside)."""
    longest = max((len(m) for m in re.findall(r"`+", code)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}sql\n{code}\n{fence}"


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    if not rows:
        return "_none_\n"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _pairs(mapping: dict[str, Any], keys: Sequence[str]) -> str:
    return table(
        [{"field": k, "value": mapping.get(k)} for k in keys if mapping.get(k) is not None], ("field", "value")
    )


def _where(data: dict[str, Any]) -> list[str]:
    cov = data["coverage"]
    out = [
        "## Where it goes wrong\n",
        "Coverage is 1 − dropped mass (teacher attention on evicted positions), per step and query "
        "head. Lowest P5 first:\n",
        table(worst(cov["heads"], "p5"), ("layer", "q_head", "kv_head", "n", "mean", "min", "p1", "p5")),
        "\nBy span of the query token:\n",
        table(cov["spans"], ("span", "n", "mean", "min", "p1", "p5")),
        "\nSteps with the highest dropped mass (mean over heads):\n",
        table(
            worst(cov["dropped_mass_series"], "mean", high=True),
            ("request", "step", "mean", "p95", "max", "worst_layer", "worst_q_head"),
        ),
        "\nTeacher-forced divergence per request:\n",
        table(
            data["divergence"]["requests"],
            ("request", "steps", "kl_mean", "kl_max", "top1_agreement", "first_divergence_step", "kl_at_divergence"),
        ),
    ]
    free = data["divergence"]["free_generation"]
    if free:
        out += [
            "\nFree generation against the paired run:\n",
            table(free, ("request", "other_run", "compared", "agreement", "first_diff_position", "prompt_mismatches")),
        ]
    return out


def _dynamics(data: dict[str, Any]) -> list[str]:
    dyn = data["dynamics"]
    fr, st = dyn["freezing"], dyn["stale"]
    frozen = [r for r in fr["onsets"] if r.get("frozen")]
    out = [
        "\n## Cache dynamics\n",
        f"Freezing (windows of {fr['window']} steps): {fr['frozen']} of {fr['sets']} KV sets froze.\n",
        table(
            sorted(frozen, key=lambda r: r["onset_step"])[:15],
            (
                "request",
                "layer",
                "kv_head",
                "q_head",
                "onset_step",
                "last_promotion_rate",
                "last_threshold",
                "last_heavy_age",
            ),
        ),
        f"\nMargins near a tie (relative {dyn['margins']['threshold']:g}): share "
        f"{num(dyn['margins']['near_zero_share'])}. Most sensitive KV sets:\n",
        table(
            worst(dyn["margins"]["heads"], "near_zero_share", 8, high=True),
            ("layer", "kv_head", "q_head", "evictions", "near_zero", "near_zero_share", "margin_median"),
        ),
        f"\nStale heavy hitters: {st['stale_victims']} of {st['heavy_evictions']} heavy-slot evictions "
        "had gained almost no attention over the window before they went.\n",
        table(
            worst(st["holders"], "stale_holder_share", 8, high=True),
            ("layer", "kv_head", "q_head", "steps", "stale_holder_share", "first_stale_step"),
        ),
    ]
    oracle = data["oracle"]
    out.append("\n## Oracle agreement\n")
    out.append(
        table(
            oracle["heads"][:16], ("layer", "kv_head", "q_head", "evictions", "agreement", "regret", "rank_corr_future")
        )
        if oracle["available"]
        else f"Not available: {text(oracle['reason'])}\n"
    )
    out += guard_section(data)
    return out


def guard_section(data: dict[str, Any]) -> list[str]:
    """The guard's requests and actions (DESIGN.md §18.5), when the run has them."""
    guard = data.get("guard") or {}
    if not guard.get("requests"):
        return []
    return [
        "\n## Guard\n",
        "The online risk per request and the actions it took (slots per layer and KV set):\n",
        table(guard["requests"], ("request", "steps", "max_risk", "peak_step", "mean_risk", "actions")),
        "\n",
        table(guard["actions"], ("request", "step", "risk", "action", "slots_before", "slots_after", "evicted"))
        if guard["actions"]
        else "No action was taken.\n",
        *([f"\n{text(guard_cost_line(guard['cost']))}\n"] if guard.get("cost") else []),
    ]


def _failures(data: dict[str, Any]) -> list[str]:
    out = ["\n## Failures\n"]
    if not data["failures"]:
        return out + ["No request failed.\n"]
    for f in data["failures"]:
        out += [
            f"### {f['rank']}. request {f['request']}: **{text(f['verdict'])}**\n",
            f"{text(VERDICT_TEXT[f['verdict']])}. {text(f['summary'])}. Failed by: "
            f"{text(', '.join(f['failed_by']))}; decision step {num(f['decision_step'])}.\n",
            table(f["facts"], FACT_COLUMNS),
            "\nEvicted evidence (first 10 rows):\n",
            table(f["evicted_evidence"][:10], EVIDENCE_COLUMNS),
            "\n" + _fence(f["sql"]) + "\n",
        ]
    return out


def culprit_lines(v: dict[str, Any]) -> list[str]:
    """The request's culprit tokens (DESIGN.md §19), one bullet each, when a search ran."""
    from .culprits import culprit_summary, why_left

    line = culprit_summary(v.get("culprits"))
    if line is None:
        return []
    out = [f"Culprit tokens: {text(line)}.\n"]
    out += [f"- `{c['position']}` {text(repr(c.get('text')))}: {text(why_left(c))}" for c in v["culprits"]["culprits"]]
    return out + ([""] if len(out) > 1 else [])


def why_section(data: dict[str, Any]) -> list[str]:
    """The counterfactual verdicts (``h2o-lens explain``), when the run has any."""
    why = data.get("why") or []
    if not why:
        return []
    out = ["\n## Why: counterfactual re-runs\n"]
    for v in why:
        label = v["verdict"] + (f" ({v['sub_label']})" if v.get("sub_label") else "")
        out += [
            f"### request {v['request']}: **{text(label)}**\n",
            f"{text(CAUSAL_TEXT.get(v['verdict'], v['verdict']))}. {text(v['reason'])}.\n",
        ]
        if v.get("estimate") is not None and v.get("agrees") is False:
            out.append(f"The fast estimate (threshold rules, no re-run) says **{text(v['estimate'])}**.\n")
        out += [
            table(why_rows(v), WHY_COLUMNS),
            "\n" + text(why_budgets(v)) + ".\n",
            f"Decided by: {text(', '.join(v.get('decided_by') or []) or '–')}.\n",
        ]
        out += culprit_lines(v)
    dist = data.get("budget_distribution") or []
    if dist:
        out += [
            "\n### Minimal passing budgets across the root\n",
            "Share of explained requests that pass at each keep ratio (the oracle bounds every scoring policy):\n",
            table(dist, ("curve", "keep_ratio", "share", "requests")),
        ]
    return out


LIFECYCLE_COLUMNS = ("request", "ok", "steps", "first_bad_step", "layer", "kv_set", "logged_only", "reference_only")


def lifecycle_section(data: dict[str, Any]) -> list[str]:
    """The state lifecycle check: pass/fail and the first bad step of each request (DESIGN.md §15.1)."""
    lc = data.get("lifecycle") or {}
    out = ["\n## State lifecycle\n"]
    if lc.get("state_events"):
        out.append("State events logged: " + ", ".join(f"{k} {v}" for k, v in lc["state_events"].items()) + "\n")
    if not lc.get("checked"):
        return out + ["Not checked: run `h2o-lens check RUN` to compare the logged kept sets with the reference.\n"]
    status = "PASS" if lc["ok"] else f"FAIL ({lc['failed']} request(s))"
    out.append(
        f"**{status}**: logged kept sets against the same tokens run alone on the plain runtime "
        f"(near-tie tolerance {text(lc.get('tolerance'))}, {lc.get('tie_flips', 0)} tie flip(s) tolerated).\n"
    )
    return out + [table(lc["requests"], LIFECYCLE_COLUMNS), ""]


def _integrity(run: dict[str, Any]) -> list[str]:
    """A warning and the problems when the run's files are damaged or incomplete."""
    if run.get("integrity") in (None, "ok") and not run.get("problems"):
        return []
    return [
        f"> **Warning: this run's data is damaged or incomplete** ({text(run.get('integrity'))}). "
        "The numbers below come from the files that could be read and may be wrong; the gate "
        "fails on it.\n",
        table(run.get("problems") or [], PROBLEM_COLUMNS),
        "",
    ]


def _failed_checks(verdict: dict[str, Any]) -> list[str]:
    """The line naming the failed gate checks (none when the gate passes)."""
    failed = [c["name"] for c in verdict["checks"] if c.get("pass") is False]
    return [f"Failed checks: {text(', '.join(failed))}\n"] if failed else []


def render_markdown(data: dict[str, Any]) -> str:
    """Markdown text of a report dict."""
    run, verdict = data["run"], data["verdict"]
    out = [
        f"# H2O Lens report: {text(run['run_id'])}\n",
        f"**Verdict: {verdict['status'].upper()}** (report schema {data['report_schema_version']}, "
        f"generated {text(data['generated_at'])})\n",
        *_integrity(run),
        *_failed_checks(verdict),
        table(verdict["checks"], ("name", "value", "op", "threshold", "status", "reason")),
        "\n## Run\n",
        _pairs(run, PROVENANCE),
        "\n## Summary\n",
        _pairs(data["summary"], SUMMARY),
        "\nVerdicts: " + ", ".join(f"{k} {v}" for k, v in data["summary"]["verdicts"].items()) + "\n\n",
    ]
    out += _where(data)
    out += [
        "\n## Evidence\n",
        "Share of KV sets still holding each span at the answer step (any token / every token):\n",
        table(
            data["evidence"],
            (
                "request",
                "label",
                "at_step",
                "sets",
                "held_any_share",
                "held_all_share",
                "first_deletion_step",
                "last_deletion_step",
            ),
        ),
    ]
    out += _dynamics(data)
    out += _failures(data)
    out += why_section(data)
    out += lifecycle_section(data)
    return "\n".join(out)
