"""Dynamics: promotion rate, heavy threshold, heavy-slot age and cache freezing per KV set."""

from __future__ import annotations

import math

import pandas as pd
import streamlit as st

from app import charts, common, data, state

PAGE = "dynamics"


def _head_column(df: pd.DataFrame) -> tuple[str, str]:
    """Sets are per query head for ``gqa='none'`` runs, else per KV head."""
    return ("q_head", "query head") if df["q_head"].notna().any() else ("kv_head", "KV head")


def _maps(onset: pd.DataFrame, rate: pd.DataFrame, head: str, head_title: str) -> None:
    frozen = int(onset["frozen"].sum())
    common.metric_row(
        [
            (
                "Frozen KV sets",
                f"{frozen} / {len(onset)}",
                "sets whose promotion rate stayed near 0 while the threshold rose and heavy slots aged",
            ),
            ("Earliest freeze onset", common.fmt(onset["onset_step"].min()), "step"),
            (
                "Mean late promotion rate",
                common.fmt(onset["last_promotion_rate"].mean(), ".1%"),
                "promotion rate in each set's last window",
            ),
        ]
    )
    c1, c2 = st.columns(2)
    c1.plotly_chart(
        charts.heatmap(
            onset,
            x=head,
            y="layer",
            z="onset_step",
            x_title=head_title,
            title="Freeze onset step (blank: never froze)",
            colorbar="step",
            colorscale="YlOrRd",
            reverse=True,
            fmt=".0f",
        ),
        key="dyn_onset",
    )
    c2.plotly_chart(
        charts.heatmap(
            rate,
            x=head,
            y="layer",
            z="mean",
            x_title=head_title,
            title="Promotion rate, mean over windows",
            colorbar="rate",
            zmin=0.0,
            zmax=1.0,
            colorscale="Greens",
            fmt=".2f",
        ),
        key="dyn_rate",
    )


def render() -> None:
    root = state.current_root()
    row = common.run_page(root, "Dynamics")
    if row is None:
        state.publish(PAGE)
        return
    run = row["run_id"]
    names: list[str] = []
    with state.guard("the eviction dynamics", run):
        shape = data.run_shape(root, run)
        if not shape["layers"] or shape["first_step"] is None:
            common.no_data(row, "steps", "This run logged no `steps` rows, so promotion and freezing are unknown.")
            state.publish(PAGE)
            return
        span = shape["last_step"] - shape["first_step"] + 1
        top = st.columns([3, 1], gap="large")
        window = top[0].slider(
            "Window (steps)",
            1,
            max(2, span // 2),
            max(4, math.ceil(span / 32)),
            key="w_dynamics_window",
            help="Promotion rate and freezing are measured over windows of this many steps",
        )
        with st.spinner("Measuring promotion and freezing…"):
            onset, rate, series = data.freezing(root, run, window)
        if onset.empty:
            st.info("No window holds a step of this run.")
            state.publish(PAGE)
            return
        requests = sorted(int(r) for r in onset["request"].unique())
        request = requests[0]
        if len(requests) > 1:
            request = state.select("Request", requests, "request", page=PAGE, cast=int, container=top[1])
            names.append("request")
        onset, rate, series = (df[df["request"] == request] for df in (onset, rate, series))
        head_col, head_title = _head_column(series)
        _maps(onset, rate, head_col, head_title)
        st.subheader("One KV set over the run")
        c1, c2, c3 = st.columns([1, 1, 3], vertical_alignment="bottom")
        layer = state.select("Layer", shape["layers"], "layer", page=PAGE, cast=int, container=c1)
        heads = shape["q_heads"] if head_col == "q_head" else shape["kv_heads"]
        head = state.select(head_title[0].upper() + head_title[1:], heads, "head", page=PAGE, cast=int, container=c2)
        names += ["layer", "head"]
        one = series[(series["layer"] == layer) & (series[head_col] == head)]
        set_onset = onset.loc[(onset["layer"] == layer) & (onset[head_col] == head), "onset_step"]
        step = None if set_onset.empty or pd.isna(set_onset.iloc[0]) else int(set_onset.iloc[0])
        c3.markdown(
            f"Layer {layer}, {head_title} {head}: "
            + (f"frozen from step **{step}**." if step is not None else "**never froze** for good.")
        )
        st.plotly_chart(charts.dynamics_figure(one, step), key="dyn_series")
        st.caption(
            "A window is frozen when its promotion rate is ≤ 5%, its threshold rose over the previous "
            "window and the heavy slots aged by ≥ 0.5 per step; the onset is the first window from "
            "which every window to the end is frozen."
        )
    state.publish(PAGE, names)


render()
