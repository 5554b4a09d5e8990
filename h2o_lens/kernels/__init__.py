"""Triton kernels of H2O Lens, one per file, and the choice of backend.

Every kernel implements a contract that a torch function defines:

* :func:`decode_step_triton` — :func:`h2o_lens.ops.decode_step` (fused step, in place);
* :func:`prefill_scores_triton` — the scores of :func:`h2o_lens.ops.prefill_attention`;
* :func:`replay_dropped_mass_triton` — :func:`replay_dropped_mass_torch` (DESIGN.md §6);
  the replay's torch passes :func:`replay_teacher_torch` and :func:`replay_masked_torch` share it.

Nothing here imports triton at module level: the launchers are loaded on
first access and compile their kernels on first call, so a CPU-only install
imports this package. On CPU the kernels run under ``TRITON_INTERPRET=1``
(slow; for tests).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from ..errors import ConfigError
from ._checks import KernelInputError, interpret_mode

__all__ = [
    "triton_available",
    "resolve_backend",
    "KernelInputError",
    "decode_step_triton",
    "decode_step_cpu",
    "fused_step",
    "prefill_scores_triton",
    "replay_dropped_mass_triton",
    "replay_dropped_mass_torch",
    "replay_masked_torch",
    "replay_teacher_torch",
]

_LAUNCHERS = {
    "decode_step_triton": ".decode",
    "decode_step_cpu": ".cpu",
    "prefill_scores_triton": ".prefill",
    "replay_dropped_mass_triton": ".replay",
    "replay_dropped_mass_torch": ".replay",
    "replay_masked_torch": ".replay",
    "replay_teacher_torch": ".replay",
}


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` succeeds on this machine."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while importing
        return False
    return True


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The backend that runs on ``device``: ``"torch"``, ``"triton"`` or ``"cpp"``.

    ``"auto"`` picks Triton on a CUDA device when triton imports, torch
    otherwise. ``"triton"`` is honoured on CUDA, and on CPU only under
    ``TRITON_INTERPRET=1``; ``"cpp"`` (the fused CPU step) on CPU where it builds;
    anything else raises :class:`~h2o_lens.errors.ConfigError`.
    """
    device = torch.device(device)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "cpp":
        return _cpp_backend(device)
    if backend != "triton":
        raise ConfigError(f"unknown backend {backend!r}; expected auto, torch, triton or cpp")
    if not triton_available():
        raise ConfigError(
            "backend='triton' but triton does not import here; install it "
            "(pip install 'h2o-lens[gpu]') or use backend='auto' or 'torch'"
        )
    if device.type != "cuda" and not interpret_mode():
        raise ConfigError(
            f"backend='triton' needs a CUDA device, got tensors on {device}; use "
            "backend='auto' or 'torch' on CPU, or set TRITON_INTERPRET=1 before triton is "
            "imported to run the kernels in Triton's (slow) interpreter"
        )
    return "triton"


def _cpp_backend(device: torch.device) -> str:
    if device.type != "cpu":
        raise ConfigError(f"backend='cpp' is the fused CPU step, got tensors on {device}; use 'auto' or 'triton'")
    from .cpu import cpu_step_problem

    problem = cpu_step_problem()
    if problem is not None:
        raise ConfigError(
            f"backend='cpp': {problem}; use backend='torch' (the build needs a C++ compiler, ninja and room in "
            "torch's extension folder, TORCH_EXTENSIONS_DIR)"
        )
    return "cpp"


def fused_step(backend: str, asks: tuple | None = None) -> Any:
    """The fused decode step of a resolved ``backend`` (``"triton"`` or ``"cpp"``), which share one
    contract (:func:`decode_step_triton`). ``asks`` ``(want_candidates, weights, journal,
    protected)``: what the CPU step is to give or take besides (bound to it; None: nothing); the
    Triton step takes none of them (:meth:`h2o_lens.cache.H2OCacheLayer._kernel_step` sends it none)."""
    if backend == "cpp":
        from .cpu import decode_step_cpu

        names = ("want_candidates", "weights", "journal", "protected")
        return functools.partial(decode_step_cpu, **dict(zip(names, asks or ())))
    from .decode import decode_step_triton

    return decode_step_triton


def __getattr__(name: str) -> Any:
    if name in _LAUNCHERS:
        value = getattr(importlib.import_module(_LAUNCHERS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'h2o_lens.kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
