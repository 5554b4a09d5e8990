"""The oracle: evict the least *remaining* teacher attention, with hindsight (DESIGN.md §2.12).

A slot's ranking value at step t is ``R_t(i) = Σ_{s>t} A_s(i)``, the attention a full-cache
teacher gives key i from the generated query rows after t, aggregated over the KV set's
query heads like the run (DESIGN.md §2.6). All B slots are free (split ``(B, 0, 0)``: no recent window,
the new token competes at once); at prefill the top B prompt positions by ``R_{P−1}`` are
kept, at each step the lowest ``R_t`` over D = C ∪ {t} leaves (a tie evicts the older), and
an evicted position never returns. The values come from a teacher table installed with
:func:`h2o_lens.hindsight.teacher_scores`; it bounds what an online attention-scoring policy
could keep with these slots. Not a baseline and not an alternative: it needs a teacher.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import reference as ref
from .base import Policy, StepContext

__all__ = ["ORACLE", "RemainingAttention", "simulate", "remaining"]


def remaining(logits, prefill: int, gqa: str = "sum") -> np.ndarray:
    """``(N, N)`` FP64 table: row t holds ``R_t(i)`` (rows ``t >= prefill − 1`` are meaningful).

    ``A_s(i)`` is the aggregated softmax of row s over keys ``0 … s`` of the logits ``(G, N, N)``,
    for the generated rows ``s >= prefill``; ``R_t = Σ_{s>t} A_s``.
    """
    x = np.asarray(logits, dtype=np.float64)
    n = x.shape[1]
    a = np.zeros((n, n))
    for s in range(prefill, n):
        a[s, : s + 1] = ref.aggregate(ref.softmax(x[:, s, : s + 1]), gqa)
    out = np.zeros((n, n))
    for t in range(n - 2, -1, -1):
        out[t] = out[t + 1] + a[t + 1]
    return out


def simulate(logits, prefill: int, heavy: int, recent: int, gqa: str = "sum") -> list[list[int]]:
    """Kept positions of the oracle for one KV-head group, in FP64, the teacher being full
    attention on these same logits.

    Parameters
    ----------
    logits : array ``(G, N, N)``, pre-softmax ``q_t·k_i/√d`` of the group's query heads
    prefill : prompt length P (1 <= P <= N)
    heavy, recent : the slot count is ``B = heavy + recent`` (the policy's split is ``(B, 0)``:
        there is no recent window whatever the split)
    gqa : ``"sum"`` or ``"max"`` (``"none"``: one head with ``"sum"``)

    Returns
    -------
    The sorted kept positions after the prefill (index 0), then after each decode
    step t = P … N−1.
    """
    x = ref.check(logits, prefill, heavy, recent, gqa)
    n = x.shape[1]
    budget = heavy + recent
    r = remaining(x, prefill, gqa)
    kept = ref.keep_prompt({i: r[prefill - 1, i] for i in range(prefill)}, prefill, budget, 0)
    out = [sorted(kept)]
    for t in range(prefill, n):
        cand = sorted(kept) + [t]  # D = C ∪ {t}
        kept = set(cand)
        if len(cand) > budget:
            kept.discard(ref.evict({i: r[t, i] for i in cand}, t, 0))
        out.append(sorted(kept))
    return out


class RemainingAttention(Policy):
    """Ranks by the teacher's remaining attention, read from the installed teacher table."""

    def split(self, heavy: int, recent: int, sink: int) -> tuple[int, int, int]:
        return heavy + recent, 0, 0

    def prefill_scores(self, columns: Any, rows: Any, positions: Any, ctx: StepContext) -> tuple[Any, Any]:
        from ..hindsight import active_table

        table = active_table(self.name)
        if int(ctx.step.max()) != table.prompt_len - 1:
            from ..errors import ConfigError

            raise ConfigError(
                f"the teacher table was built for a prompt of {table.prompt_len} tokens, the run's prompt "
                f"has {int(ctx.step.max()) + 1}; build the table on the run's own prompt"
            )
        return table.lookup(ctx.layer, ctx.step, positions), None

    def decode_scores(
        self, scores: Any, history: Any, weights: Any, positions: Any, ctx: StepContext
    ) -> tuple[Any, Any]:
        from ..hindsight import active_table

        table = active_table(self.name)
        scores.copy_(table.lookup(ctx.layer, ctx.step, positions))
        new = positions.new_zeros(*positions.shape[:-1], 1) + ctx.step  # (b, Hs, 1) the new token
        return table.lookup(ctx.layer, ctx.step, new).to(scores.dtype), None


ORACLE = RemainingAttention(
    name="oracle",
    rank=20,
    label="oracle",
    colour="#222222",
    summary="the least remaining teacher attention, with hindsight: the bound of attention scoring",
    scored=True,
    teacher=True,
    reference=simulate,
)
