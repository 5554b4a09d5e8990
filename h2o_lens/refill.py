"""The guard's ``refill``: re-prefill a request's tokens so far at a higher budget, then go on (DESIGN.md §18.2).

An evicted key cannot come back from the cache; it can from the text. :func:`refill_rows` runs a
fresh H2O prefill of each chosen row's prompt and generated tokens at its new slot count and puts
that state in place of the row's, in the live cache, between two decode steps. The row then goes on
exactly as a fresh run at the higher budget whose prompt is those tokens (a request equals itself
alone, DESIGN.md §2.7). :class:`Refill` is the logits processor that does it inside ``generate``
for the rows the guard marked, and replaces their next-token logits by the fresh prefill's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from . import compat, eviction
from .cache import H2OCache, H2OCacheLayer
from .slot_blocks import BLOCK_BACKENDS, widened

__all__ = ["refill_rows", "Refill"]


def refill_rows(model: Any, cache: H2OCache, input_ids: torch.Tensor, rows: list[int], slots: list[int]):
    """Replace the state of batch ``rows`` of ``cache`` by a fresh prefill of their tokens so far.

    ``input_ids (b, n)`` every token the cache has processed, left-padded as ``generate`` holds
    them (row ``r``'s real tokens are its last ``next_pos[r]``); ``slots`` the new slot count per
    KV set of each row (its extra slots are heavy slots). Returns the fresh prefills' logits of
    each row's last position ``(len(rows), vocab)``.
    """
    first = cache.layers[0]
    logits = []
    for r, n in zip(rows, slots):
        length = int(first.next_pos[r])
        seq = input_ids[r, input_ids.shape[1] - length :][None]  # (1, L)
        old = cache.request_configs[r]
        cfg = dataclasses.replace(old, heavy=int(old.heavy) + n - old.capacity)
        fresh = H2OCache(cfg, model.config, layer_class=H2OCacheLayer, extensions=())
        with torch.no_grad():
            out = model(input_ids=seq, use_cache=True, logits_to_keep=1, **compat.cache_kwargs(fresh))
        logits.append(out.logits[0, -1])
        _adopt_row(cache, r, fresh, cfg)
    return torch.stack(logits)


def _adopt_row(cache: H2OCache, r: int, fresh: H2OCache, cfg: Any) -> None:
    """Put row 0 of ``fresh`` (one request, its own budget) in place of row ``r`` of ``cache``."""
    args = fresh.budgets[0]
    if args not in cache.budgets:
        cache.budgets.append(args)
    first = cache.layers[0]
    caps = cache.row_capacity(first.budget)  # (b,) before the change
    index = first.budget.clone()
    index[r] = cache.budgets.index(args)
    cache._rows = index.cpu()
    cache.request_configs[r] = cfg
    width = max(cache.budgets[i].capacity for i in set(index.tolist()))
    pad = {"keys": 0.0, "values": 0.0, "scores": 0.0, "history": 0, "positions": eviction.EMPTY}
    for layer, new in zip(cache.layers, fresh.layers):
        fill = caps.clone() if layer.fill is None else layer.fill.clone()
        extra = width - layer.keys.shape[2]
        for name, value in pad.items():
            t = getattr(layer, name)
            if t is None:
                continue
            if extra > 0:
                t = widened(t, extra, value, cache.backend in BLOCK_BACKENDS)
            src = getattr(new, name)
            t[r] = value
            t[r, :, : src.shape[2]] = src[0].to(t.dtype)
            setattr(layer, name, t)
        fill[r] = args.capacity if new.fill is None else int(new.fill[0])
        layer.fill = fill.to(layer.keys.device)
        layer.budget = index.to(layer.budget.device)
        layer.next_pos = layer.next_pos.clone()
        layer.next_pos[r] = new.next_pos[0]
        layer._groups = layer._row_budgets = None
    cache.slots_changed([r], [args.capacity], "refill")  # a guard's reservoir starts over for the row


class Refill:
    """A logits processor that refills the rows the guard marked (:func:`refill_rows`) and gives
    them the fresh prefill's next-token logits. Pass it to ``generate`` as
    ``logits_processor=[guard.refill(model)]``; the recompute's time is part of the step's."""

    def __init__(self, guard: Any, model: Any):
        self.guard = guard
        self.model = model

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        state = self.guard.last
        if state is None:
            return scores
        state.refiller = True
        if not state.pending:
            return scores
        pending, state.pending = state.pending, []
        t0 = time.perf_counter()
        rows = [p["row"] for p in pending]
        fresh = refill_rows(self.model, state.cache, input_ids, rows, [p["slots_after"] for p in pending])
        seconds = time.perf_counter() - t0
        scores = scores.clone()
        scores[rows] = fresh.to(scores.dtype)
        for p in pending:
            p.pop("row")
            state.events.append({**p, "seconds": seconds / len(pending)})
        state.refill_seconds += seconds
        return scores
