"""FP64 reference of H2O (DESIGN.md §2), written for reading, not speed.

Plain numpy loops over one KV-head group. The runtime and the kernels are
tested against it; anyone can check a recorded run with it. The references of
the other ranked policies (:mod:`h2o_lens.policies.tova`,
:mod:`h2o_lens.policies.scissorhands`) take the same inputs, return the same
kept sets and share the pieces defined here once: which prompt positions are
kept (:func:`keep_prompt`) and which slot a decode step evicts (:func:`evict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "simulate",
    "simulate_sets",
    "trace",
    "Trace",
    "check",
    "softmax",
    "aggregate",
    "uniform_share",
    "keep_prompt",
    "evict",
]


@dataclass
class Trace:
    """Everything the reference computed, step by step.

    ``kept[k]`` is the sorted kept set after the prefill (k = 0) and after
    decode step ``prefill + k - 1``; ``scores[k]`` maps each kept position to
    its cumulative score; ``victims[k]`` lists the evicted positions.
    """

    kept: list[list[int]] = field(default_factory=list)
    scores: list[dict[int, float]] = field(default_factory=list)
    victims: list[list[int]] = field(default_factory=list)


def check(logits, prefill: int, heavy: int, recent: int, gqa: str, pinned=()) -> np.ndarray:
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
    pins = list(pinned)
    if len(set(pins)) != len(pins) or any(not 0 <= p < prefill for p in pins):
        raise ValueError(f"pinned must be distinct prompt positions in [0, {prefill}), got {pins}")
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


def keep_prompt(rank: dict[int, float], prefill: int, heavy: int, recent: int, pinned=()) -> set[int]:
    """Prompt positions kept in one shot: the ``pinned`` ones, the ``recent`` last and the top
    ``heavy`` of the rest by ``rank`` (higher kept; a tie keeps the newer). Everything when the
    prompt fits."""
    if prefill <= heavy + recent:
        return set(range(prefill))
    fixed = set(range(prefill - recent, prefill)) | set(pinned)  # a pin in the window counts once
    rest = sorted((i for i in range(prefill) if i not in fixed), key=lambda i: (-rank[i], -i))
    return fixed | set(rest[:heavy])


def evict(rank: dict[int, float], t: int, recent: int, pinned=()) -> int:
    """The victim of step ``t`` among the candidates ``rank`` holds: the lowest rank among the
    positions outside the ``recent`` newest (``i <= t - recent``) and not ``pinned``; a tie
    evicts the older."""
    eligible = [i for i in rank if i <= t - recent and i not in pinned]
    return min(eligible, key=lambda i: (rank[i], i))


def trace(logits, prefill: int, heavy: int, recent: int, gqa: str = "sum", pinned=()) -> Trace:
    """Run H2O on one KV-head group and keep every intermediate.

    Parameters
    ----------
    logits : array ``(G, N, N)``
        Pre-softmax ``q_t·k_i/√d`` per query head of the group; row t is the
        query at position t, column i the key at position i (only i <= t read).
    prefill : int
        Prompt length P (1 <= P <= N).
    heavy, recent : int
        The policy's split of the slots left by the pins, heavy + recent >= 1.
    gqa : {"sum", "max"}
    pinned : sequence of int
        Prompt positions never evicted (DESIGN.md §2.11); they hold slots of their own,
        so the budget is B = heavy + recent + len(pinned).
    """
    x = check(logits, prefill, heavy, recent, gqa, pinned)
    n = x.shape[1]
    pinned = frozenset(pinned)
    budget = heavy + recent + len(pinned)
    out = Trace()

    # prefill: full causal attention, column sums of the aggregated weights
    score: dict[int, float] = {i: 0.0 for i in range(prefill)}
    for u in range(prefill):
        w = aggregate(softmax(x[:, u, : u + 1]), gqa)  # (u+1,)
        for i in range(u + 1):
            score[i] += w[i]
    keep = keep_prompt(score, prefill, heavy, recent, pinned)  # pins, recent, then the top heavy (tie: newer)
    victims = sorted(i for i in range(prefill) if i not in keep)
    score = {i: score[i] for i in keep}
    out.kept.append(sorted(score))
    out.scores.append(dict(score))
    out.victims.append(victims)

    for t in range(prefill, n):
        cand = sorted(score) + [t]
        w = aggregate(softmax(x[:, t, cand]), gqa)  # (|D|,)
        score[t] = 0.0
        for i, wi in zip(cand, w):
            score[i] += wi
        victims = []
        if len(cand) > budget:
            victim = evict(score, t, recent, pinned)  # the lowest eligible score (tie: the older)
            del score[victim]
            victims = [victim]
        out.kept.append(sorted(score))
        out.scores.append(dict(score))
        out.victims.append(victims)
    return out


def simulate(logits, prefill: int, heavy: int, recent: int, gqa: str = "sum", pinned=()) -> list[list[int]]:
    """Kept positions of H2O for one KV-head group, in FP64.

    Returns the sorted kept positions after the prefill of ``prefill`` tokens
    (index 0), then after each decode step t = prefill … N−1.
    See :func:`trace` for the parameters.
    """
    return trace(logits, prefill, heavy, recent, gqa, pinned).kept


def simulate_sets(logits, prefill: int, splits, gqa: str = "sum") -> list[list[list[int]]]:
    """Kept positions of H2O for every KV set of a layer, each at its own slot count, in FP64
    (a budget plan, DESIGN.md §2.14).

    ``logits (Hs, G, N, N)`` one KV-head group per set; ``splits`` one ``(heavy, recent)`` per
    set. Each set runs :func:`simulate` alone: a plan changes how many slots a set holds, never
    how it chooses (the same keep rule, tie rules and victim). Returns ``kept[set][k]``.
    """
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 4 or len(splits) != x.shape[0]:
        raise ValueError(
            f"logits must be (Hs, G, N, N) with one split per KV set, got {x.shape} and {len(splits)} splits"
        )
    return [simulate(x[s], prefill, heavy, recent, gqa) for s, (heavy, recent) in enumerate(splits)]
