"""Tokens: the prompt and the generation, each token coloured by when the cache evicted it."""

from __future__ import annotations

import streamlit as st

from app import charts, common, culprits_view, data, state, textview
from app.plain import md

PAGE = "tokens"
WINDOW = 2_000  # tokens drawn at once
_MODES = {"step": "Eviction step in one KV set", "share": "Share of KV sets that evicted it"}


def _controls(shape: dict) -> dict:
    top = st.columns([2, 3], gap="large")
    out: dict = {"request": 0, "layer": None, "kv_head": None, "q_head": None}
    out["mode"] = top[0].radio(
        "Colour by",
        list(_MODES),
        format_func=_MODES.get,
        key="w_tokens_mode",
        horizontal=True,
        help="One KV set: the step it evicted the token. Share: how many of the "
        f"{shape['sets']} KV sets had evicted it",
    )
    lo, hi = shape["first_step"], shape["last_step"]
    if lo is None:
        out["at_step"], out["range"] = None, (0, 0)
    else:
        out["at_step"] = state.slider(
            "Cache at step",
            lo,
            hi,
            "step",
            page=PAGE,
            default=hi,
            container=top[1],
            help="Only evictions at or before this step count; later tokens are greyed",
        )
        out["range"] = (lo, max(out["at_step"], lo + 1))  # colours span the steps up to the chosen one
    out["row"] = st.columns(5)
    c = iter(out["row"])
    if (shape["requests"] or 1) > 1:
        out["request"] = state.select(
            "Request", list(range(shape["requests"])), "request", page=PAGE, cast=int, container=next(c)
        )
    if shape["layers"]:
        step_mode = out["mode"] == "step"
        out["layer"] = state.select(
            "Layer", shape["layers"], "layer", page=PAGE, cast=int, container=next(c), disabled=not step_mode
        )
        out["kv_head"] = state.select(
            "KV head", shape["kv_heads"], "head", page=PAGE, cast=int, container=next(c), disabled=not step_mode
        )
        if shape["q_heads"]:
            out["q_head"] = state.select(
                "Query head", shape["q_heads"], "q_head", page=PAGE, cast=int, container=next(c), disabled=not step_mode
            )
    out["free"] = next(c, None) or st.container()
    return out


def _colour_line(ctl: dict, shape: dict) -> None:
    if ctl["mode"] == "step":
        which = f"layer {ctl['layer']}, KV head {ctl['kv_head']}" + (
            f", query head {ctl['q_head']}" if ctl["q_head"] is not None else ""
        )
        st.markdown(f"Colour: the step **{which}** evicted the token.")
    else:
        st.markdown(f"Colour: the share of the **{shape['sets']} KV sets** that had evicted the token.")


def _recalls(root, run: str, ctl: dict, first: int, last: int) -> dict[int, str] | None:
    """Notes of the positions shown that the cold tier recalled by the chosen step, with a caption
    (DESIGN.md §7.5); None for a run that recalled none of them."""
    recalled = data.recalled(root, run, ctl["request"], first, last)
    if recalled.empty:
        return None
    notes = textview.recall_notes(recalled, ctl["at_step"])
    st.caption(
        f"{len(notes)} position(s) shown were recalled from the cold tier by step {ctl['at_step']} "
        "(green dotted overline; hover for the steps, the layer/KV sets and the tier)."
    )
    return notes


def render() -> None:
    root = state.current_root()
    row = common.run_page(root, "Tokens")
    if row is None:
        state.publish(PAGE)
        return
    run = row["run_id"]
    names = ["request", "layer", "head", "step", "token"]
    with state.guard("the tokens", run):
        shape = data.run_shape(root, run)
        if not shape["tokens"]:
            common.no_data(row, "tokens", "This run logged no tokens (the `tokens` table is empty).")
            state.publish(PAGE)
            return
        ctl = _controls(shape)
        n_tokens = shape["tokens"] // max(shape["requests"] or 1, 1)
        first = 0
        if n_tokens > WINDOW:
            first = state.number(
                f"First position shown (of {n_tokens:,})",
                0,
                n_tokens - 1,
                "from",
                page=PAGE,
                default=0,
                container=st.columns(5)[0],
                help=f"The text shows {WINDOW:,} tokens at a time",
            )
            names.append("from")
        last = first + WINDOW - 1
        with st.spinner("Colouring tokens…"):
            df = data.tokens(
                root, run, ctl["request"], ctl["layer"], ctl["kv_head"], ctl["q_head"], ctl["at_step"], first, last
            )
        if df.empty:
            st.info("No tokens in this window.")
            state.publish(PAGE, names)
            return
        positions = df["position"].tolist()
        evidence = df.loc[df["evidence"].notna(), "position"].tolist()
        token = state.number(
            "Selected token (position)",
            positions[0],
            positions[-1],
            "token",
            page=PAGE,
            default=evidence[0] if evidence else positions[0],
            container=ctl["free"],
            help="Its lifetime across layers and heads is shown below the text",
        )
        mode = ctl["mode"]
        _colour_line(ctl, shape)
        notes = _recalls(root, run, ctl, first, last)
        st.html(textview.legend_html(mode=mode, step_range=ctl["range"], recalls=notes is not None))
        culprits, search = culprits_view.culprits_of(root, run, ctl["request"])
        st.html(
            textview.token_html(
                df,
                mode=mode,
                step_range=ctl["range"],
                at_step=ctl["at_step"],
                selected=token,
                culprits=culprits,
                recalled=notes,
            )
        )
        st.caption(
            f"Positions {positions[0]}–{positions[-1]}; hover a token for its position and eviction. "
            "Evidence spans are underlined."
        )
        if culprits_view.caption(search):
            st.caption(culprits_view.caption(search))
    with state.guard("the token lifetime", run):
        life = data.lifetime(root, run, ctl["request"], token)
        text = df.loc[df["position"] == token, "text"]
        label = str(text.iloc[0]) if len(text) else ""
        st.subheader(f"Token {token}: {md(repr(label))}")
        if notes and token in notes:
            st.caption(f"This position was {notes[token]}.")
        if life.empty:
            st.info("This run logged no KV sets (no `steps` or `evictions` rows).")
        else:
            kept = int(life["kept"].sum())
            common.metric_row(
                [
                    ("KV sets that evicted it", f"{len(life) - kept} / {len(life)}", None),
                    ("First eviction step", common.fmt(life["evicted_step"].min()), None),
                    ("Last eviction step", common.fmt(life["evicted_step"].max()), None),
                    (
                        "Median margin at eviction",
                        common.fmt(life["margin"].median(), ".3g"),
                        "lowest surviving score − the token's score when it was evicted",
                    ),
                ]
            )
            st.plotly_chart(charts.lifetime_heatmap(life, position=token, text=label), key="tokens_life")
            with st.expander("Evictions of this token, per KV set"):
                st.dataframe(life[~life["kept"]], hide_index=True)
    state.publish(PAGE, names)


render()
