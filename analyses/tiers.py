"""What the dashboard shows of a cold tier and of a budget plan (DESIGN.md §2.13, §2.14, §7.5).

* :func:`recalled_tokens`: per position of one request, when the cold tier's recall window held
  it (from the ``recalls`` table): first and last step, the steps, the layer/KV sets, the tier;
* :func:`cold_overview`: a run's hot slots, cold bytes written and read (the manifest's counters,
  the ``cold_runs`` view) and its recall counts (``recalls`` rows, recalled positions);
* :func:`set_slots`: slots per layer and KV set, from the ``set_budgets`` view of a planned run,
  else the most slots each KV set held (``steps.kept``): unequal kept sets of any run;
* :func:`plan_evidence`: a plan file's evidence (tokens for 90 % and 95 % of the teacher's mass,
  slot shares) as long frames per layer and KV set, beside the slots.

Every query reads only the run's own rows (its files), so the pages stay fast on a large root.
"""

from __future__ import annotations

import json
import os
from typing import Any

import duckdb
import pandas as pd

from ._base import Source, connect, relation

__all__ = ["recalled_tokens", "cold_overview", "cold_bytes_per_token", "set_slots", "plan_evidence"]


def recalled_tokens(
    source: Source, run_id: str, *, request: int = 0, first: int | None = None, last: int | None = None
) -> duckdb.DuckDBPyRelation:
    """Per recalled position of ``request`` (in ``first..last``): ``position, first_step,
    last_step, steps`` (distinct decode steps it sat in a recall window), ``sets`` (distinct
    layer/KV sets that recalled it), ``layers`` (their list), ``tier`` and ``bytes_read``. A run
    without a cold tier gives no rows."""
    con = connect(source)
    if not relation(con, "SELECT 1 FROM recalls WHERE run_id = $run LIMIT 1", run=run_id).fetchall():
        return relation(
            con,
            "SELECT NULL::BIGINT AS position, NULL::BIGINT AS first_step, NULL::BIGINT AS last_step, "
            "NULL::BIGINT AS steps, NULL::BIGINT AS sets, NULL::VARCHAR AS layers, NULL::VARCHAR AS tier, "
            "NULL::BIGINT AS bytes_read WHERE false",
        )
    sql = """
        SELECT position, min(step) AS first_step, max(step) AS last_step, count(DISTINCT step) AS steps,
               count(DISTINCT (layer, coalesce(q_head, kv_head))) AS sets,
               string_agg(DISTINCT layer::VARCHAR, ',' ORDER BY layer::VARCHAR) AS layers,
               string_agg(DISTINCT tier, ',') AS tier, sum(bytes_read)::BIGINT AS bytes_read
        FROM recalls
        WHERE run_id = $run AND request = $req AND position BETWEEN $lo AND $hi
        GROUP BY position ORDER BY position
    """
    lo = -1 if first is None else int(first)
    hi = 2**62 if last is None else int(last)
    return relation(con, sql, run=run_id, req=int(request), lo=lo, hi=hi)


def cold_overview(source: Source, run_id: str) -> dict[str, Any] | None:
    """A cold-tier run's numbers (None without a tier): ``store, recall, every, select`` (its
    settings), ``hot_slots`` (slots per KV set, the recall window inside them), ``evicted,
    recalled, bytes_written, bytes_read, bytes_read_per_token, recall_hit_rate`` (the manifest's
    counters, ``cold_runs``), ``recall_rows`` and ``recalled_positions`` (the ``recalls`` table)
    and ``requests_recalled`` (requests with at least one recall)."""
    con = connect(source)
    # the catalog's runs row first: cold_runs joins every run's requests, not worth it without a tier
    if not relation(con, "SELECT 1 FROM runs WHERE run_id = $run AND cold IS NOT NULL", run=run_id).fetchall():
        return None
    row = relation(con, "SELECT * FROM cold_runs WHERE run_id = $run", run=run_id).df()
    if row.empty:
        return None
    out = {k: (None if pd.isna(v) else v) for k, v in row.iloc[0].to_dict().items()}
    slots = relation(con, "SELECT heavy + recent FROM runs WHERE run_id = $run", run=run_id).fetchall()
    out["hot_slots"] = int(slots[0][0]) if slots and slots[0][0] is not None else None
    counts = relation(
        con,
        "SELECT count(*), count(DISTINCT (request, position)), count(DISTINCT request) FROM recalls "
        "WHERE run_id = $run",
        run=run_id,
    ).fetchall()[0]
    out["recall_rows"], out["recalled_positions"], out["requests_recalled"] = (int(x or 0) for x in counts)
    return out


def cold_bytes_per_token(source: Source, run_ids: list[str]) -> dict[str, float | None]:
    """``run_id -> cold bytes read per generated token`` of the cold-tier runs among ``run_ids``
    (the ``cold_runs`` view); empty when none has a cold tier (a sweep's fourth curve)."""
    con = connect(source)
    sql = "SELECT run_id, bytes_read_per_token FROM cold_runs WHERE list_contains($ids, run_id)"
    return dict(relation(con, sql, ids=list(run_ids)).fetchall())


def set_slots(source: Source, run_id: str) -> tuple[pd.DataFrame, str]:
    """Slots per layer and KV set of a run: ``layer, kv_set, slots`` (mean over requests) and where
    they come from: ``"plan"`` (the ``set_budgets`` view of a run under a budget plan), ``"kept"``
    (the most slots each set held after a step, ``steps.kept``, of any other run) or ``""`` (no
    rows). ``kv_set`` is the KV head, the query head under ``gqa='none'``."""
    con = connect(source)
    # the catalog's plan rows first: set_budgets joins every run's requests, not worth it unplanned
    if relation(con, "SELECT 1 FROM h2o_lens_catalog.plans WHERE run_id = $run LIMIT 1", run=run_id).fetchall():
        plan = relation(
            con,
            "SELECT layer, kv_set, avg(slots) AS slots FROM set_budgets WHERE run_id = $run "
            "GROUP BY layer, kv_set ORDER BY layer, kv_set",
            run=run_id,
        ).df()
        if len(plan):
            return plan, "plan"
    kept = relation(
        con,
        """
        SELECT layer, kv_set, avg(held) AS slots FROM (
            SELECT request, layer, coalesce(q_head, kv_head) AS kv_set, max(kept) AS held
            FROM steps WHERE run_id = $run AND kept IS NOT NULL GROUP BY ALL
        ) GROUP BY layer, kv_set ORDER BY layer, kv_set
        """,
        run=run_id,
    ).df()
    return kept, ("kept" if len(kept) else "")


def plan_evidence(path: str | os.PathLike) -> pd.DataFrame:
    """The evidence a plan file carries (``h2o-lens plan -o FILE``): one row per layer and KV set,
    ``layer, kv_set, k90, k95, share`` (tokens for 90 % and 95 % of the teacher's attention mass,
    as shares of the prompt, and the plan's share of the prompt). Raises ``ValueError`` when the
    file is not a plan or carries no evidence, ``OSError`` when it cannot be read."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    evidence = doc.get("evidence") if isinstance(doc, dict) else None
    if not isinstance(evidence, dict) or not isinstance(evidence.get("k90"), list):
        raise ValueError(f"{os.fspath(path)!r} carries no planner evidence (write it with h2o-lens plan -o)")
    rows = []
    shares = evidence.get("shares") or []
    for layer, row in enumerate(evidence["k90"]):
        k95 = evidence.get("k95", [])[layer] if layer < len(evidence.get("k95", [])) else []
        share = shares[layer] if layer < len(shares) else []
        for s, k in enumerate(row):
            rows.append(
                {
                    "layer": layer,
                    "kv_set": s,
                    "k90": float(k),
                    "k95": float(k95[s]) if s < len(k95) else float("nan"),
                    "share": float(share[s]) if s < len(share) else float("nan"),
                }
            )
    return pd.DataFrame(rows, columns=["layer", "kv_set", "k90", "k95", "share"])
