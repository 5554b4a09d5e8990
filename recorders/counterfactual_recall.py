"""explain's ``recall`` variant (DESIGN.md §6.10, §6.11): would a recall window have fixed the answer?

The run's policy at the run's slot count ``B`` with a cold tier (DESIGN.md §2.13): evicted K/V kept
in the ``cpu`` store and a recall window of ``w`` slots **inside** ``B`` refilled with ``exact``
selection (a run recorded with a cold tier keeps its own store, selection and refill period, the
window alone varies). The smallest window that fixes the answer is bisected like the minimal budget
(:func:`recorders.counterfactual_search.bisect_budget`, checked for monotonicity) over
``[lo, hi]``: ``lo`` 1 (the run itself is window 0), or for a run with a cold tier its own window
``r``, which failed; ``hi`` the largest window the policy can give up at ``B``
(:func:`largest_window`: ``B - k - 1`` for h2o with ``k`` pinned positions). It stops within
``max(1, round(resolution · B))`` windows. Every probe is a recorded re-run (no replay); only the
one at the window found is kept, or, when no window fixes it, the one at ``hi``: its
``counterfactual`` object holds ``window`` and the search (``bisection``, over windows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from h2o_lens.cold_config import ColdTier
from h2o_lens.config import H2OConfig
from h2o_lens.errors import ConfigError
from runlog.errors import RecorderError

from .counterfactual_budgets import _drop
from .counterfactual_outcomes import RECALL, Outcome, _fresh, _note, counterfactual_id
from .counterfactual_parent import ParentRequest
from .counterfactual_runner import Runner
from .counterfactual_search import bisect_budget

__all__ = ["recall_config", "largest_window", "recall_skip", "recall_window"]


def recall_config(parent: ParentRequest, window: int) -> H2OConfig:
    """The run's policy and slot count with a recall window of ``window`` slots inside them: the
    run's own cold tier with another window, else the ``cpu`` store with ``exact`` selection."""
    cfg = parent.config
    tier = cfg.cold if cfg.cold is not None else ColdTier(store="cpu", select="exact")
    return dataclasses.replace(cfg, cold=dataclasses.replace(tier, recall=int(window)))


def largest_window(parent: ParentRequest) -> int | None:
    """The largest recall window the run's policy takes at its slot count (None: not even one slot)."""
    slots = int(parent.slots)
    for window in range(slots - 1 - len(parent.config.pinned), 0, -1):
        try:
            recall_config(parent, window)
        except ConfigError:
            continue
        return window
    return None


def recall_skip(parent: ParentRequest) -> str | None:
    """Why the recall variant cannot run for this parent (None: it can)."""
    if parent.press is not None:
        return f"the press {parent.press.press} prunes the prompt outside the cache: a cold tier does not apply"
    cfg = parent.config
    if cfg.plan is not None:
        return "a cold tier with a budget plan is not supported"
    if cfg.spec.teacher:
        return f"policy {cfg.policy!r} plans from the teacher: a recall window would change its plan"
    if largest_window(parent) is None:
        return f"{parent.slots} slots leave the policy no room for a recall window"
    return None


def _kept(runner: Runner) -> Outcome | None:
    """A recall search an earlier explain finished (its kept run notes the search), else None;
    probes a killed search left are reused by the new one as they are found (:func:`_fresh`)."""
    parent = runner.parent
    prefix = counterfactual_id(parent.run_id, parent.request, RECALL, window=0).removesuffix("0")
    for run_dir in sorted(runner.out.glob(prefix + "*")):
        got = _fresh(runner.out, run_dir.name)
        if got is not None and got.bisection is not None:
            return got
    return None


def recall_window(runner: Runner, checks: int, resolution: float, say: Callable[[str], None]) -> Outcome:
    """Bisect the smallest recall window that fixes the request (module docstring); the outcome is
    the kept run, ``bisection`` the search over windows (``min_slots``: the window)."""
    parent = runner.parent
    slots = int(parent.slots)
    reused = _kept(runner)
    if reused is not None:
        return reused
    hi = largest_window(parent)
    own = parent.config.cold.recall if parent.config.cold is not None else None
    lo = min(own, hi) if own is not None else 1
    known = {own: runner.passes(parent.answer)} if own is not None and parent.answer is not None else {}
    probes: dict[int, Outcome] = {}

    def pass_fn(window: int) -> bool:
        say(f"recall window of {window} slots")
        got = runner.record_free(RECALL, lambda: recall_config(parent, window), slots, replay=False, window=window)
        runner.probe_seconds.append(got.seconds)
        if not got.ran:
            raise RecorderError(f"the recall window of {window} slots could not run: {got.error}")
        probes[window] = got
        return bool(got.passed)

    step = max(1, round(resolution * slots))
    try:
        bis = bisect_budget(pass_fn, lo, hi, known=known, checks=checks, resolution=step)
    except Exception as exc:
        _drop(runner.out, probes.values())
        return Outcome(RECALL, slots, None, False, error=f"{type(exc).__name__}: {exc}")
    at = bis.min_slots if bis.min_slots is not None else bis.smallest_pass
    keep = at if at is not None else hi
    _drop(runner.out, (o for w, o in probes.items() if w != keep))
    got = probes.get(keep)
    if got is None:  # a known window (the run's own): record it now
        got = runner.record_free(RECALL, lambda: recall_config(parent, keep), slots, replay=False, window=keep)
    if got.ran:
        _note(runner.out / got.run_id, bisection=bis.to_dict(), window=keep, min_window=bis.min_slots)
    got.bisection, got.window = bis, keep
    return got
