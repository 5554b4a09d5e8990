"""One prompt forward for every H2O configuration of a batch (DESIGN.md §12.5).

A sweep runs the same batch of prompts under many configurations: policies, budgets,
aggregations. H2O's prefill attends fully, so the forward over the prompt (every layer's
keys, values, outputs and the logits of the first new token) does not depend on the policy
or the budget; only the keep rule applied at its end does. Inside :func:`reuse_prompts`,
the first ``generate`` of a prompt batch runs its prefill as usual and keeps, per layer,
what the keep rule reads (the prompt's keys and values, the column sums, the queries of the
last rows) with the logits. A later ``generate`` of the same batch under another
configuration skips the model's forward over the prompt: every layer applies its own keep
rule to the kept tensors (:meth:`h2o_lens.cache.H2OCacheLayer.adopt_prompt`) and
``generate`` receives the kept logits. The run is the same, bit for bit, as with its own
prefill: the kept tensors are what that prefill would compute from the same inputs.

A prompt forward is reused only where that holds: the same token ids, padding mask and
position ids; the same model dtype, aggregation (``gqa``, which sets the column sums and
the KV sets), prefill row block, backend (the torch prefill; the Triton one is not kept)
and attention scaling; a fresh H2O cache whose first forward is the prompt alone; no
diagnosis fault on. Anything else runs its own prefill. The model's weights must not
change inside the scope.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import faults
from .cache import H2OCache

__all__ = ["PromptReuse", "reuse_prompts"]

#: keyword arguments of a prompt forward that the reuse understands; any other tensor argument
#: (images, embeddings) means the forward is not a plain prompt and runs as usual
_PLAIN = {"input_ids", "attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep", "return_dict"}


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
class _Prompt:
    """A prompt forward kept for the next configuration: per layer ``(query rows, key, value,
    scores, valid, scaling, repeat)`` (the K/V once per KV head, to be repeated ``repeat`` times
    per head) and the forward's logits (the last positions only)."""

    layers: list[tuple[Any, ...]]
    logits: torch.Tensor
    output_type: type


@dataclass
class _Capture:
    """Hears one prefill layer by layer (``H2OCache.prompt_capture``)."""

    rows: int
    layers: dict[int, tuple[Any, ...]] = field(default_factory=dict)

    def __call__(self, layer: int, query, key, value, scores, valid, scaling: float, repeat: int = 1) -> None:
        r = min(max(self.rows, 1), query.shape[2])
        if repeat > 1:  # one copy per KV head; the adopting layer repeats it again (the same values)
            key, value = key[:, ::repeat].contiguous(), value[:, ::repeat].contiguous()
        self.layers[layer] = (query[:, :, query.shape[2] - r :].clone(), key, value, scores, valid, scaling, repeat)


class PromptReuse:
    """The reuse scope of one model (see the module docstring); :func:`reuse_prompts` is the
    context-manager form. ``keep``: prompt forwards held at once (the oldest goes first): a
    sweep runs a batch's configurations one after another, so two (one per aggregation) cover
    a grid of ``--gqa sum,max``. ``hits`` and ``misses`` count the prompt forwards reused and
    computed."""

    def __init__(self, model: Any, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep={keep}; expected at least 1 prompt forward")
        self.model = model
        self.keep = keep
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
        """What makes two prompt forwards the same, or None when this forward is not one to reuse."""
        if args or set(kwargs) - _PLAIN:
            return None
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 1:
            return None
        if any(layer.is_initialized or layer.shared is not None for layer in cache.layers) or cache.sharing:
            return None
        if cache.prompt_width is not None and cache.prompt_width != ids.shape[1]:
            return None  # assisted decoding's first forward: prompt and draft
        if any(faults.active(name) for name in faults.KNOWN):
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            return None
        return (
            _digest(ids),
            _digest(mask),
            _digest(kwargs.get("position_ids")),
            str(kwargs.get("logits_to_keep")),
            str(self.model.dtype),
            cache.config.gqa,
            cache.prefill_chunk,
            cache.resolve_backend(ids.device),
            self.model.config._attn_implementation,
        )

    def _forward(self, original, *args: Any, **kwargs: Any):
        cache = kwargs.get("cache")
        if not isinstance(cache, H2OCache):
            return original(*args, **kwargs)
        key = self._identity(cache, args, kwargs)
        if key is None:
            return original(*args, **kwargs)
        kept = self._store.get(key)
        if kept is not None and len(kept.layers) == len(cache.layers):
            self._store.move_to_end(key)
            self.hits += 1
            for layer, (query, key, value, scores, valid, scaling, repeat) in zip(cache.layers, kept.layers):
                if repeat > 1:
                    key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
                layer.adopt_prompt(query, key, value, scores, valid, scaling)
            cache.prompt_reused = True
            heard = getattr(cache.prompt_sink, "on_reused_head", None)
            if heard is not None:  # the output head did not run: say how many positions it gave
                heard(kept.logits.shape[1])
            return kept.output_type(logits=kept.logits.clone(), cache=cache)
        capture = _Capture(self._rows)
        cache.prompt_capture = capture
        try:
            out = original(*args, **kwargs)
        finally:
            cache.prompt_capture = None
        self.misses += 1
        logits = getattr(out, "logits", None)
        if sorted(capture.layers) == list(range(len(cache.layers))) and isinstance(logits, torch.Tensor):
            self._store[key] = _Prompt([capture.layers[i] for i in range(len(cache.layers))], logits.clone(), type(out))
            while len(self._store) > self.keep:
                self._store.popitem(last=False)
        return out


@contextlib.contextmanager
def reuse_prompts(model: Any, keep: int = 2) -> Iterator[PromptReuse]:
    """Within the scope, a ``generate`` of ``model`` under an H2O cache starts from the prompt
    forward of an earlier ``generate`` of the same prompts (DESIGN.md §12.5) instead of
    forwarding them again. Yields the :class:`PromptReuse` (its ``hits`` and ``misses``)."""
    with PromptReuse(model, keep) as scope:
        yield scope
