"""Exported reports of one run: JSON (versioned, with a CI verdict), Markdown and HTML.

``report_data`` runs every analysis the report needs (aggregation stays in
DuckDB; only aggregated rows reach Python) and returns one JSON-ready dict
that validates against ``report.schema.json`` shipped next to this module.
The renderers only format that dict. The HTML file is self-contained:
plotly.js is inlined once and every figure is JSON drawn by ``Plotly.newPlot``,
so it opens offline.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import duckdb

from runlog import read_manifest
from runlog.errors import RecorderError, storage_error
from runlog.manifest import check_manifest

from ._base import Source, connect, first_row, manifest_at, plain, records, relation, run_info
from ._html import render_html
from ._markdown import render_markdown
from .agreement import oracle_agreement
from .attribution import FailedArg, attribute
from .causal import budget_distribution, causal_verdicts, explained_requests
from .coverage import (
    coverage_by_span,
    coverage_stats,
    dropped_mass,
    dropped_mass_by_layer,
    dropped_mass_series,
    head_coverage,
)
from .divergence import divergence_summary, free_generation, replay_series
from .dynamics import freeze_onset, margin_sensitivity
from .errors import MissingColumnError, ParameterError
from .evidence import evidence_held
from .guard import guard_actions, guard_cost, guard_requests, guard_risk
from .stale import stale_holders, stale_victims
from .thresholds import Thresholds
from .views import run_problems

__all__ = [
    "REPORT_SCHEMA_VERSION",
    "SCHEMA_PATH",
    "FORMATS",
    "report_data",
    "build_report",
    "render_report",
    "write_report",
    "report_schema",
]

REPORT_SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")
FORMATS = ("html", "md", "json")


def report_schema() -> dict[str, Any]:
    """The JSON Schema of the JSON report."""
    return json.loads(SCHEMA_PATH.read_text())


# -- sections --------------------------------------------------------------------------------


def _versions(manifest: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dist in ("h2o-lens", "duckdb", "pyarrow", "transformers", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    recorded = manifest.get("versions")
    return {"report": out, "run": recorded if isinstance(recorded, dict) else None}


def _provenance(info: dict[str, Any]) -> dict[str, Any]:
    try:  # fields of the wrong type are left out (the runs view reports them)
        manifest = check_manifest(read_manifest(info["path"]))[0] if info.get("path") else {}
    except (RecorderError, OSError):
        manifest = {}
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    keys = (
        "run_id",
        "name",
        "status",
        "model",
        "policy",
        "heavy",
        "recent",
        "sink",
        "gqa",
        "seed",
        "backend",
        "prompt_len",
        "new_tokens",
        "requests",
        "created_at",
        "finished_at",
        "source_run",
        "max_logit_diff",
        "logit_tolerance",
        "schema_version",
        "error",
        "integrity",
    )
    out = {k: plain(info.get(k)) for k in keys}
    command = manifest.get("command")
    out["command"] = " ".join(map(str, command)) if isinstance(command, list) else command
    out["config"] = plain(config)
    out["model_info"] = plain(manifest.get("model")) if isinstance(manifest.get("model"), dict) else None
    out["versions"] = plain(_versions(manifest))
    return out


def _one(rel: duckdb.DuckDBPyRelation) -> dict[str, Any]:
    row = first_row(rel)
    return {k: plain(v) for k, v in zip(rel.columns, row)} if row else {}


def _totals(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, Any]:
    sql = """
        SELECT (SELECT count(*) FROM evictions WHERE run_id = $run) AS evictions,
               (SELECT count(*) FROM replay_steps WHERE run_id = $run) AS replay_steps,
               (SELECT avg(kl) FROM replay_steps WHERE run_id = $run) AS kl_mean,
               (SELECT max(kl) FROM replay_steps WHERE run_id = $run) AS kl_max,
               (SELECT avg(top1_agree::INT) FROM replay_steps WHERE run_id = $run) AS top1_agreement,
               (SELECT min(step) FROM steps WHERE run_id = $run) AS first_step,
               (SELECT max(step) FROM steps WHERE run_id = $run) AS last_step
    """
    return _one(relation(con, sql, run=run_id))


def _coverage(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, Any]:
    overall = _one(coverage_stats(dropped_mass(con, run_id), by=()))
    span = (
        _one(relation(con, "SELECT max(step) - min(step) + 1 AS n FROM replay WHERE run_id = $run", run=run_id)).get(
            "n"
        )
        or 0
    )
    bucket = max(1, math.ceil(span / 48))  # at most 48 step columns in the layer × step heatmap
    return {
        "overall": overall,
        "heads": records(head_coverage(con, run_id).df()),
        "spans": records(coverage_by_span(con, run_id, by_head=False).df()),
        "dropped_mass_series": records(dropped_mass_series(con, run_id).df()),
        "dropped_mass_by_layer": {
            "bucket": bucket,
            "rows": records(dropped_mass_by_layer(con, run_id, bucket=bucket).df()),
        },
    }


def _divergence(con: duckdb.DuckDBPyConnection, run_id: str, th: Thresholds) -> dict[str, Any]:
    free = free_generation(con, run_id)
    return {
        "requests": records(divergence_summary(con, run_id, kl_high=th.kl_high).df()),
        "series": records(replay_series(con, run_id).df()),
        "free_generation": records(free.df()) if free is not None else None,
    }


def _dynamics(con: duckdb.DuckDBPyConnection, run_id: str, totals: dict[str, Any], th: Thresholds) -> dict[str, Any]:
    first, last = totals.get("first_step"), totals.get("last_step")
    window = max(4, math.ceil(((last - first + 1) if first is not None else 0) / 32))
    onsets = freeze_onset(con, run_id, window=window).df()
    margins = margin_sensitivity(con, run_id, threshold=th.margin_tie).df()
    victims = (
        stale_victims(con, run_id)
        .query(
            "sv",
            """
        SELECT layer, kv_head, q_head, count(*) AS heavy_evictions,
               count(*) FILTER (WHERE stale) AS stale, avg(residency) FILTER (WHERE stale) AS residency_mean
        FROM sv GROUP BY ALL ORDER BY layer, kv_head, q_head""",
        )
        .df()
    )
    holders = (
        stale_holders(con, run_id)
        .query(
            "sh",
            """
        SELECT layer, kv_head, q_head, count(*) AS steps,
               avg(stale_holder::INT) AS stale_holder_share,
               min(step) FILTER (WHERE stale_holder) AS first_stale_step
        FROM sh GROUP BY ALL ORDER BY layer, kv_head, q_head""",
        )
        .df()
    )
    frozen = int(onsets["frozen"].sum()) if len(onsets) else 0
    return {
        "freezing": {
            "window": window,
            "sets": len(onsets),
            "frozen": frozen,
            "frozen_share": frozen / len(onsets) if len(onsets) else None,
            "onsets": records(onsets),
        },
        "margins": {
            "threshold": th.margin_tie,
            "relative": True,
            "heads": records(margins),
            "near_zero_share": plain(margins["near_zero"].sum() / margins["evictions"].sum())
            if len(margins) and margins["evictions"].sum()
            else None,
        },
        "stale": {
            "victims": records(victims),
            "holders": records(holders),
            "stale_victims": int(victims["stale"].sum()) if len(victims) else 0,
            "heavy_evictions": int(victims["heavy_evictions"].sum()) if len(victims) else 0,
        },
    }


def _oracle(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, Any]:
    try:
        heads = oracle_agreement(con, run_id).df()
    except MissingColumnError as exc:
        return {"available": False, "reason": str(exc), "heads": []}
    return {"available": True, "reason": None, "heads": records(heads)}


def _guard(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, Any]:
    """The guard's requests, actions and risk per step (DESIGN.md §18.5), empty lists for a run
    without the guard; and its cost as the manifest stored it (``None`` when it did not)."""
    return {
        "requests": records(guard_requests(con, run_id).df()),
        "actions": records(guard_actions(con, run_id).df()),
        "risk": records(guard_risk(con, run_id).df()),
        "cost": guard_cost(con, run_id),
    }


def _why(con: duckdb.DuckDBPyConnection, run_id: str, th: Thresholds, attributions: list) -> dict[str, Any]:
    """The counterfactual verdicts of the run's explained requests and, when the root has several
    explained requests, the distribution of minimal passing budgets (DESIGN.md §6.10)."""
    why = [plain(v.to_dict()) for v in causal_verdicts(con, run_id, thresholds=th, estimates=attributions)]
    out: dict[str, Any] = {"why": why}
    if why and len(explained_requests(con).df()) > 1:
        out["budget_distribution"] = records(budget_distribution(con))
    return out


def _lifecycle(info: dict[str, Any]) -> dict[str, Any]:
    """The state lifecycle check stored in the manifest (DESIGN.md §15.1); never recomputed here."""
    manifest = manifest_at(info.get("path"))
    events: dict[str, int] = {}  # saves, restores, cancels, reorders, prefix copies (DESIGN.md §15)
    for e in manifest.get("state_events") or []:
        if isinstance(e, dict) and isinstance(e.get("event"), str):
            events[e["event"]] = events.get(e["event"], 0) + 1
    stored = manifest.get("lifecycle")
    if not isinstance(stored, dict) or not isinstance(stored.get("requests"), list):
        return {
            "checked": False,
            "ok": None,
            "tolerance": None,
            "failed": 0,
            "tie_flips": 0,
            "requests": [],
            "state_events": events,
        }
    keys = ("request", "ok", "steps", "first_bad_step", "layer", "kv_set", "tie_flips")
    rows = []
    for r in stored["requests"]:
        if isinstance(r, dict):
            row = {k: plain(r.get(k)) for k in keys}
            row["logged_only"] = " ".join(map(str, r.get("logged_only") or [])) or None
            row["reference_only"] = " ".join(map(str, r.get("reference_only") or [])) or None
            rows.append(row)
    failed = sum(r["ok"] is False for r in rows)
    return {
        "checked": True,
        "ok": failed == 0,
        "tolerance": plain(stored.get("tolerance")),
        "failed": failed,
        "tie_flips": sum(int(r["tie_flips"] or 0) for r in rows),
        "requests": rows,
        "state_events": events,
    }


#: why a gate check that has a threshold found nothing to compare, per check (DESIGN.md §6.10)
_NO_DATA = {
    "coverage_p5": "no replay rows: the run was not replayed or evicted nothing that was measured",
    "kl_mean": "no replay steps: the run was not replayed (h2o-lens replay RUN)",
    "top1_agreement": "no replay steps: the run was not replayed (h2o-lens replay RUN)",
    "frozen_share": "no steps rows to tell frozen KV sets",
    "max_logit_diff": "no implementation check: the run was not replayed (h2o-lens replay RUN)",
    "lifecycle_errors": "the state lifecycle check has not run (h2o-lens check RUN; "
    "gate_max_lifecycle_errors=null switches it off)",
}


def _check(name: str, value: Any, threshold: Any, op: str) -> dict[str, Any]:
    """One gate check; with a threshold set, a value it cannot compare fails (no data, with the reason)."""
    value = plain(value)
    out = {"name": name, "value": value, "threshold": threshold, "op": op}
    if threshold is None:
        return {**out, "status": "off", "pass": None, "reason": "switched off (threshold null)"}
    if value is None:
        return {**out, "status": "no data", "pass": False, "reason": _NO_DATA.get(name, "no data")}
    ok = value >= threshold if op == ">=" else value <= threshold
    reason = None if ok else f"{_shown(value)} is not {op} {_shown(threshold)}"
    return {**out, "status": "pass" if ok else "fail", "pass": bool(ok), "reason": reason}


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _run_checks(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The checks of the run itself: it ended ``complete`` (1, else 0) and it was replayed (its replay
    steps: a gate reads the replay)."""
    status = data["run"].get("status")
    state = _check("run_complete", int(status == "complete"), 1, ">=")  # numbers, as every check's
    if not state["pass"]:
        error = data["run"].get("error")
        state["reason"] = f"the run is {status or 'of unknown status'}, not complete" + (f" ({error})" if error else "")
    steps = data["summary"].get("replay_steps") or 0
    replayed = _check("replayed", steps, 1, ">=")
    if not replayed["pass"]:
        replayed["reason"] = "the run has no replay steps: it was never replayed (h2o-lens replay RUN)"
    return [state, replayed]


def _verdict(data: dict[str, Any], th: Thresholds) -> dict[str, Any]:
    """Pass only when every check that is on passes: no data, an incomplete or unreplayed run fail."""
    totals, failures = data["summary"], data["failures"]
    checks = [
        *_run_checks(data),
        _check("coverage_p5", data["coverage"]["overall"].get("p5"), th.gate_min_coverage_p5, ">="),
        _check("kl_mean", totals.get("kl_mean"), th.gate_max_kl_mean, "<="),
        _check("top1_agreement", totals.get("top1_agreement"), th.gate_min_top1_agreement, ">="),
        _check("failures", len(failures), th.gate_max_failures, "<="),
        _check("frozen_share", data["dynamics"]["freezing"]["frozen_share"], th.gate_max_frozen_share, "<="),
        _check(
            "max_logit_diff",
            data["run"].get("max_logit_diff"),
            th.logit_bound(data["run"].get("logit_tolerance")),
            "<=",
        ),
        # the logged kept sets against the single-request reference (no data: the check was not run)
        _check(
            "lifecycle_errors",
            data["lifecycle"]["failed"] if data["lifecycle"]["checked"] else None,
            th.gate_max_lifecycle_errors,
            "<=",
        ),
        # numbers read from a damaged or incomplete run cannot pass a gate
        _check("problems", len(data["run"]["problems"]), 0, "<="),
    ]
    if checks[-1]["pass"] is False:
        checks[-1]["reason"] = f"the run's files are damaged or incomplete: {data['run'].get('integrity')}"
    passed = all(c["pass"] is not False for c in checks)
    failed = [c["name"] for c in checks if c["pass"] is False]
    return {"pass": passed, "status": "pass" if passed else "fail", "failed": failed, "checks": checks}


def report_data(
    source: Source, run_id: str, *, thresholds: Thresholds | Mapping[str, Any] | None = None, failed: FailedArg = None
) -> dict[str, Any]:
    """Every section of the report of ``run_id`` as one JSON-ready dict (see ``report.schema.json``)."""
    con = connect(source)
    th = Thresholds.from_mapping(thresholds)
    info = run_info(con, run_id)
    totals = _totals(con, run_id)
    attributions = attribute(con, run_id, failed=failed, thresholds=th)
    data: dict[str, Any] = {
        "report_schema_version": REPORT_SCHEMA_VERSION,
        "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "run": {**_provenance(info), "problems": records(run_problems(con, run_id).df())},
        "thresholds": th.to_dict(),
        "coverage": _coverage(con, run_id),
        "divergence": _divergence(con, run_id, th),
        "evidence": records(evidence_held(con, run_id).df()),
        "dynamics": _dynamics(con, run_id, totals, th),
        "oracle": _oracle(con, run_id),
        "guard": _guard(con, run_id),
        "failures": [{"rank": i + 1, **plain(a.to_dict())} for i, a in enumerate(attributions)],
        **_why(con, run_id, th, attributions),
        "lifecycle": _lifecycle(info),
    }
    data["summary"] = {
        **{k: totals.get(k) for k in ("evictions", "replay_steps", "kl_mean", "kl_max", "top1_agreement")},
        "coverage_mean": data["coverage"]["overall"].get("mean"),
        "coverage_p5": data["coverage"]["overall"].get("p5"),
        "coverage_min": data["coverage"]["overall"].get("min"),
        "near_zero_margin_share": data["dynamics"]["margins"]["near_zero_share"],
        "frozen_sets": data["dynamics"]["freezing"]["frozen"],
        "kv_sets": data["dynamics"]["freezing"]["sets"],
        "stale_victims": data["dynamics"]["stale"]["stale_victims"],
        "failures": len(attributions),
        "verdicts": {
            v: sum(a.verdict == v for a in attributions)
            for v in ("budget", "scoring", "scoring_lag", "not_the_cache", "implementation_error", "unknown")
        },
    }
    data["verdict"] = _verdict(data, th)
    return data


# -- rendering -----------------------------------------------------------------------------------


def build_report(
    root: Source,
    run_id: str,
    *,
    fmt: str = "html",
    thresholds: Thresholds | Mapping[str, Any] | None = None,
    failed: FailedArg = None,
) -> str:
    """The report of ``run_id`` as text: ``"html"`` (self-contained), ``"md"`` or ``"json"``."""
    if fmt not in FORMATS:
        raise ParameterError(f"unknown report format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return render_report(report_data(root, run_id, thresholds=thresholds, failed=failed), fmt)


def render_report(data: dict[str, Any], fmt: str = "html") -> str:
    """A report dict (:func:`report_data`) as text in ``fmt``; the verdict shows in each format."""
    if fmt not in FORMATS:
        raise ParameterError(f"unknown report format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt == "json":
        return json.dumps(data, indent=1, allow_nan=False)
    if fmt == "md":
        return render_markdown(data)
    return render_html(data)


def write_report(
    root: Source,
    run_id: str,
    path: str | os.PathLike,
    fmt: str | None = None,
    *,
    thresholds: Thresholds | Mapping[str, Any] | None = None,
    failed: FailedArg = None,
) -> Path:
    """Write the report to ``path``; ``fmt`` defaults to the suffix (.html, .md, .json)."""
    path = Path(path)
    if fmt is None:
        fmt = {".html": "html", ".htm": "html", ".md": "md", ".json": "json"}.get(path.suffix.lower())
        if fmt is None:
            raise ParameterError(
                f"cannot tell the report format from {path.name!r}; pass fmt= one of "
                f"{', '.join(FORMATS)} or use a .html, .md or .json name"
            )
    text = build_report(root, run_id, fmt=fmt, thresholds=thresholds, failed=failed)
    data = text.encode("utf-8")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:  # a full disk: no temporary file is left, the error says what was needed
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise storage_error(path, exc, len(data)) from exc
    return path
