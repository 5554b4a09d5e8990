"""Heavy hitters only: H2O's scores with no recent window (DESIGN.md §2.5)."""

from __future__ import annotations

from ..reference import simulate
from .h2o import CumulativeAttention

__all__ = ["HEAVY"]


class HeavyOnly(CumulativeAttention):
    """Every slot is a heavy slot: ``(B, 0, 0)``; the new token competes at once."""

    def split(self, heavy: int, recent: int, sink: int) -> tuple[int, int, int]:
        return heavy + recent, 0, 0


HEAVY = HeavyOnly(
    name="heavy",
    rank=3,
    label="heavy only",
    colour="#ff7f0e",
    summary="scores alone: new tokens have no observation window",
    baseline=True,
    scored=True,
    accumulates=True,
    kernels=frozenset({"decode", "prefill"}),
    prefill="columns",
    reference=simulate,  # the split (B, 0) is passed to it as is
)
