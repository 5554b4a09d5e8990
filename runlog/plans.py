"""Budgets per layer and KV set in the log (DESIGN.md §5.6): the ``set_budgets`` view.

A run under a budget plan (DESIGN.md §2.14) writes no single budget: its manifest's
``config.plan`` holds the plan as given (slot counts, or shares of the prompt) and each
request's ``prompt_len`` resolves it. The catalog keeps one row per (run, layer, KV set) of every
planned run (``h2o_lens_catalog.plans``) and the view ``set_budgets`` resolves them per request:
``run_id, request, layer, kv_set, slots, heavy, recent`` with ``kv_set`` the KV head, or the query
head under ``gqa='none'`` (``coalesce(q_head, kv_head)`` of the eviction and step rows). A run
without a plan has no rows there: its budget is ``requests.heavy`` and ``recent``, as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from .contract import model_shape

__all__ = ["PLANS", "plan_rows", "SET_BUDGETS_VIEW"]

#: the catalog table behind ``set_budgets``: each planned run's entries as given
PLANS = pa.schema(
    [
        pa.field("run_id", pa.string()),
        pa.field("policy", pa.string()),
        pa.field("sink", pa.int64()),
        pa.field("layer", pa.int64()),
        pa.field("kv_set", pa.int64()),
        pa.field("unit", pa.string()),  # slots | ratio
        pa.field("value", pa.float64()),
    ]
)


def _entries(plan: Mapping[str, Any]) -> tuple[str, list] | None:
    for unit, key in (("slots", "slots"), ("ratio", "ratios")):
        table = plan.get(key)
        if isinstance(table, list) and table:
            return unit, table
    return None


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def plan_rows(runs: Iterable[Any]) -> list[dict[str, Any]]:
    """``PLANS`` rows of the catalog's runs (entries with ``manifest``) that ran under a plan; a
    one-entry layer is one row per KV set of the model the manifest names. A malformed plan gives
    no rows (the run's other checks say what is wrong with it)."""
    out: list[dict[str, Any]] = []
    for run in runs:
        manifest = getattr(run, "manifest", None)
        config = manifest.get("config") if isinstance(manifest, Mapping) else None
        plan = config.get("plan") if isinstance(config, Mapping) else None
        found = _entries(plan) if isinstance(plan, Mapping) else None
        if found is None:
            continue
        unit, table = found
        sets = model_shape(manifest).get("sets")
        rows = []
        for layer, entry in enumerate(table):
            entry = entry if isinstance(entry, list) else [entry]
            if len(entry) == 1 and sets:
                entry = entry * sets
            if not all(_number(x) for x in entry):
                rows = []
                break
            base = {"run_id": run.run_id, "policy": config.get("policy"), "sink": config.get("sink") or 0}
            rows += [
                {**base, "layer": layer, "kv_set": s, "unit": unit, "value": float(x)} for s, x in enumerate(entry)
            ]
        out += rows
    return out


#: per request, layer and KV set of a planned run: its slots and the policy's split of them
#: (h2o_lens.plan.split: a ratio entry resolves as a keep ratio, max(2, round(r · P)), halves to
#: heavy and recent, and the baselines re-split them as H2OConfig.split does)
SET_BUDGETS_VIEW = """
CREATE OR REPLACE VIEW set_budgets AS
WITH s AS (
    SELECT p.run_id, q.request, p.layer, p.kv_set, p.policy, p.sink,
           CASE WHEN p.unit = 'ratio' THEN greatest(2, round_even(p.value * q.prompt_len, 0))
                ELSE p.value END::BIGINT AS slots
    FROM h2o_lens_catalog.plans p JOIN requests q ON q.run_id = p.run_id
)
SELECT run_id, request, layer, kv_set, slots,
       CASE policy WHEN 'local' THEN 0 WHEN 'sink' THEN 0 WHEN 'heavy' THEN slots
                   ELSE slots // 2 END AS heavy,
       CASE policy WHEN 'local' THEN slots WHEN 'sink' THEN slots - sink WHEN 'heavy' THEN 0
                   ELSE slots - slots // 2 END AS recent
FROM s
"""
