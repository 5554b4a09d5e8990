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
