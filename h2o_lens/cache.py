"""The H2O cache: per-layer slot storage that evicts in place.

A :class:`H2OCacheLayer` owns the keys, values, FP32 scores and original
positions of its ``B`` slots per request and KV set, with a few verbs
(prefill, decode, reorder). :class:`H2OCache` is the thin transformers
``Cache`` container. The attention weights exist only inside the attention
function (:mod:`h2o_lens.hooks`); ``update`` hands the layer to it through
the kwargs dict that the attention modules pass on (DESIGN.md §3). The layers
call the cache's extensions at their events (:mod:`h2o_lens.extension`, the one
way to extend the cache, DESIGN.md §1.1); what they tell a listener is defined
in :mod:`h2o_lens.events`. A verification segment (:mod:`h2o_lens.speculative`)
works on a layer through :class:`~h2o_lens.speculative.SegmentLayer`. The prompt's
keep rule and slots are in :mod:`h2o_lens.prompt_slots`, the per-row bookkeeping in
:mod:`h2o_lens.cache_rows`, save and restore in :mod:`h2o_lens.cache_state`.
:func:`use_layer_class` builds the caches of a block with a subclass of the layer
that overrides public verbs only (the tests' known bugs, DESIGN.md §15.5).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import cache_rows as _per_row
from . import cache_state as _state
from . import compat, ops, slot_blocks
from . import extension as _extension
from . import plan as _plan
from . import prompt_slots as _slots
from . import speculative as _speculative
from .cache_state import ROW_STATE
from .cold import ColdExtension
from .compat import Cache, CacheLayerMixin
from .config import H2OConfig
from .errors import ConfigError, UnsupportedModelError
from .events import CacheListener, DecodeEvent
from .events import PrefillEvent as PrefillEvent  # defined in h2o_lens.events, also read from here
from .events import decode_stats as decode_stats  # defined in h2o_lens.events, also read from here
from .extension import CacheExtension, PromptChoice, StepEvent, StepNeeds
from .layer_class import check_layer_class, current_layer_class, register_plain, use_layer_class
from .prompt_slots import POS_DTYPE as POS_DTYPE  # defined in h2o_lens.prompt_slots, also read from here
from .prompt_slots import SharedPrefix
from .shape import model_shape

__all__ = ["H2OCache", "H2OCacheLayer", "use_layer_class", "current_layer_class"]

#: per-request state that moves with the batch rows (beam reorder, expansion, selection)
_ROW_STATE = ROW_STATE


@register_plain
class H2OCacheLayer(CacheLayerMixin):
    """Slot storage of one attention layer: ``(b, Hs, B, d)`` keys and values.

    ``Hs`` is the number of KV sets: the KV heads, or the query heads with
    ``gqa="none"`` (K/V duplicated per query head).
    """

    is_compileable = False
    is_croppable = True  # the last verification segment only (DESIGN.md §14)
    is_sliding = False

    def __init__(self, owner: H2OCache, layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.scores: torch.Tensor | None = None  # (b, Hs, B) float32
        self.history: torch.Tensor | None = None  # (b, Hs, B) int64, for a policy that keeps one
        self.positions: torch.Tensor | None = None  # (b, Hs, B) int32, -1 empty
        self.fill: torch.Tensor | None = None  # (b,) used slots, None once all full
        self.next_pos: torch.Tensor | None = None  # (b,) position of the next token
        self.seen = 0  # columns processed, padding included (what generate counts)
        self.budget: torch.Tensor | None = None  # (b,) int64 index into owner.budgets
        self._groups: list[tuple[torch.Tensor | None, ops.PolicyArgs]] | None = None
        self._row_budgets: ops.RowBudgets | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.segment: _speculative.Segment | None = None  # open verification segment (DESIGN.md §14)
        #: a shared prompt prefix (DESIGN.md §15.4): its K, V ``(1, Hs, P0, d)`` and column sums ``(1, Hs, P0)``
        self.shared: SharedPrefix | None = None
        self.scaling: float | None = None  # the attention scale of the last prefill
        self.draft = False  # a draft to verify follows the prompt in this forward (DESIGN.md §14)
        #: a prompt an extension held back after its keep rule (:meth:`lay_prompt` lays it)
        self.held_prompt: tuple | None = None

    # -- transformers' CacheLayerMixin -------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, kwargs: dict | None = None, **extra: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the new K/V for the attention function; returns them unchanged."""
        if not compat.stage_layer(self, kwargs):  # hands this layer to the attention function
            raise UnsupportedModelError(
                f"layer {self.layer_idx}: the attention module called cache.update without its "
                "kwargs dict, so the H2O attention function cannot reach the cache; this "
                "architecture is not supported (supported: Llama, Qwen2/3, Mistral, Phi-3 families)"
            )
        if self.pending is not None:  # the last forward's K/V never reached H2O's attention
            raise UnsupportedModelError.unattended(self.layer_idx)
        copies = self.owner.shape.copies(self.owner.config.gqa)  # G under gqa="none", else 1
        if copies > 1:
            key_states = key_states.repeat_interleave(copies, dim=1)
            value_states = value_states.repeat_interleave(copies, dim=1)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + compat.mask_query_length(query_length), 0

    def get_seq_length(self) -> int:
        """Logical length: columns seen (not the slot count), as generate expects."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name up to transformers 5.12

    def reset(self) -> None:
        self.keys = self.values = self.scores = self.history = self.positions = None
        self.fill = self.next_pos = self.budget = self._groups = self._row_budgets = self.segment = None
        self.seen = 0
        self.is_initialized = False
        self.held_prompt = None
        for ext in self.owner.extensions:
            ext.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: K, V, scores, positions and counters move together."""
        if self.keys is None:
            return
        idx = beam_idx.to(self.keys.device)
        self.move_rows(lambda t: t.index_select(0, idx), "reorder")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.move_rows(lambda t: t.repeat_interleave(repeats, dim=0), "repeat")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.move_rows(lambda t: t[indices], "select")

    def move_rows(
        self, move: Callable[[torch.Tensor], torch.Tensor], kind: str, names: tuple[str, ...] = _ROW_STATE
    ) -> None:
        """Apply a row reorder, expansion or selection (``kind``: ``reorder``, ``repeat``, ``select``)
        to the tensors ``names`` of the row state at once (DESIGN.md §8.1), after confirming an open
        verification segment; the extensions move theirs (:meth:`CacheExtension.rows_moved`)."""
        self.end_segment(0)
        self._groups = self._row_budgets = None
        for name in names:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, slot_blocks.moved(t, move))  # block storage stays blocks (DESIGN.md §2.7)
        for ext in self.owner.extensions:
            ext.rows_moved(self, move, kind)

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-r)``: take back the last ``r`` tokens of the open verification segment
        and close it (``crop(0)`` confirms it in full), as assisted decoding calls it
        after each verification (DESIGN.md §14); to transformers 5.14 also ``crop(length)``."""
        removed = compat.crop_count(tokens_to_remove, self.seen)
        if removed is None:
            raise UnsupportedModelError(
                f"crop({tokens_to_remove}): the H2O cache takes a negative count (tokens to remove "
                "from the end), as transformers' assisted decoding passes it; an absolute length is "
                "not supported"
            )
        self.end_segment(removed)

    # -- what a verification segment uses (speculative.SegmentLayer) ---------------
    @property
    def segment_mode(self) -> str:
        """How a verification segment is taken back: ``rollback`` or ``defer`` (DESIGN.md §14)."""
        return self.owner.speculative

    @property
    def hears_decode(self) -> bool:
        """Whether an extension hears the decode events (then a step builds them)."""
        return self.owner.hears_decode

    def announce(self, event: DecodeEvent) -> None:
        """Hand a decode event to the extensions that hear them (:meth:`CacheExtension.on_decode`)."""
        for ext in self.owner.extensions:
            if ext.hears_decode:
                ext.on_decode(self, event)

    def one_budget(self) -> ops.PolicyArgs | None:
        """The budget of every row, or None when the rows' budgets differ."""
        budgets = self.owner.budgets
        args = _plan.layer_args(budgets[0], self.layer_idx) if len(budgets) == 1 else None
        return None if args is None or args.sets is not None else args  # this layer's (DESIGN.md §2.14)

    def stage(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stage new K/V ``(b, Hs, n, d)`` for the next step, as :meth:`update` does (no count)."""
        self.pending = (key, value)

    def load_state(self, state: Mapping[str, torch.Tensor | None], *, copy: bool = False) -> None:
        """Set fields of the row state (:data:`_ROW_STATE`) from ``state``: each is rebound, or with
        ``copy`` copied into the live tensor where both exist (the per-request counters ``fill``
        and ``next_pos`` are always rebound: a decode event holds the old ones)."""
        for name, value in state.items():
            if name not in _ROW_STATE:
                raise KeyError(f"{name!r} is not row state of an H2O cache layer; expected one of {_ROW_STATE}")
            cur = getattr(self, name)
            if copy and value is not None and cur is not None and name not in ("fill", "next_pos"):
                cur.copy_(value)
            else:
                setattr(self, name, value)

    def rewind(self, tokens: int) -> None:
        """Take the last ``tokens`` columns back from the columns seen (a crop, DESIGN.md §14)."""
        self.seen -= tokens

    # -- H2O verbs ---------------------------------------------------------------
    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending is None:
            raise UnsupportedModelError(
                f"layer {self.layer_idx}: the attention function ran without a preceding cache.update"
            )
        kv, self.pending = self.pending, None
        return kv

    def groups(self) -> list[tuple[torch.Tensor | None, ops.PolicyArgs]]:
        """Rows of each distinct budget: ``[(rows or None, args), ...]``, this layer's (DESIGN.md §2.14)."""
        if self._groups is None:
            self._groups = [(rows, _plan.layer_args(a, self.layer_idx)) for rows, a in self.owner.groups(self.budget)]
        return self._groups

    def prefill(self, query: torch.Tensor, valid: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Full causal attention over the prompt, then keep at most ``B_r`` slots per request.

        ``query (b, Hq, P, d)``, ``valid (b, P)`` bool or None. Returns the
        attention output ``(b, P, Hq, d)``. Each request's budget is resolved
        against its own (unpadded) prompt length; the slot storage is as wide
        as the largest budget, and a request with fewer slots leaves the rest empty.
        """
        owner = self.owner
        self.scaling = scaling
        if owner.sharing == "prefix":
            return self._stage_prefix(query, scaling)
        if self.shared is not None:
            return self._prefill_suffix(query, valid, scaling)
        key, value = self.take_pending()  # (b, Hs, P, d)
        out, scores, rows = _slots.prompt_attention(self, query, key, value, valid, scaling)
        self._keep_prompt(query, key, value, valid, scores, rows)
        return out

    def adopt_prompt(self, query, key, value, scores, valid, scaling: float) -> None:
        """:meth:`prefill` from a prompt forward computed for another configuration of the same
        prompt (DESIGN.md §12.5): ``key, value (b, Hs, P, d)`` and ``scores (b, Hs, P)`` as this
        layer's torch prefill computed them, ``query (b, Hq, R, d)`` the last ``R`` prompt rows'
        queries (what a policy that ranks by the last rows reads). The keep rule, the listener's
        event and the prompt sink see what a prefill of their own would give them."""
        self.lazy_initialization(key, value)
        self.seen = key.shape[2]
        self.pending = None
        self.scaling = scaling
        spec = self.owner.config.spec
        if self.owner.prompt_sink is not None:
            _slots.hand_on_prompt(self, query, key, value, scores, valid)
        rows = None
        if spec.prefill == "rows":
            rows = ops.prefill_rows(query, key, valid, scaling, self.owner.config.gqa, spec.prefill_rows)
        self._keep_prompt(query, key, value, valid, scores if spec.prefill == "columns" else None, rows)

    def prompt_keep(self, query, key, valid, scores, rows):
        """The policy's prefill keep rule over a whole prompt, without laying anything into slots
        (:func:`h2o_lens.prompt_slots.keep_rule`): ``positions, count, drive, history, keep, eligible``."""
        return _slots.keep_rule(self, query, key, valid, scores, rows)

    def forget_groups(self) -> None:
        """Drop the rows' budget groups worked out so far (the budgets changed)."""
        self._groups = self._row_budgets = None

    def _keep_prompt(self, query, key, value, valid, scores, rows) -> None:
        """Apply the policy's prefill keep rule to a whole prompt and lay the kept positions into
        slots, unless an extension holds the prompt back (:meth:`CacheExtension.prompt_chosen`).

        ``key, value (b, Hs, P, d)`` the prompt's, ``scores (b, Hs, P)`` its column sums (or None),
        ``rows`` its last rows' weights for a row-ranking policy (or None).
        """
        kept = self.prompt_keep(query, key, valid, scores, rows)
        choice = PromptChoice(query, key, valid, self.scaling, kept[0], kept[1], kept[4], self.draft, value)
        # held while the extensions are asked: one that decides for every layer at the last one lays
        # them all (:meth:`lay_prompt`), this one included
        self.held_prompt = (query, key, value, valid, scores, rows)
        held = False
        for ext in self.owner.extensions:
            held = ext.prompt_chosen(self, choice) or held
        if not held and self.held_prompt is not None:
            self.held_prompt = None
            self._lay_prompt(key, value, kept)

    def lay_prompt(self) -> None:
        """Lay a prompt an extension held back into slots, with the rows' budgets as they are now
        (the keep rule runs again); a no-op when none is held."""
        if self.held_prompt is not None:
            (query, key, value, valid, scores, rows), self.held_prompt = self.held_prompt, None
            self._lay_prompt(key, value, self.prompt_keep(query, key, valid, scores, rows))

    def _lay_prompt(self, key, value, kept) -> None:
        _slots.lay(self, key, value, kept)

    # -- a shared prompt prefix (DESIGN.md §15.4) -------------------------------------------------
    def _stage_prefix(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The prefix forward: full causal attention, K, V and column sums kept whole, nothing evicted."""
        key, value = self.take_pending()  # (1, Hs, P0, d)
        self.owner.backend = "torch"  # the shared path is the torch path (the keep rule is the same)
        out, self.shared = _slots.prefix_forward(self, query, key, value, scaling)
        return out

    def _prefill_suffix(self, query: torch.Tensor, valid: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Each request's suffix against the shared prefix, then the keep rule over its whole prompt
        (:func:`h2o_lens.prompt_slots.suffix_prefill`)."""
        shared, self.shared = self.shared, None
        out, key, value, valid_all, scores = _slots.suffix_prefill(self, shared, query, valid, scaling)
        self._keep_prompt(query, key, value, valid_all, scores, None)
        return out

    def own_prefix_scores(self, shared: torch.Tensor) -> torch.Tensor:
        """A request's own copy of the shared prefix's column sums ``(Hs, P0)``, into which its
        suffix's share is added: the copy of copy-on-write (DESIGN.md §15.4)."""
        return shared.clone()

    def decode(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """One decode step; returns the attention output ``(b, 1, Hq, d)``.

        All rows step in one computation. When budgets differ, each row steps on its
        first ``B_r`` slots with its own split (:class:`~h2o_lens.ops.RowBudgets`),
        exactly as if alone (DESIGN.md §2.7). An open verification segment is
        confirmed in full first (DESIGN.md §14).
        """
        self.end_segment(0)
        return self.decode_once(query, scaling)[0]

    def decode_once(
        self, query: torch.Tensor, scaling: float, *, emit: bool = True
    ) -> tuple[torch.Tensor, ops.DecodeResult, DecodeEvent | None]:
        """One decode step of the staged token: ``(out (b, 1, Hq, d), result, event)``.

        What the step computes beyond its eviction (the candidate set, the overwritten K/V of
        a rollback's journal) is what the extensions ask (:meth:`step_needs`); ``emit`` False
        keeps the event from them (a ``defer`` segment's working copy). The event is None
        when no extension hears the decode events.
        """
        key, value = self.take_pending()  # (b, Hs, 1, d)
        owner = self.owner
        captured = owner.graph_events is not None  # a graph records this step (DESIGN.md §2.16)
        step = self.next_pos.clone() if captured else self.next_pos  # (b,)
        q, k, v = query[:, :, 0].contiguous(), key[:, :, 0].contiguous(), value[:, :, 0].contiguous()
        for ext in owner.extensions:  # the before-step event: slots an extension added may change
            ext.before_step(self, q, k, v)
        args = self.groups()[0][1]  # policy, gqa and seed are the config's: the same for every budget
        rows = self.row_budgets()
        needs = self.step_needs()
        protected = self.protected()
        hears = owner.hears_decode
        want = hears or needs.candidates
        journal = needs.journal
        weights = needs.candidates  # an extension reads the step's softmax weights
        if rows is not None and self._kernel_step(args, want, protected, journal):
            res = self._step_groups(self.groups(), q, k, v, step, scaling, (want, weights, journal, protected))
        else:
            slots = (self.keys, self.values, self.scores, self.positions)
            res = self._step(
                args, q, k, v, *slots, step, self.fill, scaling, want, self.history, rows, journal, protected, weights
            )
        event = None
        if hears:
            event = DecodeEvent(
                step=step,
                slot=res.slot,
                evicts=res.evicts,
                cand_scores=res.cand_scores,
                cand_positions=res.cand_positions,
                kept=self.positions,
                protected=protected,
            )
            if emit and captured:  # to the listeners after each replay, from the graph's buffers
                owner.graph_events.append((self, event))
            elif emit:
                self.announce(event)
        if captured:
            self.next_pos.add_(1)  # in place: a replay reads the same buffer
        else:
            self.next_pos = step + 1
        if self.fill is not None:
            caps = self.keys.shape[2] if rows is None else rows.capacity.flatten(1).amax(1)  # (b,) B_r
            self.fill = (self.fill + 1).clamp(max=caps) if rows is None else torch.minimum(self.fill + 1, caps)
            if bool((self.fill >= caps).all()):
                self.fill = None
        if owner.extensions:
            taken = StepEvent(step, q, k, scaling, res, event, self.segment is not None)
            for ext in owner.extensions:
                ext.step_taken(self, taken)
        return res.out[:, None], res, event

    def journal(self) -> _speculative.Journal:
        """The cache's rollback journal (:class:`h2o_lens.speculative.Journal`), attached on first use."""
        return self.owner.extension_of(_speculative.Journal)

    def protected(self) -> torch.Tensor | None:
        """``(b, 1, K)`` int64 on the slots' device: what the extensions keep from eviction, per row
        (-2 pads; :meth:`CacheExtension.protected`, the pins, DESIGN.md §2.11), or None."""
        parts = [p for ext in self.owner.extensions if (p := ext.protected(self)) is not None]
        if not parts:
            return None
        device = parts[0].device if self.keys is None else self.keys.device
        return torch.cat([p.to(device) for p in parts], -1)[:, None, :]

    def step_needs(self) -> StepNeeds:
        """What the extensions need of the next decode step (:meth:`CacheExtension.step_needs`,
        the before-step event: called once per step)."""
        needs = StepNeeds()
        for ext in self.owner.extensions:
            needs = needs | ext.step_needs(self)
        return needs

    # -- verification segments (DESIGN.md §14) --------------------------------------
    def decode_segment(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """A forward of ``m`` tokens after the prefill, as ``m`` plain decode steps.

        ``query (b, Hq, m, d)``; returns ``(b, m, Hq, d)``. The segment stays open
        until :meth:`crop` (or the next forward) says how many tokens stood.
        """
        key, value = self.take_pending()  # (b, Hs, m, d)
        self.end_segment(0)
        at_once = self.owner.backend != "cpp" and _speculative.batched(self, query.shape[2])  # torch bits
        seg = _speculative.begin(self, scaling, at_once)
        self.segment = seg
        if at_once:
            return _speculative.run_batched(self, seg, query, key, value)
        outs = [
            _speculative.step(self, seg, query[:, :, i : i + 1], key[:, :, i : i + 1], value[:, :, i : i + 1])
            for i in range(query.shape[2])
        ]
        return torch.cat(outs, 1)

    def prefill_and_segment(
        self, query: torch.Tensor, valid: torch.Tensor | None, scaling: float, width: int
    ) -> torch.Tensor:
        """The first forward of assisted decoding: the prompt's ``width`` columns and a draft.

        The prompt is prefilled, the draft tokens after it form a verification segment.
        """
        key, value = self.take_pending()
        self.pending = (key[:, :, :width], value[:, :, :width])
        self.draft = True  # the prompt cannot wait for the other layers: the draft follows in this forward
        try:
            out = self.prefill(query[:, :, :width], None if valid is None else valid[:, :width], scaling)
        finally:
            self.draft = False
        self.pending = (key[:, :, width:], value[:, :, width:])
        return torch.cat([out, self.decode_segment(query[:, :, width:], scaling)], 1)

    def end_segment(self, rolled_back: int) -> None:
        """Close the open segment, taking its last ``rolled_back`` tokens back; no-op if none."""
        seg = self.segment
        if seg is None:
            if rolled_back:
                raise UnsupportedModelError(
                    f"layer {self.layer_idx}: crop of {rolled_back} tokens with no open verification "
                    "segment; the H2O cache can take back only the tokens of the last multi-token "
                    "forward (speculative or assisted decoding, DESIGN.md §14)"
                )
            return
        event = _speculative.end(self, seg, rolled_back)  # checks rolled_back before it changes anything
        self.segment = None
        for ext in self.owner.extensions:
            ext.on_segment(self, event)

    def row_budgets(self) -> ops.RowBudgets | None:
        """Per-row capacity, recent window and sink when the requests' budgets differ; None
        when every row uses the one budget (as wide as the storage)."""
        budgets = [_plan.layer_args(a, self.layer_idx) for a in self.owner.budgets]
        if len(budgets) == 1 and budgets[0].sets is None and self.keys.shape[2] == budgets[0].capacity:
            return None  # (storage wider than the budget: an extension's slots, extension.widen)
        if self._row_budgets is None:
            self._row_budgets = _plan.row_budgets(budgets, self.budget, self.owner.shape.sets(self.owner.config.gqa))
        return self._row_budgets

    def _kernel_step(self, args: ops.PolicyArgs, want: bool, protected=None, journal: bool = False) -> bool:
        """Whether the fused step runs: the backend and policy have one, and on Triton no listener
        needs the candidates, nothing is protected (its kernel knows no pins, DESIGN.md §2.11) and
        no ``journal`` is kept; the compiled CPU step gives all of them, in FP32, BF16 and FP16 (an
        FP64 cache takes the torch step, DESIGN.md §2.8)."""
        backend = self.owner.backend
        triton = backend == "triton" and not want and protected is None and not journal
        cpp = backend == "cpp" and self.keys.dtype != torch.float64
        return (cpp or triton) and "decode" in args.spec.kernels

    def _step(
        self,
        args: ops.PolicyArgs,
        q,
        k,
        v,
        keys,
        values,
        scores,
        positions,
        step,
        fill,
        scaling: float,
        want: bool,
        history: torch.Tensor | None = None,
        rows: ops.RowBudgets | None = None,
        journal: bool = False,
        protected: torch.Tensor | None = None,
        weights: bool = False,
    ) -> ops.DecodeResult:
        """The fused step (Triton or compiled CPU) when :meth:`_kernel_step` allows it and every row
        has the one budget, the torch step otherwise."""
        if rows is None and self._kernel_step(args, want, protected, journal):
            from .kernels import fused_step

            asks = (want, weights, journal, protected)  # what the torch step gives, asked of the CPU step
            return fused_step(self.owner.backend, asks)(
                q, k, v, keys, values, scores, positions, step, fill, scaling, args, layer=self.layer_idx
            )
        return ops.decode_step(
            q,
            k,
            v,
            keys,
            values,
            scores,
            positions,
            step,
            fill,
            scaling,
            args,
            layer=self.layer_idx,
            history=history,
            want_candidates=want,
            rows=rows,
            journal=journal,
            protected=protected,
        )

    def _step_groups(self, groups, q, k, v, step, scaling: float, asks: tuple | None = None) -> ops.DecodeResult:
        if self.owner.backend == "cpp" or any(a.sets is not None for _, a in groups):  # one call, rows ragged
            return _plan.kernel_step(self, q, k, v, step, scaling, asks)
        return _per_row.step_groups(self, self._step, groups, q, k, v, step, scaling)

    def nbytes(self) -> tuple[int, int]:
        """``(kv_bytes, metadata_bytes)`` physically held by this layer."""
        if self.keys is None:
            return 0, 0
        kv = sum(t.untyped_storage().nbytes() for t in (self.keys, self.values))  # block padding included
        meta = self.scores.numel() * self.scores.element_size() + self.positions.numel() * self.positions.element_size()
        if self.history is not None:
            meta += self.history.numel() * self.history.element_size()
        return kv, meta


class H2OCache(Cache):
    """A transformers ``Cache`` whose layers keep at most ``B`` slots each.

    Parameters
    ----------
    config : H2OConfig
        The policy (not ``full``: the full cache is transformers' own).
    model_config : PretrainedConfig
        The model's (text) config: layer count and head counts.
    listener : CacheListener, optional
        Receives an event per layer at prefill and at every decode step (and
        ``on_segment`` when a verification segment ends, if it has one), through
        :class:`~h2o_lens.extension.ListenerExtension`.
    speculative : str
        How a verification segment is taken back: ``rollback`` (default) or
        ``defer`` (DESIGN.md §14).
    layer_class : type, optional
        The class of the layers, a subclass of :class:`H2OCacheLayer` (DESIGN.md §15.5);
        default the class in effect (:func:`use_layer_class`), :class:`H2OCacheLayer` outside one.
    extensions : sequence of CacheExtension, optional
        What the layers call at their events (:mod:`h2o_lens.extension`, DESIGN.md §1.1), after the
        listener's view; default one from each factory of the :func:`~h2o_lens.extension.use_extensions`
        blocks in effect (a sequence, even empty, replaces those).
    row_pins : sequence of position sets, optional
        One set of pinned positions per batch row, in place of ``config.pinned``: each row is the
        config pinned at its own set, at the same slot count (DESIGN.md §2.11).
    """

    def __init__(
        self,
        config: H2OConfig,
        model_config: Any,
        listener: CacheListener | None = None,
        prefill_chunk: int = 512,
        speculative: str = "rollback",
        layer_class: type[H2OCacheLayer] | None = None,
        extensions: Sequence[CacheExtension] | None = None,
        row_pins: Sequence[Sequence[int]] | None = None,
    ):
        if not config.spec.evicts:
            raise ConfigError(
                f"policy {config.policy!r} uses transformers' own cache; H2OCache needs an evicting policy"
            )
        layer_class = current_layer_class() if layer_class is None else check_layer_class(layer_class)
        self.config = config
        #: layers, query and KV heads of the model (:func:`h2o_lens.shape.model_shape`)
        self.shape = model_shape(model_config)
        if config.plan is not None:
            config.plan.check(self.shape.layers, self.shape.sets(config.gqa))
        self.group = self.shape.group
        self.num_query_heads, self.num_kv_heads = self.shape.q_heads, self.shape.kv_heads
        self.listener = listener
        self.prefill_chunk = prefill_chunk
        self.speculative = _speculative.check_mode(speculative)
        #: prompt columns of the generate call: a longer first forward (assisted decoding's
        #: prompt plus draft) is a prefill and a verification segment (DESIGN.md §14)
        self.prompt_width: int | None = None
        self.budgets: list[ops.PolicyArgs] = []  # distinct budgets; layers index them per row
        self.request_configs: list[H2OConfig] | None = None  # resolved per prefill row
        self.row_pins = _per_row.check_row_pins(config, row_pins)  # each row's own pins, or None
        self._rows: torch.Tensor | None = None
        self.backend: str | None = None  # "torch" | "triton" | "cpp", resolved at the first prefill
        #: the recorder's request of each batch row (None until a recorder names them); moves with the rows
        self.request_ids: list[int] | None = None
        self.sharing: str | None = None  # "prefix" while a shared prefix is being computed (DESIGN.md §15.4)
        #: called per layer by a plain CPU prefill with ``(layer, key, value, scores, valid)``: the bits
        #: a replay's prompt pass computes (DESIGN.md §6.1); None: nothing is handed on
        self.prompt_sink: Callable[..., None] | None = None
        #: called per layer by a plain torch prefill with ``(layer, query, key, value, scores, valid,
        #: scaling, repeat, lse)`` so that another configuration can start from this prompt forward
        #: (:mod:`h2o_lens.prompt_reuse`, DESIGN.md §12.5); None: nothing is kept
        self.prompt_capture: Callable[..., None] | None = None
        self.prompt_reused = False  # the prefill was another configuration's, reused (DESIGN.md §12.5)
        #: what the layers call at their events (:mod:`h2o_lens.extension`); set once the layers exist
        self.extensions: tuple[CacheExtension, ...] = ()
        self.hears_decode = False  # whether an extension hears the decode events (then steps build them)
        #: while a graph records a decode step: the list its layers' decode events go to, announced
        #: after each replay (:mod:`h2o_lens.graphs`, DESIGN.md §2.16); None otherwise
        self.graph_events: list | None = None
        super().__init__(layers=[layer_class(self, i) for i in range(self.shape.layers)])
        self.extensions = tuple(_extension.build(self, listener, extensions))
        if config.cold is not None:  # the cold tier is an extension too (DESIGN.md §2.13)
            self.extension_of(ColdExtension)
        self.hears_decode = any(ext.hears_decode for ext in self.extensions)

    def extension_of(self, kind: type[CacheExtension]) -> CacheExtension:
        """The cache's extension of class ``kind``, a new ``kind()`` attached after the others if none."""
        found = next((ext for ext in self.extensions if type(ext) is kind), None)
        if found is None:
            found = _extension.build(self, None, [kind()])[0]
            self.extensions += (found,)
            self.hears_decode = self.hears_decode or found.hears_decode
        return found

    @property
    def row_index(self) -> torch.Tensor | None:
        """``(b,)`` int64 CPU: each row's index into :attr:`budgets` (None before the first prompt)."""
        return self._rows

    @row_index.setter
    def row_index(self, index: torch.Tensor | None) -> None:
        self._rows = index

    @property
    def args(self) -> ops.PolicyArgs:
        """The policy arguments when every request shares one budget."""
        if not self.budgets:
            raise ConfigError("the H2O cache has not seen a prompt yet")
        if len(self.budgets) > 1:
            raise ConfigError(
                f"the requests of this cache have {len(self.budgets)} different budgets "
                "(a keep ratio resolved per prompt length); read them per request with "
                "cache.request_budgets() or cache.request_configs"
            )
        return self.budgets[0]

    @property
    def resolved_config(self) -> H2OConfig | None:
        """The config in slot counts, or None when the requests' budgets differ (or no prompt yet)."""
        if self.config.resolved and self.row_pins is None:
            return self.config
        cfgs = self.request_configs or []
        return cfgs[0] if cfgs and all(c == cfgs[0] for c in cfgs) else None

    def assign_budgets(self, prompt_lens: torch.Tensor) -> torch.Tensor:
        """Resolve the budget of each request against its own prompt length, once: ``prompt_lens (b,)``
        → ``(b,)`` int64 indices into :attr:`budgets` (:func:`h2o_lens.cache_rows.assign_budgets`)."""
        return _per_row.assign_budgets(self, prompt_lens)

    def groups(self, budget: torch.Tensor) -> list[tuple[torch.Tensor | None, ops.PolicyArgs]]:
        """``budget (b,)`` → ``[(rows, args), ...]`` per distinct budget; rows None means all."""
        if len(self.budgets) == 1:
            return [(None, self.budgets[0])]
        idx = budget.cpu()
        out = []
        for g in sorted(set(idx.tolist())):
            rows = torch.nonzero(idx == g)[:, 0]
            out.append((None if len(rows) == len(idx) else rows.to(budget.device), self.budgets[g]))
        return out

    def row_capacity(self, budget: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """``(b,)`` slot count ``B_r`` of each row on ``budget``'s device (of ``layer`` under a plan)."""
        budgets = self.budgets if layer is None else [_plan.layer_args(a, layer) for a in self.budgets]
        caps = torch.tensor([a.capacity for a in budgets], dtype=torch.int64, device=budget.device)
        return caps[budget]

    def request_budgets(self) -> dict[str, torch.Tensor]:
        """Per batch row (in the cache's current row order): ``heavy, recent, sink`` slots
        actually used by the policy (:attr:`H2OConfig.split`), ``(b,)`` int64 CPU tensors."""
        budget = self.layers[0].budget
        if budget is None:
            raise ConfigError("the H2O cache has not seen a prompt yet")
        table = torch.tensor([[a.heavy, a.recent, a.sink] for a in self.budgets], dtype=torch.int64)
        t = table[budget.cpu()]
        return {"heavy": t[:, 0], "recent": t[:, 1], "sink": t[:, 2]}

    def resolve_backend(self, device: torch.device) -> str:
        """``auto`` → Triton on CUDA, torch elsewhere; resolved once, on the first prefill."""
        if self.backend is None:
            from .kernels import resolve_backend

            self.backend = resolve_backend(self.config.backend, device)
        return self.backend

    def end_segments(self) -> None:
        """Confirm every layer's open verification segment in full (DESIGN.md §14)."""
        for layer in self.layers:
            layer.end_segment(0)

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-r)`` on every layer: the last ``r`` tokens of the verification segment go back."""
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    # -- rows: reorder, selection, cancellation (DESIGN.md §15.3) ---------------------------------
    def _move_rows(self, index: list[int]) -> None:
        """The per-row bookkeeping outside the layers follows a row selection or reorder."""
        if self._rows is not None:
            self._rows = self._rows[torch.tensor(index, dtype=torch.int64)]
        if self.request_configs is not None:
            self.request_configs = [self.request_configs[i] for i in index]
        if self.request_ids is not None:
            self.request_ids = [self.request_ids[i] for i in index]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._move_rows([int(i) for i in beam_idx.tolist()])
        self.notify({"event": "reorder", "index": [int(i) for i in beam_idx.tolist()]})

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._move_rows([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        n = len(self.request_configs) if self.request_configs is not None else 0
        self._move_rows([i for i in range(n) for _ in range(repeats)])

    @property
    def batch_size(self) -> int:
        """Rows held (0 before the first prompt)."""
        keys = self.layers[0].keys
        return 0 if keys is None else keys.shape[0]

    def cancel(self, rows: int | list[int]) -> list[int]:
        """Remove the batch rows ``rows`` (their requests end); the other rows keep their state and
        move up in order. Returns the rows kept (their old indices; :func:`h2o_lens.cache_rows.cancel`)."""
        return _per_row.cancel(self, rows)

    # -- save and restore (DESIGN.md §15.2) -----------------------------------------------------
    def export_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(header, tensors)``: everything a restored cache needs to continue exactly
        (:func:`h2o_lens.cache_state.export_state`)."""
        return _state.export_state(self)

    def import_state(self, header: dict[str, Any], tensors: dict[str, torch.Tensor], device: Any = None) -> None:
        """Load what :meth:`export_state` returned into this (fresh) cache."""
        _state.import_state(self, header, tensors, device)

    def notify(self, event: dict) -> None:
        """Tell the extensions a state event of the cache (:meth:`CacheExtension.on_state`)."""
        for ext in self.extensions:
            ext.on_state(self, event)

    def slots_changed(self, rows: list[int], slots: list[int], kind: str) -> None:
        """Tell the extensions that batch ``rows`` hold ``slots`` slots per KV set now (``kind``:
        ``raise`` or ``refill``; :meth:`CacheExtension.slots_changed`)."""
        for ext in self.extensions:
            ext.slots_changed(self, list(rows), [int(n) for n in slots], kind)

    def nbytes(self) -> dict[str, int]:
        """Physical bytes held: ``kv`` (keys + values) and ``metadata`` (scores + positions)."""
        kv = meta = 0
        for layer in self.layers:
            a, m = layer.nbytes()
            kv, meta = kv + a, meta + m
        return {"kv": kv, "metadata": meta}
