"""The attention function and mask function registered with transformers.

Registered under one name, :data:`ATTN_NAME`, only while a scope
(:func:`h2o_lens.runtime.h2o`) is active: nothing is patched at import.
:func:`attention_implementation` is that scope's registration, shared with
the replay (:mod:`recorders.replay`), which registers its own functions.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import compat
from .errors import ImplementationError, UnsupportedModelError

__all__ = ["ATTN_NAME", "attention_implementation", "h2o_attention", "h2o_mask"]

ATTN_NAME = "h2o_lens"
_lock = threading.Lock()


@dataclass
class _Users:
    """Active uses of one implementation name and what the registries held before the first."""

    count: int
    attention_fn: Callable[..., Any]
    mask_fn: Callable[..., Any]
    saved: tuple[Any, Any]

    @property
    def functions(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        return self.attention_fn, self.mask_fn


_users: dict[str, _Users] = {}  # name -> active uses (see attention_implementation)


def h2o_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """Pass the 2-D padding mask ``(b, kv_length)`` through unchanged.

    Causality and slot validity are built inside :func:`h2o_attention`; the
    only thing it needs from the model is which prompt columns are padding.
    Everything else is ignored, so every supported transformers release can call
    it its own way (4.56 to 5.3 by keyword with ``cache_position``; later ones
    with ``q_length`` first).
    """
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.to(torch.bool)


def h2o_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    h2o_layer: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the H2O cache of ``module``'s layer.

    ``query (b, Hq, q, d)``; ``key``/``value`` are what the cache's
    ``update`` returned (the new tokens only). Returns ``(b, q, Hq, d)``.
    """
    h2o_layer = compat.staged_layer(module, h2o_layer)
    if h2o_layer is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} ran the H2O attention without an H2O cache; inside "
            "h2o_lens.h2o(...) call model.generate(...), or pass cache=session.new_cache() "
            "to the forward"
        )
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window is not None and h2o_layer.seen > window:
        raise UnsupportedModelError(
            f"layer {h2o_layer.layer_idx} uses sliding-window attention (window {window}) and the "
            f"sequence reached {h2o_layer.seen} tokens; H2O Lens does not combine H2O with sliding "
            "windows: use a model config with sliding_window=None or shorter sequences"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q_len = query.shape[2]
    if not h2o_layer.is_initialized or h2o_layer.keys is None:
        valid = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise UnsupportedModelError(
                    f"expected a 2-D padding mask from the registered mask function, got shape "
                    f"{tuple(attention_mask.shape)}; a model that builds its own 4-D mask is not supported"
                )
            valid = attention_mask[:, -q_len:]
        width = h2o_layer.owner.prompt_width
        if width is not None and q_len > width:  # assisted decoding's first forward: prompt + draft
            return h2o_layer.prefill_and_segment(query, valid, scaling, width), None
        return h2o_layer.prefill(query, valid, scaling), None
    if q_len != 1:  # a verification segment: q_len plain decode steps (DESIGN.md §14)
        return h2o_layer.decode_segment(query, scaling), None
    return h2o_layer.decode(query, scaling), None


@contextlib.contextmanager
def attention_implementation(
    model: Any, name: str, attention_fn: Callable[..., Any], mask_fn: Callable[..., Any]
) -> Iterator[None]:
    """Run ``model`` with ``attention_fn`` and ``mask_fn`` registered under ``name``.

    Registers both with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface``, switches ``model`` to ``name`` and, on exit
    (exceptions included), switches it back to its previous implementation
    and restores the two registries. Uses of one name nest (reference
    counted): the first registers, the last restores what the registries held
    before (nothing, usually); all of them must pass the same functions.

    Parameters
    ----------
    model : a transformers model whose attention routes through ``AttentionInterface``
    name : the implementation name, e.g. :data:`ATTN_NAME`
    attention_fn, mask_fn : the attention function and the mask function
    """
    previous = model.config._attn_implementation
    _acquire(name, attention_fn, mask_fn)
    try:
        model.set_attn_implementation(name)
        yield
    finally:
        try:
            model.set_attn_implementation(previous)
        finally:
            _release(name)


def _acquire(name: str, attention_fn: Callable[..., Any], mask_fn: Callable[..., Any]) -> None:
    """Count one user of ``name``; the first registers the functions."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _lock:
        held = _users.get(name)
        if held is None:
            saved = (AttentionInterface._global_mapping.get(name), AttentionMaskInterface._global_mapping.get(name))
            AttentionInterface.register(name, attention_fn)
            AttentionMaskInterface.register(name, mask_fn)
            _users[name] = _Users(1, attention_fn, mask_fn, saved)
            return
        if held.functions != (attention_fn, mask_fn):
            raise ImplementationError(
                f"the attention implementation {name!r} is already registered with other functions "
                f"({held.functions[0]!r}, {held.functions[1]!r}) by an enclosing scope; give the "
                "nested scope its own name or the same functions"
            )
        held.count += 1


def _release(name: str) -> None:
    """Undo one :func:`_acquire`; the last restores what the registries held before."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _lock:
        held = _users.get(name)
        if held is None:
            return
        held.count -= 1
        if held.count > 0:
            return
        del _users[name]
        for registry, saved in zip((AttentionInterface, AttentionMaskInterface), held.saved):
            if saved is None:
                registry._global_mapping.pop(name, None)
            else:
                registry._global_mapping[name] = saved
