"""Deliberately broken state handling, for diagnosis only (DESIGN.md §8.1).

The lifecycle check and the reports must catch an implementation that gets the
serving state wrong. To show that they do, the runtime carries a few known bugs
behind this switch; each is off unless a test turns it on::

    with faults.inject("scores_not_rolled_back"):
        ...  # the runtime now misbehaves in exactly that way

:data:`KNOWN` names every fault and what it breaks. The switch is process-wide
and meant for tests; nothing outside ``tests/`` should turn a fault on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .errors import ConfigError

__all__ = ["KNOWN", "inject", "active"]

#: fault name -> what the broken runtime does
KNOWN: dict[str, str] = {
    "scores_not_rolled_back": "a rejected speculative segment's attention stays in the cumulative scores",
    "kv_reorder_without_scores": "a beam reorder moves K and V but not the scores and positions",
    "prefix_without_copy": "requests sharing a prompt prefix write into the shared slots (no copy-on-write)",
}

_ON: set[str] = set()


@contextlib.contextmanager
def inject(*names: str) -> Iterator[None]:
    """Turn the named faults on for the duration of the block."""
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ConfigError(f"unknown fault(s) {unknown}; known: {sorted(KNOWN)}")
    before = set(_ON)
    _ON.update(names)
    try:
        yield
    finally:
        _ON.clear()
        _ON.update(before)


def active(name: str) -> bool:
    """Whether the fault ``name`` is on (a misspelt name is an error, never silently off)."""
    if name not in KNOWN:
        raise ConfigError(f"unknown fault {name!r}; known: {sorted(KNOWN)}")
    return name in _ON
