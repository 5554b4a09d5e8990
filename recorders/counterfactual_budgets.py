"""The two budget searches of explain (DESIGN.md §6.10): the policy's and the oracle's minimal slot count.

Each drives :func:`recorders.counterfactual_search.bisect_budget` with re-runs of the request
(:class:`recorders.counterfactual_runner.Runner`); the policy's probes are recorded as run folders
and all but the one kept are removed, the oracle's are judged without a run folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from runlog.errors import RecorderError
from runlog.ownership import remove_run

from .counterfactual_outcomes import ORACLE_BUDGET, POLICY_BUDGET, Outcome, _existing, _note
from .counterfactual_runner import Runner
from .counterfactual_search import Bisection, bisect_budget, press_ratio

__all__ = ["policy_budget", "oracle_budget"]


def policy_budget(runner: Runner, slots: int, hi: int, checks: int, step: int, say: Callable[[str], None]) -> Outcome:
    parent = runner.parent
    known = {hi: True}
    if parent.answer is not None:
        known[slots] = runner.passes(parent.answer)
    reused = _existing(runner.out, parent, "policy_budget")
    if reused is not None:
        return reused

    probes: dict[int, Outcome] = {}

    def pass_fn(s: int) -> bool:
        # each probe is recorded (no replay) so that the one found needs no extra generation
        say(f"policy at {s} slots")
        got = runner.record_free(POLICY_BUDGET, lambda: runner.budget_config(s), s, replay=False, **_ratio(runner, s))
        runner.probe_seconds.append(got.seconds)
        if not got.ran:
            raise RecorderError(f"the policy at {s} slots could not run: {got.error}")
        probes[s] = got
        return bool(got.passed)

    try:
        bis = bisect_budget(pass_fn, min(slots, hi), hi, known=known, checks=checks, resolution=step)
    except Exception as exc:
        _drop(runner.out, probes.values())
        return Outcome(POLICY_BUDGET, None, None, False, error=f"{type(exc).__name__}: {exc}")
    at = bis.min_slots if bis.min_slots is not None else bis.smallest_pass
    _drop(runner.out, (o for s, o in probes.items() if s != at))
    if at is None:
        return Outcome(POLICY_BUDGET, None, None, True, False, bisection=bis)
    got = probes.get(at)
    if got is None:  # a known count (the search never ran it): record it now
        got = runner.record_free(
            POLICY_BUDGET, lambda: runner.budget_config(at), at, replay=False, **_ratio(runner, at)
        )
    if got.ran:
        _note(runner.out / got.run_id, bisection=bis.to_dict(), min_slots=bis.min_slots)
    got.bisection = bis
    return got


def _ratio(runner: Runner, slots: int) -> dict[str, float]:
    """A press probe's compression ratio, noted in its ``counterfactual`` object."""
    if runner.parent.press is None:
        return {}
    return {"compression_ratio": press_ratio(slots, runner.parent.prompt_len)}


def _drop(out: Path, outcomes: Any) -> None:
    """Remove the run folders of bisection probes other than the one kept."""
    for o in list(outcomes):
        if o.run_id:
            remove_run(out / o.run_id)


def _same_as_oracle(same: Outcome, bis: Bisection) -> Outcome:
    """The oracle's minimal budget is the run's own count: the same-count oracle run stands for it."""
    return Outcome(
        ORACLE_BUDGET,
        same.slots,
        same.run_id,
        True,
        True,
        same.answer,
        bisection=bis,
        teacher_agreement=same.teacher_agreement,
    )


def oracle_budget(runner: Runner, full_run: str, slots: int, hi: int, same: Outcome, checks: int, step: int) -> Outcome:
    if not same.ran:
        return Outcome("oracle_budget", None, None, False, error=f"the oracle could not run: {same.error}")
    reused = _existing(runner.out, runner.parent, ORACLE_BUDGET)
    if reused is not None:
        return reused
    if same.bisection is not None:  # found at the run's own count earlier: the oracle run holds it
        return _same_as_oracle(same, same.bisection)
    lo, top = (1, slots) if same.passed else (slots, hi)
    known = {slots: bool(same.passed), hi: True}
    try:
        bis = bisect_budget(
            lambda s: runner.oracle_passes(full_run, s), lo, top, known=known, checks=checks, resolution=step
        )
    except Exception as exc:
        return Outcome("oracle_budget", None, None, False, error=f"{type(exc).__name__}: {exc}")
    at = bis.min_slots if bis.min_slots is not None else bis.smallest_pass
    if at is None:
        return Outcome("oracle_budget", None, None, True, False, bisection=bis)
    if at == slots:  # the oracle run at the same count is that run: note the search there
        _note(runner.out / same.run_id, bisection=bis.to_dict(), min_slots=bis.min_slots)
        return _same_as_oracle(same, bis)
    got = runner.record_oracle(
        ORACLE_BUDGET, full_run, at, replay=False, bisection=bis.to_dict(), min_slots=bis.min_slots
    )
    got.bisection = bis
    return got
