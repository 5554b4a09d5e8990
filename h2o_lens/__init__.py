"""H2O Lens: exact H2O KV-cache eviction for transformers, and the tools to see it.

The public API is re-exported lazily so that ``import h2o_lens`` stays cheap
and needs no pyarrow, duckdb or streamlit. Recording lives one layer up, in
:mod:`recorders` (``recorders.record``): this package imports nothing above it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "H2OConfig": ".config",
    "H2OLensError": ".errors",
    "ConfigError": ".errors",
    "UnsupportedModelError": ".errors",
    "DefaultModelMissingError": ".errors",
    "ImplementationError": ".errors",
    "UnsupportedVersionError": ".errors",
    "MissingExtraError": ".errors",
    "h2o": ".runtime",
    "H2OSession": ".runtime",
    "H2OCache": ".cache",
    "simulate": ".reference",
    "load_model": ".models",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = _EXPORTS[name]
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'h2o_lens' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
