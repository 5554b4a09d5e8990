"""The sweep's page: its curves (quality, physical KV, latency) and its table in one HTML file.

``h2o-lens sweep`` writes it as ``sweep.html`` beside ``sweep.csv`` (DESIGN.md §6.9, §12);
plotly.js is inlined once, so the file opens offline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from h2o_lens import policies as registry
from h2o_lens import presses

__all__ = ["sweep_html", "sweep_figure"]


def sweep_html(table: Any, page_size: int, policy_of: Mapping[str, str], *, x: str = "keep_ratio") -> str:
    """The three curves over keep ratio (or slot count, ``x="slots"``) as one self-contained HTML page.

    ``table``: the sweep's per-configuration table (pandas; one row per curve label and budget,
    the columns ``h2o-lens sweep`` writes to ``sweep.csv``); the figure is :func:`sweep_figure`,
    the table below it. plotly.js is inlined once.
    """
    from plotly.offline import get_plotlyjs

    axis = _axis(x)
    body = sweep_figure(table, page_size, policy_of, x=x).to_json()
    style = (
        "body{font-family:sans-serif;margin:24px}table{border-collapse:collapse;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}"
    )
    html = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>H2O Lens sweep</title>"
        f"<style>{style}</style><script>{get_plotlyjs()}</script></head><body><div id='fig'></div>"
        f"<script>const f={body};Plotly.newPlot('fig',f.data,f.layout);</script>"
        f"<h3>Per policy and {axis} (means over runs; accuracy over checked requests; latency: median)</h3>"
        f"{table.to_html(index=False, border=0, float_format=lambda v: f'{v:.4g}')}</body></html>"
    )
    return html


def _axis(x: str) -> str:
    return "keep ratio (%)" if x == "keep_ratio" else "slots per KV set (full cache: right end)"


def sweep_figure(
    table: Any, page_size: int, policy_of: Mapping[str, str], *, x: str = "keep_ratio", title: str | None = None
) -> Any:
    """The sweep's plotly figure: four panels (accuracy, KL, physical KV bytes per token with and
    without pages, latency), each policy in its registry colour across all of them (a second
    aggregation of the same policy dotted); each policy's curve starts from the full cache at
    100 %. ``policy_of`` maps each curve label to its policy name; ``title`` replaces the sweep's.
    """
    import pandas as pd
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    scale = 100 if x == "keep_ratio" else 1
    cold = "cold_bytes_per_token" in table and table["cold_bytes_per_token"].notna().any()
    fig = make_subplots(
        # the template named, not the process's default: importing Streamlit switches plotly's
        # default template, and the page must not depend on what else the process has loaded
        figure=go.Figure(layout={"template": "plotly"}),
        rows=3 if cold else 2,
        cols=2,
        horizontal_spacing=0.08,
        vertical_spacing=0.09 if cold else 0.14,
        subplot_titles=(
            "quality: answer accuracy",
            "quality: mean KL(teacher ‖ run), nats (full cache: 0)",
            f"physical KV bytes per token (dashed: pages of {page_size} tokens)",
            "decode latency, ms per token",
            *(("cold tier: bytes read per generated token (POLICY+cold curves)",) if cold else ()),
        ),
    )
    is_full = table["policy"].map(lambda label: not _evicts(policy_of[label]))
    full = table[is_full]
    drawn: set[str] = set()
    for label in dict.fromkeys(table["policy"][~is_full]):
        g = pd.concat([full, table[table["policy"] == label]], ignore_index=True).sort_values(x)
        name = policy_of[label]
        _add_curves(fig, g, x, scale, label, _colour(name), "dot" if name in drawn else "solid")
        drawn.add(name)
    _axes(fig, table, x, scale)
    if cold:
        _cold_panel(fig, table, x, scale, policy_of)
    if title is not None:
        fig.update_layout(title=title)
    return fig


def _cold_panel(fig: Any, table: Any, x: str, scale: int, policy_of: Mapping[str, str]) -> None:
    """The fourth curve: cold bytes read per generated token of each cold-tier curve label."""
    import plotly.graph_objects as go

    for label in dict.fromkeys(table["policy"]):
        g = table[(table["policy"] == label) & table["cold_bytes_per_token"].notna()].sort_values(x)
        if g.empty:
            continue
        color = _colour(policy_of[label])
        fig.add_trace(
            go.Scatter(
                x=g[x] * scale,
                y=g["cold_bytes_per_token"],
                name=f"{label} cold bytes",
                legendgroup=label,
                showlegend=False,
                mode="lines+markers",
                line={"color": color},
                marker={"color": color},
            ),
            row=3,
            col=1,
        )
    ticks = sorted({float(v) * scale for v in table[x]})
    fig.update_xaxes(title_text=_axis(x), type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks], row=3, col=1)
    fig.update_yaxes(title_text="bytes per token", rangemode="tozero", row=3, col=1)
    fig.update_layout(height=1200)


def _evicts(policy: str) -> bool:
    return presses.is_press_policy(policy) or registry.get(policy).evicts


def _colour(policy: str) -> str:  # a press's from h2o_lens.presses (DESIGN.md §17)
    return presses.colour(policy) if presses.is_press_policy(policy) else registry.get(policy).colour


def _add_curves(fig: Any, g: Any, x: str, scale: int, label: str, color: str, dash: str) -> None:
    """One curve label's four traces (its rows with the full cache's, sorted along ``x``)."""
    import plotly.graph_objects as go

    common = dict(x=g[x] * scale, legendgroup=label, line={"color": color, "dash": dash}, marker={"color": color})
    fig.add_trace(go.Scatter(y=g["accuracy"], name=label, mode="lines+markers", **common), row=1, col=1)
    kl = g["kl_mean"].where(g["kl_mean"] > 0)  # log axis: the full cache's KL of 0 is left out
    fig.add_trace(go.Scatter(y=kl, name=label, showlegend=False, mode="lines+markers", **common), row=1, col=2)
    fig.add_trace(
        go.Scatter(y=g["kv_bytes_per_token"], name=f"{label} tokens", showlegend=False, mode="lines+markers", **common),
        row=2,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            y=g["paged_bytes_per_token"],
            name=f"{label} pages",
            showlegend=False,
            mode="lines",
            **{**common, "line": {"color": color, "dash": "dash"}},
        ),
        row=2,
        col=1,
    )
    fig.add_trace(
        go.Scatter(y=g["ms_per_token"], name=label, showlegend=False, mode="lines+markers", **common), row=2, col=2
    )


def _axes(fig: Any, table: Any, x: str, scale: int) -> None:
    """Log x axes ticked at the sweep's budgets; the y axes and the layout."""
    ticks = sorted({float(v) * scale for v in table[x]})
    for row in (1, 2):
        for col in (1, 2):
            fig.update_xaxes(
                title_text=_axis(x),
                type="log",
                tickvals=ticks,
                ticktext=[f"{t:g}" for t in ticks],
                row=row,
                col=col,
            )
    fig.update_yaxes(range=[-0.05, 1.05], row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_yaxes(rangemode="tozero", row=2, col=1)
    fig.update_yaxes(rangemode="tozero", row=2, col=2)
    fig.update_layout(
        height=820,
        width=1300,
        title="H2O Lens budget sweep: quality, physical memory and latency against keep ratio",
        legend={"title": {"text": "policy"}},
    )
