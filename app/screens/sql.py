"""SQL: a sandboxed, read-only console over the views, with each view's schema beside it."""

from __future__ import annotations

import pandas as pd
import streamlit as st

import analyses
from analyses import views
from app import common, data, state

PAGE = "sql"
TIMEOUT_S = 10.0
_ORDER = ("runs", "tokens", "evictions", "steps", "replay", "replay_steps", "requests", "problems")


def _schemas(root: state.Root) -> None:
    st.markdown("#### Views")
    with state.guard("the view schemas"):
        schemas = data.schemas(root)
        first = [v for v in _ORDER if v in schemas]
        for view in first + sorted(v for v in schemas if v not in _ORDER):
            cols = schemas[view]
            with st.expander(f"`{view}` ({len(cols)} columns)"):
                st.dataframe(
                    pd.DataFrame(cols),
                    hide_index=True,
                    column_config={
                        "name": st.column_config.TextColumn("column"),
                        "doc": st.column_config.TextColumn("meaning", width="large"),
                    },
                )


def _console(root: state.Root, run: str | None) -> None:
    examples = views.console_examples(run or "RUN_ID")
    pick = st.selectbox("Example", ["(your own query)", *examples], key="w_sql_example")
    if pick in examples and st.session_state.get("_sql_example") != pick:
        st.session_state["w_sql_text"] = examples[pick]
    st.session_state["_sql_example"] = pick
    st.session_state.setdefault("w_sql_text", examples["Evictions per layer and KV head"])
    with st.form("sql_form", border=False):
        sql = st.text_area("One SELECT statement", key="w_sql_text", height=200)
        c1, c2 = st.columns([1, 3], vertical_alignment="bottom")
        max_rows = c1.number_input("Rows at most", 1, state.MAX_ROWS, 1_000, step=500, key="w_sql_rows")
        run_it = c2.form_submit_button("Run query", type="primary", icon=":material/play_arrow:")
    st.caption(
        f"Read-only: one SELECT (or WITH … SELECT) over the views; files outside the runs root are "
        f"out of reach; a query stops after {TIMEOUT_S:g} s, within 1 GB of memory and 2 threads, "
        f"and returns at most {state.MAX_ROWS:,} rows and 64 MB (a larger result is refused, not cut)."
    )
    if run_it:
        try:
            with st.spinner("Running…"):
                st.session_state["_sql_result"] = (
                    sql,
                    analyses.run_sql(root.path, sql, max_rows=int(max_rows), timeout_s=TIMEOUT_S),
                )
        except (analyses.SQLSandboxError, analyses.ParameterError) as exc:
            st.session_state.pop("_sql_result", None)
            st.error(str(exc), icon=":material/block:")
    result = st.session_state.get("_sql_result")
    if result is not None:
        ran, df = result
        note = " (truncated: raise the row limit or aggregate)" if df.attrs.get("truncated") else ""
        st.markdown(f"**{len(df):,} row(s)**{note}")
        st.dataframe(df, hide_index=True)


def render() -> None:
    root = state.current_root()
    st.title("SQL console")
    runs = common.load_runs(root)
    if runs is None:
        return
    if runs.empty:
        common.empty_root(root)
        state.publish(PAGE)
        return
    left, right = st.columns([2, 1], gap="large")
    with left:
        _console(root, state.remembered("run"))
    with right:
        _schemas(root)
    state.publish(PAGE)


render()
