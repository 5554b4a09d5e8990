"""Random: a seeded random victim outside the recent window, the no-information floor (DESIGN.md §2.5).

The draws are a hash of (seed, layer, KV set, position, step), so a request gets the
same choices alone or in any batch.
"""

from __future__ import annotations

from typing import Any

from .base import Policy, StepContext

__all__ = ["RANDOM"]


class RandomDraw(Policy):
    """Ranks by a fresh seeded draw per slot and step; the new token draws 1 (never below a slot)."""

    def prefill_scores(self, columns: Any, rows: Any, positions: Any, ctx: StepContext) -> tuple[Any, Any]:
        from ..ops import random_scores

        return random_scores(ctx.seed, ctx.layer, positions, ctx.step), None

    def decode_scores(
        self, scores: Any, history: Any, weights: Any, positions: Any, ctx: StepContext
    ) -> tuple[Any, Any]:
        from ..ops import random_scores

        scores.copy_(random_scores(ctx.seed, ctx.layer, positions, ctx.step))
        return scores.new_ones(*scores.shape[:-1], 1), None


RANDOM = RandomDraw(
    name="random",
    rank=5,
    label="random",
    colour="#8c564b",
    summary="a random victim outside the recent window: the no-information floor",
    baseline=True,
)
