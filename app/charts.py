"""Plotly figures of the pages: small frames in, figures with titles, units and colour bars out."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = [
    "warm_up",
    "PALETTE",
    "divergence_figure",
    "heatmap",
    "lines",
    "margin_bars",
    "lifetime_heatmap",
    "dynamics_figure",
    "compare_figure",
    "mark_step",
    "guard_figure",
]

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
_MARGIN = dict(l=10, r=10, t=50, b=10)


def warm_up() -> None:
    """Build one figure of each kind, so plotly's lazily imported validators load before a page needs them."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=("a", "b"))
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines+markers"), row=1, col=1)
    fig.add_trace(go.Heatmap(z=[[0, 1]], colorbar=dict(title=dict(text="z", side="right"))), row=2, col=1)
    fig.add_trace(go.Bar(x=[0], y=[1]), row=2, col=1)
    fig.add_vline(x=0, line_dash="dash", annotation_text="x", row=1, col=1)
    _layout(fig, "warm-up", 100).to_json()


def _layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    fig.update_layout(
        title=dict(text=title, x=0, xanchor="left"),
        height=height,
        margin=_MARGIN,
        legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1),
        hovermode="x unified",
    )
    return fig


def mark_step(fig: go.Figure, step: int | None, label: str, color: str = "#555", *, rows: int = 1) -> None:
    """A dashed vertical line at ``step`` across ``rows`` stacked subplots, labelled once at the top."""
    if step is None:
        return
    line = dict(x=step, line_dash="dash", line_color=color, line_width=1.2)
    if rows == 1:
        fig.add_vline(
            **line,
            annotation_text=label,
            annotation_position="top right",
            annotation_font_size=11,
            annotation_font_color=color,
        )
        return
    for row in range(1, rows + 1):
        extra = (
            dict(
                annotation_text=label,
                annotation_position="top right",
                annotation_font_size=11,
                annotation_font_color=color,
            )
            if row == 1
            else {}
        )
        fig.add_vline(**line, row=row, col=1, **extra)


def _requests(df: pd.DataFrame) -> list[int]:
    return sorted(int(r) for r in df["request"].unique()) if len(df) else []


def divergence_figure(series: pd.DataFrame, dropped: pd.DataFrame) -> go.Figure:
    """KL, top-1 agreement and dropped mass over steps, one colour per request."""
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=(
            "KL(teacher ‖ run) per step (nats, log scale)",
            "Top-1 agreement with the teacher (rolling mean of 8 steps)",
            "Dropped mass: teacher attention on evicted positions (solid: mean over heads, dotted: worst head)",
        ),
    )
    requests = sorted(set(_requests(series)) | set(_requests(dropped)))
    many = len(requests) > 1
    for i, r in enumerate(requests):
        color = PALETTE[i % len(PALETTE)]
        _divergence_traces(fig, series[series["request"] == r], r, color, many)
        _dropped_traces(fig, dropped[dropped["request"] == r], r, color)
    fig.update_yaxes(type="log", dtick=1, title_text="KL", row=1, col=1)
    fig.update_yaxes(range=[-0.05, 1.05], title_text="agreement", row=2, col=1)
    fig.update_yaxes(rangemode="tozero", title_text="share of attention", row=3, col=1)
    fig.update_xaxes(title_text="step (query position)", row=3, col=1)
    fig.update_annotations(font_size=13)
    return _layout(fig, "", 640).update_layout(margin=dict(l=10, r=10, t=40, b=10))


def _divergence_traces(fig: go.Figure, s: pd.DataFrame, r: int, color: str, many: bool) -> None:
    """One request's KL (row 1), rolling top-1 agreement and disagreement ticks (row 2)."""
    name = f"request {r}" if many else None
    if not len(s):
        return
    kl = s["kl"].clip(lower=1e-9)
    fig.add_trace(
        go.Scatter(
            x=s["step"],
            y=kl,
            mode="lines",
            line=dict(color=color, width=1.4),
            name=name or "KL",
            legendgroup=str(r),
            showlegend=many,
            hovertemplate="KL %{y:.3g}",
        ),
        row=1,
        col=1,
    )
    agree = s["top1_agree"].astype(float)
    fig.add_trace(
        go.Scatter(
            x=s["step"],
            y=agree.rolling(8, min_periods=1).mean(),
            mode="lines",
            line=dict(color=color, width=1.4),
            legendgroup=str(r),
            showlegend=False,
            name=name or "top-1",
            hovertemplate="agreement %{y:.2f}",
        ),
        row=2,
        col=1,
    )
    miss = s[~s["top1_agree"].astype(bool)]
    fig.add_trace(
        go.Scatter(
            x=miss["step"],
            y=[0.0] * len(miss),
            mode="markers",
            marker=dict(symbol="line-ns-open", size=10, color=color),
            legendgroup=str(r),
            showlegend=False,
            name="disagreement",
            hovertemplate="top-1 differs",
        ),
        row=2,
        col=1,
    )


def _dropped_traces(fig: go.Figure, d: pd.DataFrame, r: int, color: str) -> None:
    """One request's dropped mass (row 3): mean over heads, solid; worst head, dotted."""
    if not len(d):
        return
    fig.add_trace(
        go.Scatter(
            x=d["step"],
            y=d["mean"],
            mode="lines",
            line=dict(color=color, width=1.6),
            legendgroup=str(r),
            showlegend=False,
            name="mean over heads",
            hovertemplate="mean %{y:.3g}",
        ),
        row=3,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=d["step"],
            y=d["max"],
            mode="lines",
            line=dict(color=color, width=0.8, dash="dot"),
            legendgroup=str(r),
            showlegend=False,
            name="worst head",
            hovertemplate="worst head %{y:.3g}",
        ),
        row=3,
        col=1,
    )


def heatmap(
    df: pd.DataFrame,
    *,
    x: str,
    y: str,
    z: str,
    title: str,
    colorbar: str,
    x_title: str,
    y_title: str = "layer",
    zmin: float | None = None,
    zmax: float | None = None,
    colorscale: str = "Viridis",
    reverse: bool = False,
    fmt: str = ".3f",
    height: int | None = None,
) -> go.Figure:
    """A layer × head heatmap of one value; missing cells stay blank.

    With only one of ``zmin``/``zmax`` given, the other end comes from the data.
    """
    values = pd.to_numeric(df[z], errors="coerce").astype(float)
    grid = values.groupby([df[y], df[x]]).first().unstack(x)
    if (zmin is None) != (zmax is None) and values.notna().any():
        zmin = float(values.min()) if zmin is None else zmin
        zmax = float(values.max()) if zmax is None else zmax
        if zmin >= zmax:
            zmin, zmax = min(zmin, zmax - 1e-9), max(zmax, zmin + 1e-9)
    rows = len(grid.index)
    fig = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(),
            x=[str(c) for c in grid.columns],
            y=[str(i) for i in grid.index],
            colorscale=colorscale,
            reversescale=reverse,
            zmin=zmin,
            zmax=zmax,
            xgap=1,
            ygap=1,
            colorbar=dict(title=dict(text=colorbar, side="right"), thickness=12),
            hovertemplate=f"{y_title} %{{y}}, {x_title} %{{x}}<br>{colorbar}: %{{z:{fmt}}}<extra></extra>",
        )
    )
    fig.update_xaxes(title_text=x_title, type="category")
    fig.update_yaxes(title_text=y_title, type="category", autorange="reversed")
    out = _layout(fig, title, height or max(260, min(720, 90 + 18 * rows)))
    return out.update_layout(hovermode="closest")


def lines(
    df: pd.DataFrame,
    *,
    x: str,
    ys: Sequence[tuple[str, str]],
    title: str,
    y_title: str,
    x_title: str = "step (query position)",
    height: int = 320,
    y_range: Sequence[float] | None = None,
    color_by: str | None = None,
) -> go.Figure:
    """Lines of columns ``ys`` (column, legend name) over ``x``, optionally one colour per ``color_by``."""
    fig = go.Figure()
    groups = [(None, df)] if color_by is None else list(df.groupby(color_by, sort=True))
    for i, (key, part) in enumerate(groups):
        for j, (col, name) in enumerate(ys):
            label = name if key is None else f"{name} ({color_by} {key})"
            fig.add_trace(
                go.Scatter(
                    x=part[x],
                    y=part[col],
                    mode="lines",
                    name=label,
                    line=dict(color=PALETTE[(i * len(ys) + j) % len(PALETTE)], width=1.6),
                )
            )
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=y_title, range=list(y_range) if y_range else None)
    return _layout(fig, title, height)


def margin_bars(hist: pd.DataFrame, *, log: bool) -> go.Figure:
    """The margin histogram; with ``log`` the x axis is log10(margin) labelled in margin units."""
    bins = hist[hist["bin"] >= 0]
    ties = int(hist.loc[hist["bin"] < 0, "evictions"].sum())
    if log and len(bins):
        lo, hi = bins["lo"].map(math.log10), bins["hi"].map(math.log10)
    else:
        lo, hi = bins["lo"], bins["hi"]
    fig = go.Figure(
        go.Bar(
            x=(lo + hi) / 2,
            y=bins["evictions"],
            width=(hi - lo) * 0.95,
            marker_color=PALETTE[0],
            customdata=list(zip(bins["lo"], bins["hi"])),
            name="evictions",
            hovertemplate="margin %{customdata[0]:.3g} … %{customdata[1]:.3g}<br>%{y} evictions<extra></extra>",
        )
    )
    if log and len(bins):
        first, last = math.floor(lo.min()), math.ceil(hi.max())
        ticks = list(range(first, last + 1))
        fig.update_xaxes(
            tickvals=ticks,
            ticktext=[f"1e{t}" for t in ticks],
            title_text="margin (lowest surviving score − victim score, log scale)",
        )
    else:
        fig.update_xaxes(title_text="margin (lowest surviving score − victim score)")
    fig.update_yaxes(title_text="evictions")
    title = "Eviction margins" + (f" ({ties:,} exact ties with margin 0 not shown)" if ties else "")
    return _layout(fig, title, 340).update_layout(hovermode="closest", bargap=0)


def lifetime_heatmap(life: pd.DataFrame, *, position: int, text: str) -> go.Figure:
    """Eviction step of one token per (layer, head); kept cells are grey."""
    df = life.copy()
    head = "q_head" if df["q_head"].notna().any() else "kv_head"
    df["head"] = df[head].astype(int)
    grid = df.pivot_table(index="layer", columns="head", values="evicted_step", aggfunc="first")
    grid = grid.reindex(index=sorted(df["layer"].unique()), columns=sorted(df["head"].unique()))
    info = {(int(r.layer), int(r.head)): r for r in df.itertuples()}
    hover = [[_life_hover(info.get((int(l), int(h)))) for h in grid.columns] for l in grid.index]
    kept = grid.isna().astype(float).where(grid.isna())
    fig = go.Figure()
    fig.add_trace(
        go.Heatmap(
            z=kept.to_numpy(),
            x=[str(c) for c in grid.columns],
            y=[str(i) for i in grid.index],
            colorscale=[[0, "#d9d9d9"], [1, "#d9d9d9"]],
            showscale=False,
            xgap=1,
            ygap=1,
            text=hover,
            hoverinfo="text",
        )
    )
    fig.add_trace(
        go.Heatmap(
            z=grid.to_numpy(),
            x=[str(c) for c in grid.columns],
            y=[str(i) for i in grid.index],
            colorscale="YlOrRd",
            reversescale=True,
            xgap=1,
            ygap=1,
            text=hover,
            hoverinfo="text",
            colorbar=dict(title=dict(text="evicted at step", side="right"), thickness=12),
        )
    )
    fig.update_xaxes(title_text="query head" if head == "q_head" else "KV head", type="category")
    fig.update_yaxes(title_text="layer", type="category", autorange="reversed")
    title = (
        f"Lifetime of token {position} {html.escape(repr(text))}: eviction step per layer and head "
        "(grey: kept to the end)"
    )  # plotly reads tags in titles: the token is shown as text
    rows = len(grid.index)
    return _layout(fig, title, max(260, min(720, 90 + 18 * rows))).update_layout(hovermode="closest")


def _life_hover(row: object) -> str:
    if row is None:
        return ""
    where = f"layer {int(row.layer)}, KV head {int(row.kv_head)}"
    if pd.notna(row.q_head):
        where += f", query head {int(row.q_head)}"
    if bool(row.kept):
        return f"{where}<br>kept to the end"
    return (
        f"{where}<br>evicted at step {int(row.evicted_step)} ({row.phase}), age {int(row.age)}"
        f"<br>score {row.score:.4g}, margin {row.margin:.3g}"
        f"{'<br>left the recent window this step' if bool(row.left_recent) else ''}"
    )


def dynamics_figure(series: pd.DataFrame, onset: int | None) -> go.Figure:
    """Promotion rate, heavy threshold and heavy-slot age per window of one KV set."""
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.07,
        subplot_titles=(
            "Promotion rate: share of tokens leaving the recent window that kept a slot",
            "Heavy threshold: lowest heavy-slot score (min_heavy_score)",
            "Mean age of the heavy slots (steps)",
        ),
    )
    x = series["end_step"]
    fig.add_trace(
        go.Scatter(
            x=x,
            y=series["promotion_rate"],
            mode="lines+markers",
            name="promotion rate",
            line=dict(color=PALETTE[0]),
            marker=dict(size=4),
        ),
        row=1,
        col=1,
    )
    frozen = series[series["frozen"].astype(bool)]
    fig.add_trace(
        go.Scatter(
            x=frozen["end_step"],
            y=frozen["promotion_rate"],
            mode="markers",
            name="frozen window",
            marker=dict(color=PALETTE[1], size=8, symbol="x"),
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(x=x, y=series["threshold"], mode="lines", name="threshold", line=dict(color=PALETTE[4])),
        row=2,
        col=1,
    )
    fig.add_trace(
        go.Scatter(x=x, y=series["heavy_age"], mode="lines", name="heavy age", line=dict(color=PALETTE[2])),
        row=3,
        col=1,
    )
    fig.update_yaxes(range=[-0.05, 1.05], title_text="rate", row=1, col=1)
    fig.update_yaxes(title_text="score", row=2, col=1)
    fig.update_yaxes(title_text="steps", row=3, col=1)
    fig.update_xaxes(title_text="step (end of window)", row=3, col=1)
    fig.update_annotations(font_size=13)
    mark_step(fig, onset, "freeze onset", PALETTE[1], rows=3)
    return _layout(fig, "", 620).update_layout(margin=dict(l=10, r=10, t=40, b=10))


def compare_figure(
    frames: Sequence[tuple[str, pd.DataFrame, pd.DataFrame]], colours: Sequence[str] | None = None
) -> go.Figure:
    """KL and mean dropped mass of several runs over steps (request 0), one colour each
    (``colours``, e.g. each run's policy colour; the palette when None)."""
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=("KL(teacher ‖ run) per step (nats, log scale)", "Dropped mass, mean over heads"),
    )
    for i, (name, series, dropped) in enumerate(frames):
        color = colours[i] if colours is not None else PALETTE[i % len(PALETTE)]
        s = series[series["request"] == series["request"].min()] if len(series) else series
        d = dropped[dropped["request"] == dropped["request"].min()] if len(dropped) else dropped
        fig.add_trace(
            go.Scatter(
                x=s["step"],
                y=s["kl"].clip(lower=1e-9),
                mode="lines",
                name=name,
                line=dict(color=color, width=1.4),
                legendgroup=name,
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=d["step"],
                y=d["mean"],
                mode="lines",
                name=name,
                showlegend=False,
                line=dict(color=color, width=1.4),
                legendgroup=name,
            ),
            row=2,
            col=1,
        )
    fig.update_yaxes(type="log", dtick=1, title_text="KL", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", title_text="share of attention", row=2, col=1)
    fig.update_xaxes(title_text="step (query position)", row=2, col=1)
    fig.update_annotations(font_size=13)
    return _layout(fig, "", 520).update_layout(margin=dict(l=10, r=10, t=40, b=10))


def budget_curves(dist: pd.DataFrame) -> go.Figure:
    """Share of explained requests passing at each keep ratio, one step curve per policy (the
    oracle dashed: the upper bound of every scoring policy)."""
    from analyses import ORACLE_CURVE

    fig = go.Figure()
    for curve, g in dist.groupby("curve", sort=False):
        fig.add_trace(
            go.Scatter(
                x=100 * g["keep_ratio"],
                y=g["share"],
                mode="lines+markers",
                name=f"{curve} ({int(g['requests'].iloc[0])} requests)",
                line={"shape": "hv", "dash": "dash" if curve == ORACLE_CURVE else "solid"},
            )
        )
    fig.update_xaxes(title_text="keep ratio (%)")
    fig.update_yaxes(title_text="share of requests that pass", range=[-0.02, 1.02])
    return _layout(fig, "Minimal passing budgets", 360)


def guard_figure(risk: pd.DataFrame, actions: pd.DataFrame) -> go.Figure:
    """The guard's risk of each request over its steps (the prefill's point first), with a marker
    where it acted (DESIGN.md §18)."""
    fig = go.Figure()
    for i, request in enumerate(_requests(risk)):
        part = risk[risk["request"] == request]
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(
            go.Scatter(
                x=part["step"],
                y=part["risk"],
                mode="lines+markers" if len(part) < 40 else "lines",
                name=f"request {request}",
                line=dict(color=color, width=1.6),
                marker=dict(size=4),
            )
        )
        acts = actions[actions["request"] == request] if len(actions) else actions
        if len(acts):
            fig.add_trace(
                go.Scatter(
                    x=acts["step"],
                    y=acts["risk"],
                    mode="markers+text",
                    name=f"action (request {request})",
                    text=acts["action"],
                    textposition="top center",
                    marker=dict(symbol="triangle-up", size=12, color=color, line=dict(color="#222", width=1)),
                    hovertext=[
                        f"{a.action} at step {a.step}: {a.slots_before} -> {a.slots_after} slots"
                        for a in acts.itertuples()
                    ],
                    hoverinfo="text",
                    showlegend=False,
                )
            )
    fig.update_xaxes(title_text="step (query position; the first point is the prefill's)")
    fig.update_yaxes(title_text="risk", range=[0, 1.08])
    return _layout(fig, "Guard: online risk per step, and where it acted", 300)
