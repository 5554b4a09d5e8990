"""Input checks and small helpers shared by the kernel launchers (no triton here)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from ..errors import H2OLensError

__all__ = [
    "KernelInputError",
    "interpret_mode",
    "check_tensor",
    "check_device",
    "check_step_inputs",
    "rows_table",
    "next_pow2",
    "cdiv",
    "dot_options",
    "FLOAT_DTYPES",
    "INT_DTYPES",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)


class KernelInputError(H2OLensError, ValueError):
    """A tensor handed to a Triton launcher has the wrong shape, dtype, device or layout."""


def interpret_mode() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_tensor(
    fn: str,
    name: str,
    t: torch.Tensor,
    shape: Sequence[int | None],
    dtypes: Iterable[torch.dtype],
    contiguous: bool = True,
) -> None:
    """Raise :class:`KernelInputError` unless ``t`` has ``shape`` (None = any), a dtype in
    ``dtypes`` and (when ``contiguous``) a contiguous layout. ``fn`` names the caller."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    want = tuple("*" if s is None else s for s in shape)
    if t.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape)):
        raise KernelInputError(f"{fn}: {name} has shape {tuple(t.shape)}, expected {want}")
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise KernelInputError(
            f"{fn}: {name} has dtype {str(t.dtype).replace('torch.', '')}, "
            f"expected one of {names}; convert it with .to(...)"
        )
    if contiguous and not t.is_contiguous():
        raise KernelInputError(
            f"{fn}: {name} of shape {tuple(t.shape)} is not contiguous (strides {t.stride()}); pass {name}.contiguous()"
        )


def check_device(fn: str, *, on_cpu: bool = False, **tensors: torch.Tensor | None) -> torch.device:
    """All tensors on one device, which is CUDA, or CPU under ``TRITON_INTERPRET=1``; with
    ``on_cpu`` (the fused CPU step, :mod:`h2o_lens.kernels.cpu`), the CPU."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise KernelInputError(f"{fn}: tensors are on different devices ({listing}); move them to one device")
    if on_cpu:
        if first.type != "cpu":
            raise KernelInputError(f"{fn}: tensors are on {first}; the fused CPU step takes CPU tensors")
        return first
    if first.type != "cuda" and not interpret_mode():
        raise KernelInputError(
            f"{fn}: tensors are on {first}, but Triton kernels need a CUDA device; on CPU set "
            "TRITON_INTERPRET=1 before triton is imported (slow, for tests) or use backend='torch'"
        )
    return first


def check_step_inputs(
    fn: str, query, key, value, keys, values, scores, positions, step, fill, on_cpu: bool = False
) -> tuple[int, ...]:
    """Shapes, dtypes and devices of a fused decode step's inputs, as both fused steps take them
    (``on_cpu``: this file's); returns ``(b, Hs, B, d, Hq)`` or raises :class:`KernelInputError`."""
    if keys.dim() != 4:
        raise KernelInputError(f"{fn}: keys has shape {tuple(keys.shape)}, expected (b, Hs, B, d)")
    b, hs, cap, d = keys.shape
    if query.dim() != 3 or query.shape[0] != b or query.shape[2] != d or query.shape[1] % hs:
        raise KernelInputError(
            f"{fn}: query has shape {tuple(query.shape)}, expected (b={b}, Hq, d={d}) "
            f"with Hq a multiple of the {hs} KV sets of keys"
        )
    hq = query.shape[1]
    dt = (keys.dtype,)
    dense = not on_cpu  # the CPU step reads strided slots (block storage); its caller checks the inner axes
    check_tensor(fn, "keys", keys, (b, hs, cap, d), FLOAT_DTYPES, dense)
    check_tensor(fn, "values", values, (b, hs, cap, d), dt, dense)
    check_tensor(fn, "query", query, (b, hq, d), dt)
    check_tensor(fn, "key", key, (b, hs, d), dt)
    check_tensor(fn, "value", value, (b, hs, d), dt)
    check_tensor(fn, "scores", scores, (b, hs, cap), (torch.float32,), dense)
    check_tensor(fn, "positions", positions, (b, hs, cap), INT_DTYPES, dense)
    check_tensor(fn, "step", step, (b,), INT_DTYPES)
    if fill is not None:
        check_tensor(fn, "fill", fill, (b,), INT_DTYPES)
    check_device(
        fn,
        on_cpu=on_cpu,
        query=query,
        key=key,
        value=value,
        keys=keys,
        values=values,
        scores=scores,
        positions=positions,
        step=step,
        fill=fill,
    )
    if cap < 1:
        raise KernelInputError(f"{fn}: keys has {cap} slots; the cache needs at least one")
    return b, hs, cap, d, hq


def rows_table(rows, b: int, hs: int, device: torch.device) -> torch.Tensor:
    """A :class:`~h2o_lens.ops.RowBudgets`' capacity, recent window and sink per request and KV set,
    ``(b, Hs, 3)`` int64 contiguous on ``device``: the table both fused steps read."""
    parts = [t.to(device=device, dtype=torch.int64).expand(b, hs, 1) for t in (rows.capacity, rows.recent, rows.sink)]
    return torch.cat(parts, -1).contiguous()


def dot_options(dtype: torch.dtype) -> dict:
    """Launch constants ``PREC`` and ``DOT_F32`` of the ``tl.dot`` calls for inputs of ``dtype``.

    FP32 inputs use IEEE products (TF32 would be less accurate than torch's FP32
    matmul); 16-bit inputs keep Triton's default. Triton's CPU interpreter
    multiplies bf16 bit patterns as integers, so under ``TRITON_INTERPRET=1`` the
    kernels widen bf16 tiles to FP32 before ``tl.dot`` (``DOT_F32``); products of
    bf16 values are exact in FP32.
    """
    widen = dtype == torch.bfloat16 and interpret_mode()
    return dict(PREC="ieee" if dtype == torch.float32 or widen else None, DOT_F32=widen)
