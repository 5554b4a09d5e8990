"""The runtime's known state bugs, for diagnosis (DESIGN.md §15.5): a subclass of the cache layer.

The lifecycle check and the reports must catch an implementation that gets the serving state
wrong. :class:`FaultyLayer` is the H2O cache layer with some of these bugs, each overriding the
one public verb that does the work (never a private method: the test of the cache's extension
point says so); :func:`inject` builds the caches of a block with it::

    with inject("scores_not_rolled_back"):
        ...  # every H2O cache built here (h2o(...), record(...)) has the bug

The live runtime has no fault switch: a bug exists only in a cache built inside the block
(:func:`h2o_lens.cache.use_layer_class`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from h2o_lens.cache import H2OCacheLayer, use_layer_class
from h2o_lens.errors import ConfigError

__all__ = ["KNOWN", "FaultyLayer", "faulty_layer", "inject"]

#: fault name -> what the broken runtime does
KNOWN: dict[str, str] = {
    "scores_not_rolled_back": "a rejected speculative segment's attention stays in the cumulative scores",
    "kv_reorder_without_scores": "a beam reorder moves K and V but not the scores and positions",
    "prefix_without_copy": "requests sharing a prompt prefix write into the shared slots (no copy-on-write)",
}


class FaultyLayer(H2OCacheLayer):
    """An H2O cache layer with the bugs named in :attr:`faults` (:func:`faulty_layer` makes one)."""

    faults: frozenset[str] = frozenset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if "kv_reorder_without_scores" not in self.faults or self.keys is None:
            return super().reorder_cache(beam_idx)
        idx = beam_idx.to(self.keys.device)
        # K and V move; scores, positions and counters stay with the old rows
        self.move_rows(lambda t: t.index_select(0, idx), "reorder", names=("keys", "values"))

    def own_prefix_scores(self, shared: torch.Tensor) -> torch.Tensor:
        if "prefix_without_copy" in self.faults:
            return shared  # no copy: each request adds its suffix's share into the shared sums
        return super().own_prefix_scores(shared)

    def end_segment(self, rolled_back: int) -> None:
        seg = self.segment
        if "scores_not_rolled_back" not in self.faults or seg is None or not rolled_back:
            return super().end_segment(rolled_back)
        # the ranking values after every proposed step, rejected ones included: those of the live
        # (rollback) or working (defer) slots step by step, the last state of a segment at once
        kept = seg.batch.scores(seg.steps) if seg.batch is not None else self.scores.clone()
        super().end_segment(rolled_back)
        self.scores.copy_(kept)  # the rejected queries' attention stays in the scores


def faulty_layer(*names: str) -> type[FaultyLayer]:
    """A :class:`FaultyLayer` subclass with the faults ``names`` (none: the plain layer's behaviour)."""
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ConfigError(f"unknown fault(s) {unknown}; known: {sorted(KNOWN)}")
    return type("FaultyLayer", (FaultyLayer,), {"faults": frozenset(names)})


@contextlib.contextmanager
def inject(*names: str) -> Iterator[type[FaultyLayer]]:
    """Build the H2O caches of the block with the faults ``names``; yields the layer class."""
    cls = faulty_layer(*names)
    with use_layer_class(cls):
        yield cls
