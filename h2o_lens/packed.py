"""Packed linear layers for batched decoding on CPU (DESIGN.md §16).

A decode step multiplies a few rows (one per request) by every weight matrix
of the model. With a handful of rows MKL's ordinary ``sgemm`` re-lays out the
weight on each call and runs far below the cores' peak: on the packaged model
eight rows cost about 2.4 times one row. ``cblas_sgemm_compute`` on a weight
packed once for that row count (``torch.ops.mkl._mkl_linear``, what
``torch.compile`` uses on CPU) brings eight rows to about 1.5 times one row.

:func:`packed_linears` packs every float32 ``nn.Linear`` of a CPU model for a
given row count and routes the layers through the packed product while the
``with`` block lasts, in the model's forwards of one new position per row. The
prompt pass (even its last-position head, which has as many rows), a forward
of another row count (a speculative segment, a replay's forward) and anything
that needs gradients take the ordinary ``F.linear``, so only the decode steps
of that batch change. One row is never packed: there the plain product is faster.
The packed product differs from ``F.linear`` by float rounding only (another
blocking of the same sums). Packs are cached per model (one row count at a
time, refreshed when a weight changes in place); they cost one more copy of
the linear weights, so a model whose copy would take more than half the free memory is not
packed. ``H2O_LENS_PACKED_LINEARS=0`` turns packing off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["packed_linears", "packing_available", "ENV_SWITCH"]

#: set to ``0`` to keep every linear layer on ``F.linear``
ENV_SWITCH = "H2O_LENS_PACKED_LINEARS"

# model -> (rows, {module: (data_ptr, version, packed weight)})
_PACKS: weakref.WeakKeyDictionary[Any, tuple[int, dict[torch.nn.Linear, tuple[int, int, torch.Tensor]]]]
_PACKS = weakref.WeakKeyDictionary()


def _kernel_present() -> bool:
    mkl = getattr(torch.ops, "mkl", None)
    try:
        return bool(
            torch.backends.mkl.is_available()
            and mkl is not None
            and hasattr(mkl, "_mkl_linear")
            and hasattr(mkl, "_mkl_reorder_linear_weight")
        )
    except (AttributeError, RuntimeError):
        return False


def _linears(model: Any) -> list[torch.nn.Linear]:
    return [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
    ]


def _free_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def packing_available(model: Any) -> bool:
    """Whether :func:`packed_linears` would pack ``model``: CPU float32 linears, MKL, not
    switched off, and room for the packed copy (at most half the free memory, unless packed
    already)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not isinstance(model, torch.nn.Module) or not _kernel_present():
        return False
    layers = _linears(model)
    if not layers:
        return False
    if model in _PACKS:
        return True
    free = _free_bytes()
    return free is None or 2 * sum(m.weight.nbytes for m in layers) <= free


def _packs_for(model: Any, rows: int) -> dict[torch.nn.Linear, tuple[int, int, torch.Tensor]]:
    held = _PACKS.get(model)
    packs = held[1] if held is not None and held[0] == rows else {}
    fresh: dict[torch.nn.Linear, tuple[int, int, torch.Tensor]] = {}
    for module in _linears(model):
        weight = module.weight
        key = (weight.data_ptr(), weight._version)
        old = packs.get(module)
        if old is not None and old[:2] == key:
            fresh[module] = old
        else:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
            fresh[module] = (key[0], key[1], packed)
    _PACKS[model] = (rows, fresh)
    return fresh


class _Gate:
    """Open while the model runs a forward of one new position per row (a decode step)."""

    def __init__(self) -> None:
        self.open = False

    def wrap(self, original):
        def forward(*args: Any, **kwargs: Any):
            x = kwargs.get("input_ids", args[0] if args else None)
            if x is None:
                x = kwargs.get("inputs_embeds")
            before = self.open
            self.open = x is not None and x.dim() >= 2 and x.shape[1] == 1
            try:
                return original(*args, **kwargs)
            finally:
                self.open = before

        return functools.wraps(original)(forward)


def _product(x: torch.Tensor, packed: torch.Tensor, module: torch.nn.Linear, rows: int) -> torch.Tensor:
    """``module(x)`` by MKL's packed product (``x`` has ``rows`` rows)."""
    return torch.ops.mkl._mkl_linear(x, packed, module.weight, module.bias, rows)


def _packed_forward(module: torch.nn.Linear, packed: torch.Tensor, rows: int, gate: _Gate):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if (
            not gate.open
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or x.numel() != rows * module.in_features
            or (torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad))
        ):
            return F.linear(x, module.weight, module.bias)
        return _product(x, packed, module, rows)

    return forward


@contextlib.contextmanager
def packed_linears(model: Any, rows: int) -> Iterator[bool]:
    """Route ``model``'s float32 CPU linear layers through products packed for ``rows`` rows,
    in the forwards of one new position per row (decode steps).

    Yields whether packing is on (``False`` for one row, a model on another
    device or dtype, a torch without MKL, ``H2O_LENS_PACKED_LINEARS=0``, or no
    room). The model's and every layer's own ``forward`` are back in place when
    the block ends, exceptions included. A forward of several positions per row
    (a prompt pass, whose last-position head also has ``rows`` rows), an input
    of another row count, or one that needs gradients goes through ``F.linear``
    unchanged.
    """
    if rows < 2 or not packing_available(model):
        yield False
        return
    packs = _packs_for(model, int(rows))
    gate = _Gate()
    saved: list[tuple[Any, bool, Any]] = [(model, "forward" in vars(model), vars(model).get("forward"))]
    try:
        model.forward = gate.wrap(model.forward)
        for module, (_, _, packed) in packs.items():
            saved.append((module, "forward" in vars(module), vars(module).get("forward")))
            module.forward = _packed_forward(module, packed, int(rows), gate)
        yield True
    finally:
        for module, had, old in reversed(saved):
            if had:
                module.forward = old
            else:
                del module.forward
