"""H2O: heavy hitters by cumulative attention plus a recent window (DESIGN.md §2.1)."""

from __future__ import annotations

from typing import Any

from ..reference import simulate
from .base import Policy, StepContext

__all__ = ["H2O", "CumulativeAttention"]


class CumulativeAttention(Policy):
    """Ranks by the running sum of aggregated weights; the new token's own weight seeds its score."""

    def prefill_scores(self, columns: Any, rows: Any, positions: Any, ctx: StepContext) -> tuple[Any, Any]:
        return columns, None  # (b, Hs, P) column sums (DESIGN.md §2.3)

    def decode_scores(
        self, scores: Any, history: Any, weights: Any, positions: Any, ctx: StepContext
    ) -> tuple[Any, Any]:
        cap = scores.shape[-1]
        scores += weights[..., :cap]
        return weights[..., cap:], None


H2O = CumulativeAttention(
    name="h2o",
    rank=0,
    label="H2O",
    colour="#1f77b4",
    summary="the method",
    scored=True,
    accumulates=True,
    kernels=frozenset({"decode", "prefill"}),
    prefill="columns",
    reference=simulate,
)
