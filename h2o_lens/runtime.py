"""The scoped way in: run a Hugging Face causal LM with an H2O cache.

>>> with h2o_lens.h2o(model, H2OConfig(heavy=64, recent=64)) as session:
...     out = model.generate(**inputs, max_new_tokens=64)
...     session.last_cache.nbytes()

Inside the scope ``model.generate`` builds a fresh :class:`H2OCache` for each
call (unless one is passed as ``cache=``); on exit, exceptions included, the
model's attention implementation and ``generate`` are restored exactly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from . import hooks
from .cache import CacheListener, H2OCache
from .config import H2OConfig
from .errors import ConfigError, UnsupportedModelError
from .speculative import check_mode

__all__ = ["h2o", "H2OSession", "check_model", "full_kv_bytes"]

_TESTED = ("llama", "qwen2", "qwen3", "mistral", "phi3")


def check_model(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless the runtime can hook ``model``."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        raise UnsupportedModelError(
            f"expected a transformers causal LM (PreTrainedModel with .config and .generate), "
            f"got {type(model).__name__}"
        )
    text = config.get_text_config(decoder=True)
    if getattr(text, "is_encoder_decoder", False) or getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; H2O Lens hooks decoder-only causal LMs"
        )
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route attention through transformers' "
            "AttentionInterface, so the H2O attention cannot be installed; supported families: " + ", ".join(_TESTED)
        )
    types = getattr(text, "layer_types", None) or []
    odd = sorted({t for t in types if t != "full_attention"})
    if odd:
        raise UnsupportedModelError(
            f"{type(model).__name__} has layers of type {odd}; H2O Lens supports models whose "
            "layers all use full attention"
        )
    if not hasattr(text, "num_attention_heads") or not hasattr(text, "num_hidden_layers"):
        raise UnsupportedModelError(f"{type(model).__name__}'s config has no attention head counts")


def full_kv_bytes(model: Any, tokens: int, batch: int = 1, dtype: torch.dtype | None = None) -> int:
    """Bytes of a full KV cache of ``tokens`` positions (K and V, all layers)."""
    text = model.config.get_text_config(decoder=True)
    hkv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = dtype or next(model.parameters()).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * text.num_hidden_layers * hkv * d * tokens * batch * elem


class H2OSession:
    """Handle of an active scope: makes caches and remembers the last one."""

    def __init__(
        self, model: Any, config: H2OConfig, listener: CacheListener | None = None, speculative: str = "rollback"
    ):
        self.model = model
        self.config = config
        self.listener = listener
        self.speculative = check_mode(speculative)
        self.last_cache: H2OCache | None = None

    def new_cache(self, listener: CacheListener | None = None) -> H2OCache:
        """A fresh cache for one generation (one batch of prompts)."""
        cache = H2OCache(
            self.config, self.model.config, listener=listener or self.listener, speculative=self.speculative
        )
        self.last_cache = cache
        return cache

    def _generate(self, original, *args: Any, **kwargs: Any):
        if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
            kwargs["cache"] = self.new_cache()
        cache = kwargs.get("cache")
        if isinstance(cache, H2OCache):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:  # assisted decoding's first forward is the prompt plus a draft (DESIGN.md §14)
                cache.prompt_width = ids.shape[-1]
        out = original(*args, **kwargs)
        if isinstance(cache, H2OCache):
            cache.end_segments()  # a segment no crop closed stands in full
        return out


@contextlib.contextmanager
def h2o(
    model: Any,
    config: H2OConfig | None = None,
    *,
    listener: CacheListener | None = None,
    speculative: str = "rollback",
    **options: Any,
) -> Iterator[H2OSession]:
    """Run ``model`` with H2O eviction inside a ``with`` block.

    Parameters
    ----------
    model : transformers causal LM (Llama, Qwen2/3, Mistral, Phi-3 families)
    config : H2OConfig, optional
        The policy; or give its fields as keyword arguments
        (``h2o(model, heavy=64, recent=64, gqa="max")``).
    listener : CacheListener, optional
        Receives eviction events (the recorder uses this).
    speculative : str
        ``rollback`` (default) or ``defer``: how a rejected draft of assisted or
        speculative decoding (``assistant_model=``, ``prompt_lookup_num_tokens=``)
        is taken back (DESIGN.md §14).

    The policy ``full`` leaves the model untouched (transformers' own cache),
    so a comparison runs the exact baseline.
    """
    if config is None:
        config = H2OConfig(**options)
    elif options:
        raise ConfigError(f"give either a config or keyword options, not both (got {sorted(options)})")
    if not isinstance(config, H2OConfig):
        raise ConfigError(f"config must be an H2OConfig, got {type(config).__name__}")
    session = H2OSession(model, config, listener, speculative)
    if not config.spec.evicts:
        yield session
        return
    check_model(model)
    had_instance_generate = "generate" in vars(model)
    saved_generate = vars(model).get("generate")
    with hooks.attention_implementation(model, hooks.ATTN_NAME, hooks.h2o_attention, hooks.h2o_mask):
        try:
            original = model.generate
            model.generate = functools.wraps(original)(functools.partial(session._generate, original))
            yield session
        finally:
            if had_instance_generate:
                model.generate = saved_generate
            else:
                vars(model).pop("generate", None)
