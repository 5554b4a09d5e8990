"""Overview: KL, top-1 agreement and dropped mass over steps, first divergence, verdicts."""

from __future__ import annotations

import streamlit as st

from analyses.guard import guard_cost_line
from app import charts, common, data, state

PAGE = "overview"
_DIVERGENCE = {
    "kl_mean": st.column_config.NumberColumn("KL mean", format="%.4g"),
    "kl_max": st.column_config.NumberColumn("KL max", format="%.4g"),
    "kl_p95": st.column_config.NumberColumn("KL P95", format="%.4g"),
    "top1_agreement": st.column_config.NumberColumn("top-1", format="percent"),
    "first_divergence_step": st.column_config.NumberColumn("first divergence"),
    "kl_at_divergence": st.column_config.NumberColumn("KL there", format="%.4g"),
    "teacher_nll_mean": st.column_config.NumberColumn(
        "teacher NLL", format="%.4g", help="mean −log p_teacher(run's token)"
    ),
}


def _headline(row: dict, div) -> int | None:
    first = div["first_divergence_step"].dropna()
    first_step = int(first.min()) if len(first) else None
    correct = f"{int(row['correct'])}/{int(row['checked'])}" if row.get("checked") else "–"
    common.metric_row(
        [
            ("KL mean", common.fmt(row.get("kl_mean")), "mean KL(teacher ‖ run) over steps, nats"),
            (
                "Top-1 agreement",
                common.fmt(row.get("top1_agreement"), ".1%"),
                "share of steps where the run's most likely token is the teacher's",
            ),
            (
                "Dropped mass",
                common.fmt(row.get("dropped_mass_mean")),
                "mean teacher attention on positions the cache had evicted (0 = nothing lost)",
            ),
            ("Evictions", common.fmt(int(row.get("evictions") or 0)), "eviction rows over all layers and heads"),
            ("First divergence", common.fmt(first_step), "first step whose top-1 token differs from the teacher's"),
            ("Correct", correct, "requests the answer checker accepted"),
        ]
    )
    return first_step


def _bytes(n) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return "–"


def _cold(cold: dict | None) -> None:
    """The cold tier's numbers of a run recorded with ``--cold`` (DESIGN.md §2.13)."""
    if cold is None:
        return
    st.subheader("Cold tier")
    window = cold.get("recall")
    st.caption(
        f"Evicted K/V went to the **{cold.get('store')}** store instead of being dropped; a recall window of "
        f"{common.fmt(window)} slots inside the hot slots brought back, every {common.fmt(cold.get('every'))} "
        f"step(s), the cold entries the queries attend to most ({cold.get('select')} selection). The hot memory "
        "stays the run's slot count: compare with plain H2O at the same slots."
    )
    hit = cold.get("recall_hit_rate")
    common.metric_row(
        [
            (
                "Hot slots",
                common.fmt(cold.get("hot_slots")),
                f"slots per KV set, the {window}-slot recall window inside",
            ),
            ("Cold bytes written", _bytes(cold.get("bytes_written")), "K/V bytes moved to the cold store (manifest)"),
            ("Cold bytes read", _bytes(cold.get("bytes_read")), "K/V bytes read back from the cold store (manifest)"),
        ]
    )
    common.metric_row(
        [
            ("Read per token", _bytes(cold.get("bytes_read_per_token")), "cold bytes read per generated token"),
            (
                "Recalls",
                common.fmt(cold.get("recall_rows")),
                f"rows of the recalls table (an entry brought into a window at a refill); "
                f"{common.fmt(cold.get('recalled_positions'))} distinct positions in "
                f"{common.fmt(cold.get('requests_recalled'))} request(s)",
            ),
            (
                "Recall hit rate",
                common.fmt(hit, ".1%") if hit is not None else "–",
                "share of the teacher's attention to evicted positions the window held (after a replay)",
            ),
        ]
    )


def render() -> None:
    root = state.current_root()
    row = common.run_page(root, "Overview")
    if row is None:
        state.publish(PAGE)
        return
    run = row["run_id"]
    with state.guard("the divergence curves", run):
        with st.spinner("Reading KL, agreement and dropped mass…"):
            series = data.replay_series(root, run)
            dropped = data.dropped_mass_series(root, run)
            div = data.divergence(root, run)
            shape = data.run_shape(root, run)
        first_step = _headline(row, div)
        if series.empty and dropped.empty:
            common.no_data(
                row,
                "replay_steps",
                "This run has no teacher replay, so KL, agreement and dropped "
                f"mass are unknown. Replay it against a full-cache teacher: `h2o-lens replay {run}`.",
            )
        else:
            lo, hi = shape["first_step"], shape["last_step"]
            step = state.slider(
                "Inspect step",
                lo,
                hi,
                "step",
                page=PAGE,
                default=first_step if first_step is not None else hi,
                help="Marks a step on the curves; the Tokens page shows the cache then",
            )
            fig = charts.divergence_figure(series, dropped)
            charts.mark_step(fig, first_step, "first divergence", charts.PALETTE[1], rows=3)
            if step != first_step:
                charts.mark_step(fig, step, f"step {step}", rows=3)
            st.plotly_chart(fig, key="overview_curves")
            if len(div) > 1:
                st.dataframe(div, hide_index=True, column_config=_DIVERGENCE)
    with state.guard("the cold tier", run):
        _cold(data.cold(root, run))
    with state.guard("the guard's log", run):
        requests, actions, risk = data.guard_log(root, run)
        if not requests.empty:
            st.subheader("Guard")
            st.caption(
                "The online risk of each request, computed while it ran without the teacher, and what the "
                "guard did (DESIGN.md §18): a raise grows the request's slots for the rest of its generation."
            )
            st.plotly_chart(charts.guard_figure(risk, actions), key="overview_guard_risk")
            st.dataframe(requests, hide_index=True, key="overview_guard_requests")
            if actions.empty:
                st.caption("No action was taken.")
            else:
                st.dataframe(actions, hide_index=True, key="overview_guard_actions")
            cost = data.guard_cost(root, run)
            if cost is not None:
                st.caption(guard_cost_line(cost))
    st.subheader("Attribution: the threshold estimate")
    st.caption(
        "Each failed request gets one estimated verdict from the logged measures against thresholds "
        "(`analyses.attribute`): budget, scoring lag, not the cache, or implementation error, with the "
        "facts that decided it. The cause comes from re-runs: `h2o-lens explain`, the Report page's Why section."
    )
    with state.guard("the attribution", run):
        with st.spinner("Attributing failures…"):
            attributions = data.attributions(root, run)
        common.show_attributions(
            attributions, judged=bool(row.get("replay_steps") or row.get("checked")), estimate=True
        )
    state.publish(PAGE, ["step"])


render()
