"""Save and restore an H2O cache's state (DESIGN.md §15.2): plain JSON and the layers' row-state tensors."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import ops, pins
from .config import H2OConfig
from .errors import ConfigError
from .slot_blocks import BLOCK_BACKENDS, rebased

__all__ = ["ROW_STATE", "export_state", "import_state"]

#: per-request state that moves with the batch rows (beam reorder, expansion, selection)
ROW_STATE = ("keys", "values", "scores", "history", "positions", "fill", "next_pos", "budget")


def export_state(cache: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(header, tensors)``: everything a restored cache needs to continue exactly.

    ``header`` is plain JSON (budgets, per-row budget choice, backend, columns seen,
    request ids); ``tensors`` maps ``layer.<i>.<name>`` to each layer's row state
    (:data:`ROW_STATE`), on the CPU.
    """
    if cache.batch_size == 0:
        raise ConfigError("the H2O cache has not seen a prompt yet: there is no state to save")
    cache.end_segments()  # an open verification segment stands in full (DESIGN.md §14)
    header = {
        "budgets": [dataclasses.asdict(a) for a in cache.budgets],
        "rows": None if cache.row_index is None else cache.row_index.tolist(),
        "request_configs": None if cache.request_configs is None else [c.to_dict() for c in cache.request_configs],
        "request_ids": cache.request_ids,
        "backend": cache.backend,
        "prefill_chunk": cache.prefill_chunk,
        "seen": [layer.seen for layer in cache.layers],
        "batch": cache.batch_size,
        "next_pos": cache.layers[0].next_pos.tolist(),
    }
    tensors = {}
    for i, layer in enumerate(cache.layers):
        for name in ROW_STATE:
            t = getattr(layer, name)
            if t is not None:
                tensors[f"layer.{i}.{name}"] = t.detach().cpu()
    return header, tensors


def args_from_dict(a: dict[str, Any]) -> ops.PolicyArgs:
    """A budget as :func:`export_state` wrote it (JSON lists back to tuples; a budget plan's table too)."""
    a = {**a, "pinned": tuple(a["pinned"])}
    if a.get("plan") is not None:
        a["plan"] = tuple(tuple(tuple(s) for s in row) for row in a["plan"])
    if a.get("sets") is not None:
        a["sets"] = tuple(tuple(s) for s in a["sets"])
    return ops.PolicyArgs(**a)


def import_state(cache: Any, header: dict[str, Any], tensors: dict[str, torch.Tensor], device: Any = None) -> None:
    """Load what :meth:`export_state` returned into this (fresh) cache."""
    if len(header["seen"]) != len(cache.layers):
        raise ConfigError(
            f"the saved state has {len(header['seen'])} layers, this model {len(cache.layers)}; "
            "restore it into the model it was saved from"
        )
    cache.budgets = [args_from_dict(a) for a in header["budgets"]]
    pins.attach(cache)
    cache.row_index = None if header["rows"] is None else torch.tensor(header["rows"], dtype=torch.int64)
    cfgs = header["request_configs"]
    cache.request_configs = None if cfgs is None else [H2OConfig(**c) for c in cfgs]
    cache.request_ids = None if header["request_ids"] is None else [int(r) for r in header["request_ids"]]
    cache.backend = header["backend"]
    cache.prefill_chunk = int(header["prefill_chunk"])
    for i, layer in enumerate(cache.layers):
        layer.reset()
        for name in ROW_STATE:
            t = tensors.get(f"layer.{i}.{name}")
            t = None if t is None else t.to(device) if device is not None else t
            if t is not None and name in ("keys", "values") and cache.backend in BLOCK_BACKENDS:
                t = rebased(t)  # the torch step's block storage (DESIGN.md §2.7)
            setattr(layer, name, t)
        layer.seen = int(header["seen"][i])
        layer.device, layer.dtype = layer.keys.device, layer.keys.dtype
        layer.is_initialized = True
