"""Pinned positions as a cache extension (DESIGN.md §2.11): :class:`Pins` protects each row's pins.

A row's budget (:class:`~h2o_lens.ops.PolicyArgs`) says how many slots its pins take and which
positions they are, so the slot count travels with everything a budget travels with (per-row
budgets, saved state, the guard's rescue). Keeping them in the cache is this extension's work:
it answers :meth:`~h2o_lens.extension.CacheExtension.protected` with each row's pinned
positions, and the cache hands what its extensions protect to the prefill's keep rule and to
every decode step's eligibility test. A cache gets one where pins arise
(:func:`attach`): a pinned config's first prompt, the guard's rescue, a restored state.
"""

from __future__ import annotations

from typing import Any

import torch

from .extension import CacheExtension

__all__ = ["Pins", "attach", "NO_POSITION"]

#: what pads a row's protected positions: no slot ever holds it (an empty slot holds -1)
NO_POSITION = -2


class Pins(CacheExtension):
    """Protects the positions each row's budget pins, in every layer and KV set."""

    #: the prompt forward is the same with or without pins: only the keep rule reads them
    observer = True

    def __init__(self) -> None:
        #: per layer, the last answer: (the budgets' pins, the layer's budget index tensor, the table)
        self._memo: dict[int, tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    def protected(self, layer: Any) -> torch.Tensor | None:
        budgets, rows = layer.owner.budgets, layer.budget
        pins = tuple(a.pinned for a in budgets)
        if rows is None or not any(pins):
            return None
        memo = self._memo.get(layer.layer_idx)
        if memo is not None and memo[0] == pins and memo[1] is rows:
            return memo[2]
        width = max(len(p) for p in pins)
        table = torch.full((len(budgets), width), NO_POSITION, dtype=torch.int64)
        for i, p in enumerate(pins):
            table[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
        out = table.to(rows.device)[rows]  # (b, K)
        self._memo[layer.layer_idx] = (pins, rows, out)
        return out

    def reset(self, layer: Any) -> None:
        self._memo.pop(layer.layer_idx, None)


def attach(cache: Any) -> None:
    """Give ``cache`` its :class:`Pins` extension once some budget of it pins a position."""
    if any(a.pinned for a in cache.budgets):
        cache.extension_of(Pins)
