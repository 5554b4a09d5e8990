"""Verification segments of speculative and assisted decoding (DESIGN.md §14).

A forward of ``m`` tokens after the prefill (a draft being verified) is processed,
per layer, as ``m`` successive plain decode steps: token ``i`` attends to the cache
after token ``i − 1``'s step, then is appended and may evict, exactly what greedy
decoding of the same tokens does. ``crop(-r)`` then takes the last ``r`` steps back,
so the cache is in the state after the last accepted token. Two modes:

``rollback``
    the steps are applied to the live slots; the cache's :class:`Journal` (an extension,
    :mod:`h2o_lens.extension`) records what each step overwrote (the victim slot's K/V,
    and copies of the scores, positions, history, fill and next position before the
    step) and the undo copies them back, newest first: bit-exact, never a subtraction.
``defer``
    the live slots stay as they were; the steps run on a working copy (the
    temporary capacity) and on confirmation the accepted steps are applied to the
    live slots from their stored query, key and value, so only confirmed tokens
    are ever scored or evict.

The layer calls :func:`begin`, :func:`step` and :func:`end`; the cache's extensions hear
one :class:`~h2o_lens.events.SegmentEvent` per layer when a segment ends, and the applied
steps' decode events through :meth:`SegmentLayer.announce` (:mod:`h2o_lens.extension`). The segment
reaches the layer through :class:`SegmentLayer` only, and picks each victim with
:func:`h2o_lens.eviction.select_victim`, the decode step's own rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from . import eviction, ops
from .errors import ConfigError, UnsupportedModelError
from .events import DecodeEvent, SegmentEvent
from .extension import NOTHING, CacheExtension, StepEvent, StepNeeds
from .slot_blocks import moved

__all__ = [
    "MODES",
    "SegmentLayer",
    "Segment",
    "Journal",
    "check_mode",
    "begin",
    "step",
    "end",
    "batched",
    "run_batched",
]

MODES = ("rollback", "defer")

#: state a decode step rebinds or updates; a journal entry copies the small ones
_META = ("scores", "positions", "history", "fill", "next_pos")
_SLOTS = ("keys", "values", "scores", "positions", "history")


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ConfigError(f"unknown speculative mode {mode!r}; expected one of {', '.join(MODES)} (DESIGN.md §14)")
    return mode


@runtime_checkable
class SegmentLayer(Protocol):
    """What a verification segment reads and calls on a cache layer;
    :class:`h2o_lens.cache.H2OCacheLayer` implements it.

    The segment reads the slot storage and the per-request counters, writes the victims'
    K/V, positions and ranking values into the storage tensors in place, and changes the
    layer's fields only through :meth:`stage`, :meth:`decode_once`, :meth:`load_state` and
    :meth:`rewind`; a ``rollback`` segment's journal is its cache's :class:`Journal` extension
    (:meth:`journal`). Shapes: ``b`` rows, ``Hs`` KV sets, ``B`` slots, head size ``d``.
    """

    layer_idx: int
    keys: torch.Tensor  # (b, Hs, B, d)
    values: torch.Tensor  # (b, Hs, B, d)
    scores: torch.Tensor  # (b, Hs, B) the policy's ranking values
    positions: torch.Tensor  # (b, Hs, B) original positions, -1 empty
    history: torch.Tensor | None  # (b, Hs, B), for a policy that keeps one
    fill: torch.Tensor | None  # (b,) used slots, None once all are full
    next_pos: torch.Tensor  # (b,) position of the next token

    @property
    def segment_mode(self) -> str:
        """``rollback`` or ``defer`` (:data:`MODES`)."""
        ...

    @property
    def hears_decode(self) -> bool:
        """Whether an extension hears the decode events (a segment then builds them)."""
        ...

    def announce(self, event: DecodeEvent) -> None:
        """Hand an applied step's decode event to the extensions that hear them."""
        ...

    def protected(self) -> torch.Tensor | None:
        """``(b, 1, K)`` the positions the extensions keep from eviction (padded with -2), or None."""
        ...

    def one_budget(self) -> ops.PolicyArgs | None:
        """The budget of every row, or None when the rows' budgets differ."""
        ...

    def stage(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stage the next step's new K/V ``(b, Hs, 1, d)``, as ``update`` does."""
        ...

    def journal(self) -> Journal:
        """The cache's :class:`Journal` extension, attached on first use."""
        ...

    def decode_once(
        self, query: torch.Tensor, scaling: float, *, emit: bool = True
    ) -> tuple[torch.Tensor, ops.DecodeResult, DecodeEvent | None]:
        """One decode step of the staged token (:meth:`h2o_lens.cache.H2OCacheLayer.decode_once`)."""
        ...

    def load_state(self, state: Mapping[str, torch.Tensor | None], *, copy: bool = False) -> None:
        """Set row-state fields by name (``copy``: into the live slot tensors)."""
        ...

    def rewind(self, tokens: int) -> None:
        """Take the last ``tokens`` columns back from the count of columns seen."""
        ...


@dataclass
class _Entry:
    """What one applied step changed, enough to restore it by copy."""

    meta: dict
    slot: torch.Tensor | None = None  # (b, Hs) slot written (B: none)
    old_key: torch.Tensor | None = None  # (b, Hs, d) what it held
    old_value: torch.Tensor | None = None


class Journal(CacheExtension):
    """Speculative decoding's journal, on the cache's extension point (DESIGN.md §14).

    While a layer's ``rollback`` segment is open (:meth:`open` … :meth:`take`), the step's
    before-step event (:meth:`step_needs`, once per step) copies the small state the step
    rebinds or updates (:data:`_META`) and asks the step for the K/V it overwrites; the
    after-step event (:meth:`step_taken`) records the slot written and what it held. The
    segment's undo reads the entries back, newest first. It changes nothing itself
    (an observer), and asks nothing of a layer with no open segment."""

    observer = True

    def __init__(self) -> None:
        self._open: dict[int, list[_Entry]] = {}  # layer index → its open segment's entries
        self._before: dict[int, dict] = {}  # layer index → the state before the step under way

    def open(self, layer: SegmentLayer) -> None:
        """Start journaling ``layer``'s steps (an empty journal)."""
        self._open[layer.layer_idx] = []
        self._before.pop(layer.layer_idx, None)

    def take(self, layer: SegmentLayer) -> list[_Entry]:
        """Stop journaling ``layer``; its entries, oldest first (empty when none was open)."""
        self._before.pop(layer.layer_idx, None)
        return self._open.pop(layer.layer_idx, [])

    def step_needs(self, layer: Any) -> StepNeeds:
        if layer.layer_idx not in self._open:
            return NOTHING
        self._before[layer.layer_idx] = {name: _clone(t) for name, t in _state(layer, _META).items()}
        return StepNeeds(journal=True)

    def step_taken(self, layer: Any, step: StepEvent) -> None:
        entries = self._open.get(layer.layer_idx)
        if entries is not None:
            res = step.result
            entries.append(_Entry(self._before.pop(layer.layer_idx), res.slot, res.old_key, res.old_value))

    def reset(self, layer: Any) -> None:
        self.take(layer)


@dataclass
class Segment:
    mode: str
    start: torch.Tensor  # (b,) first query position
    scaling: float
    journal: Journal | None = None  # rollback, step by step: the cache's journal, open for the layer
    inputs: list = field(default_factory=list)  # defer: (q, k, v) per step
    events: list = field(default_factory=list)  # decode events per step (None when no extension hears them)
    live: dict | None = None  # defer: the live state, untouched while the copy runs
    batch: _Batch | None = None  # the whole segment verified at once (:func:`run_batched`)

    @property
    def steps(self) -> int:
        return self.batch.steps if self.batch is not None else len(self.events)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else moved(t, torch.clone)  # block storage stays blocks (DESIGN.md §2.7)


def _state(layer: SegmentLayer, names: tuple[str, ...]) -> dict[str, torch.Tensor | None]:
    return {name: getattr(layer, name) for name in names}


def begin(layer: SegmentLayer, scaling: float, at_once: bool = False) -> Segment:
    """Open a segment on ``layer``; in ``defer`` mode its steps run on a working copy (not
    needed when the segment is verified ``at_once``, :func:`run_batched`)."""
    seg = Segment(layer.segment_mode, layer.next_pos.clone(), scaling)
    if seg.mode == "rollback" and not at_once:
        seg.journal = layer.journal()
        seg.journal.open(layer)
    if seg.mode == "defer" and not at_once:
        seg.live = _state(layer, _SLOTS + ("fill", "next_pos"))
        layer.load_state({name: _clone(seg.live[name]) for name in _SLOTS})
    return seg


def step(
    layer: SegmentLayer, seg: Segment, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """One token of the segment as a plain decode step; returns its attention output ``(b, 1, Hq, d)``."""
    layer.stage(key, value)
    if seg.mode == "rollback":  # the cache's journal records the step (:class:`Journal`)
        out, _, event = layer.decode_once(query, seg.scaling, emit=True)
    else:
        seg.inputs.append((query, key, value))
        out, _, event = layer.decode_once(query, seg.scaling, emit=False)
    seg.events.append(event)
    return out


def end(layer: SegmentLayer, seg: Segment, rolled_back: int) -> SegmentEvent:
    """Close ``seg`` keeping all but its last ``rolled_back`` steps; the cache is then
    in the state after the last accepted token (DESIGN.md §14)."""
    if not 0 <= rolled_back <= seg.steps:
        raise UnsupportedModelError(
            f"layer {layer.layer_idx}: crop of {rolled_back} tokens, but the open verification segment "
            f"holds {seg.steps}; only tokens of the last multi-token forward can be taken back"
        )
    accepted = seg.steps - rolled_back
    if seg.batch is not None:
        return _end_batched(layer, seg, rolled_back)
    if seg.mode == "rollback":
        for entry in reversed(seg.journal.take(layer)[accepted:]):
            _undo(layer, entry)
    else:
        layer.load_state(seg.live)
        for query, key, value in seg.inputs[:accepted]:
            layer.stage(key, value)
            layer.decode_once(query, seg.scaling, emit=True)
    layer.rewind(rolled_back)
    return SegmentEvent(seg.start, seg.steps, accepted, seg.events[accepted:], seg.mode)


def _end_batched(layer: SegmentLayer, seg: Segment, rolled_back: int) -> SegmentEvent:
    batch = seg.batch
    accepted = batch.steps - rolled_back
    if batch.applied != accepted:
        _apply(layer, batch, accepted)
    if seg.mode == "defer" and layer.hears_decode:
        for event in seg.events[:accepted]:
            layer.announce(event)
    layer.rewind(rolled_back)
    return SegmentEvent(seg.start, batch.steps, accepted, seg.events[accepted:], seg.mode)


def _undo(layer: SegmentLayer, entry: _Entry) -> None:
    """Restore the state before one step: metadata by copy, the victim slot's K/V by scatter."""
    cap = layer.keys.shape[2]
    slot = entry.slot
    idx = slot.clamp(max=cap - 1)[..., None, None].expand(*slot.shape, 1, layer.keys.shape[-1])
    written = (slot < cap)[..., None]  # (b, Hs, 1): the step overwrote a slot
    for t, old in ((layer.keys, entry.old_key), (layer.values, entry.old_value)):
        t.scatter_(2, idx, torch.where(written, old, t.gather(2, idx)[:, :, 0])[:, :, None])
    layer.load_state(entry.meta, copy=True)


# -- the whole segment in one computation (DESIGN.md §14.1) -------------------------------------


@dataclass
class _Batch:
    """A segment verified at once: what each state ``t = 0 … m`` (after its first ``t`` steps)
    is made of. ``victims (b, Hs, m)`` the slot each step wrote (distinct: a written slot
    holds a recent token, never eligible while the segment lasts); ``key, value (b, Hs, m, d)``
    the segment's own; ``old_key, old_value`` what the victims held before (the journal); the
    ranking values of every state (:meth:`scores`) and its :meth:`positions`; ``applied`` the
    state the live storage holds."""

    victims: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    old_key: torch.Tensor
    old_value: torch.Tensor
    totals: torch.Tensor  # (b,Hs,m+1,B) each initial slot's running sum
    runs: torch.Tensor  # (b,Hs,m,m) [k, i] step k's slot's sum after step i (:func:`_slot_runs`)
    writer: torch.Tensor  # (b,Hs,B) int64 the step that wrote each slot, m: none
    pos0: torch.Tensor  # (b,Hs,B) int64 the positions before the segment
    start: torch.Tensor  # (b,1,1) int64 the first step's position
    dtype: torch.dtype  # of the positions
    old_pos: torch.Tensor  # (b,Hs,m) the victims' positions before the segment
    new_pos: torch.Tensor  # (b,Hs,m) each step's position
    applied: int
    rounds: int = 1  # computations of the rows until the victims settled

    def __post_init__(self):
        self._run_of = self.writer.clamp(max=self.steps - 1)  # (b,Hs,B) the row of runs per slot

    @property
    def steps(self) -> int:
        return self.victims.shape[-1]

    def scores(self, t: int, candidates: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ranking values of state ``t`` ``(b, Hs, B)`` (written into ``out`` if given);
        ``candidates``: step ``t``'s after its update and before its write."""
        if t == 0 and not candidates:
            return self.totals[:, :, 0] if out is None else out.copy_(self.totals[:, :, 0])
        i = t if candidates else t - 1
        written = self.writer < i if candidates else self.writer <= i
        run = self.runs[..., i].gather(2, self._run_of)
        return torch.where(written, run, self.totals[:, :, i + 1], out=out)

    def positions(self, t: int) -> torch.Tensor:
        """The positions of state ``t`` ``(b, Hs, B)``."""
        return torch.where(self.writer < t, self.start + self.writer, self.pos0).to(self.dtype)


def batched(layer: SegmentLayer, m: int) -> bool:
    """Whether a segment of ``m`` tokens on ``layer`` can be verified at once (:func:`run_batched`):
    on CPU, one budget, a full cache, a policy whose score is the running sum of weights
    (``Policy.accumulates``, no history) and a recent window of at least ``m`` (so no token of
    the segment can be a victim while it lasts). Otherwise the segment runs step by step."""
    if m < 2 or layer.fill is not None or layer.history is not None:
        return False
    args = layer.one_budget()
    return args is not None and args.spec.accumulates and args.recent >= m and layer.keys.device.type == "cpu"


def run_batched(
    layer: SegmentLayer, seg: Segment, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """The ``m`` decode steps of a segment in one computation, equal bit for bit to the steps
    one by one (DESIGN.md §14.1). Returns the outputs ``(b, m, Hq, d)``.

    Step ``i`` attends to the storage left by steps ``0 … i − 1``: the initial slots with each
    earlier victim replaced by that step's token. Given a guess of the victims, every step's
    storage is known, and all ``m`` rows run through the decode step's own attention
    (:func:`~h2o_lens.ops.attend_rows`, the same block reductions). The ranking values follow
    in order (sequential sums), and each step's victim is re-selected from them. Row ``i`` is
    exact as soon as the guess is right before ``i``, so each round fixes at least one more
    step; the guess is final when a round returns it unchanged (usually the first).
    """
    b, hs, cap, d = layer.keys.shape
    m = query.shape[2]
    args = layer.one_budget()
    start = layer.next_pos  # (b,)
    qg = query.reshape(b, hs, -1, m, d).transpose(2, 3) * seg.scaling  # (b,Hs,m,G,d)
    sc0 = layer.scores.numpy()
    pos0 = layer.positions
    ar_m = np.arange(m)
    pos0_np = pos0.numpy().astype(np.int64)
    start_np = start.numpy().astype(np.int64)[:, None, None, None]
    steps = torch.from_numpy(start_np + ar_m[:, None])  # (b,1,m,1)
    protected = layer.protected()  # (b, 1, K) or None
    pins = None if protected is None else protected[:, None]  # (b, 1, 1, K) against (b, Hs, m, B)
    # (b,Hs,m,B) initial slots eligible at step i (before any write)
    elig = eviction.eligible_mask(pos0[:, :, None], steps, args.recent, args.sink, all_live=True, pinned=pins).numpy()
    logits = _all_logits(qg, layer.keys, key)  # (b,Hs,m,G,B+m): every row against every key
    guess = _first_guess(elig, _rough_totals(logits, cap, layer.scores, args.gqa), pos0)
    acc = layer.scores.dtype
    out = layer.scores.new_empty(qg.shape)  # in the scores' dtype, as the step's
    agg = layer.scores.new_empty(b, hs, m, cap + 1)
    totals = np.empty((b, hs, m + 1, cap), sc0.dtype)  # (b,Hs,m+1,B) each slot's running sum per state
    totals[:, :, 0] = sc0
    lo = 0  # rows before lo are exact already
    slots = (layer.keys, layer.values)
    rounds = 0
    while rounds <= m:  # each round fixes one more step: m + 1 rounds always settle
        rounds += 1
        writer = _writers(guess, cap)  # (b,Hs,B) the step that wrote each slot, m: none
        if lo < m:  # (lo == m: every row was exact, the last victim alone was re-selected)
            out[:, :, lo:], agg[:, :, lo:] = _rows(qg, slots, key, value, writer, lo, args.gqa, acc, logits)
        agg_np = agg.numpy()  # (b,Hs,m,B+1)
        totals[:, :, 1:] = agg_np[..., :cap]
        np.cumsum(totals, axis=2, out=totals)  # in place, in order: the steps' sums
        before = writer[:, :, None, :] < ar_m[:, None]  # (b,Hs,m,B) written before step i
        cand = elig & ~before
        # the step's own choice: a tie among candidates (unwritten slots) goes to the older
        # position; with no candidate at all every slot ties, written ones too, as in the step
        pos = pos0_np[:, :, None]
        found = cand.any(-1)  # (b,Hs,m) step i had a candidate
        if not found.all():
            pos = np.where(before, start_np + writer[:, :, None], pos)
        sums = torch.from_numpy(totals[:, :, 1:])  # (b,Hs,m,B) each step's ranking values
        victims = eviction.select_victim(sums, torch.from_numpy(pos), torch.from_numpy(cand))[0].numpy()  # (b,Hs,m)
        wrong = (victims != guess).reshape(-1, m).any(0)
        if not wrong.any():
            break
        lo = int(wrong.argmax()) + 1  # rows up to the first wrong step used a right guess
        guess = victims
    else:
        raise AssertionError(f"layer {layer.layer_idx}: the segment's victims did not settle in {m + 1} rounds")
    out = out.transpose(1, 2).reshape(b, m, hs * qg.shape[3], d)
    runs = _slot_runs(agg_np, victims, sc0.dtype)
    vic = torch.from_numpy(victims)
    idx = vic[..., None].expand(b, hs, m, d)
    batch = _Batch(
        vic,
        key,
        value,
        layer.keys.gather(2, idx),
        layer.values.gather(2, idx),
        torch.from_numpy(totals),
        torch.from_numpy(runs),
        torch.from_numpy(writer),
        torch.from_numpy(pos0_np),
        torch.from_numpy(start_np[..., 0]),
        pos0.dtype,
        pos0.gather(2, vic),
        steps[..., 0].expand(b, hs, m).to(pos0.dtype),
        0,
        rounds,
    )
    seg.batch = batch
    hears = layer.hears_decode
    if hears:
        seg.events += _batch_events(batch, start, vic, found, agg, pos0.dtype, protected)
    if seg.mode == "rollback":  # apply now (a later crop undoes from the journal)
        _apply(layer, batch, m)
        if hears:
            for event in seg.events:
                layer.announce(event)
    return out.to(query.dtype)


def _batch_events(batch: _Batch, start, vic, found, agg, pos_dtype, protected=None) -> list[DecodeEvent]:
    """The decode event of each of the ``m`` steps of a segment verified at once: ``vic (b, Hs, m)``
    the victims, ``found`` whether each step had a candidate, ``agg (b, Hs, m, B + 1)`` the steps'
    aggregated weights (the new token's last)."""
    b, hs, m = vic.shape
    cap = agg.shape[-1] - 1
    new_pos = start[:, None, None].expand(b, hs, 1).to(pos_dtype)
    kept = [batch.positions(t) for t in range(m + 1)]
    return [
        _decode_event(
            start + i,
            vic[..., i],
            torch.from_numpy(found[..., i]),
            torch.cat([batch.scores(i, candidates=True), agg[:, :, i, cap:]], -1),
            torch.cat([kept[i], new_pos + i], -1),
            kept[i + 1],
            protected,
        )
        for i in range(m)
    ]


def _decode_event(step, slot, evicts, cand_scores, cand_positions, kept, protected=None) -> DecodeEvent:
    return DecodeEvent(
        step=step,
        slot=slot,
        evicts=evicts,
        cand_scores=cand_scores,
        cand_positions=cand_positions,
        kept=kept,
        protected=protected,
    )


def _all_logits(qg, keys, key) -> torch.Tensor:
    """``(b, Hs, m, G, B + m)`` the logits of every row against the initial slots and the
    segment's tokens, in one matmul per KV set."""
    b, hs, m, g, d = qg.shape
    q = qg.reshape(b, hs, m * g, d)
    return torch.matmul(q, torch.cat([keys, key], 2).transpose(-1, -2)).view(b, hs, m, g, -1)


_FUTURE: dict[int, torch.Tensor] = {}  # per m: the (m, 1, m) mask of the later tokens


def _rough_totals(logits, cap: int, scores, gqa: str) -> np.ndarray:
    """Approximate ranking values of the initial slots after each step ``(b, Hs, m, B)``: the
    rows attend to all initial slots and the segment's tokens so far (no eviction). Only a guess
    of the victims is drawn from them. Sets the logits of each row against the segment's later
    tokens to −inf in place (no row's storage reads them, :func:`_rows`)."""
    m = logits.shape[2]
    future = _FUTURE.get(m)
    if future is None:  # token k is not there yet for row i < k
        future = _FUTURE[m] = torch.ones(m, m, dtype=torch.bool).triu(1)[:, None]
    logits[..., cap:].masked_fill_(future, float("-inf"))
    w = torch.softmax(logits.to(scores.dtype), -1)[..., :cap]
    return (scores[:, :, None] + eviction.aggregate_group(w, gqa, 3).cumsum(2)).numpy()


#: per (dtype, device, G, d, m, B): whether the rows' fast path (block logits gathered from
#: :func:`_all_logits`, values in padded blocks for one matmul) gives the decode step's bits
#: (:func:`~h2o_lens.ops.block_logits`, a matmul per block), checked on the first segment
_FAST_ROWS: dict[tuple, bool] = {}


def _first_guess(elig: np.ndarray, rough: np.ndarray, positions: torch.Tensor) -> np.ndarray:
    """Victims ``(b, Hs, m)`` chosen step by step from the rough ranking values ``(b, Hs, m, B)``
    by the step's rule (:func:`~h2o_lens.eviction.select_victim`), a slot taken by an earlier step
    no longer a candidate: only a guess. ``positions (b, Hs, B)`` the slots' before the segment."""
    b, hs, m, cap = elig.shape
    ok = torch.from_numpy(elig.copy())  # (b,Hs,m,B) candidates, less the slots taken so far
    scores = torch.from_numpy(rough)
    guess = torch.empty(b, hs, m, dtype=torch.int64)
    for i in range(m):
        v, _ = eviction.select_victim(scores[:, :, i], positions, ok[:, :, i])  # (b,Hs)
        guess[:, :, i] = v
        ok[:, :, i + 1 :].scatter_(-1, v[:, :, None, None].expand(b, hs, m - i - 1, 1), False)
    return guess.numpy()


def _writers(victims: np.ndarray, cap: int) -> np.ndarray:
    """``(b, Hs, B)`` the first step whose victim is each slot, ``m`` for none (a guess may
    name a slot twice; the later step then writes nothing, so the steps before it stay exact)."""
    b, hs, m = victims.shape
    first = np.full((b, hs, cap), m, np.int64)
    np.minimum.at(first, (np.arange(b)[:, None, None], np.arange(hs)[:, None], victims), np.arange(m))
    return first


def _rows(qg, slots, key, value, writer: np.ndarray, lo: int, gqa: str, acc: torch.dtype, logits=None):
    """The attention of steps ``lo … m − 1``, each over its own storage (the initial slots, a
    slot written by an earlier step holding that step's token): ``out (b, Hs, r, G, d)`` and
    the aggregated weights ``(b, Hs, r, B + 1)`` (slots, then the step's own token).
    ``slots`` the initial keys and values; ``logits`` :func:`_all_logits`, from which each
    row's block logits are gathered where that gives the step's bits (DESIGN.md §14.1)."""
    b, hs, m, g, d = qg.shape
    cap = writer.shape[-1]
    r = m - lo
    n, K = -(-cap // ops.DECODE_BLOCK), ops.DECODE_BLOCK
    # (b,Hs,r,n·K) where each row finds each slot among the initial slots, the segment's tokens
    # (a slot written before the row: cap + its step) and a zero row (the last block's padding)
    idx = np.full((b, hs, r, n * K), cap + m, np.int64)
    written = writer[:, :, None, :] < np.arange(lo, m)[:, None]
    idx[..., :cap] = np.where(written, cap + writer[:, :, None, :], np.arange(cap))
    base = (np.arange(b * hs) * (cap + m + 1)).reshape(b, hs, 1, 1)
    q = qg[:, :, lo:].reshape(b, hs * r, g, d)

    def storage(init, own, width):  # (b, Hs·r, width, d): each row's slots, then zeros up to width
        src = torch.cat([init, own, init.new_zeros(b, hs, 1, d)], 2).view(-1, d)
        at = torch.from_numpy((idx[..., :width] + base).reshape(-1))
        return src.index_select(0, at).view(b, hs * r, width, d)

    own = (key[:, :, lo:].reshape(b, hs * r, d), value[:, :, lo:].reshape(b, hs * r, d))
    key_id = (qg.dtype, qg.device, g, d, m, cap)
    if logits is None or not _FAST_ROWS.get(key_id, True):
        res = ops.attend_rows(q, storage(slots[0], key, cap), storage(slots[1], value, cap), *own, acc)
    else:  # the block logits by one gather, the values in padded blocks for one matmul
        src = logits[:, :, lo:, None].expand(b, hs, r, n, g, cap + m)
        at = torch.from_numpy(np.minimum(idx, cap + m - 1))  # the padding: any column (overwritten)
        block = src.gather(5, at.view(b, hs, r, n, 1, K).expand(b, hs, r, n, g, K))
        values = storage(slots[1], value, n * K).view(b, hs * r, n, K, d)
        res = ops.attend_rows(q, None, values, *own, acc, logits=block.view(b, hs * r, n, g, K).to(acc), cap=cap)
        if key_id not in _FAST_ROWS:
            exact = ops.attend_rows(q, storage(slots[0], key, cap), storage(slots[1], value, cap), *own, acc)
            _FAST_ROWS[key_id] = all(torch.equal(x, y) for x, y in zip(res, exact))
            res = res if _FAST_ROWS[key_id] else exact
    out, weights = res
    return out.view(b, hs, r, g, d), eviction.aggregate_group(weights, gqa, 2).view(b, hs, r, cap + 1)


def _slot_runs(agg: np.ndarray, victims: np.ndarray, dtype) -> np.ndarray:
    """``(b, Hs, m, m)`` ``[k, i]``: after step ``i``'s update (``i ≥ k``), the ranking value of
    the slot step ``k`` wrote, as the steps one by one compute it: the sum restarts from the
    weight its token gave itself (garbage for ``i < k``)."""
    b, hs, m, cap = agg.shape[0], agg.shape[1], agg.shape[2], agg.shape[3] - 1
    vic = torch.from_numpy(victims)[:, :, None, :].expand(b, hs, m, m)
    after = torch.from_numpy(agg).gather(3, vic).numpy()  # (b,Hs,i,k) agg[i, v_k]
    ar = np.arange(m)
    k, i = ar[:, None], ar[None, :]
    seq = np.where(i > k, after.transpose(0, 1, 3, 2), 0)  # (b,Hs,k,i)
    seq = np.where(i == k, agg[..., cap][..., None], seq)
    return np.cumsum(seq, axis=3, dtype=dtype)


def _apply(layer: SegmentLayer, batch: _Batch, t: int) -> None:
    """Make the live storage state ``t`` of ``batch``: the victims of steps before ``t`` hold
    their tokens, the others their old K/V (a copy, DESIGN.md §14.1). Only the slots of the
    steps between the applied state and ``t`` are written (the victims are distinct)."""
    a = batch.applied
    lo, hi = min(a, t), max(a, t)
    if hi > lo:
        vic = batch.victims[..., lo:hi]
        idx = vic[..., None].expand(*vic.shape, batch.key.shape[-1])
        forward = t > a
        layer.keys.scatter_(2, idx, (batch.key if forward else batch.old_key)[:, :, lo:hi])
        layer.values.scatter_(2, idx, (batch.value if forward else batch.old_value)[:, :, lo:hi])
        layer.positions.scatter_(2, vic, (batch.new_pos if forward else batch.old_pos)[:, :, lo:hi])
    batch.scores(t, out=layer.scores)
    layer.load_state({"next_pos": layer.next_pos + (t - a)})
    batch.applied = t
