"""The attention function and mask function registered with transformers.

Registered under one name, :data:`ATTN_NAME`, only while a scope
(:func:`h2o_lens.runtime.h2o`) is active: nothing is patched at import.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from .errors import UnsupportedModelError

__all__ = ["ATTN_NAME", "h2o_attention", "h2o_mask", "register", "unregister"]

ATTN_NAME = "h2o_lens"
_lock = threading.Lock()
_users = 0


def h2o_mask(batch_size: int, q_length: int, kv_length: int, *args: Any,
             attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """Pass the 2-D padding mask ``(b, kv_length)`` through unchanged.

    Causality and slot validity are built inside :func:`h2o_attention`; the
    only thing it needs from the model is which prompt columns are padding.
    """
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.to(torch.bool)


def h2o_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None,
                  dropout: float = 0.0, h2o_layer: Any = None, **kwargs: Any
                  ) -> tuple[torch.Tensor, None]:
    """Attention over the H2O cache of ``module``'s layer.

    ``query (b, Hq, q, d)``; ``key``/``value`` are what the cache's
    ``update`` returned (the new tokens only). Returns ``(b, q, Hq, d)``.
    """
    if h2o_layer is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} ran the H2O attention without an H2O cache; inside "
            "h2o_lens.h2o(...) call model.generate(...), or pass cache=session.new_cache() "
            "to the forward")
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window is not None and h2o_layer.seen > window:
        raise UnsupportedModelError(
            f"layer {h2o_layer.layer_idx} uses sliding-window attention (window {window}) and the "
            f"sequence reached {h2o_layer.seen} tokens; H2O Lens does not combine H2O with sliding "
            "windows: use a model config with sliding_window=None or shorter sequences")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q_len = query.shape[2]
    if not h2o_layer.is_initialized or h2o_layer.keys is None:
        valid = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise UnsupportedModelError(
                    f"expected a 2-D padding mask from the registered mask function, got shape "
                    f"{tuple(attention_mask.shape)}; a model that builds its own 4-D mask is not supported")
            valid = attention_mask[:, -q_len:]
        return h2o_layer.prefill(query, valid, scaling), None
    if q_len != 1:
        raise UnsupportedModelError(
            f"layer {h2o_layer.layer_idx}: a forward of {q_len} tokens after the prefill; the H2O "
            "cache decodes one token per step (chunked prefill and speculative decoding are not supported)")
    return h2o_layer.decode(query, scaling), None


def register() -> None:
    """Register the attention and mask functions (reference counted)."""
    global _users
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _lock:
        if _users == 0:
            AttentionInterface.register(ATTN_NAME, h2o_attention)
            AttentionMaskInterface.register(ATTN_NAME, h2o_mask)
        _users += 1


def unregister() -> None:
    """Undo one :func:`register`; the last one removes the names again."""
    global _users
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _lock:
        _users = max(0, _users - 1)
        if _users == 0:
            AttentionInterface._global_mapping.pop(ATTN_NAME, None)
            AttentionMaskInterface._global_mapping.pop(ATTN_NAME, None)
