"""Local: the recent window alone (DESIGN.md §2.5)."""

from __future__ import annotations

from typing import Any

from .base import Policy, StepContext

__all__ = ["LOCAL", "Unscored"]


class Unscored(Policy):
    """No ranking value: every score is 0, so position alone decides (the oldest eligible
    slot leaves; a prefill keeps the newest)."""

    def prefill_scores(self, columns: Any, rows: Any, positions: Any, ctx: StepContext) -> tuple[Any, Any]:
        return None, None  # the caller ranks by zeros

    def decode_scores(
        self, scores: Any, history: Any, weights: Any, positions: Any, ctx: StepContext
    ) -> tuple[Any, Any]:
        return scores.new_zeros(*scores.shape[:-1], 1), None


class RecentOnly(Unscored):
    """Every slot is a recent slot: ``(0, B, 0)``."""

    def split(self, heavy: int, recent: int, sink: int) -> tuple[int, int, int]:
        return 0, heavy + recent, 0


LOCAL = RecentOnly(
    name="local",
    rank=2,
    label="local window",
    colour="#2ca02c",
    summary="recency alone: what far context is worth",
    baseline=True,
    kernels=frozenset({"decode"}),
)
