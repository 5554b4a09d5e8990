"""A request's prompt pass, handed from its recording to its replay (DESIGN.md §6.1).

The replay starts each request with a full-attention forward of its prompt: the keys and
values of every layer, the column sums of the prompt rows' weights and the logits of the
last prompt row. The recording's prefill has just computed the same things: H2O's prefill
attends fully, with the replay's attention function on the CPU row-by-row path
(:func:`h2o_lens.ops.prefill_rowwise`). ``record(..., keep_prompt_pass=True)`` keeps them per
request, and ``replay(..., prompt_passes=...)`` starts from them instead of forwarding the
prompt again. A replay from the run folder alone computes the same bits: it forwards a request
recorded alone alone, and the prompts of a batch again as the same padded batch (the manifest's
``prefill_batches``, which :class:`PromptSink` tells the recorder about). A pass that does not
match the request (other prompt tokens, layer count, KV heads or dtype) is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["PromptPass", "PromptSink"]


@dataclass
class PromptPass:
    """One request's prompt as the prefill computed it.

    ``ids`` the prompt's token ids; per layer ``keys, values (1, Hkv, P, d)`` (one set per KV
    head, as the model's own cache holds them) and ``cols (Hs, P)`` float32, the column sums of
    the prompt rows' weights aggregated as the run's ``gqa``; ``first (1, vocab)`` float32 the
    logits of the last prompt row.
    """

    ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cols: list[torch.Tensor]
    first: torch.Tensor

    def fits(self, ids: tuple[int, ...], layers: int, kv_heads: int, dtype: torch.dtype) -> bool:
        """Whether the pass is the prompt ``ids`` of a model with this shape and dtype."""
        return (
            self.ids == ids
            and len(self.keys) == len(self.values) == len(self.cols) == layers
            and all(k.shape[1] == kv_heads and k.dtype == dtype for k in self.keys)
        )


class PromptSink:
    """Hears a generate call's prefill: per layer the prompt K/V and column sums when the layer
    ran on the row-by-row path (``H2OCache.prompt_sink``), and the output head's first call.
    Tells whether a replay can compute the same prompt states (:meth:`complete`) and, when asked
    to ``keep`` them, cuts them into one :class:`PromptPass` per batch row."""

    def __init__(self, keep: bool):
        self.keep = keep
        #: layer -> per batch row (key, value, cols) of the row's own positions, copied out of the
        #: batch at once, so the batch's prompt K/V are not held through the generation (a lone
        #: unpadded row is the batch's tensors themselves: a copy would only double them)
        self.layers: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.masked = False  # the prefill had a padding mask (each row cut to its span)
        self.head_width: int | None = None  # positions the output head computed at the prefill

    def __call__(self, layer: int, key, value, scores, valid) -> None:
        self.masked = valid is not None
        rows = []
        for r in range(key.shape[0] if self.keep else 0):
            if valid is None and key.shape[0] == 1 and key.is_contiguous() and value.is_contiguous():
                rows.append((key, value, scores[0]))  # the row is the whole batch: nothing to cut away
                continue
            span = slice(None) if valid is None else valid[r].nonzero()[:, 0]
            own = key[r : r + 1, :, span], value[r : r + 1, :, span], scores[r][:, span]
            rows.append(tuple(t.clone() for t in own))
        self.layers[layer] = rows

    def on_head(self, module, args, output) -> None:
        """Forward hook of the output head: how many positions the prefill put through it."""
        if self.head_width is None:
            self.head_width = args[0].shape[1]

    def on_reused_head(self, width: int) -> None:
        """The prefill was a reused prompt forward (:mod:`h2o_lens.prompt_reuse`): its logits
        came from ``width`` positions through the output head, which did not run again."""
        if self.head_width is None:
            self.head_width = width

    def complete(self, layers: int) -> bool:
        """Every layer's prefill ran row by row, and the first forward computed the logits of the
        last prompt positions only (no draft tokens after the prompt, as assisted decoding adds)."""
        return sorted(self.layers) == list(range(layers)) and self.head_width == 1

    def passes(self, rows: Mapping[int, list[int]], logits: torch.Tensor | None, layers: int) -> dict[int, PromptPass]:
        """``rows``: batch row -> its prompt ids; ``logits (rows, vocab)`` generate's logits of the
        first new token (the prefill's last positions). Returns ``{row: PromptPass}``, empty
        unless the sink keeps passes and the prefill was :meth:`complete`."""
        if not (self.keep and logits is not None and self.complete(layers)):
            return {}
        passes = {}
        for r, ids in rows.items():
            keys, values, cols = (list(t) for t in zip(*(self.layers[layer][r] for layer in range(layers))))
            if keys[0].shape[2] == len(ids):
                passes[r] = PromptPass(tuple(ids), keys, values, cols, logits[r : r + 1].float().clone())
        return passes
