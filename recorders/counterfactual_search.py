"""The budget search of explain (DESIGN.md §6.10): the smallest passing slot count, checked for monotonicity.

Pure functions of a pass test (slot count -> bool); no model, no run folder. The searches that
re-run a request through them are in :mod:`recorders.counterfactual_budgets`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from runlog.errors import RecorderError

__all__ = ["Bisection", "bisect_budget", "bisection_from", "split_slots", "press_ratio"]


@dataclasses.dataclass(frozen=True)
class Bisection:
    """The smallest passing slot count in ``[lo, hi]``, and whether the pass test looked monotone.

    Attributes
    ----------
    min_slots : int or None
        The smallest passing slot count; ``None`` when nothing in the range
        passes or when the test is not monotone (then ``smallest_pass`` is
        the smallest count seen passing, and ``violations`` the evidence).
    monotone : bool
        False when a probe passed at a count below one that failed.
    probes : dict slots -> passed, every count tested (with the known ones)
    violations : tuple of (passing slots, failing slots) pairs with passing < failing
    """

    lo: int
    hi: int
    min_slots: int | None
    monotone: bool
    probes: Mapping[int, bool]
    violations: tuple[tuple[int, int], ...] = ()
    smallest_pass: int | None = None
    resolution: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "lo": self.lo,
            "hi": self.hi,
            "resolution": self.resolution,
            "min_slots": self.min_slots,
            "monotone": self.monotone,
            "probes": [[int(s), bool(p)] for s, p in sorted(self.probes.items())],
            "violations": [list(v) for v in self.violations],
            "smallest_pass": self.smallest_pass,
        }


def bisection_from(d: Mapping[str, Any]) -> Bisection:
    """A :class:`Bisection` from its :meth:`Bisection.to_dict` (a counterfactual's manifest)."""
    return Bisection(
        int(d["lo"]),
        int(d["hi"]),
        d.get("min_slots"),
        bool(d.get("monotone", True)),
        {int(s): bool(p) for s, p in d.get("probes", [])},
        tuple(tuple(v) for v in d.get("violations", [])),
        d.get("smallest_pass"),
        int(d.get("resolution", 1)),
    )


def _violations(probes: Mapping[int, bool]) -> tuple[tuple[int, int], ...]:
    """(pass, fail) pairs with the passing count below the failing one (at most one per pass)."""
    items = sorted(probes.items())
    out = []
    for i, (s, ok) in enumerate(items):
        if ok:
            worse = [t for t, ok2 in items[i + 1 :] if not ok2]
            if worse:
                out.append((s, worse[-1]))
    return tuple(out)


def _widest_gap(probes: Mapping[int, bool], lo: int, hi: int) -> int | None:
    """The middle of the widest run of untested counts strictly inside ``(lo, hi)``."""
    tested = sorted(s for s in probes if lo <= s <= hi)
    edges = [lo, *tested, hi] if tested else [lo, hi]
    best = None
    for a, b in zip(edges, edges[1:]):
        if b - a > 1 and (best is None or b - a > best[1] - best[0]):
            best = (a, b)
    return None if best is None else (best[0] + best[1]) // 2


def bisect_budget(
    pass_fn: Callable[[int], bool],
    lo: int,
    hi: int,
    *,
    known: Mapping[int, bool] | None = None,
    checks: int = 2,
    resolution: int = 1,
) -> Bisection:
    """The smallest slot count in ``[lo, hi]`` at which ``pass_fn`` passes.

    Bisection assumes the pass test is monotone in the slot count. It is
    checked, not trusted: after the search, ``checks`` more counts are
    tested (alternately below and above the result, in the widest untested
    gaps); together with every probe of the search, any count that passes
    below one that fails makes the result ``monotone=False`` with
    ``min_slots=None`` and the offending pairs, instead of a wrong number.

    Parameters
    ----------
    pass_fn : slot count -> bool (called at most once per count)
    lo, hi : the range searched, ``1 <= lo <= hi``
    known : results already known (e.g. the parent run's own count), not re-tested
    checks : extra counts tested to check monotonicity
    resolution : stop when the failing and passing counts are this close: the
        result is then the smallest count seen passing, at most ``resolution - 1``
        above the true minimum (1: exact)
    """
    if not 1 <= lo <= hi:
        raise RecorderError(f"bisect_budget: need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    probes: dict[int, bool] = {int(k): bool(v) for k, v in (known or {}).items()}

    def test(s: int) -> bool:
        if s not in probes:
            probes[s] = bool(pass_fn(s))
        return probes[s]

    found: int | None = None
    if test(hi):
        if lo in probes and probes[lo]:
            found = lo
        else:
            # a count below lo is taken to fail (0 slots attend to nothing) unless lo is tested
            a, b = (lo if lo in probes else lo - 1), hi
            while b - a > max(1, int(resolution)):
                m = (a + b) // 2
                a, b = (a, m) if test(m) else (m, b)
            found = b
        for k in range(checks):
            below = k % 2 == 0
            point = _widest_gap(probes, lo, found) if below else _widest_gap(probes, found, hi)
            if point is None:
                point = _widest_gap(probes, found, hi) if below else _widest_gap(probes, lo, found)
            if point is None:
                break
            test(point)
    bad = _violations({s: p for s, p in probes.items() if lo <= s <= hi})
    passing = [s for s, p in probes.items() if p and lo <= s <= hi]
    if found is not None and passing:
        found = min(passing)  # a check below the search's result may have passed (still monotone)
    return Bisection(
        lo,
        hi,
        None if bad else found,
        not bad,
        dict(sorted(probes.items())),
        bad,
        min(passing) if passing else None,
        max(1, int(resolution)),
    )


def split_slots(heavy: int, recent: int, slots: int) -> tuple[int, int]:
    """``slots`` split as ``heavy:recent`` (at least one recent slot when the run had one)."""
    total = heavy + recent
    h = int(math.floor(slots * heavy / total + 0.5)) if total else 0
    h = min(max(h, 0), slots)
    r = slots - h
    if recent and r == 0 and slots > 1:
        h, r = h - 1, 1
    if heavy and h == 0 and slots > 1 and recent:
        h, r = 1, r - 1
    return h, r


def press_ratio(slots: int, prompt_len: int) -> float:
    """The compression ratio at which kvpress keeps ``slots`` of ``prompt_len`` positions
    (``int(P · (1 - c)) == slots``; 0 from ``P`` slots on: nothing pruned)."""
    if slots >= prompt_len:
        return 0.0
    return (prompt_len - slots - 0.5) / prompt_len
