"""The guard's raise: a row's slot count grows, from a decode step or from the prefill on (DESIGN.md §18.2).

Both verbs change the rows' budgets through the cache's own bookkeeping and tell its extensions
(:meth:`h2o_lens.cache.H2OCache.notify` before, :meth:`~h2o_lens.cache.H2OCache.slots_changed` after).
"""

from __future__ import annotations

import dataclasses

from . import eviction, ops
from .cache import H2OCache
from .errors import ConfigError
from .pins import attach as attach_pins
from .slot_blocks import BLOCK_BACKENDS, widened

__all__ = ["grow_rows", "raise_prompt"]


def grow_rows(cache: H2OCache, rows: list[int], slots: list[int]) -> None:
    """Grow the slot count of batch ``rows`` of ``cache`` to ``slots`` per KV set, for the rest
    of the generation (DESIGN.md §18.2).

    The new slots are heavy slots (the recent window and the sink stay as they are); they start
    empty at the end of each row's storage, so the next steps fill them before anything is
    evicted again, as an H2O run whose slot count changed at this step. Positions evicted
    before stay evicted. Call it between decode steps. A listener's ``on_state`` hears a
    ``raise`` event (rows, requests, slots) first.
    """
    first = cache.layers[0]
    if first.budget is None:
        raise ConfigError("grow_rows: the H2O cache has not seen a prompt yet")
    old_caps = cache.row_capacity(first.budget)  # (b,)
    requests = [cache.request_ids[r] for r in rows] if cache.request_ids is not None else list(rows)
    # a listener first hears the rows as they were (the recorder writes its pending steps)
    cache.notify({"event": "raise", "rows": list(rows), "requests": requests, "slots": [int(n) for n in slots]})
    index = first.budget.clone()
    for r, n in zip(rows, slots):
        old = cache.budgets[int(index[r])]
        if n < old.capacity:
            raise ConfigError(f"grow_rows: row {r} holds {old.capacity} slots; a raise to {n} would shrink it")
        new = dataclasses.replace(old, heavy=old.heavy + n - old.capacity)
        if new not in cache.budgets:
            cache.budgets.append(new)
        index[r] = cache.budgets.index(new)
        if cache.request_configs is not None:
            cfg = cache.request_configs[r]
            cache.request_configs[r] = dataclasses.replace(cfg, heavy=int(cfg.heavy) + n - old.capacity)
    cache._rows = index.cpu()
    width = max(a.capacity for a in (cache.budgets[i] for i in set(index.tolist())))
    for layer in cache.layers:
        fill = old_caps.clone() if layer.fill is None else layer.fill.clone()
        layer.budget = index.to(layer.budget.device)
        extra = width - layer.keys.shape[2]
        if extra > 0:
            pad = {"keys": 0.0, "values": 0.0, "scores": 0.0, "history": 0, "positions": eviction.EMPTY}
            for name, value in pad.items():
                t = getattr(layer, name)
                if t is not None:
                    setattr(layer, name, widened(t, extra, value, cache.backend in BLOCK_BACKENDS))
        layer.fill = fill.to(layer.keys.device)
        layer._groups = layer._row_budgets = None
    cache.slots_changed(rows, slots, "raise")


def raise_prompt(
    cache: H2OCache, rows: list[int], slots: list[int], pinned: list[tuple[int, ...]] | None = None
) -> None:
    """Give batch ``rows`` of ``cache`` ``slots`` per KV set before their prompts are laid into
    slots: from the prefill on, each such row is an H2O run at its new slot count (the extra
    slots are heavy slots), with ``pinned[i]`` (when given) its pinned positions (DESIGN.md §2.11, taken
    out of those slots). A listener's ``on_state`` hears a ``raise`` event first, as with
    :func:`grow_rows`."""
    from .config import pin

    requests = [cache.request_ids[r] for r in rows] if cache.request_ids is not None else list(rows)
    cache.notify({"event": "raise", "rows": list(rows), "requests": requests, "slots": [int(n) for n in slots]})
    index = cache._rows.clone()
    for i, (r, n) in enumerate(zip(rows, slots)):
        old = cache.budgets[int(index[r])]
        cfg = cache.request_configs[r]
        cfg = dataclasses.replace(cfg, heavy=int(cfg.heavy) + n - old.capacity)
        if pinned is not None and pinned[i]:
            cfg = pin(cfg, pinned[i])
        new = ops.PolicyArgs(cfg.policy, *cfg.split, cfg.gqa, cfg.seed, cfg.pinned)
        if new not in cache.budgets:
            cache.budgets.append(new)
        index[r] = cache.budgets.index(new)
        cache.request_configs[r] = cfg
    cache._rows = index
    for layer in cache.layers:
        if layer.budget is not None:
            layer.budget = index.to(layer.budget.device)
        layer.forget_groups()
    attach_pins(cache)  # the rescue's pins are kept by the cache's Pins extension (DESIGN.md §2.11)
    cache.slots_changed(rows, slots, "raise")


# -- token cues -------------------------------------------------------------------------------------
