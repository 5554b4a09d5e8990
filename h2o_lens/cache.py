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


@dataclass
class PrefillEvent:
    """What one layer decided at prefill. Shapes ``(b, Hs, P)`` unless noted.

    ``positions`` original positions (-1 padding), ``scores`` column sums,
    ``keep`` kept slots, ``eligible`` positions outside the recent window and
    the sink, ``step (b,)`` the last prompt position of each request.
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

    def stats(self, recent: int, sink: int = 0) -> policy.StepStats:
        return decode_stats(self.cand_scores, self.cand_positions, self.slot, self.evicts,
                            self.step, recent, sink)


def decode_stats(cand_scores: torch.Tensor, cand_positions: torch.Tensor, slot: torch.Tensor,
                 evicts: torch.Tensor, step: torch.Tensor, recent: int, sink: int = 0) -> policy.StepStats:
    """:class:`~h2o_lens.policy.StepStats` of decode steps, any leading dims.

    ``cand_* (..., Hs, B + 1)``, ``slot, evicts (..., Hs)``, ``step (...)``.
    """
    step_col = step[..., None, None]
    eligible = policy.eligible_mask(cand_positions, step_col, recent, sink)
    return policy.step_stats(cand_scores, cand_positions, eligible, slot, evicts, step[..., None], recent)


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

    def __init__(self, owner: "H2OCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.scores: torch.Tensor | None = None  # (b, Hs, B) float32
        self.positions: torch.Tensor | None = None  # (b, Hs, B) int32, -1 empty
        self.fill: torch.Tensor | None = None  # (b,) used slots, None once all full
        self.next_pos: torch.Tensor | None = None  # (b,) position of the next token
        self.seen = 0  # columns processed, padding included (what generate counts)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- transformers' CacheLayerMixin -------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               kwargs: dict | None = None, **extra: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the new K/V for the attention function; returns them unchanged."""
        if kwargs is None:
            raise UnsupportedModelError(
                f"layer {self.layer_idx}: the attention module called cache.update without its "
                "kwargs dict, so the H2O attention function cannot reach the cache; this "
                "architecture is not supported (supported: Llama, Qwen2/3, Mistral, Phi-3 families)")
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
        self.keys = self.values = self.scores = self.positions = None
        self.fill = self.next_pos = None
        self.seen = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: K, V, scores, positions and counters move together."""
        if self.keys is None:
            return
        idx = beam_idx.to(self.keys.device)
        for name in ("keys", "values", "scores", "positions", "fill", "next_pos"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for name in ("keys", "values", "scores", "positions", "fill", "next_pos"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for name in ("keys", "values", "scores", "positions", "fill", "next_pos"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedModelError(
            "the H2O cache cannot be cropped: an eviction is irreversible, so assisted or "
            "speculative decoding (which rolls tokens back) is not supported; generate without it")

    # -- H2O verbs ---------------------------------------------------------------
    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending is None:
            raise UnsupportedModelError(
                f"layer {self.layer_idx}: the attention function ran without a preceding cache.update")
        kv, self.pending = self.pending, None
        return kv

    @property
    def capacity(self) -> int:
        return self.owner.args.capacity

    def prefill(self, query: torch.Tensor, valid: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Full causal attention over the prompt, then keep at most B slots.

        ``query (b, Hq, P, d)``, ``valid (b, P)`` bool or None. Returns the
        attention output ``(b, P, Hq, d)``.
        """
        key, value = self.take_pending()  # (b, Hs, P, d)
        b, hs, p, d = key.shape
        owner = self.owner
        args = owner.resolve_args(p)
        if owner.resolve_backend(key.device) == "triton":
            from .kernels import prefill_scores_triton

            out, _ = ops.prefill_attention(query, key, value, valid, scaling, args.gqa, need_scores=False)
            scores = prefill_scores_triton(query.contiguous(), key.contiguous(), valid, scaling, args.gqa)
        else:
            out, scores = ops.prefill_attention(query, key, value, valid, scaling, args.gqa,
                                                chunk=owner.prefill_chunk)
        if valid is None:
            pos = torch.arange(p, device=key.device, dtype=POS_DTYPE).expand(b, p)
        else:
            pos = (valid.cumsum(-1) - 1).to(POS_DTYPE).masked_fill(~valid, policy.EMPTY)
        positions = pos[:, None, :].expand(b, hs, p)  # (b, Hs, P)
        keep = ops.prefill_select(scores, positions, args, owner.generator)
        stored = scores if args.scored else torch.zeros_like(scores)  # local/sink/random: unscored
        cap = args.capacity
        count = pos.amax(-1).to(torch.int64) + 1  # (b,) real tokens
        # slots hold the kept positions in ascending order, then empty slots
        big = torch.iinfo(POS_DTYPE).max
        order = torch.where(keep, positions, big).argsort(-1)[..., :cap]  # (b,Hs,min(P,B))
        kept_pos = torch.where(keep.gather(-1, order), positions.gather(-1, order), policy.EMPTY)
        n = order.shape[-1]
        self.keys = key.new_zeros(b, hs, cap, d)
        self.values = value.new_zeros(b, hs, cap, d)
        self.scores = scores.new_zeros(b, hs, cap)
        self.positions = torch.full((b, hs, cap), policy.EMPTY, dtype=POS_DTYPE, device=key.device)
        gidx = order[..., None].expand(b, hs, n, d)
        self.keys[:, :, :n] = key.gather(2, gidx)
        self.values[:, :, :n] = value.gather(2, gidx)
        self.scores[:, :, :n] = torch.where(kept_pos >= 0, stored.gather(-1, order), 0.0)
        self.positions[:, :, :n] = kept_pos
        self.next_pos = count.to(POS_DTYPE)
        fill = count.clamp(max=cap)
        self.fill = None if bool((fill >= cap).all()) else fill
        self.is_initialized = True
        if owner.listener is not None:
            eligible = policy.eligible_mask(positions, (count - 1)[:, None, None], args.recent, args.sink)
            owner.listener.on_prefill(self.layer_idx, PrefillEvent(
                positions=positions, scores=scores, keep=keep, eligible=eligible, step=count - 1))
        return out

    def decode(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """One decode step; returns the attention output ``(b, 1, Hq, d)``."""
        key, value = self.take_pending()  # (b, Hs, 1, d)
        owner = self.owner
        listener = owner.listener
        step = self.next_pos  # (b,)
        step_fn = ops.decode_step
        if listener is None and owner.backend == "triton" and owner.args.policy != "random":
            from .kernels import decode_step_triton as step_fn
        res = step_fn(query[:, :, 0].contiguous(), key[:, :, 0].contiguous(), value[:, :, 0].contiguous(),
                      self.keys, self.values,
                              self.scores, self.positions, step, self.fill, scaling, owner.args,
                              generator=owner.generator,
                              **({"want_candidates": True} if listener is not None else {}))
        if listener is not None:
            listener.on_decode(self.layer_idx, DecodeEvent(
                step=step, slot=res.slot, evicts=res.evicts, cand_scores=res.cand_scores,
                cand_positions=res.cand_positions, kept=self.positions))
        self.next_pos = step + 1
        if self.fill is not None:
            self.fill = (self.fill + 1).clamp(max=self.capacity)
            if bool((self.fill >= self.capacity).all()):
                self.fill = None
        return res.out[:, None]

    def nbytes(self) -> tuple[int, int]:
        """``(kv_bytes, metadata_bytes)`` physically held by this layer."""
        if self.keys is None:
            return 0, 0
        kv = self.keys.numel() * self.keys.element_size() * 2
        meta = self.scores.numel() * self.scores.element_size() \
            + self.positions.numel() * self.positions.element_size()
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

    def __init__(self, config: H2OConfig, model_config: Any, listener: CacheListener | None = None,
                 prefill_chunk: int = 512):
        if config.policy == "full":
            raise ConfigError("policy 'full' uses transformers' own cache; H2OCache needs an evicting policy")
        text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") \
            else model_config
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
        self.generator = torch.Generator().manual_seed(config.seed)
        self._args: ops.PolicyArgs | None = None
        self.backend: str | None = None  # "torch" | "triton", resolved at the first prefill
        self.resolved_config: H2OConfig | None = config if config.resolved else None
        super().__init__(layers=[H2OCacheLayer(self, i) for i in range(n_layers)])

    @property
    def args(self) -> ops.PolicyArgs:
        if self._args is None:
            raise ConfigError("the H2O cache has not seen a prompt yet")
        return self._args

    def resolve_args(self, prompt_len: int) -> ops.PolicyArgs:
        """Resolve a ratio budget against the (padded) prompt length, once."""
        if self._args is None:
            cfg = self.config.resolve(prompt_len)
            heavy, recent, sink = cfg.split
            self.resolved_config = cfg
            self._args = ops.PolicyArgs(cfg.policy, heavy, recent, sink, cfg.gqa)
        return self._args

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
