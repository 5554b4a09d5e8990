"""The model drivers of H2O Lens: recording, replay and re-runs of a model under a policy.

:func:`record` generates with a policy and writes every eviction, :func:`replay`
re-runs a recorded run against a full-cache teacher, :func:`check_lifecycle`
checks a cache's state across a save and restore. The logs they write follow the
contract of :mod:`runlog` (one layer down), which opens them without torch.

These entry points import torch and transformers: they are loaded on first use,
so ``import recorders`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

#: the recording and replay entry points import torch: loaded on first access
_LAZY = {
    "record": ".recorder",
    "record_teacher_forced": ".recorder",
    "replay": ".replay",
    "check_lifecycle": ".lifecycle",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'recorders' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
