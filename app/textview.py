"""The prompt and the generation as coloured text: one ``<span>`` per token.

Colours come from a light scale so that black text stays readable: in
``step`` mode the step a chosen KV set evicted the token (early = orange,
late = pale yellow), in ``share`` mode the share of KV sets that had
evicted it (0 = none = no colour, 1 = all = red). Evidence tokens are
underlined, tokens not yet seen at the chosen step are greyed, the selected
token is outlined. Positions a cold tier's recall window held (DESIGN.md §2.13) get a green
dotted overline and say when, in how many layer/KV sets and from which tier in their hover.
"""

from __future__ import annotations

import functools
import html

import pandas as pd
from plotly.colors import sample_colorscale

__all__ = ["token_html", "legend_html", "recall_notes"]

_STEP_SCALE = "YlOrRd"
_SHARE_SCALE = "Reds"
_EVIDENCE = "#1f77b4"
_CULPRIT = "#d62728"  # the culprit tokens of a search (DESIGN.md §19)
_RECALLED = "#2ca02c"  # positions the cold tier recalled (DESIGN.md §2.13)


def _color(scale: str, t: float) -> str:
    return _sample(scale, round(min(max(t, 0.0), 1.0), 2))


@functools.lru_cache(maxsize=512)
def _sample(scale: str, t: float) -> str:
    return sample_colorscale(scale, [t])[0]


def _shown(text: object) -> str:
    raw = "" if text is None or (isinstance(text, float) and pd.isna(text)) else str(text)
    if raw == "":
        return "∅"
    return html.escape(raw.replace("\n", "↵\n").replace("\t", "⇥\t"))


def token_html(
    df: pd.DataFrame,
    *,
    mode: str,
    step_range: tuple[int, int],
    at_step: int | None,
    selected: int | None,
    culprits: dict[int, str] | None = None,
    recalled: dict[int, str] | None = None,
) -> str:
    """HTML of the tokens of ``df`` (:func:`analyses.views.token_evictions` rows); ``culprits``
    (position -> when and why it left, DESIGN.md §19) are boxed in red, the reason in their hover;
    ``recalled`` (position -> when the cold tier recalled it, :func:`recall_notes`) are overlined
    in green, the note in their hover."""
    lo, hi = step_range
    span = max(hi - lo, 1)
    parts = [
        '<div style="font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 0.9rem; '
        'line-height: 1.9; white-space: pre-wrap; word-break: break-word; max-height: 520px; '
        'overflow-y: auto; padding: 0.6rem; border: 1px solid rgba(128,128,128,0.35); '
        'border-radius: 0.4rem;">'
    ]
    in_prompt = None
    for row in df.itertuples(index=False):
        if in_prompt is not None and in_prompt and not row.is_prompt:
            parts.append(
                '<span style="display:inline-block; margin: 0 0.4rem; padding: 0 0.4rem; '
                'border-radius: 0.3rem; background:#444; color:#fff; font-size:0.75rem;">'
                'generation ▸</span>'
            )
        in_prompt = bool(row.is_prompt)
        pos = int(row.position)
        future = at_step is not None and pos > at_step
        style = ["border-radius: 2px", "padding: 1px 0"]
        if mode == "step":
            step = row.evicted_step
            gone = not pd.isna(step)
            if gone:
                style.append(f"background: {_color(_STEP_SCALE, 0.6 - 0.55 * (int(step) - lo) / span)}")
            what = f"evicted at step {int(step)}" if gone else "kept"
        else:
            share = float(row.evicted_share) if not pd.isna(row.evicted_share) else 0.0
            if share > 0:
                style.append(f"background: {_color(_SHARE_SCALE, 0.08 + 0.5 * share)}")
            what = f"{share:.0%} of KV sets evicted it ({int(row.evicted_sets)}/{int(row.sets)})"
        if future:
            style.append("color: #999")
            what = "not yet seen at this step"
        if isinstance(row.evidence, str):
            style.append(f"border-bottom: 3px solid {_EVIDENCE}")
            what += f" · evidence {row.evidence!r}"
        if culprits and pos in culprits:
            style.append(f"box-shadow: 0 0 0 2px {_CULPRIT}")
            what += f" · culprit: {culprits[pos]}"
        if recalled and pos in recalled:
            style.append(f"border-top: 3px dotted {_RECALLED}")
            what += f" · {recalled[pos]}"
        if selected is not None and pos == selected:
            style.append("outline: 2px solid #000; outline-offset: 1px")
        title = html.escape(f"position {pos} · {what}", quote=True)
        parts.append(f'<span title="{title}" style="{"; ".join(style)}">{_shown(row.text)}</span>')
    parts.append("</div>")
    return "".join(parts)


def recall_notes(recalled: pd.DataFrame, at_step: int | None = None) -> dict[int, str]:
    """``position -> note`` of :func:`analyses.tiers.recalled_tokens` rows recalled at or before
    ``at_step``: ``recalled from cpu at steps 149–155 (3 steps), 2 layer/KV sets (layers 0,1)``."""
    out: dict[int, str] = {}
    for r in recalled.itertuples(index=False):
        if at_step is not None and int(r.first_step) > at_step:
            continue
        steps = (
            f"step {int(r.first_step)}"
            if r.first_step == r.last_step
            else (f"steps {int(r.first_step)}–{int(r.last_step)} ({int(r.steps)} steps)")
        )
        out[int(r.position)] = f"recalled from {r.tier} at {steps}, {int(r.sets)} layer/KV set(s) (layers {r.layers})"
    return out


def legend_html(*, mode: str, step_range: tuple[int, int], recalls: bool = False) -> str:
    """A one-line legend: the colour scale with its ends, evidence and selection marks."""
    if mode == "step":
        stops = [_color(_STEP_SCALE, 0.6 - 0.55 * t) for t in (0.0, 0.25, 0.5, 0.75, 1.0)]
        left, right = f"evicted at step {step_range[0]}", f"step {step_range[1]}"
    else:
        stops = [_color(_SHARE_SCALE, 0.08 + 0.5 * t) for t in (0.0, 0.25, 0.5, 0.75, 1.0)]
        left, right = "few KV sets evicted it", "all KV sets"
    bar = (
        f'<span style="display:inline-block; width: 160px; height: 12px; vertical-align: middle; '
        f'border-radius: 2px; background: linear-gradient(to right, {", ".join(stops)});"></span>'
    )
    item = 'style="margin-right: 1.2rem; white-space: nowrap;"'
    return (
        f'<div style="font-size: 0.85rem; line-height: 2;">'
        f'<span {item}>{left} {bar} {right}</span>'
        f'<span {item}>no colour: kept</span>'
        f'<span {item}><span style="border-bottom: 3px solid {_EVIDENCE};">evidence</span></span>'
        f'<span {item}><span style="color:#999;">grey: not yet seen</span></span>'
        f'<span {item}><span style="outline: 2px solid #000; outline-offset: 1px;">selected</span></span>'
        + (
            f'<span {item}><span style="border-top: 3px dotted {_RECALLED};">recalled from the cold tier</span></span>'
            if recalls
            else ""
        )
        + '</div>'
    )
