"""The cache policies as the analyses and the dashboard see them, read from the registry.

:mod:`h2o_lens.policies` declares each policy once (DESIGN.md §2.9) and imports no torch,
so the layers without a model read it here instead of keeping their own lists.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from h2o_lens import policies as registry
from h2o_lens import presses

__all__ = ["policy_colours", "policy_colour", "policy_labels", "scored_policy", "effective_split"]

#: colour of a policy the registry does not know (a log written by another version)
UNKNOWN_COLOUR = "#444444"


def scored_policy(policy: str | None) -> bool:
    """Whether attention drove a run's evictions (DESIGN.md §6.10).

    ``None`` (a run whose manifest names no policy) is read as scored, the reading that
    keeps every verdict open; a name the registry does not know is not. A kvpress press
    (``kvpress:...``, DESIGN.md §17) is scored when attention drives its choice.
    """
    if policy is None:
        return True
    if presses.is_press_policy(policy):
        return presses.scored(policy)
    return policy in registry.names() and registry.get(policy).scored


def policy_colours() -> dict[str, str]:
    """``{policy: "#rrggbb"}``: each policy's colour in plots and the dashboard."""
    return {p.name: p.colour for p in registry.all_policies()}


def policy_colour(policy: str | None) -> str | None:
    """The colour of one run's policy: the registry's, a kvpress press's (DESIGN.md §17), or
    None for a name neither knows."""
    if presses.is_press_policy(policy):
        return presses.colour(policy)
    return policy_colours().get(policy) if policy is not None else None


def policy_labels() -> dict[str, str]:
    """``{policy: display name}``."""
    return {p.name: p.label for p in registry.all_policies()}


def effective_split(policy: str | None, heavy: Any, recent: Any, sink: Any = 0) -> tuple[int, int, int] | None:
    """``(heavy, recent, sink)`` slots the policy runs with at the configured ``heavy`` and
    ``recent`` (:meth:`h2o_lens.policies.Policy.split`): ``local`` runs every slot as recent,
    ``heavy`` every slot as a heavy hitter (DESIGN.md §2.5).

    None when the split is not known: a budget set per request by a keep ratio (no
    ``heavy``/``recent``), or a policy the registry does not know (a kvpress press, a log of
    another version).
    """
    if policy not in registry.names() or _missing(heavy) or _missing(recent):
        return None
    return registry.get(policy).split(int(heavy), int(recent), 0 if _missing(sink) else int(sink))


def _missing(value: Any) -> bool:
    return value is None or bool(pd.isna(value))  # None, NaN or pd.NA from a DataFrame
