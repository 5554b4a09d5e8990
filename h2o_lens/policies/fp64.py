"""Shared pieces of the FP64 references of the ranked policies (DESIGN.md §2.10).

Plain numpy over one KV-head group, written for reading. A reference takes the
pre-softmax logits ``(G, N, N)`` of the group (row t the query at position t,
column i the key at position i), the prompt length and the split, and returns the
kept sets after the prefill and after each decode step, like
:func:`h2o_lens.reference.simulate`. Each reference states its own ranking value;
the two choices every ranked policy shares are here, once: which prompt positions
are kept (:func:`keep_prompt`) and which slot a decode step evicts (:func:`evict`).
"""
from __future__ import annotations

import numpy as np

__all__ = ["check", "softmax", "aggregate", "uniform_share", "keep_prompt", "evict"]


def check(logits, prefill: int, heavy: int, recent: int, gqa: str) -> np.ndarray:
    """The logits as an FP64 ``(G, N, N)`` array, after checking every argument."""
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 3 or x.shape[1] != x.shape[2]:
        raise ValueError(f"logits must have shape (G, N, N), got {x.shape}")
    n = x.shape[1]
    if not 1 <= prefill <= n:
        raise ValueError(f"prefill must be in [1, {n}], got {prefill}")
    if heavy < 0 or recent < 0 or heavy + recent < 1:
        raise ValueError(f"need heavy, recent >= 0 and heavy + recent >= 1, got {heavy}, {recent}")
    if gqa not in ("sum", "max"):
        raise ValueError(f"gqa must be 'sum' or 'max', got {gqa!r} (pass one head with 'sum' for 'none')")
    return x


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis."""
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def aggregate(w: np.ndarray, gqa: str) -> np.ndarray:
    """``(G, K)`` weights of the group's query heads → ``(K,)`` (DESIGN.md §2.6)."""
    return w.sum(axis=0) if gqa == "sum" else w.max(axis=0)


def uniform_share(heads: int, gqa: str) -> float:
    """Numerator of the aggregated uniform weight over ``n`` keys, ``agg_h(1/n) = share / n``.

    ``G`` for ``sum`` (G heads of ``1/n`` each), 1 for ``max``.
    """
    return float(heads) if gqa == "sum" else 1.0


def keep_prompt(rank: dict[int, float], prefill: int, heavy: int, recent: int) -> set[int]:
    """Prompt positions kept in one shot: the ``recent`` last and the top ``heavy`` of the rest
    by ``rank`` (higher kept; a tie keeps the newer). Everything when the prompt fits."""
    if prefill <= heavy + recent:
        return set(range(prefill))
    recent_set = set(range(prefill - recent, prefill))
    rest = sorted((i for i in range(prefill) if i not in recent_set), key=lambda i: (-rank[i], -i))
    return recent_set | set(rest[:heavy])


def evict(rank: dict[int, float], t: int, recent: int) -> int:
    """The victim of step ``t`` among the candidates ``rank`` holds: the lowest rank among the
    positions outside the ``recent`` newest (``i <= t - recent``); a tie evicts the older."""
    eligible = [i for i in rank if i <= t - recent]
    return min(eligible, key=lambda i: (rank[i], i))
