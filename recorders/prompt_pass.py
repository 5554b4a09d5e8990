"""A request's prompt pass, handed from its recording to its replay (DESIGN.md §6.1).

The replay starts each request with a full-attention forward of its prompt: the keys and
values of every layer, the column sums of the prompt rows' weights and the logits of the
last prompt row. The recording's prefill has just computed the same things: H2O's prefill
attends fully, with the replay's attention function on the CPU row-by-row path
(:func:`h2o_lens.ops.prefill_rowwise`). ``record(..., keep_prompt_pass=True)`` keeps them per
request, and ``replay(..., prompt_passes=...)`` starts from them instead of forwarding the
prompt again: the same bits for a request recorded alone; in a padded batch, the prompt states
the run itself attended to (see DESIGN.md §6.1 for when they differ from the prompt alone). A
pass that does not match the request (other prompt tokens, layer count, KV heads or dtype) is
ignored: the replay then forwards the prompt itself.
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

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *self.cols, self.first]
        return sum(t.numel() * t.element_size() for t in tensors)

    def fits(self, ids: tuple[int, ...], layers: int, kv_heads: int, dtype: torch.dtype) -> bool:
        """Whether the pass is the prompt ``ids`` of a model with this shape and dtype."""
        return (
            self.ids == ids
            and len(self.keys) == len(self.values) == len(self.cols) == layers
            and all(k.shape[1] == kv_heads and k.dtype == dtype for k in self.keys)
        )


class PromptSink:
    """Receives the prefill's per-layer K/V and column sums (``H2OCache.prompt_sink``) and the
    output head's first call, and cuts them into one :class:`PromptPass` per batch row."""

    def __init__(self):
        #: layer -> per batch row (key, value, cols) of the row's own positions, copied out of the
        #: batch at once, so the batch's prompt K/V are not held through the generation
        self.layers: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.head_in: torch.Tensor | None = None  # (rows, 1, hidden) the last prompt positions
        self.head_out: torch.Tensor | None = None
        self.head_calls = 0

    def __call__(self, layer: int, key, value, scores, valid) -> None:
        rows = []
        for r in range(key.shape[0]):
            span = slice(None) if valid is None else valid[r].nonzero()[:, 0]
            own = key[r : r + 1, :, span], value[r : r + 1, :, span], scores[r][:, span]
            rows.append(tuple(t.clone() for t in own))
        self.layers[layer] = rows

    def on_head(self, module, args, output) -> None:
        """Forward hook of the output head: its input and logits at the prefill."""
        self.head_calls += 1
        if self.head_calls == 1:
            self.head_in, self.head_out = args[0], output

    def passes(self, rows: Mapping[int, list[int]], logits: torch.Tensor | None, head, layers: int):
        """``rows``: batch row -> its prompt ids; ``logits (rows, vocab)`` generate's logits of the
        first new token; ``head`` the model's output embedding. Returns ``{row: PromptPass}``,
        empty unless every layer reported and the prefill's logits are the head's own output on
        the last prompt positions (no draft tokens, no processing after the head)."""
        whole = sorted(self.layers) == list(range(layers))
        out_ok = self.head_out is not None and self.head_in.shape[1] == 1 and logits is not None
        if not (whole and out_ok and torch.equal(self.head_out[:, -1].float(), logits.float())):
            return {}
        passes = {}
        for r, ids in rows.items():
            keys, values, cols = (list(t) for t in zip(*(self.layers[layer][r] for layer in range(layers))))
            if keys[0].shape[2] != len(ids):
                continue
            # the replay's prompt forward computes the head on this one row: so does the pass
            with torch.no_grad():
                first = head(self.head_in[r : r + 1])[:, -1].float()
            passes[r] = PromptPass(tuple(ids), keys, values, cols, first)
        return passes
