"""The Heads page's budget section: slots per layer × KV set beside the concentration (DESIGN.md §2.14, §7.5).

A run under a budget plan (``record --plan FILE``) shows the slots its plan gave each layer and KV
set (the ``set_budgets`` view); any other run the most slots each set held (``steps.kept``), so
unequal kept sets of a press show too. Beside them, the tokens that hold 90 % and 95 % of the
teacher's attention mass per layer and KV set, from the evidence a plan file carries
(``h2o-lens plan -o FILE``): where the model needs its memory next to where the budget put it.
"""

from __future__ import annotations

import streamlit as st

from app import charts, data, state
from app.plain import code, md

_SOURCES = {
    "plan": "the slots the run's budget plan gave each layer and KV set (`set_budgets`, mean over requests)",
    "kept": "the most slots each layer and KV set held after a step (`steps.kept`, mean over requests)",
}


def render(root: state.Root, run: str) -> None:
    slots, source = data.set_slots(root, run)
    if slots.empty:
        return
    st.subheader("Budget per layer and KV set")
    uneven = slots["slots"].nunique() > 1
    st.caption(
        f"Slots: {_SOURCES[source]}. "
        + ("The sets hold unequal budgets." if uneven else "Every set holds the same budget.")
    )
    path = st.text_input(
        "Plan file with its evidence (optional)",
        key="w_heads_plan",
        placeholder="plan.json",
        help="A file written by `h2o-lens plan -o FILE`: its concentration is drawn beside the slots",
    )
    kw = dict(x="kv_set", y="layer", x_title="KV set", fmt=".3g")
    c1, c2, c3 = st.columns(3)
    c1.plotly_chart(
        charts.heatmap(slots, z="slots", title="Slots per layer × KV set", colorbar="slots", colorscale="Blues", **kw),
        key="heads_plan_slots",
    )
    if not path.strip():
        c2.info(
            "Give the plan file (`h2o-lens plan -o FILE`) to draw the concentration its evidence holds: "
            "the tokens that carry 90 % and 95 % of the teacher's attention per layer and KV set.",
            icon=":material/info:",
        )
        return
    try:
        ev = data.plan_evidence(path.strip())
    except (OSError, ValueError) as exc:
        c2.warning(f"Cannot read the plan's evidence from {code(path.strip())}: {md(exc)}", icon=":material/warning:")
        return
    for col, z, title in ((c2, "k90", "90 %"), (c3, "k95", "95 %")):
        col.plotly_chart(
            charts.heatmap(
                ev,
                z=z,
                title=f"Tokens for {title} of the mass",
                colorbar="of prompt",
                colorscale="Oranges",
                zmin=0.0,
                **kw,
            ),
            key=f"heads_plan_{z}",
        )
    st.caption(
        "Concentration from the plan's calibration set: a layer whose attention needs more of the prompt "
        "to reach 90 % of its mass reads more widely, and a good plan gives it more slots."
    )
