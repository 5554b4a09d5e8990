"""Pieces every page shares: the empty-root message, the run header and its warnings."""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from . import data
from .plain import code, md
from .screens import PAGES
from .state import DATA_ERRORS, Root, remembered

__all__ = [
    "PAGES",
    "empty_root",
    "problem_lines",
    "load_runs",
    "current_run",
    "run_page",
    "no_data",
    "fmt",
    "metric_row",
    "show_attributions",
    "show_why",
]


def empty_root(root: Root, problems: pd.DataFrame | None = None) -> None:
    """The friendly message of a missing or empty runs root."""
    path = Path(root.path)
    if not path.is_dir():
        st.warning(f"The runs root {code(path)} does not exist yet.", icon=":material/folder_off:")
    else:
        st.info(f"No runs under {code(path)} yet.", icon=":material/folder_open:")
    st.markdown(  # the runs root comes from the command line, not from the logs
        "Record a run into this folder, then press **Reload runs** in the sidebar:\n\n"
        f"```bash\nh2o-lens record --out {path} --prompt \"...\" --evidence \"label=text\" --replay\n```\n"
        "or open the dashboard on another runs root:\n\n"
        "```bash\nh2o-lens app path/to/runs\n```\n"
        "A synthetic run (no model needed) shows what the pages look like:\n\n"
        f"```bash\npython -c \"from runlog import write_synthetic_run; "
        f"write_synthetic_run('{path}', 'synthetic-demo')\"\n```"
    )
    if problems is not None and len(problems):
        _problem_list("Skipped while reading the root", problems)


def _reason(path: str, reason: str) -> str:
    return reason[len(path) + 2 :] if reason.startswith(f"{path}: ") else reason


def problem_lines(problems: pd.DataFrame, limit: int = 20) -> str:
    """Markdown bullets ``path: reason`` of what the readers found wrong (shown as text)."""
    lines = "\n".join(f"- {code(r.path)}: {md(_reason(r.path, r.reason))}" for r in problems.head(limit).itertuples())
    more = f"\n- … and {len(problems) - limit} more" if len(problems) > limit else ""
    return lines + more


def _problem_list(title: str, problems: pd.DataFrame) -> None:
    st.warning(f"**{title}** ({len(problems)} problem(s)):\n{problem_lines(problems)}", icon=":material/warning:")


def load_runs(root: Root) -> pd.DataFrame | None:
    """The runs table, or None after showing why it cannot be read."""
    try:
        return data.runs(root)
    except DATA_ERRORS as exc:
        st.error(f"Cannot read the runs root {code(root.path)}: {md(exc)}", icon=":material/error:")
        return None


def current_run(runs: pd.DataFrame) -> dict[str, Any] | None:
    """The ``runs_table`` row of the selected run."""
    run_id = remembered("run")
    match = runs[runs["run_id"] == run_id]
    return match.iloc[0].to_dict() if len(match) else None


def _notes(root: Root, row: dict[str, Any]) -> None:
    run_id, status = row["run_id"], row["status"]
    shown = code(run_id)
    if status == "interrupted":
        st.warning(
            f"Run {shown} was **interrupted**: its writer stopped before closing the run, so "
            "its logs end early. Everything it wrote is shown; tables it never reached are empty.",
            icon=":material/warning:",
        )
    elif status == "running":
        st.info(
            f"Run {shown} is still being written; press **Reload runs** for new rows.", icon=":material/hourglass_top:"
        )
    elif status == "failed":
        st.warning(
            f"Run {shown} **failed**: {md(row.get('error') or 'no error message recorded')}", icon=":material/warning:"
        )
    elif status not in ("complete",):
        st.warning(
            f"Run {shown} has status **{md(status)}**: its manifest is missing or unreadable.",
            icon=":material/warning:",
        )
    row["damaged_tables"] = set()
    if row.get("problems"):
        try:
            probs = data.problems(root, run_id)
        except DATA_ERRORS:
            return
        row["damaged_tables"] = set(probs["table_name"].dropna())
        _problem_list(
            f"Run {shown} has damaged or incomplete data (files left out, row counts that differ, or values "
            "no run can have); its numbers may be wrong",
            probs,
        )


def no_data(row: dict[str, Any], table: str, message: str) -> None:
    """Say why a section is empty: the table's files were unreadable, or the run never wrote it."""
    if table in row.get("damaged_tables", ()):
        st.warning(
            f"The `{table}` files of this run could not be read (listed above), so this section is empty.",
            icon=":material/warning:",
        )
    else:
        st.info(message, icon=":material/info:")


def run_page(root: Root, title: str) -> dict[str, Any] | None:
    """Title, selected run and its warnings; None (after a message) when there is no run to show."""
    st.title(title)
    runs = load_runs(root)
    if runs is None:
        return None
    if runs.empty:
        empty_root(root)
        return None
    row = current_run(runs)
    if row is None:
        st.info("Pick a run in the sidebar.")
        return None
    bits = [f"**{md(row['run_id'])}**", md(row.get("policy") or "?")]
    if not _missing(row.get("heavy")):
        bits.append(f"heavy {int(row['heavy'])} + recent {fmt(row.get('recent'), 'd')} slots")
    if row.get("gqa"):
        bits.append(f"GQA {md(row['gqa'])}")
    if row.get("model"):
        bits.append(f"model {md(row['model'])}")
    if row.get("integrity") not in (None, "ok"):
        bits.append(":red[**damaged or incomplete data**]")
    st.caption(" · ".join(bits))
    _notes(root, row)
    return row


def run_colours(policies: list[Any]) -> list[str] | None:
    """Each run's policy colour (from the policy registry, or a kvpress press's), when the policies are known and
    distinct; None otherwise (runs of one policy are told apart by the palette)."""
    colours = [data.policy_colour(p) for p in policies]
    if len(set(policies)) < len(policies) or None in colours:
        return None
    return colours


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA


def fmt(value: Any, spec: str = ".4g", none: str = "–") -> str:
    """A number for a metric card; missing values as a dash."""
    if _missing(value):
        return none
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return f"{value:,}"
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return str(value)


def metric_row(items: list[tuple[str, str, str | None]]) -> None:
    """Metric cards in one row: (label, value, help)."""
    cols = st.columns(len(items))
    for col, (label, value, help_text) in zip(cols, items):
        col.metric(label, value, help=help_text, border=True)


_VERDICTS = {
    "budget": ("Budget", "red", "the evidence is larger than the cache: no choice of slots holds it"),
    "scoring": (
        "Scoring",
        "orange",
        "the evidence was evicted and fits the heavy slots: pinning it should bring the answer back",
    ),
    "scoring_lag": (
        "Scoring lag",
        "orange",
        "the evidence was evicted right after leaving the recent window, before anything attended to it",
    ),
    "not_the_cache": ("Not the cache", "blue", "the cache does not explain the failure"),
    "implementation_error": ("Implementation error", "violet", "the replay does not reproduce the run"),
    "unknown": (
        "Unknown (run explain)",
        "gray",
        "the thresholds cannot tell; counterfactual re-runs decide (h2o-lens explain)",
    ),
}


_FACT_COLUMNS = (
    "kind",
    "note",
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
)


def show_attributions(
    attributions: list[dict[str, Any]], *, judged: bool = True, limit: int = 10, estimate: bool = False
) -> None:
    """One bordered card per failed request: verdict, why, the facts and the SQL behind them.

    ``judged`` is false when the run has neither a teacher replay nor answer-checker verdicts,
    so no request could be found failing; ``estimate`` labels each verdict as the threshold
    estimate (the causal verdict comes from re-runs, DESIGN.md §6.10).
    """
    if not attributions and not judged:
        st.info(
            "Nothing to attribute: the run has no answer-checker verdict and no teacher replay, so no "
            "request can be judged.",
            icon=":material/info:",
        )
        return
    if not attributions:
        st.success(
            "No request failed (answer checker, top-1 agreement and KL within the thresholds): "
            "there is nothing to attribute.",
            icon=":material/check_circle:",
        )
        return
    for a in attributions[:limit]:
        name, color, meaning = _VERDICTS.get(a["verdict"], (a["verdict"], "gray", ""))
        with st.container(border=True):
            label = f"{name} (estimate)" if estimate else name
            st.markdown(f"#### Request {a['request']}: :{color}-badge[{label}]")
            st.markdown(f"**Why:** {md(a['summary'])}.  \n*{name}*: {meaning}.")
            step = a.get("decision_step")
            st.caption(
                f"Failed by: {', '.join(a['failed_by']) or '–'} · decision step: {step if step is not None else '–'}"
            )
            facts = pd.DataFrame(a["facts"])
            if len(facts):
                order = [c for c in _FACT_COLUMNS if c in facts.columns]
                st.dataframe(
                    facts,
                    hide_index=True,
                    height=min(400, 38 + 35 * len(facts)),
                    column_order=order,
                    column_config={
                        "kind": st.column_config.TextColumn("fact", pinned=True),
                        "note": st.column_config.TextColumn("note", width="medium"),
                        "value": st.column_config.NumberColumn("value", format="%.4g"),
                        "threshold": st.column_config.NumberColumn("threshold", format="%.4g"),
                    },
                )
            if a.get("evicted_evidence"):
                with st.expander(f"Evidence evictions ({len(a['evicted_evidence'])} shown)"):
                    st.dataframe(pd.DataFrame(a["evicted_evidence"]), hide_index=True)
            with st.expander("SQL of the evidence evictions (paste it into the SQL page)"):
                st.code(a["sql"], language="sql")
    if len(attributions) > limit:
        st.caption(f"{len(attributions) - limit} more failed request(s): see the Report page downloads.")


_CAUSAL = {
    "scoring": ("Scoring", "orange"),
    "budget": ("Budget", "red"),
    "not_the_cache": ("Not the cache", "blue"),
    "implementation_error": ("Implementation error", "violet"),
    "undecided": ("Undecided", "gray"),
}


def show_why(why: list[dict[str, Any]]) -> None:
    """One card per explained request: the counterfactual verdict, its re-runs (linked) and budgets."""
    from analyses import CAUSAL_TEXT, WHY_COLUMNS, why_budgets, why_rows

    if not why:
        st.caption(
            "No counterfactual re-runs yet: `h2o-lens explain RUN --root ROOT` re-runs each failed request "
            "with the full cache, the evidence pinned and the oracle, and finds the budget it needed."
        )
        return
    for v in why:
        name, color = _CAUSAL.get(v["verdict"], (v["verdict"], "gray"))
        sub = f" :gray-badge[{v['sub_label']}]" if v.get("sub_label") else ""
        with st.container(border=True):
            st.markdown(f"#### Request {v['request']}: :{color}-badge[{name}]{sub}")
            st.markdown(f"**Why:** {md(v['reason'])}.  \n*{md(CAUSAL_TEXT.get(v['verdict'], ''))}*")
            if v.get("estimate") is not None and v.get("agrees") is False:
                st.warning(
                    f"The fast estimate (threshold rules, no re-run) says {md(v['estimate'])}.",
                    icon=":material/compare_arrows:",
                )
            rows = pd.DataFrame(why_rows(v), columns=list(WHY_COLUMNS))
            rows["open"] = [f"./overview?run={r}" if r else None for r in rows["run_id"]]
            st.dataframe(
                rows,
                hide_index=True,
                column_config={
                    "kl_mean": st.column_config.NumberColumn("KL", format="%.4g"),
                    "right": st.column_config.TextColumn("right?"),
                    "open": st.column_config.LinkColumn("open", display_text="open run"),
                },
            )
            st.caption(f"{md(why_budgets(v))} · decided by: {md(', '.join(v.get('decided_by') or []) or '–')}")
