"""Evictions: a filterable table of eviction rows and the histogram of their margins."""

from __future__ import annotations

import streamlit as st

from app import charts, common, data, state

PAGE = "evictions"
_ALL = "all"


def _filters(shape: dict) -> tuple[dict, list[str]]:
    c = st.columns([1, 1, 1, 3, 1.4])
    names: list[str] = []
    filters: dict = {}
    layer = state.select(
        "Layer", [_ALL, *shape["layers"]], "layer", page=PAGE, container=c[0], cast=lambda v: v if v == _ALL else int(v)
    )
    if layer != _ALL:
        filters["layer"] = layer
    head = state.select(
        "KV head",
        [_ALL, *shape["kv_heads"]],
        "head",
        page=PAGE,
        container=c[1],
        cast=lambda v: v if v == _ALL else int(v),
    )
    if head != _ALL:
        filters["kv_head"] = head
    names += ["layer", "head"]
    phase = c[2].selectbox("Phase", [_ALL, "prefill", "decode"], key="w_evictions_phase")
    if phase != _ALL:
        filters["phase"] = phase
    lo, hi = shape["first_step"], shape["last_step"]
    if lo is not None and hi > lo:
        step_min, step_max = c[3].slider("Steps", min_value=lo, max_value=hi, value=(lo, hi), key="w_evictions_steps")
        if step_min > lo:
            filters["step_min"] = step_min
        if step_max < hi:
            filters["step_max"] = step_max
    margin = c[4].number_input(
        "Largest margin",
        min_value=0.0,
        value=None,
        format="%.4g",
        placeholder="no limit",
        key="w_evictions_margin",
        help="Keep evictions whose margin is at most this (near-ties)",
    )
    if margin is not None:
        filters["margin_max"] = float(margin)
    return filters, names


def render() -> None:
    root = state.current_root()
    row = common.run_page(root, "Evictions")
    if row is None:
        state.publish(PAGE)
        return
    run = row["run_id"]
    names: list[str] = []
    with state.guard("the evictions", run):
        shape = data.run_shape(root, run)
        if not row.get("evictions"):
            common.no_data(
                row,
                "evictions",
                "This run logged no evictions (its budget was never exceeded, or the recorder was off).",
            )
            state.publish(PAGE)
            return
        filters, names = _filters(shape)
        key = tuple(sorted(filters.items()))
        with st.spinner("Filtering evictions…"):
            rows, total = data.evictions(root, run, key)
        log = st.toggle("Log-scale margins", value=True, key="w_evictions_log")
        hist = data.margin_histogram(root, run, key, log)
        ties = int(hist.loc[hist["bin"] < 0, "evictions"].sum())
        common.metric_row(
            [
                ("Matching evictions", common.fmt(total), "rows of the evictions view under these filters"),
                (
                    "Exact ties (margin 0)",
                    common.fmt(ties) if log else "–",
                    "the victim scored the same as the lowest surviving token",
                ),
                (
                    "Left the recent window",
                    common.fmt(rows["left_recent"].mean(), ".1%") if len(rows) else "–",
                    f"share among the {len(rows):,} rows shown",
                ),
                (
                    "Prefill / decode",
                    f"{int((rows['phase'] == 'prefill').sum()):,} / {int((rows['phase'] == 'decode').sum()):,}"
                    if len(rows)
                    else "–",
                    f"among the {len(rows):,} rows shown",
                ),
            ]
        )
        if len(hist):
            st.plotly_chart(charts.margin_bars(hist, log=log), key="evictions_hist")
        st.subheader("Eviction rows")
        if total > len(rows):
            st.caption(
                f"Showing the first {len(rows):,} of {total:,} matching rows in step order; narrow the "
                "filters or use the SQL page for the rest."
            )
        shown = [c for c in rows.columns if c != "q_head" or rows["q_head"].notna().any()]
        st.dataframe(
            rows,
            hide_index=True,
            height=420,
            column_order=shown,
            column_config={
                "score": st.column_config.NumberColumn(
                    "score", format="%.4g", help="cumulative score of the victim when evicted"
                ),
                "margin": st.column_config.NumberColumn(
                    "margin", format="%.3g", help="lowest surviving eligible score − victim score"
                ),
                "age": st.column_config.NumberColumn("age", help="step − position"),
            },
        )
    state.publish(PAGE, names)


render()
