"""ScissorHands-style: evict the slot most often below its uniform share over a history window
(DESIGN.md §2.10).

Each slot keeps a ``WINDOW``-bit history: bit k is set when, k steps ago, the slot's
aggregated weight was below the aggregated uniform share of that step, i.e.
``a · |D| < share`` with ``share = G`` for ``gqa="sum"`` and 1 for ``"max"``/``"none"``
(every head giving the slot ``1/|D|``). A step shifts every history left by one, sets
bit 0 from the current weights and drops bits older than the window; a new token starts
with its own bit. The count of set bits is how often the slot was unimportant; the
victim is the highest count among the eligible slots, a tie evicts the older position.
The ranking value stored as the slot's score is ``WINDOW − count`` (higher keeps, never
negative), so the shared victim rule "lowest score, tie evicts the older" applies as is.

The prompt's histories come from its last ``WINDOW`` rows: row u (|D| = u + 1 real keys)
sets bit ``P − 1 − u`` of every key it sees. It keeps H2O's split: the recent window is
protected, as in the original method.
"""

from __future__ import annotations

from typing import Any

from .. import reference as ref
from .base import Policy, StepContext

__all__ = ["SCISSORHANDS", "LowAttentionCount", "WINDOW", "simulate"]

#: history window in steps (bits of the per-slot history)
WINDOW = 32


def simulate(
    logits, prefill: int, heavy: int, recent: int, gqa: str = "sum", window: int = WINDOW, pinned=()
) -> list[list[int]]:
    """Kept positions of the ScissorHands-style policy for one KV-head group, in FP64.

    Parameters
    ----------
    logits : array ``(G, N, N)``, pre-softmax ``q_t·k_i/√d`` of the group's query heads
    prefill : prompt length P (1 <= P <= N)
    heavy, recent : the split, ``heavy + recent >= 1``
    gqa : ``"sum"`` or ``"max"`` (``"none"``: one head with ``"sum"``)
    window : history window w in steps, 1 <= w <= 63
    pinned : prompt positions never evicted, in slots of their own (DESIGN.md §2.11)

    Returns
    -------
    The sorted kept positions after the prefill (index 0), then after each decode
    step t = P … N−1.
    """
    x = ref.check(logits, prefill, heavy, recent, gqa, pinned)
    pinned = frozenset(pinned)
    if not 1 <= window <= 63:
        raise ValueError(f"window must be in [1, 63] steps, got {window}")
    n = x.shape[1]
    share = ref.uniform_share(x.shape[0], gqa)
    # low[i]: the steps (query positions) of the window at which key i was below its share
    low: dict[int, set[int]] = {i: set() for i in range(prefill)}
    for u in range(max(0, prefill - window), prefill):
        w = ref.aggregate(ref.softmax(x[:, u, : u + 1]), gqa)  # (u+1,) |D| = u + 1
        for i in range(u + 1):
            if w[i] * (u + 1) < share:
                low[i].add(u)

    def rank(t: int) -> dict[int, float]:  # window − count of low steps in (t − window, t]
        return {i: window - sum(1 for s in low[i] if s > t - window) for i in low}

    kept = ref.keep_prompt(rank(prefill - 1), prefill, heavy, recent, pinned)
    low = {i: low[i] for i in kept}
    out = [sorted(kept)]
    for t in range(prefill, n):
        cand = sorted(low) + [t]  # D = C ∪ {t}
        w = ref.aggregate(ref.softmax(x[:, t, cand]), gqa)
        low[t] = set()
        for i, wi in zip(cand, w):
            if wi * len(cand) < share:
                low[i].add(t)
        if len(cand) > heavy + recent + len(pinned):
            del low[ref.evict(rank(t), t, recent, pinned)]
        out.append(sorted(low))
    return out


def popcount(history: Any, bits: int) -> Any:
    """Set bits of each int64 of ``history`` below bit ``bits``, as int64 (same shape)."""
    import torch

    shifts = torch.arange(bits, device=history.device, dtype=torch.int64)
    return ((history[..., None] >> shifts) & 1).sum(-1)


class LowAttentionCount(Policy):
    """Ranks by ``window −`` the number of recent steps with a weight below the uniform share."""

    def _low(self, weights: Any, count: Any, ctx: StepContext) -> Any:
        """Whether each aggregated weight is below its share: ``a · |D| < share``."""
        share = ctx.group if ctx.gqa == "sum" else 1
        return weights * count < share

    def prefill_scores(self, columns: Any, rows: Any, positions: Any, ctx: StepContext) -> tuple[Any, Any]:
        import torch

        r = rows.shape[-2]
        row_pos = positions[..., -r:]  # (b, Hs, R) positions of the last R rows, -1 padding
        seen = (
            (positions[..., None, :] >= 0) & (positions[..., None, :] <= row_pos[..., None]) & (row_pos[..., None] >= 0)
        )  # (b, Hs, R, P): key present at that row
        low = seen & self._low(rows, (row_pos + 1)[..., None], ctx)  # (b, Hs, R, P)
        bit = torch.arange(r - 1, -1, -1, device=rows.device, dtype=torch.int64)  # row P-R+j: bit R-1-j
        history = (low.to(torch.int64) << bit[:, None]).sum(-2)  # (b, Hs, P), disjoint bits
        scores = (self.history - popcount(history, self.history)).to(rows.dtype)
        return scores, history

    def decode_scores(
        self, scores: Any, history: Any, weights: Any, positions: Any, ctx: StepContext
    ) -> tuple[Any, Any]:
        import torch

        cap = scores.shape[-1]
        live = positions >= 0  # (b, Hs, B)
        count = live.sum(-1, keepdim=True) + 1  # (b, Hs, 1) |D|
        low = self._low(weights, count, ctx)  # (b, Hs, B + 1)
        history.copy_(((history << 1) | (low[..., :cap] & live).to(torch.int64)) & ((1 << self.history) - 1))
        scores.copy_(self.history - popcount(history, self.history))
        new_history = low[..., cap:].to(torch.int64)  # (b, Hs, 1)
        return (self.history - new_history).to(scores.dtype), new_history


SCISSORHANDS = LowAttentionCount(
    name="scissorhands",
    rank=11,
    label="ScissorHands",
    colour="#e377c2",
    summary="how often a slot was unimportant lately: persistence of importance",
    scored=True,
    prefill="rows",
    prefill_rows=WINDOW,
    history=WINDOW,
    reference=simulate,
)
