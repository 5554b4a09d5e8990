"""The H2O cache: per-layer slot storage that evicts in place.

A :class:`H2OCacheLayer` owns the keys, values, FP32 scores and original
positions of its ``B`` slots per request and KV set, with a few verbs
(prefill, decode, reorder). :class:`H2OCache` is the thin transformers
``Cache`` container. The attention weights exist only inside the attention
function (:mod:`h2o_lens.hooks`); ``update`` hands the layer to it through
the kwargs dict that the attention modules pass on (DESIGN.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import ops, policy
from .config import H2OConfig
from .errors import ConfigError, UnsupportedModelError

__all__ = ["H2OCache", "H2OCacheLayer", "CacheListener", "PrefillEvent", "DecodeEvent"]

POS_DTYPE = torch.int32
#: per-request state that moves with the batch rows (beam reorder, expansion, selection)
_ROW_STATE = ("keys", "values", "scores", "history", "positions", "fill", "next_pos", "budget")


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
    it). :meth:`stats` derives the recorder's facts, batched if wanted.
    """

    step: torch.Tensor
    slot: torch.Tensor
    evicts: torch.Tensor
    cand_scores: torch.Tensor
    cand_positions: torch.Tensor
    kept: torch.Tensor

    def stats(
        self, recent: torch.Tensor | int, sink: torch.Tensor | int = 0, pinned: torch.Tensor | None = None
    ) -> policy.StepStats:
        return decode_stats(
            self.cand_scores, self.cand_positions, self.slot, self.evicts, self.step, recent, sink, pinned
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
) -> policy.StepStats:
    """:class:`~h2o_lens.policy.StepStats` of decode steps, any leading dims.

    ``cand_* (..., Hs, B + 1)``, ``slot, evicts (..., Hs)``, ``step (...)``;
    ``recent`` and ``sink`` ints, or per-request tensors broadcastable to ``step``;
    ``pinned`` the 1-D tensor of positions never eligible (DESIGN.md §2.11), or None.
    """

    def col(x, n):  # an int, or a tensor with n trailing unit dims
        return x[(...,) + (None,) * n] if isinstance(x, torch.Tensor) else x

    step_col = step[..., None, None]
    if pinned is not None:
        pinned = pinned.to(cand_positions.device, cand_positions.dtype)
    eligible = policy.eligible_mask(cand_positions, step_col, col(recent, 2), col(sink, 2), pinned=pinned)
    return policy.step_stats(cand_scores, cand_positions, eligible, slot, evicts, step[..., None], col(recent, 1))


class CacheListener(Protocol):
    """Receives eviction events; the recorder and the tests implement it."""

    def on_prefill(self, layer_idx: int, event: PrefillEvent) -> None: ...

    def on_decode(self, layer_idx: int, event: DecodeEvent) -> None: ...


class H2OCacheLayer(CacheLayerMixin):
    """Slot storage of one attention layer: ``(b, Hs, B, d)`` keys and values.

    ``Hs`` is the number of KV sets: the KV heads, or the query heads with
    ``gqa="none"`` (K/V duplicated per query head).
    """

    is_compileable = False
    is_croppable = False
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

    # -- transformers' CacheLayerMixin -------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, kwargs: dict | None = None, **extra: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the new K/V for the attention function; returns them unchanged."""
        if kwargs is None:
            raise UnsupportedModelError(
                f"layer {self.layer_idx}: the attention module called cache.update without its "
                "kwargs dict, so the H2O attention function cannot reach the cache; this "
                "architecture is not supported (supported: Llama, Qwen2/3, Mistral, Phi-3 families)"
            )
        if self.owner.group > 1 and self.owner.config.gqa == "none":
            key_states = key_states.repeat_interleave(self.owner.group, dim=1)
            value_states = value_states.repeat_interleave(self.owner.group, dim=1)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        self.seen += key_states.shape[-2]
        kwargs["h2o_layer"] = self
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Logical length: columns seen (not the slot count), as generate expects."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.scores = self.history = self.positions = None
        self.fill = self.next_pos = self.budget = self._groups = self._row_budgets = None
        self.seen = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: K, V, scores, positions and counters move together."""
        if self.keys is None:
            return
        idx = beam_idx.to(self.keys.device)
        self._groups = self._row_budgets = None
        for name in _ROW_STATE:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._groups = self._row_budgets = None
        for name in _ROW_STATE:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._groups = self._row_budgets = None
        for name in _ROW_STATE:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedModelError(
            "the H2O cache cannot be cropped: an eviction is irreversible, so assisted or "
            "speculative decoding (which rolls tokens back) is not supported; generate without it"
        )

    # -- H2O verbs ---------------------------------------------------------------
    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending is None:
            raise UnsupportedModelError(
                f"layer {self.layer_idx}: the attention function ran without a preceding cache.update"
            )
        kv, self.pending = self.pending, None
        return kv

    def groups(self) -> list[tuple[torch.Tensor | None, ops.PolicyArgs]]:
        """Rows of each distinct budget: ``[(rows or None for all rows, args), ...]``."""
        if self._groups is None:
            self._groups = self.owner.groups(self.budget)
        return self._groups

    def prefill(self, query: torch.Tensor, valid: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Full causal attention over the prompt, then keep at most ``B_r`` slots per request.

        ``query (b, Hq, P, d)``, ``valid (b, P)`` bool or None. Returns the
        attention output ``(b, P, Hq, d)``. Each request's budget is resolved
        against its own (unpadded) prompt length; the slot storage is as wide
        as the largest budget, and a request with fewer slots leaves the rest empty.
        """
        key, value = self.take_pending()  # (b, Hs, P, d)
        b, hs, p, d = key.shape
        owner = self.owner
        gqa = owner.config.gqa
        spec = owner.config.spec
        scores = None  # column sums, for a policy that ranks the prompt by them
        if owner.resolve_backend(key.device) == "triton":
            out, _ = ops.prefill_attention(query, key, value, valid, scaling, gqa, need_scores=False)
            if spec.prefill == "columns":
                from .kernels import prefill_scores_triton

                scores = prefill_scores_triton(query.contiguous(), key.contiguous(), valid, scaling, gqa)
        else:
            out, scores = ops.prefill_attention(query, key, value, valid, scaling, gqa, chunk=owner.prefill_chunk)
            if spec.prefill != "columns":
                scores = None
        rows = ops.prefill_rows(query, key, valid, scaling, gqa, spec.prefill_rows) if spec.prefill == "rows" else None
        dtype = scores.dtype if scores is not None else torch.promote_types(query.dtype, torch.float32)
        if valid is None:
            pos = torch.arange(p, device=key.device, dtype=POS_DTYPE).expand(b, p)
        else:
            pos = (valid.cumsum(-1) - 1).to(POS_DTYPE).masked_fill(~valid, policy.EMPTY)
        positions = pos[:, None, :].expand(b, hs, p)  # (b, Hs, P)
        count = pos.amax(-1).to(torch.int64) + 1  # (b,) real tokens
        self.budget = owner.assign_budgets(count).to(key.device)
        self._groups = self._row_budgets = None
        last = (count - 1)[:, None, None]  # (b,1,1)
        drive = torch.empty(b, hs, p, dtype=dtype, device=key.device)  # the scores that drive the choice
        history = torch.zeros(b, hs, p, dtype=torch.int64, device=key.device) if spec.history else None
        keep = torch.empty(b, hs, p, dtype=torch.bool, device=key.device)
        eligible = torch.empty_like(keep)
        heads = owner.group if gqa != "none" else 1
        for group_rows, args in self.groups():
            sel = slice(None) if group_rows is None else group_rows
            drive[sel], hist = ops.prefill_scores(
                None if scores is None else scores[sel],
                None if rows is None else rows[sel],
                positions[sel],
                args,
                self.layer_idx,
                dtype,
                heads,
            )
            if history is not None:
                history[sel] = hist
            pins = args.pins(positions)
            keep[sel] = policy.prefill_keep(drive[sel], positions[sel], args.heavy, args.recent, args.sink, pins)
            eligible[sel] = policy.eligible_mask(positions[sel], last[sel], args.recent, args.sink, pinned=pins)
        caps = owner.row_capacity(self.budget)  # (b,)
        cap = max(args.capacity for _, args in self.groups())
        # slots hold the kept positions in ascending order, then empty slots
        big = torch.iinfo(POS_DTYPE).max
        order = torch.where(keep, positions, big).argsort(-1)[..., :cap]  # (b,Hs,min(P,B))
        kept_pos = torch.where(keep.gather(-1, order), positions.gather(-1, order), policy.EMPTY)
        n = order.shape[-1]
        self.keys = key.new_zeros(b, hs, cap, d)
        self.values = value.new_zeros(b, hs, cap, d)
        self.scores = drive.new_zeros(b, hs, cap)
        self.positions = torch.full((b, hs, cap), policy.EMPTY, dtype=POS_DTYPE, device=key.device)
        gidx = order[..., None].expand(b, hs, n, d)
        self.keys[:, :, :n] = key.gather(2, gidx)
        self.values[:, :, :n] = value.gather(2, gidx)
        self.scores[:, :, :n] = torch.where(kept_pos >= 0, drive.gather(-1, order), 0.0)
        if history is not None:
            self.history = history.new_zeros(b, hs, cap)
            self.history[:, :, :n] = torch.where(kept_pos >= 0, history.gather(-1, order), 0)
        self.positions[:, :, :n] = kept_pos
        self.next_pos = count.to(POS_DTYPE)
        # slots used: a pinned position inside the recent window (or the sink) counts once,
        # so a long prompt may leave free slots, which the next steps fill (DESIGN.md §2.11)
        fill = keep[:, 0].sum(-1).to(torch.int64)  # (b,) the same for every KV set
        self.fill = None if bool((fill >= caps).all()) else fill
        self.is_initialized = True
        if owner.listener is not None:
            owner.listener.on_prefill(
                self.layer_idx,
                PrefillEvent(positions=positions, scores=drive, keep=keep, eligible=eligible, step=count - 1),
            )
        return out

    def decode(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """One decode step; returns the attention output ``(b, 1, Hq, d)``.

        All rows step in one computation. When budgets differ, each row steps on its
        first ``B_r`` slots with its own split (:class:`~h2o_lens.ops.RowBudgets`),
        exactly as if alone (DESIGN.md §2.7).
        """
        key, value = self.take_pending()  # (b, Hs, 1, d)
        owner = self.owner
        listener = owner.listener
        step = self.next_pos  # (b,)
        q, k, v = query[:, :, 0].contiguous(), key[:, :, 0].contiguous(), value[:, :, 0].contiguous()
        args = owner.budgets[0]  # policy, gqa, seed and pins are the config's: the same for every budget
        rows = self.row_budgets()
        want = listener is not None
        if rows is not None and self._kernel_step(args, want):
            res = self._step_groups(self.groups(), q, k, v, step, scaling)
        else:
            res = self._step(
                args,
                q,
                k,
                v,
                self.keys,
                self.values,
                self.scores,
                self.positions,
                step,
                self.fill,
                scaling,
                want,
                self.history,
                rows,
            )
        if listener is not None:
            listener.on_decode(
                self.layer_idx,
                DecodeEvent(
                    step=step,
                    slot=res.slot,
                    evicts=res.evicts,
                    cand_scores=res.cand_scores,
                    cand_positions=res.cand_positions,
                    kept=self.positions,
                ),
            )
        self.next_pos = step + 1
        if self.fill is not None:
            caps = self.keys.shape[2] if rows is None else rows.capacity.view(-1)  # (b,) B_r
            self.fill = (self.fill + 1).clamp(max=caps) if rows is None else torch.minimum(self.fill + 1, caps)
            if bool((self.fill >= caps).all()):
                self.fill = None
        return res.out[:, None]

    def row_budgets(self) -> ops.RowBudgets | None:
        """Per-row capacity, recent window and sink when the requests' budgets differ; None
        when every row uses the one budget (as wide as the storage)."""
        if len(self.owner.budgets) == 1:
            return None
        if self._row_budgets is None:
            self._row_budgets = ops.RowBudgets.of(self.owner.budgets, self.budget)
        return self._row_budgets

    def _kernel_step(self, args: ops.PolicyArgs, want: bool) -> bool:
        """Whether the fused Triton step runs: the backend and the policy have one
        (``Policy.kernels``), no listener needs the candidate set and nothing is pinned."""
        return not want and self.owner.backend == "triton" and "decode" in args.spec.kernels and not args.pinned

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
    ) -> ops.DecodeResult:
        """The fused Triton step when :meth:`_kernel_step` allows it (one budget), the torch
        step otherwise (any per-row budgets)."""
        if rows is None and self._kernel_step(args, want):
            from .kernels import decode_step_triton

            return decode_step_triton(
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
        )

    def _step_groups(self, groups, q, k, v, step, scaling: float) -> ops.DecodeResult:
        """The Triton step of a batch whose budgets differ: one launch per budget on its rows
        and its first ``B_r`` slots, written back (the kernel takes one budget per launch;
        the torch step takes per-row budgets in one computation)."""
        b, hs, cap = self.positions.shape
        out = q.new_empty(q.shape)
        slot = torch.empty(b, hs, dtype=torch.int64, device=q.device)
        evicts = torch.empty(b, hs, dtype=torch.bool, device=q.device)
        for rows, args in groups:
            sel = torch.arange(b, device=q.device) if rows is None else rows
            c = args.capacity
            stored = [self.keys, self.values, self.scores, self.positions]
            state = [t[sel, :, :c].contiguous() for t in stored]
            fill = None if self.fill is None else self.fill[sel]
            if fill is not None and bool((fill >= c).all()):
                fill = None
            res = self._step(args, q[sel], k[sel], v[sel], *state, step[sel], fill, scaling, False)
            for t, new in zip(stored, state):
                t[sel, :, :c] = new
            out[sel] = res.out
            slot[sel] = torch.where(res.slot >= c, cap, res.slot)  # c: the new token itself
            evicts[sel] = res.evicts
        return ops.DecodeResult(out=out, slot=slot, evicts=evicts)

    def nbytes(self) -> tuple[int, int]:
        """``(kv_bytes, metadata_bytes)`` physically held by this layer."""
        if self.keys is None:
            return 0, 0
        kv = self.keys.numel() * self.keys.element_size() * 2
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
        Receives an event per layer at prefill and at every decode step.
    """

    def __init__(
        self, config: H2OConfig, model_config: Any, listener: CacheListener | None = None, prefill_chunk: int = 512
    ):
        if not config.spec.evicts:
            raise ConfigError(
                f"policy {config.policy!r} uses transformers' own cache; H2OCache needs an evicting policy"
            )
        text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
        n_layers = text.num_hidden_layers
        hq = text.num_attention_heads
        hkv = getattr(text, "num_key_value_heads", None) or hq
        if hq % hkv:
            raise UnsupportedModelError(f"{hq} query heads are not a multiple of {hkv} KV heads")
        self.config = config
        self.group = hq // hkv
        self.num_query_heads, self.num_kv_heads = hq, hkv
        self.listener = listener
        self.prefill_chunk = prefill_chunk
        self.budgets: list[ops.PolicyArgs] = []  # distinct budgets; layers index them per row
        self.request_configs: list[H2OConfig] | None = None  # resolved per prefill row
        self._rows: torch.Tensor | None = None
        self.backend: str | None = None  # "torch" | "triton", resolved at the first prefill
        super().__init__(layers=[H2OCacheLayer(self, i) for i in range(n_layers)])

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
        if self.config.resolved:
            return self.config
        cfgs = self.request_configs or []
        return cfgs[0] if cfgs and all(c == cfgs[0] for c in cfgs) else None

    def assign_budgets(self, prompt_lens: torch.Tensor) -> torch.Tensor:
        """Resolve the budget of each request against its own prompt length, once.

        ``prompt_lens (b,)`` unpadded prompt lengths. Returns ``(b,)`` int64
        indices into :attr:`budgets` (the same for every layer).
        """
        if self._rows is None:
            lens = prompt_lens.tolist()
            pinned = self.config.pinned
            if pinned and pinned[-1] >= min(lens):
                rows = [r for r, n in enumerate(lens) if pinned[-1] >= n]
                raise ConfigError(
                    f"pinned position {pinned[-1]} is beyond the prompt of request {rows[0]} "
                    f"({lens[rows[0]]} tokens, positions 0 to {lens[rows[0]] - 1}); pinned positions "
                    "are 0-based positions of each request's real prompt tokens (padding excluded)"
                )
            cfgs = [self.config.resolve(n) for n in lens]
            rows = []
            for cfg in cfgs:
                args = ops.PolicyArgs(cfg.policy, *cfg.split, cfg.gqa, cfg.seed, cfg.pinned)
                if args not in self.budgets:
                    self.budgets.append(args)
                rows.append(self.budgets.index(args))
            self.request_configs = cfgs
            self._rows = torch.tensor(rows, dtype=torch.int64)
        return self._rows

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

    def row_capacity(self, budget: torch.Tensor) -> torch.Tensor:
        """``(b,)`` slot count ``B_r`` of each row, on ``budget``'s device."""
        caps = torch.tensor([a.capacity for a in self.budgets], dtype=torch.int64, device=budget.device)
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

    def pinned_positions(self) -> torch.Tensor | None:
        """The positions never evicted (DESIGN.md §2.11), an int64 CPU tensor; None if none."""
        return torch.tensor(self.config.pinned, dtype=torch.int64) if self.config.pinned else None

    def resolve_backend(self, device: torch.device) -> str:
        """``auto`` → Triton on CUDA, torch elsewhere; resolved once, on the first prefill."""
        if self.backend is None:
            from .kernels import resolve_backend

            self.backend = resolve_backend(self.config.backend, device)
        return self.backend

    def nbytes(self) -> dict[str, int]:
        """Physical bytes held: ``kv`` (keys + values) and ``metadata`` (scores + positions)."""
        kv = meta = 0
        for layer in self.layers:
            a, m = layer.nbytes()
            kv, meta = kv + a, meta + m
        return {"kv": kv, "metadata": meta}
