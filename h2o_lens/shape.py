"""A model's attention shape and the KV sets of an aggregation: the two rules every layer reads.

:func:`model_shape` reads layers, query heads, KV heads and head size from a transformers
config once, and :func:`kv_sets` says how many KV sets a layer keeps under an aggregation
(DESIGN.md §2.6): one per KV head, or one per query head with ``gqa="none"`` (the K/V
repeated per query head). Plain Python, no torch: :mod:`analyses` imports it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import GQA_MODES
from .errors import ConfigError, UnsupportedModelError

__all__ = ["ModelShape", "model_shape", "kv_sets"]


def kv_sets(gqa: str, q_heads: int, kv_heads: int) -> int:
    """KV sets per layer under the aggregation ``gqa``: ``q_heads`` for ``"none"`` (one set per
    query head), else ``kv_heads`` (one per KV head, its query group aggregated)."""
    if gqa not in GQA_MODES:
        raise ConfigError(f"unknown gqa mode {gqa!r}; expected one of {', '.join(GQA_MODES)}")
    return q_heads if gqa == "none" else kv_heads


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a decoder: ``layers``, ``q_heads``, ``kv_heads`` (a divisor of
    ``q_heads``) and ``head_dim`` (None when the config does not say)."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int | None = None

    def __post_init__(self) -> None:
        counts = {"layers": self.layers, "q_heads": self.q_heads, "kv_heads": self.kv_heads}
        bad = {k: v for k, v in counts.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad:
            raise UnsupportedModelError(f"the model config gives {bad}; expected positive whole numbers")
        if self.q_heads % self.kv_heads:
            raise UnsupportedModelError(f"{self.q_heads} query heads are not a multiple of {self.kv_heads} KV heads")

    @property
    def group(self) -> int:
        """Query heads per KV head, ``G``."""
        return self.q_heads // self.kv_heads

    def sets(self, gqa: str) -> int:
        """KV sets per layer under ``gqa`` (:func:`kv_sets`)."""
        return kv_sets(gqa, self.q_heads, self.kv_heads)

    def copies(self, gqa: str) -> int:
        """KV sets per KV head: ``G`` under ``gqa="none"`` (the K/V repeated per query head), else 1."""
        return self.sets(gqa) // self.kv_heads

    def heads_per_set(self, gqa: str) -> int:
        """Query heads whose weights one KV set aggregates: 1 under ``gqa="none"``, else ``G``."""
        return self.q_heads // self.sets(gqa)


def model_shape(config: Any) -> ModelShape:
    """The :class:`ModelShape` of a transformers config (its text config for a multimodal one).

    ``num_key_value_heads`` missing or None means one KV head per query head; ``head_dim``
    missing comes from ``hidden_size // num_attention_heads`` when the config has a hidden size.
    Raises :class:`~h2o_lens.errors.UnsupportedModelError` for head counts that do not divide.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    q_heads = getattr(text, "num_attention_heads", None)
    layers = getattr(text, "num_hidden_layers", None)
    if q_heads is None or layers is None:
        raise UnsupportedModelError(
            f"{type(text).__name__} has no num_attention_heads or num_hidden_layers; "
            "expected the config of a transformers decoder"
        )
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and getattr(text, "hidden_size", None):
        head_dim = text.hidden_size // q_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or q_heads
    return ModelShape(layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
