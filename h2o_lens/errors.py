"""Error hierarchy of H2O Lens.

Every error says what was received, what was expected and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "H2OLensError",
    "ConfigError",
    "UnsupportedModelError",
    "DefaultModelMissingError",
    "ImplementationError",
    "UnsupportedVersionError",
    "MissingExtraError",
]


class H2OLensError(Exception):
    """Base class of all errors raised by H2O Lens."""


class ConfigError(H2OLensError, ValueError):
    """A policy, budget or option value is invalid."""


class UnsupportedModelError(H2OLensError, TypeError):
    """The model cannot be hooked by the H2O runtime."""

    @classmethod
    def unattended(cls, layer: int) -> UnsupportedModelError:
        """A cache layer's update while the last forward's keys and values still wait for H2O's attention."""
        return cls(
            f"layer {layer}: an H2O cache got new keys and values before H2O's attention took the last ones: "
            "another attention implementation ran on it (model.set_attn_implementation inside "
            "h2o_lens.h2o(...)?) or a forward failed half way, and the cache cannot hold tokens it never "
            "attended; use a new cache (session.new_cache())"
        )


class DefaultModelMissingError(H2OLensError, ImportError):
    """The packaged default model is not installed."""


class ImplementationError(H2OLensError, RuntimeError):
    """The runtime broke one of its own invariants (a bug, never user error)."""


class UnsupportedVersionError(H2OLensError, RuntimeError):
    """The installed transformers release is outside the supported range (DESIGN.md §3.1)."""


class MissingExtraError(H2OLensError, ImportError):
    """An optional dependency (an extra such as ``h2o-lens[kvpress]``) is not installed."""
