"""Counterfactual re-runs of one failed request (DESIGN.md §6.10).

A verdict from thresholds on logged measures is a correlation; an
intervention decides. :func:`explain_request` re-runs the request of a
recorded run with one thing changed, on the same prompt tokens, the same
model and the same (greedy) decoding, and records each re-run as a normal
run folder linked to its parent (manifest ``parent_run``,
``counterfactual_kind``, ``counterfactual_request``, ``counterfactual_slots``
and a ``counterfactual`` object; the ``counterfactuals`` view joins them):

``full``
    the full cache: does the model answer right at all?
``pinned``
    the run's policy and slot count, with the evidence tokens pinned
    (:func:`h2o_lens.config.pin`): they can never be evicted.
``oracle``
    the future-aware oracle at the same slot count, generating its own
    answer with hindsight from the full-cache teacher, re-planned where its
    tokens depart from the teacher's (:class:`recorders.oracle_runs.OracleTeacher`);
    its teacher-forced top-1 agreement with the teacher's tokens is noted
    next to it.
``policy_budget`` / ``oracle_budget``
    the smallest slot count at which the run's policy (free generation, the
    heavy:recent split of the run kept) and the oracle pass, found by
    :func:`bisect_budget`; the run recorded is the one at that count, its
    ``counterfactual.bisection`` holds every probe.
``recall``
    the run's policy and slot count with a recall window inside them (a cold tier,
    DESIGN.md §2.13): the smallest window that fixes the answer, bisected the same way
    (:mod:`.counterfactual_recall`); on with the searches for a policy a cold tier takes.
``plan``
    the run's policy with the run's total slots shared out by a budget plan (DESIGN.md §2.14),
    when one is given (:mod:`.counterfactual_plan`).

Every variant has one pass test: the request's answer checker (rebuilt
from the task spec the run's manifest carries: ``task_spec``, a task-file
line), else agreement with the full-cache run's answer. A full-cache run of
the same prompt already under the root is copied instead of generated again
(:mod:`runlog.counterfactual_reuse`), and the variants share one prompt
forward (:func:`h2o_lens.prompt_reuse.reuse_prompts`, DESIGN.md §12.5) and
its prompt pass (the teacher's keys and values, the replays). A
counterfactual that raises is recorded as a ``failed`` run folder with its
error ("could not run"); the parent run is only ever read.

A kvpress press run is explained the same way (DESIGN.md §17.3): its slot count is the positions
the press keeps, ``pinned`` raises the evidence positions' scores so that the press keeps them,
and ``policy_budget`` searches the press's compression ratio (:func:`press_ratio`).

This module runs the variants in order (:func:`explain_request`); the parts live beside it and
are re-exported here: :mod:`.counterfactual_parent` (the request re-run: :func:`load_parent`,
:func:`check_parent`, the answer checker), :mod:`.counterfactual_runner` (one re-run:
:class:`~.counterfactual_runner.Runner`), :mod:`.counterfactual_search` (the budget search
:func:`bisect_budget`, no model), :mod:`.counterfactual_budgets` (the policy's and the oracle's
searches driven by re-runs) and :mod:`.counterfactual_outcomes` (:class:`Outcome`,
:class:`Explanation`, the run folders of the re-runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from h2o_lens.config import H2OConfig
from h2o_lens.errors import ConfigError
from h2o_lens.presses import PressSpec
from runlog.counterfactual_reuse import find_full_run
from runlog.errors import RecorderError
from runlog.recorded_model import check_model

from .counterfactual_budgets import oracle_budget, policy_budget
from .counterfactual_outcomes import (
    FULL,
    KINDS,
    ORACLE,
    ORACLE_BUDGET,
    PINNED,
    PLAN,
    POLICY_BUDGET,
    RECALL,
    Explanation,
    Outcome,
    _answer_of,
    _failed_run,  # noqa: F401 (re-exported for earlier callers)
    _fresh,
    _link,  # noqa: F401
    _note,  # noqa: F401
    counterfactual_id,
)
from .counterfactual_parent import ParentRequest, check_parent, checker_from_spec, load_parent
from .counterfactual_plan import plan_variant
from .counterfactual_recall import recall_skip, recall_window
from .counterfactual_runner import Runner
from .counterfactual_search import Bisection, bisect_budget, press_ratio, split_slots

#: the runner under its earlier name (the private helpers it used are re-exported above)
_Runner = Runner

__all__ = [
    "KINDS",
    "Bisection",
    "bisect_budget",
    "Outcome",
    "Explanation",
    "ParentRequest",
    "load_parent",
    "check_parent",
    "checker_from_spec",
    "explain_request",
    "split_slots",
    "press_ratio",
]


def explain_request(
    model: Any,
    tokenizer: Any,
    run_dir: str | Path,
    request: int = 0,
    *,
    out: str | Path | None = None,
    bisect: bool = True,
    replay: bool = True,
    checks: int = 1,
    resolution: float = 0.05,
    progress: Callable[[str], None] | None = None,
    allow_other_model: bool = False,
    reuse_full: bool = True,
    recall: bool | None = None,
    plan: Any = None,
) -> Explanation:
    """Run and record the counterfactuals of one request of a recorded run.

    Parameters
    ----------
    model, tokenizer : the run's model (same weights and dtype) and its tokenizer
    run_dir : the parent run folder (only read)
    request : the request to explain
    out : runs root of the counterfactuals (default: the parent's root, so views and the
        dashboard find them next to it)
    bisect : also search the minimal passing budgets (policy and oracle)
    replay : replay the recorded counterfactuals against the teacher (KL in the tables)
    checks : extra counts tested by each bisection to check monotonicity
    resolution : the budget searches stop within this share of the prompt
        (``max(1, round(resolution · P))`` slots; 0: to the slot)
    progress : called with a short label before each re-run (a progress bar)
    allow_other_model : re-run with a model whose fingerprint differs from the parent's (logged in
        each re-run's ``model_overrides``); without it such a model is refused before anything runs
    reuse_full : copy a full-cache run of the same prompt found under ``out``
        (:func:`~runlog.counterfactual_reuse.find_full_run`) instead of generating one
    recall : run the ``recall`` variant (the smallest recall window that fixes the answer);
        None: with the searches (``bisect``), for a policy a cold tier takes
    plan : a :class:`~h2o_lens.plan.BudgetPlan` (or its file): also run the ``plan`` variant, the
        run's total slots shared out by the plan

    Returns
    -------
    Explanation with one :class:`Outcome` per kind; counterfactuals that could
    not run carry the error, and their kinds depend on them (pinned, oracle and
    bisections need the full-cache run) are reported as not run.
    """
    from h2o_lens.plan import coerce
    from h2o_lens.prompt_reuse import reuse_prompts

    t0 = time.perf_counter()
    plan = coerce(plan)
    parent = load_parent(run_dir, request)
    override = check_model(parent.manifest, model, run=parent.run_id, command="explain", allow_other=allow_other_model)
    if parent.press is None and not parent.config.spec.evicts:
        raise RecorderError(
            f"run {parent.run_id!r} keeps the full cache: there is no eviction to explain; "
            "explain a run of an evicting policy"
        )
    out = Path(out) if out is not None else Path(run_dir).resolve().parent
    runner = Runner(model, tokenizer, parent, out, replay=replay, override=override)
    say = progress or (lambda label: None)
    with reuse_prompts(model) as shared:
        outcomes, copied = _run_variants(runner, bisect, checks, resolution, say, reuse_full)
        wanted = bisect if recall is None else recall
        got = _recall(runner, outcomes[FULL], checks, resolution, say, recall is None) if wanted else None
        if got is not None:
            outcomes[RECALL] = got
        if plan is not None:
            say("budget plan")
            outcomes[PLAN] = plan_variant(runner, plan, *_shape(model, parent))
    return Explanation(
        parent.run_id,
        request,
        int(parent.slots),
        parent.prompt_len,
        {k: outcomes[k] for k in KINDS if k in outcomes},
        time.perf_counter() - t0,
        list(runner.probe_seconds),
        runner.teacher.forwards if runner.teacher is not None else None,
        list(runner.generation_seconds),
        shared.hits,
        copied,
    )


def _run_variants(
    runner: Runner, bisect: bool, checks: int, resolution: float, say: Callable[[str], None], reuse_full: bool
) -> tuple[dict[str, Outcome], str | None]:
    """Every variant of :func:`explain_request`, the policy's bisection before the oracle (its
    first probe's prompt pass spares the teacher a prompt forward when nothing is pinned)."""
    parent, out = runner.parent, runner.out
    slots = int(parent.slots)
    outcomes: dict[str, Outcome] = {}

    say("full cache")
    found = None
    if reuse_full and _fresh(out, counterfactual_id(parent.run_id, parent.request, FULL)) is None:
        found = find_full_run(
            out,
            parent.prompt_ids,
            model=parent.manifest.get("model"),
            max_new_tokens=parent.max_new_tokens,
            skip=(parent.run_id,),
        )
    if found is not None:
        full = runner.copy_full(*found)
    else:
        full = runner.record_free(FULL, lambda: H2OConfig(policy="full", gqa=parent.config.gqa), None)
    outcomes[FULL] = full
    if full.ran:
        runner.teacher_text = full.answer if full.answer is not None else _answer_of(out / full.run_id)
        if full.passed is None and runner.check is None:
            full.passed = True  # the teacher agrees with itself

    def skipped(kind: str, s: int | None, why: str) -> Outcome:
        return Outcome(kind, s, None, False, error=why)

    say("pinned evidence")
    if not parent.evidence_positions:
        outcomes[PINNED] = skipped(PINNED, slots, "the run labels no evidence tokens to pin")
    else:
        outcomes[PINNED] = runner.record_free(PINNED, lambda: _pinned(parent), slots, pinned=parent.evidence_positions)

    hi = parent.prompt_len + parent.max_new_tokens  # nothing is ever evicted at this count
    step = max(1, round(resolution * parent.prompt_len))
    if bisect:
        if not full.ran or not full.passed:
            why = "the full cache does not pass: no budget does" if full.ran else "the full-cache run could not run"
            outcomes[POLICY_BUDGET] = skipped(POLICY_BUDGET, None, why)
            outcomes[ORACLE_BUDGET] = skipped(ORACLE_BUDGET, None, why)
        elif parent.press is not None and parent.press.compression_ratio is None:
            why = f"the press {parent.press.press} has no compression_ratio to search"
            outcomes[POLICY_BUDGET] = skipped(POLICY_BUDGET, None, why)
        else:
            say("policy budget (bisection)")
            # a press prunes the prompt only: from P slots on it keeps everything
            top = parent.prompt_len if parent.press is not None else hi
            outcomes[POLICY_BUDGET] = policy_budget(runner, slots, top, checks, step, say)

    say("oracle, same slots")
    if not full.ran:
        outcomes[ORACLE] = skipped(ORACLE, slots, f"needs the full-cache run, which could not run: {full.error}")
    else:
        outcomes[ORACLE] = runner.record_oracle(ORACLE, full.run_id, slots)

    if bisect and ORACLE_BUDGET not in outcomes:
        say("oracle budget (bisection)")
        outcomes[ORACLE_BUDGET] = oracle_budget(runner, full.run_id, slots, hi, outcomes[ORACLE], checks, step)
    copied = found[0].name if found is not None and full.ran else None
    return outcomes, copied


def _recall(
    runner: Runner, full: Outcome, checks: int, resolution: float, say: Callable[[str], None], quiet: bool
) -> Outcome | None:
    """The ``recall`` variant, or why it did not run (None: off by default for this parent)."""
    slots = int(runner.parent.slots or 0)
    why = recall_skip(runner.parent)
    if why is not None:
        return None if quiet else Outcome(RECALL, slots, None, False, error=why)
    if not full.ran or not full.passed:
        why = "the full cache does not pass: no window does" if full.ran else "the full-cache run could not run"
        return Outcome(RECALL, slots, None, False, error=why)
    say("recall window (bisection)")
    return recall_window(runner, checks, resolution, say)


def _shape(model: Any, parent: ParentRequest) -> tuple[int, int]:
    """Layers of ``model`` and its KV sets per layer under the run's aggregation."""
    from h2o_lens.shape import model_shape

    shape = model_shape(model.config)
    return shape.layers, shape.sets(parent.config.gqa)


def _pinned(parent: ParentRequest) -> H2OConfig | PressSpec:
    """The run's policy and slot count with the evidence positions pinned (a press: the press
    itself, its pins raised by the recorder, DESIGN.md §17.3)."""
    from h2o_lens.config import pin

    if parent.press is not None:
        pins = parent.evidence_positions
        if len(pins) > int(parent.slots):
            raise ConfigError(
                f"{len(pins)} evidence positions do not fit in the {parent.slots} positions the press keeps; "
                "nothing to pin within its count"
            )
        return parent.press
    return pin(parent.config, parent.evidence_positions)
