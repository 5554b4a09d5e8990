"""What a command can check about a model before loading it: its config, read alone (no weights)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["model_config", "check_new_tokens"]


def model_config(name: str | None) -> Any:
    """The text config of the model ``name`` would load (its ``config.json`` only, no weights), or
    None when it cannot be read without loading (the default model not converted yet, an id that is
    not cached): then the load itself says what is wrong."""
    from h2o_lens import compat
    from h2o_lens.models import DEFAULT_MODEL, default_cache_dir

    if name is None or str(name).lower() in ("default", DEFAULT_MODEL.lower()):
        folder = default_cache_dir() / compat.checkpoint_folder() / DEFAULT_MODEL
    else:
        folder = os.path.expanduser(str(name))
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception:  # noqa: BLE001 - nothing readable here: the model's load reports it
        return None
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def check_new_tokens(model_name: str | None, new_tokens: int, option: str = "--max-new-tokens") -> None:
    """Refuse (ConfigError), before the model loads, a generation length that alone passes the
    model's positions (``max_position_embeddings``); an unreadable config checks nothing (the
    prompt's own length is checked once it is tokenized)."""
    from h2o_lens.errors import ConfigError

    window = getattr(model_config(model_name), "max_position_embeddings", None)
    if isinstance(window, int) and window > 0 and new_tokens >= window:
        raise ConfigError(
            f"{option} {new_tokens:,} is past the model's {window:,} positions (config.max_position_embeddings) "
            f"even before the prompt; give at most {window - 1:,}"
        )
