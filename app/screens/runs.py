"""Runs: every run of the root with its settings and headline numbers; pick one, or two to compare."""

from __future__ import annotations

import streamlit as st

from app import common, data, state
from app.plain import code

PAGE = "runs"
_COLUMNS = {
    "run_id": st.column_config.TextColumn("run", pinned=True),
    "name": st.column_config.TextColumn("name", help="the run's name (the task, for suite runs)"),
    "status": st.column_config.TextColumn("status"),
    "policy": st.column_config.TextColumn("policy"),
    "heavy": st.column_config.NumberColumn(
        "heavy", help="heavy-hitter slots the policy runs with (local: none; heavy and oracle: all)"
    ),
    "recent": st.column_config.NumberColumn("recent", help="recent-window slots the policy runs with"),
    "sink": st.column_config.NumberColumn("sink", help="attention-sink slots (the sink policy)"),
    "gqa": st.column_config.TextColumn("GQA", help="aggregation of a query group's weights"),
    "kl_mean": st.column_config.NumberColumn("KL mean", format="%.4f", help="mean KL(teacher ‖ run) per step, nats"),
    "top1_agreement": st.column_config.NumberColumn(
        "top-1", format="percent", help="share of steps where run and teacher agree"
    ),
    "dropped_mass_mean": st.column_config.NumberColumn(
        "dropped mass", format="%.4f", help="mean teacher attention on evicted positions"
    ),
    "evictions": st.column_config.NumberColumn("evictions", format="localized"),
    "correct": st.column_config.TextColumn("correct", help="requests the answer checker accepted"),
    "prompt_len": st.column_config.NumberColumn("prompt", help="prompt tokens"),
    "new_tokens": st.column_config.NumberColumn("generated", help="generated tokens"),
    "model": st.column_config.TextColumn("model"),
    "source_run": st.column_config.TextColumn("paired with", help="runs.source_run"),
    "created_at": st.column_config.DatetimeColumn("started (UTC)", format="YYYY-MM-DD HH:mm"),
    "integrity": st.column_config.TextColumn(
        "integrity",
        help="'ok' when every file was read in full and matches the manifest's row counts; "
        "otherwise what is wrong, and the run's numbers may be incomplete",
    ),
}


def _pick(run_ids: list[str]) -> None:
    """Selection callback: the first selected row becomes the run, the second the compared run."""
    rows = st.session_state["runs_table"].selection.rows
    chosen = [run_ids[i] for i in rows if i < len(run_ids)]
    if chosen:
        st.session_state["w_sidebar_run"] = chosen[0]
        state.remember("run", chosen[0])
    if len(chosen) > 1:
        state.remember("other", chosen[1])
        st.session_state.pop("w_compare_other", None)


def render() -> None:
    root = state.current_root()
    st.title("Runs")
    runs = common.load_runs(root)
    if runs is None:
        return
    with state.guard("the skipped files"):
        problems = data.problems(root)
        if runs.empty:
            common.empty_root(root, problems)
            state.publish(PAGE)
            return
        if len(problems):
            st.warning(
                f"**{len(problems)} problem(s) with the runs' data**: unreadable files are left out, "
                "and the runs concerned are marked in the integrity column (the rest of each run is "
                f"shown):\n{common.problem_lines(problems)}",
                icon=":material/warning:",
            )
    st.caption(
        f"{len(runs)} run(s) under {code(root.path)}, newest first. Select a row to open that run; "
        "select two rows to compare them."
    )
    table = data.with_effective_split(runs)
    table["correct"] = [
        f"{int(c)}/{int(n)}" if n else None for c, n in zip(table["correct"].fillna(0), table["checked"])
    ]
    table = table[list(_COLUMNS)]
    run_ids = table["run_id"].tolist()
    st.dataframe(
        table,
        column_config=_COLUMNS,
        hide_index=True,
        on_select=lambda: _pick(run_ids),
        selection_mode="multi-row",
        key="runs_table",
        height=min(600, 38 + 35 * len(table)),
    )
    run, other = state.remembered("run"), state.remembered("other")
    st.markdown(f"**Selected run:** {code(run)}" + (f" · **compared with:** {code(other)}" if other else ""))
    cols = st.columns(5)
    for col, (key, label) in zip(
        cols,
        (
            ("overview", "Overview"),
            ("tokens", "Tokens"),
            ("heads", "Heads"),
            ("report", "Report"),
            ("compare", "Compare"),
        ),
    ):
        col.page_link(f"screens/{key}.py", label=f"Open {label}", icon=":material/arrow_forward:")
    state.publish(PAGE)


render()
