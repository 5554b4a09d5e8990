"""TOVA: evict the lowest attention of the current step, with no accumulation (DESIGN.md §2.10).

The ranking value of a slot is the aggregated weight the current query gives it, and
nothing of earlier steps: at step t over D = C ∪ {t}, the lowest current weight among
the eligible slots is evicted (a tie evicts the older position). The prompt is ranked by
its last row's weights. It keeps H2O's split, so the recent window is protected and a
comparison with ``h2o`` isolates "current weight" against "cumulative weight"; a budget
with ``recent=0`` is the original method, where the new token may be its own victim.
"""

from __future__ import annotations

from typing import Any

from .. import reference as ref
from .base import Policy, StepContext

__all__ = ["TOVA", "CurrentAttention", "simulate"]


def simulate(logits, prefill: int, heavy: int, recent: int, gqa: str = "sum", pinned=()) -> list[list[int]]:
    """Kept positions of TOVA for one KV-head group, in FP64.

    Parameters
    ----------
    logits : array ``(G, N, N)``, pre-softmax ``q_t·k_i/√d`` of the group's query heads
    prefill : prompt length P (1 <= P <= N)
    heavy, recent : the split, ``heavy + recent >= 1``
    gqa : ``"sum"`` or ``"max"`` (``"none"``: one head with ``"sum"``)
    pinned : prompt positions never evicted, in slots of their own (DESIGN.md §2.11)

    Returns
    -------
    The sorted kept positions after the prefill (index 0), then after each decode
    step t = P … N−1.
    """
    x = ref.check(logits, prefill, heavy, recent, gqa, pinned)
    n = x.shape[1]
    pinned = frozenset(pinned)
    last = ref.aggregate(ref.softmax(x[:, prefill - 1, :prefill]), gqa)  # (P,) the last prompt row
    kept = ref.keep_prompt({i: last[i] for i in range(prefill)}, prefill, heavy, recent, pinned)
    out = [sorted(kept)]
    for t in range(prefill, n):
        cand = sorted(kept) + [t]  # D = C ∪ {t}
        w = ref.aggregate(ref.softmax(x[:, t, cand]), gqa)  # (|D|,) this step only
        kept = set(cand)
        if len(cand) > heavy + recent + len(pinned):
            kept.discard(ref.evict(dict(zip(cand, w)), t, recent, pinned))
        out.append(sorted(kept))
    return out


class CurrentAttention(Policy):
    """Ranks by the current step's aggregated weight; the score is replaced, not added."""

    def prefill_scores(self, columns: Any, rows: Any, positions: Any, ctx: StepContext) -> tuple[Any, Any]:
        return rows[..., -1, :], None  # (b, Hs, P) the last prompt row

    def decode_scores(
        self, scores: Any, history: Any, weights: Any, positions: Any, ctx: StepContext
    ) -> tuple[Any, Any]:
        cap = scores.shape[-1]
        scores.copy_(weights[..., :cap])
        return weights[..., cap:], None


TOVA = CurrentAttention(
    name="tova",
    rank=10,
    label="TOVA",
    colour="#17becf",
    summary="the current step's attention alone: what accumulation adds",
    scored=True,
    prefill="rows",
    prefill_rows=1,
    reference=simulate,
)
