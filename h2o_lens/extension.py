"""The one way to extend the H2O cache: a :class:`CacheExtension` hears the cache's events (DESIGN.md §1.1).

An extension is an object attached to one :class:`~h2o_lens.cache.H2OCache`; the cache's
layers call it at fixed points of their verbs, and only there. Every method has a no-op
default, so an extension overrides just the events it needs:

===========================  ====================================================================
``step_needs(layer)``        before a decode step, once per step: what the step must compute for
                             the extension (:class:`StepNeeds`: the candidate set and weights, the
                             overwritten K/V, as :class:`~h2o_lens.speculative.Journal` asks)
``protected(layer)``         before every eviction choice (the prefill's keep rule, each decode
                             step): the positions the extension keeps from eviction, per row
                             (``(b, K)`` int64 padded with -2, or None; :class:`~h2o_lens.pins.Pins`)
``before_step(l, q, k, v)``  before a decode step's attention: its query ``q (b, Hq, d)``, the new
                             key and value ``(b, Hs, d)``; the extension may write the slots it
                             added past the rows' capacity (:func:`widen`, :func:`write_slots`)
``prompt_chosen(layer, c)``  after the prefill's keep rule (:class:`PromptChoice`), before the kept
                             positions are laid into slots; ``True`` holds the prompt back until
                             the extension calls ``layer.lay_prompt()``
``on_prefill(layer, e)``     the prompt laid into slots (:class:`~h2o_lens.events.PrefillEvent`)
``on_decode(layer, e)``      a decode step's eviction, announced: the victim slot, the candidate
                             set and its scores (:class:`~h2o_lens.events.DecodeEvent`; a
                             verification segment announces only its applied steps)
``step_taken(layer, s)``     after each decode step, the counters updated (:class:`StepEvent`:
                             the query, the new key, the step's raw result)
``on_segment(layer, e)``     a verification segment ended (:class:`~h2o_lens.events.SegmentEvent`)
``rows_moved(layer, m, k)``  the rows of a layer moved: ``m`` applied to every per-row tensor,
                             ``k`` one of ``reorder``, ``select`` (a cancel selects), ``repeat``
``slots_changed(c, r, n, k)``  rows ``r`` of cache ``c`` hold ``n`` slots now (``k``: ``raise``
                             or ``refill``)
``on_state(cache, event)``   a state event of the cache (reorder, cancel, raise, save, restore,
                             prefix share; a plain dict with its ``"event"`` name, DESIGN.md §15)
``reset(layer)``             the layer dropped its state
===========================  ====================================================================

An extension observes and asks; it never replaces a verb of the cache: the eviction itself
(the FP64 reference, the torch step, the Triton kernels) is the same with or without it, and
the kept sets of a run are the same bit for bit unless the extension protects positions
(:meth:`CacheExtension.protected`, as :class:`~h2o_lens.pins.Pins` does), changes a row's slot
count through the cache's public verbs (:func:`h2o_lens.guard.grow_rows`) or adds slots of its own
past the rows' capacity (:func:`widen`): those the step attends to and never evicts into or from,
and only the extension writes them (:func:`write_slots`, the cold tier's recall window,
DESIGN.md §2.13). A cache gets its extensions from the ``extensions`` argument, or from the
factories of a :func:`use_extensions` block (each called once per new cache). A
:class:`~h2o_lens.events.CacheListener` is the read-only view: :class:`ListenerExtension` hands
it the events it names, and the cache has no other way in.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError
from .events import CacheListener, DecodeEvent, PrefillEvent, SegmentEvent
from .slot_blocks import BLOCK_BACKENDS, widened

#: the types the events name, spelled out here: this module imports neither the cache nor ops
#: (the cache imports it): an ``H2OCacheLayer``, an ``H2OCache`` and an ``ops.DecodeResult``
H2OCacheLayer = H2OCache = DecodeResult = Any

__all__ = [
    "CacheExtension",
    "StepNeeds",
    "PromptChoice",
    "StepEvent",
    "ListenerExtension",
    "use_extensions",
    "current_extensions",
    "widen",
    "write_slots",
    "write_window",
]


@dataclass(frozen=True)
class StepNeeds:
    """What a decode step computes for an extension: ``candidates`` the candidate set D, its
    scores and the step's softmax weights (the torch step and the compiled CPU step give them, the
    Triton step none); ``journal`` the K/V the step overwrites (``DecodeResult.old_key``,
    ``old_value``)."""

    candidates: bool = False
    journal: bool = False

    def __or__(self, other: StepNeeds) -> StepNeeds:
        return StepNeeds(self.candidates or other.candidates, self.journal or other.journal)


NOTHING = StepNeeds()


@dataclass
class PromptChoice:
    """One layer's prefill keep rule, before anything is laid into slots. Shapes ``(b, Hs, P)``
    unless noted.

    ``query (b, Hq, P, d)``, ``key (b, Hs, P, d)`` and ``valid (b, P)`` (or None) the prompt's;
    ``scaling`` the attention scale; ``positions`` original positions (-1 padding); ``count (b,)``
    real tokens per row; ``keep`` the positions the rule keeps; ``draft`` True when a draft to
    verify follows the prompt in the same forward (assisted decoding's first forward: the prompt
    cannot be held back).
    """

    query: torch.Tensor
    key: torch.Tensor
    valid: torch.Tensor | None
    scaling: float | None
    positions: torch.Tensor
    count: torch.Tensor
    keep: torch.Tensor
    draft: bool
    #: ``(b, Hs, P, d)`` the prompt's values (what an extension keeps of an evicted position)
    value: torch.Tensor | None = None


@dataclass
class StepEvent:
    """One layer's decode step, as computed. ``step (b,)`` its query positions; ``query (b, Hq, d)``,
    ``key (b, Hs, d)`` the new token's; ``result`` the step's :class:`~h2o_lens.ops.DecodeResult`
    (``weights``, ``cand_scores``, ``cand_positions`` when a :class:`StepNeeds` asked for the
    candidates; ``old_key`` when one asked for the journal); ``event`` the announced decode
    event (None when no extension hears them); ``in_segment`` True for a step of a verification
    segment (it may be taken back, DESIGN.md §14)."""

    step: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    scaling: float
    result: DecodeResult
    event: DecodeEvent | None
    in_segment: bool


class CacheExtension:
    """The events of the H2O cache, each a no-op here (module docstring). Subclass it and
    override the events the extension needs; :attr:`observer` says that it only reads (a
    prefill may then be another configuration's, reused, DESIGN.md §12.5)."""

    #: True for an extension that leaves the prompt forward as it is (the cache may reuse a prompt
    #: forward for it); it may still change what is kept and decoded, as the pins and the cold tier do
    observer: bool = False
    #: True when the extension hears :meth:`on_decode` (the cache then builds the decode events)
    hears_decode: bool = False

    def before_step(self, layer: H2OCacheLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        pass

    def step_needs(self, layer: H2OCacheLayer) -> StepNeeds:
        return NOTHING

    def protected(self, layer: H2OCacheLayer) -> torch.Tensor | None:
        """The positions this extension keeps from eviction in ``layer``: ``(b, K)`` int64, one
        row per batch row, padded with -2 (no position); None protects nothing. Asked before
        each eviction choice: a protected prompt position is kept by the prefill's keep rule,
        and a slot holding one is never a decode step's victim. The slots they take are the
        row's budget's: an extension that protects makes room through the budget (pins count in
        ``PolicyArgs.capacity``), or a full row has fewer positions to choose a victim from."""
        return None

    def prompt_chosen(self, layer: H2OCacheLayer, choice: PromptChoice) -> bool:
        return False

    def on_prefill(self, layer: H2OCacheLayer, event: PrefillEvent) -> None:
        pass

    def on_decode(self, layer: H2OCacheLayer, event: DecodeEvent) -> None:
        pass

    def step_taken(self, layer: H2OCacheLayer, step: StepEvent) -> None:
        pass

    def on_segment(self, layer: H2OCacheLayer, event: SegmentEvent) -> None:
        pass

    def rows_moved(self, layer: H2OCacheLayer, move: Callable[[torch.Tensor], torch.Tensor], kind: str) -> None:
        pass

    def slots_changed(self, cache: H2OCache, rows: list[int], slots: list[int], kind: str) -> None:
        pass

    def on_state(self, cache: H2OCache, event: dict) -> None:
        pass

    def reset(self, layer: H2OCacheLayer) -> None:
        pass


class ListenerExtension(CacheExtension):
    """A :class:`~h2o_lens.events.CacheListener` on the extension point: it hears ``on_prefill``
    and ``on_decode`` per layer index, and ``on_segment`` and ``on_state`` when it has them."""

    observer = True
    hears_decode = True

    def __init__(self, listener: CacheListener):
        self.listener = listener
        self._segment = getattr(listener, "on_segment", None)
        self._state = getattr(listener, "on_state", None)

    def on_prefill(self, layer: H2OCacheLayer, event: PrefillEvent) -> None:
        self.listener.on_prefill(layer.layer_idx, event)

    def on_decode(self, layer: H2OCacheLayer, event: DecodeEvent) -> None:
        self.listener.on_decode(layer.layer_idx, event)

    def on_segment(self, layer: H2OCacheLayer, event: SegmentEvent) -> None:
        if self._segment is not None:
            self._segment(layer.layer_idx, event)

    def on_state(self, cache: H2OCache, event: dict) -> None:
        if self._state is not None:
            self._state(cache, event)


#: makes an extension for a new cache, given the cache
Factory = Callable[[Any], CacheExtension]

_FACTORIES: contextvars.ContextVar[tuple[Factory, ...]] = contextvars.ContextVar("h2o_lens_extensions", default=())


def current_extensions() -> tuple[Factory, ...]:
    """The factories of the :func:`use_extensions` blocks in effect, outermost first."""
    return _FACTORIES.get()


@contextlib.contextmanager
def use_extensions(*factories: Factory) -> Iterator[None]:
    """Give every H2O cache built inside the block an extension from each of ``factories`` (a
    callable taking the new cache, called once per cache), after those of the blocks around it.
    The choice holds for the block, in its thread or task only (a context variable), and is
    undone on exit, exceptions included; a cache that exists already keeps its extensions."""
    bad = [f for f in factories if not callable(f)]
    if bad:
        raise ConfigError(f"use_extensions takes callables that make a CacheExtension from a cache, got {bad!r}")
    token = _FACTORIES.set(_FACTORIES.get() + tuple(factories))
    try:
        yield
    finally:
        _FACTORIES.reset(token)


def build(
    cache: H2OCache, listener: CacheListener | None, given: Sequence[CacheExtension] | None
) -> list[CacheExtension]:
    """The extensions of a new cache: the listener's view first, then ``given``, or (``given`` None)
    one from each factory in effect."""
    out: list[CacheExtension] = [] if listener is None else [ListenerExtension(listener)]
    made = [f(cache) for f in current_extensions()] if given is None else list(given)
    for ext in made:
        if not isinstance(ext, CacheExtension):
            raise ConfigError(f"{ext!r} is not a CacheExtension; subclass h2o_lens.extension.CacheExtension")
        out.append(ext)
    return out


#: the per-slot tensors of a layer and the value an empty slot holds
_SLOT_FIELDS = (("keys", 0.0), ("values", 0.0), ("scores", 0.0), ("history", 0), ("positions", -1))


def widen(layer: H2OCacheLayer, extra: int) -> int:
    """Add ``extra`` empty slots past the end of ``layer``'s storage and return the first one's index.

    The slots lie past every row's capacity: the decode step attends to them once they hold a
    position, and never chooses them as a victim or fills a new token into them (the per-row
    step, DESIGN.md §2.7); only the extension that added them writes them (:func:`write_slots`).
    """
    start = layer.keys.shape[2]
    blocks = layer.owner.backend in BLOCK_BACKENDS  # the torch step's block storage (DESIGN.md §2.7)
    for name, empty in _SLOT_FIELDS:
        t = getattr(layer, name)
        if t is not None:
            setattr(layer, name, widened(t, extra, empty, blocks))
    layer.forget_groups()
    return start


def write_slots(layer: H2OCacheLayer, start: int, key, value, score, position) -> None:
    """Overwrite slots ``start …`` of ``layer`` (ones :func:`widen` added) with ``key, value
    (b, Hs, n, d)``, ``score (b, Hs, n)`` and ``position (b, Hs, n)`` (-1: empty); a per-slot
    history restarts at 0."""
    n = key.shape[2]
    end = start + n
    if start < 0 or end > layer.keys.shape[2]:
        raise ConfigError(f"write_slots({start}, n={n}) is outside the layer's {layer.keys.shape[2]} slots")
    layer.keys[:, :, start:end] = key.to(layer.keys.dtype)
    layer.values[:, :, start:end] = value.to(layer.values.dtype)
    layer.scores[:, :, start:end] = score.to(layer.scores.dtype)
    layer.positions[:, :, start:end] = position.to(layer.positions.dtype)
    if layer.history is not None:
        layer.history[:, :, start:end] = 0


def write_window(layer: H2OCacheLayer, start: int, slots, changed, key, value, score, position) -> None:
    """Write window slots ``start …`` of ``layer`` (ones :func:`widen` added). ``slots``: the
    scores and positions ``(b, Hs, n)`` of every window slot, or None when only the changed slots
    change. ``changed = (rows, at)`` (``(m,)`` each: a row is ``batch · Hs + KV set``, ``at`` a slot
    counted from ``start``): the slots given a new entry, with its ``key, value (m, d)``, ``score``
    and ``position (m,)``; the history of a changed slot restarts at 0."""
    width = layer.keys.shape[2]
    dev = layer.keys.device
    if slots is not None:
        n = slots[0].shape[2]
        if start < 0 or start + n > width:
            raise ConfigError(f"write_window({start}, n={n}) is outside the layer's {width} slots")
        layer.scores[:, :, start : start + n] = slots[0].to(dev, layer.scores.dtype)
        layer.positions[:, :, start : start + n] = slots[1].to(dev, layer.positions.dtype)
    rows, at = changed
    if not rows.numel():
        return
    if start < 0 or start >= width:
        raise ConfigError(f"write_window({start}) is outside the layer's {width} slots")
    rows, at = rows.to(dev), (at + start).to(dev)
    flat = rows * width + at  # the slots in the flattened (b·Hs·B) storage
    hs, d = layer.keys.shape[1], layer.keys.shape[3]
    zero = None if layer.history is None else torch.zeros((), dtype=layer.history.dtype, device=dev)
    fields = ((layer.keys, key), (layer.values, value), (layer.scores, score), (layer.positions, position))
    for t, new in fields + (((layer.history, zero),) if zero is not None else ()):
        new = new.to(dev, t.dtype)
        if t.is_contiguous():
            view = t.view(-1, d) if t.dim() == 4 else t.view(-1)
            view.index_copy_(0, flat, new.expand(flat.shape[0], *view.shape[1:]))
        else:
            t[rows // hs, rows % hs, at] = new
