"""Compare: two runs on the same tokens side by side (curves, kept-set overlap, free generation)."""

from __future__ import annotations

import streamlit as st

from app import charts, common, data, state
from app.plain import code, md

PAGE = "compare"
_METRICS = (
    ("policy", "policy", None),
    ("heavy", "heavy", None),
    ("recent", "recent", None),
    ("gqa", "GQA", None),
    ("kl_mean", "KL mean", ".4g"),
    ("top1_agreement", "top-1", ".1%"),
    ("dropped_mass_mean", "dropped mass", ".4g"),
    ("evictions", "evictions", None),
)


def _default_other(runs, row) -> str | None:
    others = runs[runs["run_id"] != row["run_id"]]
    linked = others[(others["run_id"] == row.get("source_run")) | (others["source_run"] == row["run_id"])]
    pick = linked if len(linked) else others
    return pick["run_id"].iloc[0] if len(pick) else None


def _side_by_side(a: dict, b: dict) -> None:
    cols = st.columns(2)
    for col, r in zip(cols, (a, b)):
        with col.container(border=True):
            st.markdown(
                f"**{code(r['run_id'])}** · {md(r['status'])}"
                + ("" if r.get("integrity") in (None, "ok") else " · :red[damaged or incomplete data]")
            )
            st.markdown(
                " · ".join(
                    f"{label} **{md(common.fmt(r.get(k), spec) if spec else common.fmt(r.get(k)))}**"
                    for k, label, spec in _METRICS
                )
            )


def _set_charts(by_set, by_step, *, value: str, key: str) -> None:
    """A KV-set statistic over steps (mean and worst set) beside its mean per (layer, KV head)."""
    c1, c2 = st.columns(2)
    c1.plotly_chart(
        charts.lines(
            by_step,
            x="step",
            ys=[("mean", "mean over KV sets"), ("min", "worst KV set")],
            title=f"Kept-set {value} over steps",
            y_title=value,
            y_range=(0, 1.02),
        ),
        key=key,
    )
    c2.plotly_chart(
        charts.heatmap(
            by_set,
            x="kv_head",
            y="layer",
            z="mean",
            x_title="KV head",
            title=f"Mean {value} per KV set",
            colorbar=value,
            zmin=0.0,
            zmax=1.0,
            colorscale="Blues",
        ),
        key=f"{key}_map",
    )


def _kept_sets(root, a: dict, b: dict) -> None:
    """The two runs' kept sets: their Jaccard overlap, or, when one of them keeps one set per query
    head (``gqa='none'``), how much of that run's per-query-head union the other's shared sets hold."""
    per_head = [r["run_id"] for r in (a, b) if r.get("gqa") == "none"]
    if len(per_head) == 2:
        st.subheader("Kept-set overlap")
        st.info(
            "Both runs keep one set per query head (GQA none): compare either of them with a run of shared "
            "KV sets (GQA sum or max) to see how much of its per-query-head union a shared set holds.",
            icon=":material/info:",
        )
        return
    if per_head:
        none_run = per_head[0]
        shared = b["run_id"] if none_run == a["run_id"] else a["run_id"]
        st.subheader("Kept-set union bound")
        with st.spinner("Rebuilding the kept sets of both runs…"):
            by_set, by_step = data.union_bound(root, shared, none_run)
        if by_step.empty:
            st.info("The runs share no logged steps, so their kept sets cannot be compared.")
            return
        st.caption(
            f"{code(none_run)} keeps one set per query head (GQA none). The union of a KV head's query-head sets "
            "is the most any shared set of that KV head could usefully keep: the upper bound of GQA "
            f"aggregation. Recall: the share of that union the shared set of {code(shared)} holds at each step "
            "(1 = all of it)."
        )
        st.metric("Mean recall of the per-query-head union", common.fmt(float(by_step["mean"].mean()), ".1%"))
        _set_charts(by_set, by_step, value="recall", key="compare_union")
        return
    st.subheader("Kept-set overlap")
    with st.spinner("Rebuilding the kept sets of both runs…"):
        by_set, by_step = data.kept_overlap(root, a["run_id"], b["run_id"])
    if by_step.empty:
        st.info("The runs share no logged steps, so their kept sets cannot be compared.")
        return
    st.caption(
        "Jaccard of the two runs' candidate sets at each step, per layer and KV head (1 = the same positions kept)."
    )
    _set_charts(by_set, by_step, value="Jaccard", key="compare_jaccard")


def render() -> None:
    root = state.current_root()
    row = common.run_page(root, "Compare")
    if row is None:
        state.publish(PAGE)
        return
    run = row["run_id"]
    runs = data.runs(root)
    default = _default_other(runs, row)
    if default is None:
        st.info(
            "Only one run under this root: record another (e.g. `--with-full` or `--teacher-force RUN`) to compare.",
            icon=":material/info:",
        )
        state.publish(PAGE)
        return
    options = [r for r in runs["run_id"] if r != run]
    other = state.select(
        "Compare with",
        options,
        "other",
        page=PAGE,
        default=default,
        help="Runs linked through runs.source_run come first by default",
    )
    b = runs[runs["run_id"] == other].iloc[0].to_dict()
    _side_by_side(row, b)
    free = None
    with state.guard("the token check", run):
        free = data.free_generation(root, run, other)
        if free is not None and len(free):
            mism = int(free["prompt_mismatches"].sum())
            if mism:
                st.warning(
                    f"The two runs do not share their prompt ({mism} prompt tokens differ): the curves "
                    "and kept sets below compare different inputs.",
                    icon=":material/warning:",
                )
    with state.guard("the curves", run):
        frames = [(r, data.replay_series(root, r), data.dropped_mass_series(root, r)) for r in (run, other)]
        if all(s.empty and d.empty for _, s, d in frames):
            st.info("Neither run has a teacher replay: no KL or dropped mass to compare.")
        else:
            colours = common.run_colours([row.get("policy"), b.get("policy")])
            st.plotly_chart(charts.compare_figure(frames, colours), key="compare_curves")
    with state.guard("the kept-set overlap", run):
        _kept_sets(root, row, b)
    with state.guard("the free generation", run):
        if free is not None and len(free):
            st.subheader("Generated tokens")
            st.caption(
                "Share of generated positions where both runs produced the same token, and the first "
                "position where they differ."
            )
            st.dataframe(free, hide_index=True)
    state.publish(PAGE, ["other"])


render()
