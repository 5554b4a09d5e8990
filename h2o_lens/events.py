"""What the H2O cache tells a listener: the eviction events and the listener (DESIGN.md §3).

A :class:`CacheListener` hears, per layer, a :class:`PrefillEvent` at the prefill and a
:class:`DecodeEvent` at every decode step. Two more methods are optional, called when the
listener has them: ``on_segment(layer_idx, SegmentEvent)`` when a verification segment ends
(DESIGN.md §14) and ``on_state(cache, event)`` when rows are reordered, cancelled, saved,
restored or share a prompt prefix (DESIGN.md §15; ``event`` a plain dict with its ``"event"``
name). The recorder
(:mod:`recorders.recorder`) and the tests implement it. A listener is the read-only view on the
cache's extension point (:class:`h2o_lens.extension.ListenerExtension`, DESIGN.md §1.1). The
events hold tensors the cache may reuse: copy what is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from . import eviction

__all__ = ["CacheListener", "PrefillEvent", "DecodeEvent", "SegmentEvent", "decode_stats"]


@dataclass
class PrefillEvent:
    """What one layer decided at prefill. Shapes ``(b, Hs, P)`` unless noted.

    ``positions`` original positions (-1 padding), ``scores`` the scores that
    drove the choice (the policy's ranking values, :func:`h2o_lens.ops.prefill_scores`:
    column sums for h2o and heavy, the seeded draw for random, zeros for local
    and sink, the last row's weights for tova, ``window − count`` for scissorhands), ``keep``
    kept slots, ``eligible`` positions outside each request's recent window and
    sink, ``step (b,)`` the last prompt position of each request.
    """

    positions: torch.Tensor
    scores: torch.Tensor
    keep: torch.Tensor
    eligible: torch.Tensor
    step: torch.Tensor


@dataclass
class DecodeEvent:
    """What one layer decided at one decode step, in raw form (cheap to emit).

    ``step (b,)`` query positions; ``cand_scores``/``cand_positions``
    ``(b, Hs, B + 1)`` the candidate set D after the score update (slots, then
    the new token); ``slot (b, Hs)`` the slot overwritten (``B``: the new token
    was its own victim); ``evicts (b, Hs)`` whether a position left the cache;
    ``kept (b, Hs, B)`` the live slot positions after the step (copy it to keep
    it); ``protected (b, 1, K)`` the positions that were not eligible whatever their score (the
    pins, padded with -2, DESIGN.md §2.11), or None. :meth:`stats` derives the recorder's facts,
    batched if wanted.
    """

    step: torch.Tensor
    slot: torch.Tensor
    evicts: torch.Tensor
    cand_scores: torch.Tensor
    cand_positions: torch.Tensor
    kept: torch.Tensor
    protected: torch.Tensor | None = None

    def stats(self, recent: torch.Tensor | int, sink: torch.Tensor | int = 0) -> eviction.StepStats:
        return decode_stats(
            self.cand_scores, self.cand_positions, self.slot, self.evicts, self.step, recent, sink, self.protected
        )


def decode_stats(
    cand_scores: torch.Tensor,
    cand_positions: torch.Tensor,
    slot: torch.Tensor,
    evicts: torch.Tensor,
    step: torch.Tensor,
    recent: torch.Tensor | int,
    sink: torch.Tensor | int = 0,
    pinned: torch.Tensor | None = None,
) -> eviction.StepStats:
    """:class:`~h2o_lens.eviction.StepStats` of decode steps, any leading dims.

    ``cand_* (..., Hs, B + 1)``, ``slot, evicts (..., Hs)``, ``step (...)``;
    ``recent`` and ``sink`` ints, or per-request tensors broadcastable to ``step``;
    ``pinned`` the positions never eligible (DESIGN.md §2.11): a 1-D tensor, or per request
    ``(..., 1, K)`` padded with -2 (a :class:`DecodeEvent`'s ``protected``), or None.
    """

    def col(x, n):  # an int, or a tensor with n trailing unit dims
        return x[(...,) + (None,) * n] if isinstance(x, torch.Tensor) else x

    step_col = step[..., None, None]
    if pinned is not None:
        pinned = pinned.to(cand_positions.device)
    eligible = eviction.eligible_mask(cand_positions, step_col, col(recent, 2), col(sink, 2), pinned=pinned)
    return eviction.step_stats(cand_scores, cand_positions, eligible, slot, evicts, step[..., None], col(recent, 1))


@dataclass
class SegmentEvent:
    """One layer's verification segment, when it ends (DESIGN.md §14).

    ``step (b,)`` the query position of the segment's first token; ``proposed`` the
    tokens of the verification forward; ``accepted`` those kept (the first
    ``accepted``); ``undone`` the decode events of the rest, newest last (in
    ``rollback`` mode they were emitted and applied, then undone; in ``defer`` mode
    they were computed on the working copy only and never emitted); ``mode``.
    """

    step: torch.Tensor
    proposed: int
    accepted: int
    undone: list[DecodeEvent]
    mode: str

    @property
    def rolled_back(self) -> int:
        return self.proposed - self.accepted


class CacheListener(Protocol):
    """Receives eviction events; the recorder and the tests implement it (module docstring:
    ``on_segment`` and ``on_state`` are optional)."""

    def on_prefill(self, layer_idx: int, event: PrefillEvent) -> None: ...

    def on_decode(self, layer_idx: int, event: DecodeEvent) -> None: ...
