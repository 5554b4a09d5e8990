"""Heads: coverage and dropped mass per layer and query head; GQA sum-vs-max kept-set overlap."""

from __future__ import annotations

import streamlit as st

from app import charts, common, data, plan_view, state
from app.plain import code

PAGE = "heads"


def _coverage_maps(cov) -> None:
    shared = st.toggle(
        "One colour scale for the three coverage maps",
        value=False,
        key="w_heads_shared",
        help="Off: each map spans its own range, so weak heads stand out. On: the maps compare directly",
    )
    low = float(min(cov["p1"].min(), cov["mean"].min()))
    scale = dict(
        x="q_head",
        y="layer",
        x_title="query head",
        colorscale="Viridis",
        **({"zmin": low, "zmax": 1.0} if shared else {}),
    )
    c1, c2 = st.columns(2)
    c1.plotly_chart(
        charts.heatmap(cov, z="mean", title="Coverage, mean over steps", colorbar="coverage", **scale), key="heads_mean"
    )
    dropped = cov.assign(dropped=1.0 - cov["mean"])
    c2.plotly_chart(
        charts.heatmap(
            dropped,
            x="q_head",
            y="layer",
            z="dropped",
            x_title="query head",
            title="Dropped mass, mean over steps",
            colorbar="dropped mass",
            zmin=0.0,
            colorscale="Reds",
        ),
        key="heads_dropped",
    )
    c3, c4 = st.columns(2)
    c3.plotly_chart(
        charts.heatmap(cov, z="p1", title="Coverage P1: the worst 1% of steps", colorbar="coverage", **scale),
        key="heads_p1",
    )
    c4.plotly_chart(
        charts.heatmap(cov, z="p5", title="Coverage P5: the worst 5% of steps", colorbar="coverage", **scale),
        key="heads_p5",
    )
    st.caption(
        "Coverage = 1 − dropped mass: the share of the full-cache teacher's attention that falls "
        "on positions the cache still holds; darker cells are heads that lost more."
    )


def _one_head(root: state.Root, run: str, cov) -> list[str]:
    st.subheader("One head over steps")
    layers = sorted(int(v) for v in cov["layer"].unique())
    heads = sorted(int(v) for v in cov["q_head"].unique())
    c1, c2, c3 = st.columns([1, 1, 3])
    layer = state.select("Layer", layers, "layer", page=PAGE, cast=int, container=c1)
    head = state.select("Query head", heads, "head", page=PAGE, cast=int, container=c2)
    stats = cov[(cov["layer"] == layer) & (cov["q_head"] == head)]
    if len(stats):
        s = stats.iloc[0]
        c3.markdown(
            f"Layer {layer}, query head {head} (KV head {int(s['kv_head'])}): coverage mean "
            f"**{s['mean']:.4f}**, P5 **{s['p5']:.4f}**, P1 **{s['p1']:.4f}**, min **{s['min']:.4f}** "
            f"over {int(s['n']):,} steps."
        )
    series = data.head_series(root, run, layer, head)
    st.plotly_chart(
        charts.lines(
            series,
            x="step",
            ys=[("dropped_mass", "dropped mass")],
            title=f"Dropped mass of layer {layer}, query head {head}",
            y_title="share of attention",
            color_by="request" if series["request"].nunique() > 1 else None,
        ),
        key="heads_series",
    )
    return ["layer", "head"]


def _gqa(root: state.Root, run: str) -> None:
    st.subheader("GQA aggregation: sum vs max kept sets")
    pair = data.gqa_pair(root, run)
    if pair is None:
        st.info(
            "No paired run with the other GQA aggregation. Record the same tokens with `gqa='max'` "
            "(or `'sum'`) and link them through `runs.source_run` to compare the kept sets.",
            icon=":material/info:",
        )
        return
    sum_run, max_run = pair
    with st.spinner("Rebuilding kept sets of both runs…"):
        by_set, by_step = data.gqa_overlap(root, sum_run, max_run)
    st.caption(
        f"Jaccard overlap of the kept sets of {code(sum_run)} (sum) and {code(max_run)} (max) on the same "
        "tokens: 1 = identical sets."
    )
    c1, c2 = st.columns(2)
    c1.plotly_chart(
        charts.heatmap(
            by_set,
            x="kv_head",
            y="layer",
            z="mean",
            x_title="KV head",
            title="Mean Jaccard over steps",
            colorbar="Jaccard",
            zmin=0.0,
            zmax=1.0,
            colorscale="Blues",
        ),
        key="heads_gqa_map",
    )
    c2.plotly_chart(
        charts.lines(
            by_step,
            x="step",
            ys=[("mean", "mean over KV sets"), ("min", "worst KV set")],
            title="Jaccard over steps",
            y_title="Jaccard",
            y_range=(0, 1.02),
        ),
        key="heads_gqa_series",
    )


def render() -> None:
    root = state.current_root()
    row = common.run_page(root, "Heads")
    if row is None:
        state.publish(PAGE)
        return
    run = row["run_id"]
    names: list[str] = []
    with state.guard("the head coverage", run):
        with st.spinner("Aggregating coverage per head…"):
            cov = data.head_coverage(root, run)
        if cov.empty:
            common.no_data(
                row,
                "replay",
                "This run has no teacher replay, so coverage per head is unknown. "
                f"Replay it against a full-cache teacher: `h2o-lens replay {run}`.",
            )
        else:
            _coverage_maps(cov)
            names = _one_head(root, run, cov)
    with state.guard("the budget per layer and KV set", run):
        plan_view.render(root, run)
    with state.guard("the GQA overlap", run):
        _gqa(root, run)
    state.publish(PAGE, names)


render()
