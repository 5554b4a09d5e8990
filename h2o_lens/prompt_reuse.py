"""One prompt forward for every H2O configuration of a batch (DESIGN.md §12.5).

A sweep runs the same batch of prompts under many configurations: policies, budgets,
aggregations. H2O's prefill attends fully, so the forward over the prompt (every layer's
keys, values, outputs and the logits of the first new token) does not depend on the
configuration; only what is applied at the end of each layer's prefill does: the column sums
(their aggregation, ``gqa``) and the keep rule. Inside :func:`reuse_prompts`, the first
``generate`` of a prompt batch runs its prefill as usual and keeps, per layer, what a keep
rule reads (the prompt's keys and values, the column sums, the queries of the last rows) with
the logits; with ``any_gqa`` also the layer's queries and the rows' log-sum-exps, from which
another aggregation's column sums come (:func:`h2o_lens.ops.prefill_columns`). A later
``generate`` of the same batch under another configuration skips the model's forward over
the prompt: every layer applies its own keep rule to the kept tensors
(:meth:`h2o_lens.cache.H2OCacheLayer.adopt_prompt`) and ``generate`` receives the kept
logits. The run is the same, bit for bit, as with its own prefill: the kept tensors are what
that prefill would compute from the same inputs.

A prompt forward is reused only where that holds: the same token ids, padding mask and
position ids; the same model dtype, prefill row block, backend (the torch prefill; the Triton
one is not kept) and attention implementation; the same aggregation, or any from the CPU flash
path with ``any_gqa``; a fresh H2O cache of the plain layer class whose first forward is the
prompt alone (a cache built with another layer class, :func:`h2o_lens.cache.use_layer_class`, may
prefill its own way), with no extension but observers (the guard reads its own prompt forward,
:mod:`h2o_lens.extension`). Anything else runs its own prefill. The model's weights must not change
inside the scope.

With ``repeated``, a batch of one prompt repeated over its rows (the same token ids, mask and
position ids in every row) is served from that prompt's one-row forward: the one held, or one run
then, at one row, into a scratch cache of the same configuration and held. Every row then starts
from the bits of that prompt prefilled alone (the culprit search's probes, one set of pins per
row, are each the probe run alone; DESIGN.md §19), and the batch costs one prompt forward of one
row. Without it such a batch is a prompt batch like any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import compat, ops
from .cache import H2OCache, H2OCacheLayer

__all__ = ["PromptReuse", "reuse_prompts"]

#: keyword arguments of a prompt forward that the reuse understands; any other tensor argument
#: (images, embeddings) means the forward is not a plain prompt and runs as usual
_PLAIN = {"input_ids", "attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep", "return_dict"}


def _plain(name: str, value: Any, width: int) -> bool:
    """Whether a keyword argument beyond :data:`_PLAIN` says nothing a fresh prompt forward does
    not: ``generate`` before transformers 5.24 also passes the cache as ``past_key_values``,
    ``inputs_embeds=None`` and ``cache_position = arange(width)`` (DESIGN.md §3.1)."""
    if name == "past_key_values":
        return True  # the cache itself, read through compat.cache_from
    if name == "inputs_embeds":
        return value is None
    if name == "cache_position":
        return (
            isinstance(value, torch.Tensor)
            and value.dim() == 1
            and value.numel() == width
            and bool((value == torch.arange(width, device=value.device)).all())
        )
    return False


def _rows_needed() -> int:
    """The last prompt rows any registered policy ranks by (``prefill="rows"``)."""
    from . import policies

    return max([p.prefill_rows for p in policies.all_policies()] + [0])


def _digest(t: torch.Tensor | None) -> str:
    if t is None:
        return "-"
    t = t.detach().cpu().contiguous()
    return f"{t.dtype}{tuple(t.shape)}:{hashlib.sha256(t.numpy().tobytes()).hexdigest()}"


@dataclass
class _Layer:
    """One layer of a kept prompt forward: what the keep rule of any configuration reads."""

    rows: torch.Tensor  # (b, Hq, R, d) the queries of the last R prompt rows
    key: torch.Tensor  # (b, Hkv, P, d), once per KV head
    value: torch.Tensor
    valid: torch.Tensor | None
    scaling: float
    cols: dict[str, torch.Tensor]  # gqa -> (b, Hs, P) column sums in that aggregation's KV sets
    query: torch.Tensor | None = None  # (b, Hq, P, d) and the rows' log-sum-exps (b, Hq, P): what
    lse: torch.Tensor | None = None  # the column sums of another aggregation come from


@dataclass
class _Prompt:
    """A prompt forward kept for the next configuration: its layers and logits (the last
    positions only)."""

    layers: list[_Layer]
    logits: torch.Tensor
    output_type: type

    def columns(self, gqa: str, copies: int, chunk: int) -> bool:
        """Make sure every layer has its column sums under ``gqa`` (computed from the kept queries
        and log-sum-exps when missing); False when they cannot be had. ``copies``: the KV sets
        per KV head under ``gqa`` (:meth:`h2o_lens.shape.ModelShape.copies`)."""
        if all(gqa in layer.cols for layer in self.layers):
            return True
        if any(layer.query is None or layer.lse is None for layer in self.layers):
            return False
        for layer in self.layers:
            if gqa not in layer.cols:
                key = layer.key.repeat_interleave(copies, 1) if copies > 1 else layer.key
                cols = ops.prefill_columns(layer.query, key, layer.lse, layer.valid, layer.scaling, gqa, chunk)
                if cols is None:
                    return False
                layer.cols[gqa] = cols
        return True


@dataclass
class _Capture:
    """Hears one prefill layer by layer (``H2OCache.prompt_capture``)."""

    rows: int
    gqa: str
    any_gqa: bool
    layers: dict[int, _Layer] = field(default_factory=dict)

    def __call__(self, layer: int, query, key, value, scores, valid, scaling: float, repeat=1, lse=None) -> None:
        r = min(max(self.rows, 1), query.shape[2])
        if repeat > 1:  # one copy per KV head; an adopting layer under gqa="none" repeats it again
            key, value = key[:, ::repeat].contiguous(), value[:, ::repeat].contiguous()
        whole = self.any_gqa and lse is not None
        self.layers[layer] = _Layer(
            rows=query[:, :, query.shape[2] - r :].clone(),
            key=key,
            value=value,
            valid=valid,
            scaling=scaling,
            cols={self.gqa: scores},
            query=query if whole else None,
            lse=lse if whole else None,
        )


class PromptReuse:
    """The reuse scope of one model (see the module docstring); :func:`reuse_prompts` is the
    context-manager form. ``keep``: prompt forwards held at once (the oldest goes first).
    ``any_gqa``: a forward also serves the other aggregations: the scope then keeps each
    layer's queries and row log-sum-exps too (the CPU flash prefill's), and gives another
    aggregation its column sums from them (:func:`h2o_lens.ops.prefill_columns`, the same bits
    as its own prefill); else one forward per aggregation. ``repeated``: a batch of one prompt
    repeated is served from that prompt's one-row forward (module docstring). ``hits`` and
    ``misses`` count the prompt forwards reused and computed."""

    def __init__(self, model: Any, keep: int = 2, any_gqa: bool = False, repeated: bool = False):
        if keep < 1:
            raise ValueError(f"keep={keep}; expected at least 1 prompt forward")
        self.model = model
        self.keep = keep
        self.any_gqa = any_gqa
        self.repeated = repeated
        self.hits = 0
        self.misses = 0
        self._store: OrderedDict[tuple, _Prompt] = OrderedDict()
        self._rows = _rows_needed()
        self._saved: tuple[bool, Any] | None = None
        #: free for the caller: what the forwards held belong to (a sweep's batch)
        self.batch: Any = None

    def __enter__(self) -> PromptReuse:
        if self._saved is not None:
            raise RuntimeError("this PromptReuse scope is already open")
        model = self.model
        self._saved = ("forward" in vars(model), vars(model).get("forward"))
        original = model.forward
        model.forward = functools.wraps(original)(functools.partial(self._forward, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        had, saved = self._saved
        self._saved = None
        if had:
            self.model.forward = saved
        else:
            vars(self.model).pop("forward", None)
        self._store.clear()

    def clear(self) -> None:
        """Drop the prompt forwards held."""
        self._store.clear()

    def _identity(self, cache: H2OCache, args: tuple, kwargs: dict) -> tuple | None:
        """What makes two prompt forwards the same (the aggregation aside), or None when this
        forward is not one to reuse."""
        if args:
            return None
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 1:
            return None
        if any(not _plain(name, kwargs[name], ids.shape[1]) for name in set(kwargs) - _PLAIN):
            return None
        if any(layer.is_initialized or layer.shared is not None for layer in cache.layers) or cache.sharing:
            return None
        if cache.prompt_width is not None and cache.prompt_width != ids.shape[1]:
            return None  # assisted decoding's first forward: prompt and draft
        if any(type(layer) is not H2OCacheLayer for layer in cache.layers):
            return None  # another layer class may prefill its own way: only the plain one's is kept
        if any(not ext.observer for ext in cache.extensions):
            return None  # an extension that acts at the prefill (the guard) reads its own prompt forward
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            return None
        return (
            _digest(ids),
            _digest(mask),
            _digest(kwargs.get("position_ids")),
            str(kwargs.get("logits_to_keep")),
            str(self.model.dtype),
            cache.prefill_chunk,
            cache.resolve_backend(ids.device),
            self.model.config._attn_implementation,
        )

    def _find(self, identity: tuple, cache: H2OCache) -> _Prompt | None:
        """The kept forward this cache can start from: one of its own aggregation, or one that
        serves every aggregation."""
        gqa = cache.config.gqa
        for key in ((identity, gqa), (identity, "*")):
            kept = self._store.get(key)
            if kept is not None and len(kept.layers) == len(cache.layers):
                if kept.columns(gqa, cache.shape.copies(gqa), cache.prefill_chunk):
                    self._store.move_to_end(key)
                    return kept
        return None

    def _forward(self, original, *args: Any, **kwargs: Any):
        cache = compat.cache_from(kwargs)
        if not isinstance(cache, H2OCache):
            return original(*args, **kwargs)
        identity = self._identity(cache, args, kwargs)
        if identity is None:
            return original(*args, **kwargs)
        kept = self._find(identity, cache)
        if kept is not None:
            self.hits += 1
            return self._adopt(kept, cache, 1)
        one = _one_row(kwargs) if self.repeated else None
        if one is not None:  # b copies of one prompt: that prompt's forward, over the rows
            row = self._identity(cache, args, one)
            kept = self._find(row, cache) if row is not None else None
            if kept is not None:
                self.hits += 1
            elif row is not None:
                kept = self._forward_one(original, row, one, cache)
            if kept is not None:
                return self._adopt(kept, cache, kwargs["input_ids"].shape[0])
        capture = _Capture(self._rows, cache.config.gqa, self.any_gqa)
        cache.prompt_capture = capture
        try:
            out = original(*args, **kwargs)
        finally:
            cache.prompt_capture = None
        self.misses += 1
        self._keep(identity, capture, out, cache)
        return out

    def _keep(self, identity: tuple, capture: _Capture, out: Any, cache: H2OCache) -> _Prompt | None:
        """Hold a captured prompt forward for the next configuration (None: the capture is incomplete)."""
        logits = getattr(out, "logits", None)
        if sorted(capture.layers) != list(range(len(cache.layers))) or not isinstance(logits, torch.Tensor):
            return None
        layers = [capture.layers[i] for i in range(len(cache.layers))]
        whole = all(layer.lse is not None for layer in layers)
        kept = _Prompt(layers, logits.clone(), type(out))
        self._store[(identity, "*" if whole else cache.config.gqa)] = kept
        while len(self._store) > self.keep:
            self._store.popitem(last=False)
        return kept

    def _forward_one(self, original, identity: tuple, one: dict, cache: H2OCache) -> _Prompt | None:
        """The prompt forward of one row (``one``: the forward's keyword arguments cut to that row),
        run into a scratch cache of the same configuration and held; None when it cannot be kept."""
        scratch = H2OCache(
            dataclasses.replace(cache.config, pinned=()),
            self.model.config,
            prefill_chunk=cache.prefill_chunk,
            layer_class=H2OCacheLayer,
            extensions=(),
        )
        scratch.prompt_width = one["input_ids"].shape[1]
        capture = _Capture(self._rows, cache.config.gqa, self.any_gqa)
        scratch.prompt_capture = capture
        kwargs = {k: v for k, v in one.items() if k not in ("cache", "past_key_values")}
        out = original(**kwargs, **compat.cache_kwargs(scratch))
        self.misses += 1
        kept = self._keep(identity, capture, out, scratch)
        if kept is not None and not self._find(identity, cache):
            return None
        return kept

    def _adopt(self, kept: _Prompt, cache: H2OCache, rows: int):
        """Start ``cache`` from a kept prompt forward (of one row repeated over ``rows`` when
        ``rows > 1``): every layer applies its own keep rule; returns the forward's output."""
        gqa = cache.config.gqa
        copies = cache.shape.copies(gqa)  # the K/V repeated per query head under gqa="none"

        def over(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or rows == 1 else t.expand(rows, *t.shape[1:]).contiguous()

        for cache_layer, layer in zip(cache.layers, kept.layers):
            key, value = layer.key, layer.value
            if copies > 1:
                key, value = key.repeat_interleave(copies, 1), value.repeat_interleave(copies, 1)
            cols = layer.cols[gqa]
            cache_layer.adopt_prompt(
                over(layer.rows), over(key), over(value), over(cols), over(layer.valid), layer.scaling
            )
        cache.prompt_reused = True
        heard = getattr(cache.prompt_sink, "on_reused_head", None)
        if heard is not None:  # the output head did not run: say how many positions it gave
            heard(kept.logits.shape[1])
        return kept.output_type(logits=over(kept.logits.clone()), **compat.cache_kwargs(cache))


def _one_row(kwargs: dict) -> dict | None:
    """The keyword arguments of a forward over ``b > 1`` identical prompt rows (the same token ids,
    mask and position ids) cut to the first row, else None."""
    ids = kwargs["input_ids"]
    if ids.shape[0] < 2 or not bool((ids == ids[:1]).all()):
        return None
    one = dict(kwargs, input_ids=ids[:1])
    for name in ("attention_mask", "position_ids"):
        t = kwargs.get(name)
        if t is None or t.shape[0] == 1:
            continue
        if t.shape[0] != ids.shape[0] or not bool((t == t[:1]).all()):
            return None
        one[name] = t[:1]
    return one


@contextlib.contextmanager
def reuse_prompts(model: Any, keep: int = 2, any_gqa: bool = False, repeated: bool = False) -> Iterator[PromptReuse]:
    """Within the scope, a ``generate`` of ``model`` under an H2O cache starts from the prompt
    forward of an earlier ``generate`` of the same prompts (DESIGN.md §12.5) instead of
    forwarding them again; with ``any_gqa``, whatever the aggregation of either; with
    ``repeated``, a batch of one prompt repeated from that prompt's one-row forward. Yields the
    :class:`PromptReuse` (its ``hits`` and ``misses``)."""
    with PromptReuse(model, keep, any_gqa, repeated) as scope:
        yield scope
