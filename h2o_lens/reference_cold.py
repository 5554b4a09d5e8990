"""FP64 reference of H2O with a cold tier (DESIGN.md §2.13), written for reading, not speed.

One KV-head group, plain numpy loops, on the pieces of :mod:`h2o_lens.reference` (softmax, GQA
aggregation, the prefill's keep rule, the decode victim). The runtime (:mod:`h2o_lens.cold`) is
tested against it: the kept, cold and recalled sets of every step, for both selections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .cold_config import PAGE, ColdTier
from .reference import aggregate, evict, keep_prompt, softmax

__all__ = ["ColdTrace", "cold_trace", "choose"]


@dataclass
class ColdTrace:
    """What the reference computed. Index 0 is the prefill, index k the decode step
    ``prefill + k - 1``: ``kept[k]`` the policy's slots after it, ``window[k]`` the recall
    window it attended to (empty at the prefill), ``recalled[k]`` the positions this step's
    refill brought in, ``victims[k]`` the positions it moved to the cold store, ``cold[k]`` the
    positions in the store and not in the window after it; ``records`` the store's positions
    in the order they were written, ``record_scores`` their scores at the end."""

    kept: list[list[int]] = field(default_factory=list)
    window: list[list[int]] = field(default_factory=list)
    recalled: list[list[int]] = field(default_factory=list)
    victims: list[list[int]] = field(default_factory=list)
    cold: list[list[int]] = field(default_factory=list)
    records: list[int] = field(default_factory=list)
    record_scores: list[float] = field(default_factory=list)


def _values(logits: np.ndarray, gqa: str) -> np.ndarray:
    """``(G, M)`` logits of the group's heads over M candidates → each head's softmax over them,
    aggregated (DESIGN.md §2.6): ``(M,)``."""
    return aggregate(softmax(logits), gqa)


def _best(values, keys: list[int], n: int) -> list[int]:
    """Indices of the ``n`` largest ``values``, a tie taking the larger ``keys`` entry."""
    return sorted(range(len(values)), key=lambda i: (-values[i], -keys[i]))[:n]


def _bound(qh: np.ndarray, keys: np.ndarray) -> float:
    """Quest's upper bound of ``qh · k`` over the ``keys (m, d)`` of a page: Σ_j max(q_j·min_j, q_j·max_j)."""
    return sum(max(qh[j] * keys[:, j].min(), qh[j] * keys[:, j].max()) for j in range(len(qh)))


def choose(q: np.ndarray, key: np.ndarray, records: list[int], recall: int, gqa: str, select: str, scan: int):
    """The records (indices into ``records``, the cold positions in store order) a refill brings
    into the window: ``q (G, d)`` the step's scaled queries, ``key (N, d)`` every position's key."""
    if not records:
        return []
    if select == "exact" or len(records) <= scan * PAGE:
        idx = list(range(len(records)))
    else:
        pages = [records[p : p + PAGE] for p in range(0, len(records), PAGE)]
        bound = np.array([[_bound(qh, key[pg]) for pg in pages] for qh in q])  # (G, pages)
        chosen = _best(_values(bound, gqa), list(range(len(pages))), scan)
        idx = [p * PAGE + i for p in sorted(chosen) for i in range(len(pages[p]))]
    logits = q @ key[[records[i] for i in idx]].T  # (G, M)
    best = _best(_values(logits, gqa), [records[i] for i in idx], recall)
    return [idx[i] for i in best]


def cold_trace(
    query,
    key,
    prefill: int,
    heavy: int,
    recent: int,
    recall: int,
    gqa: str = "sum",
    *,
    scaling: float = 1.0,
    every: int = 1,
    select: str = "exact",
    scan: int | None = None,
) -> ColdTrace:
    """H2O on one KV-head group with a cold tier of ``recall`` window slots.

    ``query (G, N, d)`` the group's post-RoPE queries, ``key (N, d)`` its keys; ``heavy, recent``
    the policy's split of the ``B - recall`` slots left to it; ``gqa`` ``sum`` or ``max`` (pass one
    head with ``sum`` for ``none``); ``scan`` the pages read exactly under ``pages`` (default as
    :class:`~h2o_lens.cold_config.ColdTier`'s).
    """
    q = np.asarray(query, dtype=np.float64) * scaling
    k = np.asarray(key, dtype=np.float64)
    n = q.shape[1]
    scan = scan if scan is not None else ColdTier(recall=recall, select="pages").pages_scanned
    out = ColdTrace()
    score: dict[int, float] = {i: 0.0 for i in range(prefill)}
    for u in range(prefill):
        w = aggregate(softmax(q[:, u] @ k[: u + 1].T), gqa)
        for i in range(u + 1):
            score[i] += w[i]
    keep = keep_prompt(score, prefill, heavy, recent)
    records = sorted(i for i in range(prefill) if i not in keep)  # the store, in write order
    rscore = {i: score[i] for i in records}
    score = {i: score[i] for i in keep}
    window: dict[int, float] = {}  # position -> score while in the window
    out.kept.append(sorted(score))
    out.window.append([])
    out.recalled.append([])
    out.victims.append(list(records))
    out.cold.append(list(records))
    for step, t in enumerate(range(prefill, n)):
        fresh: list[int] = []
        if step % every == 0:
            rscore.update(window)  # the occupants go back with their scores
            picked = [records[i] for i in choose(q[:, t], k, records, recall, gqa, select, scan)]
            fresh = sorted(p for p in picked if p not in window)
            window = {p: rscore[p] for p in picked}
        cand = sorted(score) + sorted(window) + [t]
        w = aggregate(softmax(q[:, t] @ k[cand].T), gqa)
        score[t] = 0.0
        for i, wi in zip(cand, w):
            if i in window:
                window[i] += wi
            else:
                score[i] += wi
        victims = []
        if len(score) > heavy + recent:
            victim = evict(score, t, recent)
            records.append(victim)
            rscore[victim] = score.pop(victim)
            victims = [victim]
        out.kept.append(sorted(score))
        out.window.append(sorted(window))
        out.recalled.append(fresh)
        out.victims.append(victims)
        out.cold.append(sorted(set(records) - set(window)))
    rscore.update(window)
    out.records = list(records)
    out.record_scores = [rscore[p] for p in records]
    return out
