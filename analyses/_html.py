"""The HTML report: one self-contained file, plotly.js inlined once, figures as JSON.

Every figure is a plotly ``{data, layout}`` dict built here from aggregated
rows of the report dict; one script draws them all with ``Plotly.newPlot``
and marks ``<body data-plots-rendered="N">`` when done (``data-plot-error``
on failure), which headless browsers and tests can read.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from typing import Any

from plotly.offline import get_plotlyjs

from ._format import (
    CAUSAL_TEXT,
    EVIDENCE_COLUMNS,
    FACT_COLUMNS,
    PROBLEM_COLUMNS,
    PROVENANCE,
    SUMMARY,
    VERDICT_TEXT,
    WHY_COLUMNS,
    num,
    why_budgets,
    why_rows,
    worst,
)
from .causal import ORACLE_CURVE
from .guard import guard_cost_line

__all__ = ["render_html", "figures"]

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;margin:0;
 background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:18px 28px 60px;background:#fff}
h1{font-size:22px;margin:8px 0 4px}
h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #e3e6ea;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}.sub{color:#5b6475;margin:0 0 12px}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0 10px}
th,td{border:1px solid #e3e6ea;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f1f3f6;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;padding:2px 10px;border-radius:10px;font-weight:700;color:#fff}
.pass{background:#1f8a4c}.fail{background:#c23b32}.off{background:#8a93a3}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:14px}.cols{display:flex;gap:28px;flex-wrap:wrap}
.fig{height:360px;border:1px solid #e3e6ea;border-radius:6px}
pre{background:#f4f5f7;border:1px solid #e3e6ea;padding:8px;overflow-x:auto;font-size:12px}
.damaged{border:2px solid #c23b32;background:#fdf0ef;padding:8px 12px;border-radius:6px}
.verdict{font-weight:700}.failure{border-left:4px solid #c23b32;padding-left:12px;margin:14px 0}
"""

_DRAW = """
(function () {
  var errors = [];
  window.addEventListener("error", function (e) {
    errors.push(String(e.message));
    document.body.setAttribute("data-js-errors", errors.join(" | "));
  });
  var figs = JSON.parse(document.getElementById("h2o-figures").textContent);
  var ids = Object.keys(figs);
  Promise.all(ids.map(function (id) {
    var f = figs[id];
    return Plotly.newPlot(id, f.data, f.layout, {displaylogo: false, responsive: true});
  })).then(function () {
    document.body.setAttribute("data-plots-rendered", String(ids.length));
  }).catch(function (e) {
    document.body.setAttribute("data-plot-error", String(e));
    console.error(e);
  });
})();
"""


# -- figures ----------------------------------------------------------------------------------


def _matrix(
    rows: Sequence[dict[str, Any]], row: str, col: str, value: str
) -> tuple[list[Any], list[Any], list[list[Any]]]:
    ys = sorted({r[row] for r in rows if r.get(row) is not None})
    xs = sorted({r[col] for r in rows if r.get(col) is not None})
    yi, xi = {v: i for i, v in enumerate(ys)}, {v: i for i, v in enumerate(xs)}
    z: list[list[Any]] = [[None] * len(xs) for _ in ys]
    for r in rows:
        if r.get(row) is not None and r.get(col) is not None:
            z[yi[r[row]]][xi[r[col]]] = r.get(value)
    return xs, ys, z


def _layout(title: str, x: str, y: str, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
        "margin": {"l": 60, "r": 20, "t": 40, "b": 45},
        "xaxis": {"title": {"text": x}},
        "yaxis": {"title": {"text": y}},
        **extra,
    }


def _heatmap(
    rows: Sequence[dict[str, Any]], row: str, col: str, value: str, title: str, x: str, colorscale: str, **z: Any
) -> dict[str, Any]:
    xs, ys, zz = _matrix(rows, row, col, value)
    trace = {
        "type": "heatmap",
        "x": xs,
        "y": ys,
        "z": zz,
        "colorscale": colorscale,
        "hoverongaps": False,
        "colorbar": {"thickness": 12},
        **z,
    }
    layout = _layout(title, x, row)
    for axis in ("xaxis", "yaxis"):
        layout[axis].update(zeroline=False, showgrid=False)
    return {"data": [trace], "layout": layout}


def _series(rows: Sequence[dict[str, Any]], y: str, name: str, requests: Sequence[Any]) -> list[dict]:
    return [
        {
            "type": "scatter",
            "mode": "lines",
            "name": f"{name} r{r}" if len(requests) > 1 else name,
            "x": [p["step"] for p in rows if p["request"] == r],
            "y": [p[y] for p in rows if p["request"] == r],
        }
        for r in requests
    ]


def figures(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Plotly figure dicts of a report dict, keyed by element id."""
    cov, div, dyn = data["coverage"], data["divergence"], data["dynamics"]
    figs: dict[str, dict[str, Any]] = {}
    if cov["heads"]:
        figs["fig-coverage-p5"] = _heatmap(
            cov["heads"], "layer", "q_head", "p5", "Coverage P5 per head", "query head", "Viridis", zmax=1
        )
        figs["fig-coverage-mean"] = _heatmap(
            cov["heads"], "layer", "q_head", "mean", "Coverage mean per head", "query head", "Viridis", zmax=1
        )
    series = cov["dropped_mass_series"]
    if series:
        reqs = sorted({r["request"] for r in series})[:4]
        figs["fig-dropped-steps"] = {
            "data": _series(series, "mean", "mean", reqs) + _series(series, "p95", "P95 over heads", reqs),
            "layout": _layout("Dropped mass over steps", "step", "dropped mass"),
        }
        figs["fig-dropped-layers"] = _heatmap(
            cov["dropped_mass_by_layer"]["rows"],
            "layer",
            "step_start",
            "mean",
            f"Dropped mass by layer and step (buckets of {cov['dropped_mass_by_layer']['bucket']})",
            "step",
            "Inferno",
            zmin=0,
        )
    if div["series"]:
        reqs = sorted({r["request"] for r in div["series"]})[:4]
        misses = [r for r in div["series"] if r["top1_agree"] is False]
        figs["fig-kl"] = {
            "data": _series(div["series"], "kl", "KL", reqs)
            + [
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": "top-1 differs",
                    "marker": {"color": "#c23b32"},
                    "x": [r["step"] for r in misses],
                    "y": [r["kl"] for r in misses],
                }
            ],
            "layout": _layout("KL(teacher ‖ run) over steps", "step", "KL (nats)"),
        }
    onsets = dyn["freezing"]["onsets"]
    if onsets:
        col = "q_head" if any(r.get("q_head") is not None for r in onsets) else "kv_head"
        first = [r for r in onsets if r["request"] == onsets[0]["request"]]
        figs["fig-freeze"] = _heatmap(
            first,
            "layer",
            col,
            "onset_step",
            f"Freeze onset step, request {onsets[0]['request']} (blank: never froze)",
            col.replace("_", " "),
            "Cividis",
        )
    margins = dyn["margins"]["heads"]
    if margins:
        col = "q_head" if any(r.get("q_head") is not None for r in margins) else "kv_head"
        figs["fig-margins"] = _heatmap(
            margins,
            "layer",
            col,
            "near_zero_share",
            "Share of evictions with a near-zero margin",
            col.replace("_", " "),
            "Reds",
            zmin=0,
        )
    dist = data.get("budget_distribution") or []
    if dist:
        figs["fig-budgets"] = budget_figure(dist)
    guard = data.get("guard") or {}
    if guard.get("risk"):
        reqs = sorted({r["request"] for r in guard["risk"]})[:4]
        acts = guard.get("actions") or []
        figs["fig-guard"] = {
            "data": _series(guard["risk"], "risk", "risk", reqs)
            + [
                {
                    "type": "scatter",
                    "mode": "markers+text",
                    "name": "action",
                    "marker": {"symbol": "triangle-up", "size": 11, "color": "#c23b32"},
                    "text": [a["action"] for a in acts],
                    "textposition": "top center",
                    "x": [a["step"] for a in acts],
                    "y": [a["risk"] for a in acts],
                }
            ],
            "layout": _layout("Guard: online risk over steps (the first point is the prefill's)", "step", "risk"),
        }
    return figs


def budget_figure(dist: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Share of explained requests passing at each keep ratio: one step curve per policy, the
    oracle dashed (its upper bound)."""
    traces = []
    for curve in dict.fromkeys(r["curve"] for r in dist):
        rows = [r for r in dist if r["curve"] == curve]
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "line": {"shape": "hv", "dash": "dash" if curve == ORACLE_CURVE else "solid"},
                "name": f"{curve} ({rows[0]['requests']} requests)",
                "x": [100 * r["keep_ratio"] for r in rows],
                "y": [r["share"] for r in rows],
            }
        )
    layout = _layout("Minimal passing budgets: share of requests that pass", "keep ratio (%)", "share of requests")
    layout["yaxis"]["range"] = [-0.02, 1.02]
    return {"data": traces, "layout": layout}


# -- tables ----------------------------------------------------------------------------------------


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    if not rows:
        return "<p><em>none</em></p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c)
            cls = ' class="n"' if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
            cells.append(f"<td{cls}>{html.escape(num(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _pairs(mapping: dict[str, Any], keys: Sequence[str]) -> str:
    return _table(
        [{"field": k, "value": mapping.get(k)} for k in keys if mapping.get(k) is not None], ("field", "value")
    )


def _badge(status: str) -> str:
    cls = {"pass": "pass", "fail": "fail"}.get(status, "off")
    return f'<span class="badge {cls}">{html.escape(status.upper())}</span>'


def _fig(fid: str, figs: dict[str, Any]) -> str:
    return f'<div class="fig" id="{fid}"></div>' if fid in figs else ""


def _failures(data: dict[str, Any]) -> str:
    if not data["failures"]:
        return "<p>No request failed.</p>"
    out = []
    for f in data["failures"]:
        out.append(
            f'<div class="failure"><h3>{f["rank"]}. request {f["request"]}: '
            f'<span class="verdict">{html.escape(f["verdict"])}</span></h3>'
            f"<p>{html.escape(VERDICT_TEXT[f['verdict']])}. {html.escape(f['summary'])}. Failed by: "
            f"{html.escape(', '.join(f['failed_by']))}; "
            f"decision step {html.escape(num(f['decision_step']))}.</p>"
            + _table(f["facts"], FACT_COLUMNS)
            + "<p>Evicted evidence (first 20 rows):</p>"
            + _table(f["evicted_evidence"][:20], EVIDENCE_COLUMNS)
            + f"<p>SQL that selects it (paste into the SQL console):</p><pre>{html.escape(f['sql'])}</pre></div>"
        )
    return "".join(out)


def _culprits(v: dict[str, Any]) -> str:
    """The request's culprit tokens (DESIGN.md §19), one line each, when a search ran."""
    from .culprits import culprit_summary, why_left

    line = culprit_summary(v.get("culprits"))
    if line is None:
        return ""
    items = "".join(
        f"<li><code>{c['position']}</code> {html.escape(repr(c.get('text')))}: {html.escape(why_left(c))}</li>"
        for c in v["culprits"].get("culprits") or []
    )
    return f"<p>Culprit tokens: {html.escape(line)}.</p>" + (f"<ul>{items}</ul>" if items else "")


def _why(data: dict[str, Any], figs: dict[str, Any]) -> str:
    why = data.get("why") or []
    if not why:
        return ""
    out = ["<h2>Why: counterfactual re-runs</h2>"]
    for v in why:
        label = v["verdict"] + (f" ({v['sub_label']})" if v.get("sub_label") else "")
        disagree = (
            f"<p>The fast estimate (threshold rules, no re-run) says <b>{html.escape(v['estimate'])}</b>.</p>"
            if v.get("estimate") is not None and v.get("agrees") is False
            else ""
        )
        out.append(
            f'<div class="failure"><h3>request {v["request"]}: <span class="verdict">{html.escape(label)}</span></h3>'
            f"<p>{html.escape(CAUSAL_TEXT.get(v['verdict'], v['verdict']))}. {html.escape(v['reason'])}.</p>"
            + disagree
            + _table(why_rows(v), WHY_COLUMNS)
            + f"<p>{html.escape(why_budgets(v))}. Decided by: "
            f"{html.escape(', '.join(v.get('decided_by') or []) or '–')}.</p>" + _culprits(v) + "</div>"
        )
    if "fig-budgets" in figs:
        out.append("<h3>Minimal passing budgets across the root</h3>" + _fig("fig-budgets", figs))
    return "".join(out)


def _guard(data: dict[str, Any], figs: dict[str, Any]) -> str:
    """The guard's risk curve, requests and actions (DESIGN.md §18.5), when the run has them."""
    guard = data.get("guard") or {}
    if not guard.get("requests"):
        return ""
    actions = (
        _table(guard["actions"], ("request", "step", "risk", "action", "slots_before", "slots_after", "evicted"))
        if guard["actions"]
        else "<p>No action was taken.</p>"
    )
    requests = _table(guard["requests"], ("request", "steps", "max_risk", "peak_step", "mean_risk", "actions"))
    cost = f"<p>{html.escape(guard_cost_line(guard['cost']))}</p>" if guard.get("cost") else ""
    return (
        "<h2>Guard</h2><p>The online risk per request and the actions it took.</p>"
        f"{_fig('fig-guard', figs)}{requests}{actions}{cost}"
    )


def _lifecycle(data: dict[str, Any]) -> str:
    """The state lifecycle section (DESIGN.md §15.1)."""
    lc = data.get("lifecycle") or {}
    events = lc.get("state_events") or {}
    logged = (
        "<p>State events logged: " + html.escape(", ".join(f"{k} {v}" for k, v in events.items())) + "</p>"
        if events
        else ""
    )
    if not lc.get("checked"):
        return (
            '<h2 id="lifecycle">State lifecycle</h2><p>Not checked: run <code>h2o-lens check RUN</code> '
            "to compare the logged kept sets with the reference.</p>" + logged
        )
    status = "pass" if lc["ok"] else "fail"
    cols = ("request", "ok", "steps", "first_bad_step", "layer", "kv_set", "logged_only", "reference_only")
    return (
        f'<h2 id="lifecycle">State lifecycle {_badge(status)}</h2><p>Logged kept sets against the same tokens '
        f"run alone on the plain runtime: {lc['failed']} request(s) disagree (near-tie tolerance "
        f"{html.escape(num(lc.get('tolerance')))}, {lc.get('tie_flips', 0)} tie flip(s) tolerated).</p>"
        + logged
        + _table(lc["requests"], cols)
    )


def _integrity(run: dict[str, Any]) -> str:
    """A warning box with the problems when the run's files are damaged or incomplete."""
    if run.get("integrity") in (None, "ok") and not run.get("problems"):
        return ""
    return (
        f'<div class="damaged" id="integrity"><p><strong>This run\'s data is damaged or incomplete</strong> '
        f"({html.escape(str(run.get('integrity')))}). The numbers below come from the files that could "
        "be read and may be wrong; the gate fails on it.</p>"
        + _table(run.get("problems") or [], PROBLEM_COLUMNS)
        + "</div>"
    )


def _gate(verdict: dict[str, Any]) -> str:
    """The verdict in words, the failed checks named, then every check with its reason."""
    failed = [c["name"] for c in verdict["checks"] if c.get("pass") is False]
    line = (
        f'<p class="verdict" id="gate-verdict">Verdict: {html.escape(verdict["status"].upper())}'
        + (f" (failed: {html.escape(', '.join(failed))})" if failed else "")
        + "</p>"
    )
    return line + _table(verdict["checks"], ("name", "value", "op", "threshold", "status", "reason"))


def _body(data: dict[str, Any], figs: dict[str, Any]) -> str:
    run, verdict, cov, dyn = data["run"], data["verdict"], data["coverage"], data["dynamics"]
    oracle = data["oracle"]
    oracle_html = (
        _table(
            oracle["heads"][:32],
            ("layer", "kv_head", "q_head", "evictions", "agreement", "regret", "rank_corr_future", "rank_corr_score"),
        )
        if oracle["available"]
        else f"<p>Not available: {html.escape(oracle['reason'])}</p>"
    )
    free = data["divergence"]["free_generation"]
    verdicts = ", ".join(f"{k} {v}" for k, v in data["summary"]["verdicts"].items())
    return f"""
<h1>H2O Lens report: {html.escape(run['run_id'])} {_badge(verdict['status'])}</h1>
<p class="sub">{html.escape(str(run.get('model') or ''))} · policy {html.escape(str(run.get('policy')))}
 · heavy {html.escape(num(run.get('heavy')))} + recent {html.escape(num(run.get('recent')))}
 · gqa {html.escape(str(run.get('gqa')))} · report schema {data['report_schema_version']}
 · generated {html.escape(data['generated_at'])}</p>
{_integrity(run)}
<h2>Gate</h2>{_gate(verdict)}
<div class="cols"><div><h2>Run</h2>{_pairs(run, PROVENANCE)}</div>
<div><h2>Summary</h2>{_pairs(data['summary'], SUMMARY)}
<p>Verdicts: {html.escape(verdicts)}</p></div></div>
<h2>Where it goes wrong</h2>
<p>Coverage = 1 − dropped mass, the full-cache teacher's attention on positions the run had evicted,
per step and query head. A high mean can hide the one query that needed far evidence: read P5.</p>
<div class="grid">{_fig('fig-coverage-p5', figs)}{_fig('fig-coverage-mean', figs)}
{_fig('fig-dropped-steps', figs)}{_fig('fig-kl', figs)}</div>
{_fig('fig-dropped-layers', figs)}
<h3>Heads with the lowest coverage P5</h3>
{_table(worst(cov['heads'], 'p5'), ('layer', 'q_head', 'kv_head', 'n', 'mean', 'min', 'p1', 'p5'))}
<h3>Coverage by span of the query token</h3>{_table(cov['spans'], ('span', 'n', 'mean', 'min', 'p1', 'p5'))}
<h3>Teacher-forced divergence per request</h3>
{
        _table(
            data['divergence']['requests'],
            ('request', 'steps', 'kl_mean', 'kl_max', 'top1_agreement', 'first_divergence_step', 'kl_at_divergence'),
        )
    }
{
        '<h3>Free generation against the paired run</h3>'
        + _table(free, ('request', 'other_run', 'compared', 'agreement', 'first_diff_position', 'prompt_mismatches'))
        if free
        else ''
    }
<h2>Failures</h2>{_failures(data)}
{_why(data, figs)}
<h2>Evidence</h2><p>Share of KV sets still holding each span at the answer step.</p>
{
        _table(
            data['evidence'],
            (
                'request',
                'label',
                'at_step',
                'sets',
                'held_any_share',
                'held_all_share',
                'first_deletion_step',
                'last_deletion_step',
            ),
        )
    }
<h2>Cache dynamics</h2>
<p>{dyn['freezing']['frozen']} of {dyn['freezing']['sets']} KV sets froze (promotion rate near 0 while the
heavy threshold rose and heavy slots aged; windows of {dyn['freezing']['window']} steps).
{dyn['stale']['stale_victims']} of {dyn['stale']['heavy_evictions']} heavy-slot evictions were stale.</p>
<div class="grid">{_fig('fig-freeze', figs)}{_fig('fig-margins', figs)}</div>
<h2>Oracle agreement</h2>{oracle_html}
{_guard(data, figs)}
{_lifecycle(data)}
"""


def _script_json(value: Any) -> str:
    text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(data: dict[str, Any]) -> str:
    """Self-contained HTML text of a report dict (plotly.js inlined exactly once)."""
    figs = figures(data)
    plotly_js = get_plotlyjs().replace("</script", "<\\/script")
    title = html.escape(f"H2O Lens report: {data['run']['run_id']}")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{title}</title><style>{_CSS}</style>\n<script>{plotly_js}</script></head>\n"
        f"<body><main>{_body(data, figs)}</main>\n"
        f'<script type="application/json" id="h2o-figures">{_script_json(figs)}</script>\n'
        f"<script>{_DRAW}</script></body></html>\n"
    )
