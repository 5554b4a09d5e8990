"""Analyses of H2O Lens eviction logs: DuckDB relations, attribution, reports, a SQL console.

Every measure of DESIGN.md §6 is a small function ``(source, run_id, ...) ->
DuckDBPyRelation``; ``source`` is a connection from
:func:`runlog.open_runs` or a runs root. Relations are lazy until
materialised (``.df()``, ``.fetchall()``) and bind their values, so they
compose::

    import analyses, runlog
    con = runlog.open_runs("runs")
    analyses.head_coverage(con, "run-a").df()
    analyses.attribute(con, "run-a")
    analyses.write_report("runs", "run-a", "run-a.html")

This package needs duckdb, pyarrow, pandas, numpy and plotly only, never
torch: logs open on machines without a model.
"""

from __future__ import annotations

from ._base import connect
from ._format import CAUSAL_TEXT, WHY_COLUMNS, why_budgets, why_rows
from .agreement import ORACLE_COLUMNS, oracle_agreement, oracle_available
from .attribution import VERDICTS, Attribution, Fact, attribute, evidence_sql, failed_requests
from .causal import (
    CAUSAL_VERDICTS,
    ORACLE_CURVE,
    CausalVerdict,
    budget_distribution,
    causal_verdicts,
    counterfactual_runs,
    explained_requests,
)
from .coverage import (
    coverage_by_span,
    coverage_stats,
    dropped_mass,
    dropped_mass_by_layer,
    dropped_mass_series,
    head_coverage,
)
from .curves import kv_footprint, run_curve_points
from .divergence import divergence_summary, free_generation, paired_runs, replay_series
from .dynamics import freeze_onset, freeze_series, margin_sensitivity, promotion_windows
from .errors import (
    AnalysisError,
    MissingColumnError,
    ParameterError,
    SQLRefusedError,
    SQLSandboxError,
    SQLTimeoutError,
    UnknownRunError,
)
from .evidence import evidence_deletion, evidence_evictions, evidence_held, evidence_recalls, evidence_spans
from .keptsets import gqa_overlap, kept_overlap, union_bound
from .policies import effective_split, policy_colour, policy_colours, policy_labels, scored_policy
from .report import FORMATS, REPORT_SCHEMA_VERSION, SCHEMA_PATH, build_report, report_data, report_schema, write_report
from .sql import Sandbox, check_sql, format_result, run_sql, view_schemas
from .stale import stale_holders, stale_victims
from .sweep_page import sweep_html
from .thresholds import Thresholds
from .views import HEADLINE_COLUMNS, runs_headline, runs_table

__all__ = [
    # opening logs, the runs and their headline numbers
    "connect",
    "runs_table",
    "runs_headline",
    "HEADLINE_COLUMNS",
    # coverage and divergence
    "dropped_mass",
    "coverage_stats",
    "head_coverage",
    "coverage_by_span",
    "dropped_mass_series",
    "dropped_mass_by_layer",
    "replay_series",
    "divergence_summary",
    "paired_runs",
    "free_generation",
    # evidence, kept sets, dynamics
    "evidence_spans",
    "evidence_deletion",
    "evidence_held",
    "evidence_evictions",
    "evidence_recalls",
    "kept_overlap",
    "union_bound",
    "gqa_overlap",
    "promotion_windows",
    "freeze_series",
    "freeze_onset",
    "margin_sensitivity",
    "stale_victims",
    "stale_holders",
    "oracle_agreement",
    "oracle_available",
    "ORACLE_COLUMNS",
    "kv_footprint",
    "run_curve_points",
    # policies (from the registry)
    "policy_colours",
    "effective_split",
    "policy_colour",
    "policy_labels",
    "scored_policy",
    # the sweep's curves page
    "sweep_html",
    # attribution and reports
    "Thresholds",
    "VERDICTS",
    "Fact",
    "Attribution",
    "attribute",
    "failed_requests",
    "evidence_sql",
    # counterfactual verdicts (re-runs by recorders.counterfactual)
    "CAUSAL_VERDICTS",
    "ORACLE_CURVE",
    "CausalVerdict",
    "causal_verdicts",
    "counterfactual_runs",
    "explained_requests",
    "budget_distribution",
    "CAUSAL_TEXT",
    "WHY_COLUMNS",
    "why_rows",
    "why_budgets",
    "report_data",
    "build_report",
    "write_report",
    "report_schema",
    "REPORT_SCHEMA_VERSION",
    "SCHEMA_PATH",
    "FORMATS",
    # SQL console
    "Sandbox",
    "run_sql",
    "check_sql",
    "format_result",
    "view_schemas",
    # errors
    "AnalysisError",
    "ParameterError",
    "UnknownRunError",
    "MissingColumnError",
    "SQLSandboxError",
    "SQLRefusedError",
    "SQLTimeoutError",
]
