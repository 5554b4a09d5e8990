"""What ``bench decode`` refuses before anything is allocated (its modes share it): bad sizes, a
context past the model's positions, caches past the machine's memory."""

from __future__ import annotations

from typing import Any

from .common import check_ints, check_keep, check_memory, check_positions, model_config

__all__ = ["check_decode", "decode_bytes"]


def decode_bytes(config: Any, context: int, batch: int, keep: float, element: int = 4) -> int:
    """The bytes a decode bench of ``context`` tokens and ``batch`` rows allocates at least, from the
    model's ``config`` alone: the random token ids (int64), the full cache's keys and values, the H2O
    cache's (``keep`` of them) and one layer's hidden states, in ``element``-byte values."""
    from h2o_lens.shape import model_shape

    shape = model_shape(config)
    head_dim = shape.head_dim or 1
    kv = 2 * shape.layers * shape.kv_heads * head_dim * context * batch * element
    hidden = (getattr(config, "hidden_size", None) or shape.q_heads * head_dim) * context * batch * element
    return 8 * context * batch + int(kv * (1 + keep)) + hidden


def check_decode(model_name, contexts, batches, keep: float, steps: int, rounds: int, config: Any = None) -> None:
    """Refuse, before anything is allocated, what cannot run: bad sizes, a context past the model's
    positions (with its decode steps) and one whose caches need more memory than the machine has.
    ``config`` the model's (read from its folder when None; nothing to check when unreadable)."""
    contexts = check_ints("decode", "contexts", contexts, 2)
    batches = check_ints("decode", "batch", batches, 1)
    check_ints("decode", "steps", steps, 1)
    check_ints("decode", "rounds", rounds, 1)
    check_keep("decode", keep)
    config = config if config is not None else model_config(model_name)
    if config is None:
        return
    check_positions("decode", "--contexts", config, [(n, n + 3 + rounds * steps) for n in contexts])
    for n in contexts:
        need = decode_bytes(config, n, max(batches), keep)
        check_memory("decode", "--contexts", n, need, f"batch {max(batches)}: token ids, full and H2O caches")
