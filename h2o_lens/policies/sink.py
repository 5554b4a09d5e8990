"""Sink: the first ``sink`` positions plus the recent window, StreamingLLM (DESIGN.md §2.5)."""

from __future__ import annotations

from .local import Unscored

__all__ = ["SINK"]


class SinkAndRecent(Unscored):
    """``(0, B − s, s)``: the first ``s`` positions are never eligible."""

    def split(self, heavy: int, recent: int, sink: int) -> tuple[int, int, int]:
        return 0, heavy + recent - sink, sink

    def check_budget(self, heavy: int, recent: int, sink: int) -> str | None:
        if sink >= heavy + recent:
            return (
                f"sink={sink} leaves no recent slot in a budget of {heavy + recent}; "
                "use a smaller sink or a larger budget"
            )
        return None


SINK = SinkAndRecent(
    name="sink",
    rank=4,
    label="sink + recent",
    colour="#9467bd",
    summary="first s positions + recent (StreamingLLM): fixed sinks against content heavy hitters",
    baseline=True,
    kernels=frozenset({"decode"}),
)
