"""Verification segments of speculative and assisted decoding (DESIGN.md §14).

A forward of ``m`` tokens after the prefill (a draft being verified) is processed,
per layer, as ``m`` successive plain decode steps: token ``i`` attends to the cache
after token ``i − 1``'s step, then is appended and may evict, exactly what greedy
decoding of the same tokens does. ``crop(-r)`` then takes the last ``r`` steps back,
so the cache is in the state after the last accepted token. Two modes:

``rollback``
    the steps are applied to the live slots; each step journals what it overwrote
    (the victim slot's K/V, and copies of the scores, positions, history, fill and
    next position before the step) and the undo copies them back, newest first:
    bit-exact, never a subtraction.
``defer``
    the live slots stay as they were; the steps run on a working copy (the
    temporary capacity) and on confirmation the accepted steps are applied to the
    live slots from their stored query, key and value, so only confirmed tokens
    are ever scored or evict.

The layer calls :func:`begin`, :func:`step` and :func:`end`; the listener hears
one :class:`SegmentEvent` per layer when a segment ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import faults
from .errors import ConfigError, UnsupportedModelError

__all__ = ["MODES", "SegmentEvent", "Segment", "check_mode", "begin", "step", "end"]

MODES = ("rollback", "defer")

#: state a decode step rebinds or updates; a journal entry copies the small ones
_META = ("scores", "positions", "history", "fill", "next_pos")
_SLOTS = ("keys", "values", "scores", "positions", "history")


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ConfigError(f"unknown speculative mode {mode!r}; expected one of {', '.join(MODES)} (DESIGN.md §14)")
    return mode


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
    undone: list
    mode: str

    @property
    def rolled_back(self) -> int:
        return self.proposed - self.accepted


@dataclass
class _Entry:
    """What one applied step changed, enough to restore it by copy."""

    meta: dict
    slot: torch.Tensor | None = None  # (b, Hs) slot written (B: none)
    old_key: torch.Tensor | None = None  # (b, Hs, d) what it held
    old_value: torch.Tensor | None = None


@dataclass
class Segment:
    mode: str
    start: torch.Tensor  # (b,) first query position
    scaling: float
    entries: list = field(default_factory=list)  # rollback: one _Entry per step
    inputs: list = field(default_factory=list)  # defer: (q, k, v) per step
    events: list = field(default_factory=list)  # decode events per step (None without a listener)
    live: dict | None = None  # defer: the live state, untouched while the copy runs

    @property
    def steps(self) -> int:
        return len(self.events)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def begin(layer: Any, scaling: float) -> Segment:
    """Open a segment on ``layer``; in ``defer`` mode its steps run on a working copy."""
    seg = Segment(layer.owner.speculative, layer.next_pos.clone(), scaling)
    if seg.mode == "defer":
        seg.live = {name: getattr(layer, name) for name in _SLOTS + ("fill", "next_pos")}
        for name in _SLOTS:
            setattr(layer, name, _clone(getattr(layer, name)))
    return seg


def step(layer: Any, seg: Segment, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """One token of the segment as a plain decode step; returns its attention output ``(b, 1, Hq, d)``."""
    layer.pending = (key, value)
    if seg.mode == "rollback":
        entry = _Entry({name: _clone(getattr(layer, name)) for name in _META})
        out, res, event = layer.decode_once(query, seg.scaling, journal=True, emit=True)
        entry.slot, entry.old_key, entry.old_value = res.slot, res.old_key, res.old_value
        seg.entries.append(entry)
    else:
        seg.inputs.append((query, key, value))
        out, _, event = layer.decode_once(query, seg.scaling, journal=False, emit=False)
    seg.events.append(event)
    return out


def end(layer: Any, seg: Segment, rolled_back: int) -> SegmentEvent:
    """Close ``seg`` keeping all but its last ``rolled_back`` steps; the cache is then
    in the state after the last accepted token (DESIGN.md §14)."""
    if not 0 <= rolled_back <= seg.steps:
        raise UnsupportedModelError(
            f"layer {layer.layer_idx}: crop of {rolled_back} tokens, but the open verification segment "
            f"holds {seg.steps}; only tokens of the last multi-token forward can be taken back"
        )
    accepted = seg.steps - rolled_back
    if seg.mode == "rollback":
        for entry in reversed(seg.entries[accepted:]):
            _undo(layer, entry)
    else:
        keep_scores = layer.scores
        for name, value in seg.live.items():
            setattr(layer, name, value)
        if faults.active("scores_not_rolled_back") and rolled_back:
            layer.scores = keep_scores  # the broken variant: the working copy's scores stay
        for query, key, value in seg.inputs[:accepted]:
            layer.pending = (key, value)
            layer.decode_once(query, seg.scaling, journal=False, emit=True)
    layer.seen -= rolled_back
    return SegmentEvent(seg.start, seg.steps, accepted, seg.events[accepted:], seg.mode)


def _undo(layer: Any, entry: _Entry) -> None:
    """Restore the state before one step: metadata by copy, the victim slot's K/V by scatter."""
    cap = layer.keys.shape[2]
    slot = entry.slot
    idx = slot.clamp(max=cap - 1)[..., None, None].expand(*slot.shape, 1, layer.keys.shape[-1])
    written = (slot < cap)[..., None]  # (b, Hs, 1): the step overwrote a slot
    for name, old in (("keys", entry.old_key), ("values", entry.old_value)):
        t = getattr(layer, name)
        t.scatter_(2, idx, torch.where(written, old, t.gather(2, idx)[:, :, 0])[:, :, None])
    for name in _META:
        old = entry.meta[name]
        if name == "scores" and faults.active("scores_not_rolled_back"):
            continue  # the broken variant: the rejected queries' attention stays in the scores
        cur = getattr(layer, name)
        if old is None or cur is None or name in ("fill", "next_pos"):
            setattr(layer, name, old)
        else:
            cur.copy_(old)
