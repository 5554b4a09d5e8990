"""H2O Lens dashboard entry: ``streamlit run app/main.py -- --root RUNS_ROOT``.

Builds the navigation, the run picker and the root controls in the sidebar,
then runs the selected page (one file per page in ``app/screens/``).
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `streamlit run` puts app/ first on the path, not the repository
    sys.path.insert(0, str(_REPO))

import streamlit as st  # noqa: E402

from app import charts, common, data, state  # noqa: E402
from app.plain import code  # noqa: E402

# An emoji character becomes an inline SVG favicon; a ":material/...:" icon would be fetched
# from a font server on the internet, and the dashboard must work offline.
st.set_page_config(page_title="H2O Lens", page_icon="\N{LEFT-POINTING MAGNIFYING GLASS}", layout="wide")
st.cache_resource(show_spinner=False)(charts.warm_up)()  # once per process
state.start_session()
root = state.current_root()

pages = {
    key: st.Page(f"screens/{key}.py", title=title, icon=icon, url_path=key, default=key == "runs", help=help_text)
    for key, title, icon, help_text in common.PAGES
}
current = st.navigation(list(pages.values()))
wanted = state.initial_page()
if wanted in pages and pages[wanted].title != current.title:
    st.switch_page(pages[wanted], query_params=st.query_params.to_dict())

with st.sidebar:
    runs = common.load_runs(root)
    linked = state.remembered("run")
    if runs is not None and linked is not None and linked not in set(runs["run_id"]):
        st.warning(f"Run {code(linked)} from the link is not under this runs root.", icon=":material/link_off:")
        state.remember("run", None)
    if runs is not None and len(runs):
        labels = {
            r.run_id: f"{r.run_id} · {r.policy or '?'} · {r.status}"
            + ("" if r.integrity in (None, "ok") else " · damaged data")
            for r in runs.itertuples()
        }
        state.select(
            "Run",
            list(labels),
            "run",
            page="sidebar",
            format_func=labels.get,
            help="The run every page shows; the Runs page lists them all",
        )
    st.caption(f"Runs root: {code(root.path)}")
    if st.button(
        "Reload runs", icon=":material/refresh:", help="Read the runs root again (new runs, new rows, changed status)"
    ):
        data.clear()
        st.rerun()

current.run()
