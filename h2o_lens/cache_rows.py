"""What an H2O cache does per batch row (DESIGN.md §2.7, §15.3): resolving each request's budget,
stepping rows of different budgets one launch per budget, and cancelling rows.

Functions of an :class:`~h2o_lens.cache.H2OCache` (``cache``) or one of its layers (``layer``),
split from the cache module; the cache's methods of the same names call them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import ops, pins
from .errors import ConfigError
from .plan import policy_args

__all__ = ["assign_budgets", "check_row_pins", "step_groups", "cancel"]


def check_row_pins(config: Any, row_pins: Sequence[Sequence[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    """``row_pins`` (one set of pinned positions per batch row, DESIGN.md §2.11) as sorted tuples, or
    None; a :class:`ConfigError` for a set the config cannot pin (the same checks as
    :func:`h2o_lens.config.pin` on a resolved config; a keep ratio's are made per row at the prefill)."""
    if row_pins is None:
        return None
    from .config import pin, pin_positions

    rows = tuple(pin_positions(p) for p in row_pins)
    if not rows:
        raise ConfigError("row_pins gives no set of positions; give one per batch row, or leave row_pins out")
    if config.plan is not None:
        raise ConfigError("pinned positions with a budget plan are not supported; pin with a uniform budget")
    if config.resolved:
        for p in set(rows):
            pin(config, p)
    return rows


def _row_configs(cache: Any, lens: list[int]) -> list[Any]:
    """Each row's config resolved on its prompt length, with its own pins under ``cache.row_pins``."""
    row_pins = getattr(cache, "row_pins", None)
    if row_pins is not None and len(row_pins) != len(lens):
        raise ConfigError(
            f"row_pins gives {len(row_pins)} sets of positions for a batch of {len(lens)} rows; give one per row"
        )
    pinned = list(row_pins) if row_pins is not None else [cache.config.pinned] * len(lens)
    late = [r for r, (p, n) in enumerate(zip(pinned, lens)) if p and p[-1] >= n]
    if late:
        r = late[0]
        raise ConfigError(
            f"pinned position {pinned[r][-1]} is beyond the prompt of request {r} "
            f"({lens[r]} tokens, positions 0 to {lens[r] - 1}); pinned positions "
            "are 0-based positions of each request's real prompt tokens (padding excluded)"
        )
    cfgs = [cache.config.resolve(n) for n in lens]
    if row_pins is not None:
        cfgs = [dataclasses.replace(c, pinned=p) for c, p in zip(cfgs, row_pins)]
    return cfgs


def assign_budgets(cache: Any, prompt_lens: torch.Tensor) -> torch.Tensor:
    """Resolve the budget of each request against its own prompt length, once.

    ``prompt_lens (b,)`` unpadded prompt lengths. Returns ``(b,)`` int64
    indices into :attr:`budgets` (the same for every layer). Under ``cache.row_pins`` row ``r``
    pins ``row_pins[r]`` instead of the config's pins (:func:`check_row_pins`).
    """
    if cache.row_index is None:
        cfgs = _row_configs(cache, prompt_lens.tolist())
        rows = []
        for cfg in cfgs:
            args = policy_args(cfg)  # with a budget plan, its table (DESIGN.md §2.14)
            if args not in cache.budgets:
                cache.budgets.append(args)
            rows.append(cache.budgets.index(args))
        cache.request_configs = cfgs
        cache.row_index = torch.tensor(rows, dtype=torch.int64)
        pins.attach(cache)
    return cache.row_index


def step_groups(
    layer: Any, step_fn: Callable[..., ops.DecodeResult], groups, q, k, v, step, scaling: float
) -> ops.DecodeResult:
    """The Triton step of a batch whose budgets differ: one launch per budget on its rows
    and its first ``B_r`` slots, written back (the kernel takes one budget per launch;
    the torch step takes per-row budgets in one computation)."""
    b, hs, cap = layer.positions.shape
    out = q.new_empty(q.shape)
    slot = torch.empty(b, hs, dtype=torch.int64, device=q.device)
    evicts = torch.empty(b, hs, dtype=torch.bool, device=q.device)
    for rows, args in groups:
        sel = torch.arange(b, device=q.device) if rows is None else rows
        c = args.capacity
        stored = [layer.keys, layer.values, layer.scores, layer.positions]
        state = [t[sel, :, :c].contiguous() for t in stored]
        fill = None if layer.fill is None else layer.fill[sel]
        if fill is not None and bool((fill >= c).all()):
            fill = None
        res = step_fn(args, q[sel], k[sel], v[sel], *state, step[sel], fill, scaling, False)
        for t, new in zip(stored, state):
            t[sel, :, :c] = new
        out[sel] = res.out
        slot[sel] = torch.where(res.slot >= c, cap, res.slot)  # c: the new token itself
        evicts[sel] = res.evicts
    return ops.DecodeResult(out=out, slot=slot, evicts=evicts)


def cancel(cache: Any, rows: int | list[int]) -> list[int]:
    """Remove the batch rows ``rows`` (their requests end); the other rows keep their state.

    Every layer drops the rows' keys, values, scores, positions and counters (the
    tensors are rebuilt without them, so their memory is freed) and the remaining
    rows move up in order, untouched. Returns the rows kept (their old indices): feed
    the next step only those rows of ``input_ids`` and the attention mask.
    """
    gone = sorted({int(r) for r in ([rows] if isinstance(rows, int) else rows)})
    b = cache.batch_size
    bad = [r for r in gone if not 0 <= r < b]
    if bad or not gone:
        raise ConfigError(f"cancel: rows {bad or gone} are not rows of this batch of {b}; give rows 0..{b - 1}")
    if len(gone) == b:
        raise ConfigError(f"cancel: removing all {b} rows leaves nothing to decode; drop the cache instead")
    keep = [r for r in range(b) if r not in gone]
    requests = [cache.request_ids[r] for r in gone] if cache.request_ids is not None else gone
    cache.batch_select_indices(torch.tensor(keep, dtype=torch.int64, device=cache.layers[0].keys.device))
    cache.notify({"event": "cancel", "rows": gone, "requests": requests})
    return keep
