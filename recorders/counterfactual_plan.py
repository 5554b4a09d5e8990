"""explain's ``plan`` variant (DESIGN.md §6.12): would a budget plan have fixed the answer?

The run's policy, aggregation and sink with the run's **total** slots shared out by a budget plan
(DESIGN.md §2.14, ``h2o-lens plan -o FILE``) instead of one count per layer and KV set: each
entry of the plan gets ``max(2, round(w · B))`` slots, ``w`` its share of the plan
(:func:`h2o_lens.plan.relative`, a mean of 1 over every layer and KV set) and ``B`` the run's
slot count per set. The rounding moves the total by a few slots; the variant's
``counterfactual`` object holds both totals (``plan_total``, ``run_total``) and the plan's
digest (``plan``), which also names its run folder, so that two plans explained on one run
keep two runs. It is one recorded free re-run, replayed like ``pinned``.

A press run, a run with a cold tier or pinned positions (a plan takes neither), and a run that
already ran under a plan are not re-run: the variant says why.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from typing import Any

from h2o_lens.config import H2OConfig
from h2o_lens.errors import ConfigError

from .counterfactual_outcomes import PLAN, Outcome
from .counterfactual_parent import ParentRequest
from .counterfactual_runner import Runner

__all__ = ["plan_digest", "plan_config", "plan_skip", "plan_variant"]


def plan_digest(plan: Any) -> str:
    """Eight hex digits naming a plan's shape (its entries relative to their mean)."""
    from h2o_lens.plan import relative

    text = json.dumps(relative(plan), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def plan_config(parent: ParentRequest, plan: Any, layers: int, sets: int) -> tuple[H2OConfig, int, int]:
    """``(config, plan_total, run_total)``: the run's policy under ``plan`` at the run's slot count
    per set (module docstring), for a model of ``layers`` layers of ``sets`` KV sets; totals over
    every layer and KV set. A plan of another shape is a ConfigError."""
    from h2o_lens.plan import BudgetPlan, relative

    slots = int(parent.slots)
    plan.check(layers, sets)
    weights = relative(plan)

    def one(w: float) -> int:
        return max(2, round(w * slots))

    table = [one(w) if isinstance(w, numbers.Real) else [one(x) for x in w] for w in weights]
    resolved = BudgetPlan(slots=table)
    cfg = parent.config
    config = H2OConfig(policy=cfg.policy, plan=resolved, gqa=cfg.gqa, sink=cfg.sink, seed=cfg.seed)
    return config, resolved.total(sets), slots * sets * resolved.layers


def plan_skip(parent: ParentRequest) -> str | None:
    """Why the plan variant cannot run for this parent (None: it can)."""
    if parent.press is not None:
        return f"the press {parent.press.press} chooses its own budgets: a plan applies to the cache's policies"
    cfg = parent.config
    if cfg.plan is not None:
        return "the run already ran under a budget plan; explain a run with one budget per layer to compare"
    if cfg.cold is not None:
        return "a cold tier with a budget plan is not supported"
    if cfg.pinned:
        return "pinned positions with a budget plan are not supported"
    if cfg.spec.teacher:
        return f"policy {cfg.policy!r} plans from the teacher; a budget plan is for the policies that score"
    return None


def plan_variant(runner: Runner, plan: Any, layers: int, sets: int) -> Outcome:
    """Record the ``plan`` variant of ``runner``'s parent (module docstring)."""
    parent = runner.parent
    slots = int(parent.slots)
    why = plan_skip(parent)
    if why is not None:
        return Outcome(PLAN, slots, None, False, error=why)
    digest = plan_digest(plan)
    try:
        config, total, run_total = plan_config(parent, plan, layers, sets)
    except ConfigError as exc:
        return Outcome(PLAN, slots, None, False, error=str(exc))
    extra = {"plan": digest, "plan_total": total, "run_total": run_total}
    return runner.record_free(PLAN, lambda: config, slots, **extra)
