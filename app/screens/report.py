"""Report: the gate verdict, the attribution and downloads of the HTML, Markdown and JSON reports."""

from __future__ import annotations

import functools

import pandas as pd
import streamlit as st

import analyses
from app import charts, common, data, state
from app.plain import code

PAGE = "report"
_FORMATS = (
    ("html", "HTML", "text/html", "self-contained, opens offline"),
    ("md", "Markdown", "text/markdown", "for a pull request or a notebook"),
    ("json", "JSON", "application/json", "versioned, validates against report.schema.json"),
)


def _build(root: str, run: str, fmt: str) -> str:
    """Built only when its download button is pressed (the HTML report inlines plotly.js)."""
    return analyses.build_report(root, run, fmt=fmt)


def render() -> None:
    root = state.current_root()
    row = common.run_page(root, "Report")
    if row is None:
        state.publish(PAGE)
        return
    run = row["run_id"]
    st.subheader("Download")
    cols = st.columns(len(_FORMATS))
    for col, (fmt, label, mime, note) in zip(cols, _FORMATS):
        col.download_button(
            f"{label} report",
            data=functools.partial(_build, root.path, run, fmt),
            file_name=f"{run}.{fmt}",
            mime=mime,
            icon=":material/download:",
            key=f"report_{fmt}",
            help=f"The report of {code(run)}, {note}",
            on_click="ignore",
        )
    with state.guard("the report", run):
        with st.spinner("Running every analysis of the report…"):
            report = data.report_data(root, run)
        verdict = report["verdict"]
        st.subheader("Gate")
        if verdict["pass"]:
            st.success("The run passes every check of the gate.", icon=":material/check_circle:")
        else:
            failed = [c["name"] for c in verdict["checks"] if c["pass"] is False]
            st.error(f"The run fails the gate: {', '.join(failed)}.", icon=":material/cancel:")
        checks = pd.DataFrame(verdict["checks"])
        st.dataframe(
            checks,
            hide_index=True,
            column_config={
                "value": st.column_config.NumberColumn("value", format="%.4g"),
                "threshold": st.column_config.NumberColumn("threshold", format="%.4g"),
            },
        )
        s = report["summary"]
        common.metric_row(
            [
                ("Coverage P5", common.fmt(s.get("coverage_p5")), "5th percentile of coverage over replay rows"),
                ("KL mean", common.fmt(s.get("kl_mean")), "nats"),
                (
                    "Near-tie evictions",
                    common.fmt(s.get("near_zero_margin_share"), ".1%"),
                    "share of evictions whose margin is near 0",
                ),
                ("Frozen KV sets", f"{s.get('frozen_sets', 0)} / {s.get('kv_sets', 0)}", None),
                ("Failed requests", common.fmt(s.get("failures")), None),
            ]
        )
        st.subheader("Attribution: the threshold estimate")
        st.caption(
            "A fast reading of the logged measures against thresholds, without re-running anything. "
            "Where the Why section below has re-runs, its verdict is the cause."
        )
        common.show_attributions(
            report["failures"], judged=bool(row.get("replay_steps") or row.get("checked")), estimate=True
        )
        st.subheader("Why: counterfactual re-runs")
        common.show_why(report.get("why") or [])
        dist = data.budget_distribution(root)
        if dist["curve"].nunique() and dist.groupby("curve")["requests"].max().max() > 1:
            st.plotly_chart(charts.budget_curves(dist), key="budget_curves")
    state.publish(PAGE)


render()
