"""Full: no eviction; transformers' own cache, the exact baseline (DESIGN.md §2.5)."""

from __future__ import annotations

from .base import Policy

__all__ = ["FULL"]

FULL = Policy(
    name="full",
    rank=1,
    label="full cache",
    colour="#7f7f7f",
    summary="transformers' own cache: the exact baseline",
    evicts=False,
)
