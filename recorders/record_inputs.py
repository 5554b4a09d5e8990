"""What the recorder reads of a ``generate`` call: token texts and evidence labels, the generation
config it will use (and what makes a log inexact), its EOS ids, the rows still generating and the
time of each step. Split from :mod:`recorders.recorder`, which uses them."""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from runlog.errors import RecorderError

__all__ = [
    "locate_evidence",
    "token_pieces",
    "generation_config",
    "refuse_inexact",
    "eos_ids",
    "GenerateWatch",
    "StepTimer",
]


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids]


def locate_evidence(pieces: Sequence[str], spans: Mapping[str, Any], prompt: str | None = None) -> list[str | None]:
    """Label of the evidence span each prompt token belongs to (``None`` if none).

    Parameters
    ----------
    pieces : the decoded text of each prompt token, in order
    spans : ``{label: substring}`` (first occurrence in the prompt text) or
        ``{label: (start, end)}`` character range of ``prompt`` (the user's
        prompt, found inside the tokenized text, e.g. after a chat template)
    """
    text = "".join(pieces)
    starts = np.cumsum([0] + [len(p) for p in pieces])  # char offset of each token
    labels: list[str | None] = [None] * len(pieces)
    for label, span in spans.items():
        if isinstance(span, str):
            begin = text.find(span)
            if not span or begin < 0:
                raise RecorderError(
                    f"evidence {label!r}: {span!r} does not occur in the prompt text; "
                    "give a substring of the prompt or a (start, end) character range"
                )
            end = begin + len(span)
        else:
            try:
                a, b = (int(x) for x in span)
            except (TypeError, ValueError):
                raise RecorderError(
                    f"evidence {label!r}: expected a substring or a (start, end) pair, got {span!r}"
                ) from None
            offset = 0
            if prompt is not None:
                offset = text.find(prompt)
                if offset < 0:
                    raise RecorderError(
                        f"evidence {label!r}: the prompt text is not found in the "
                        "tokenized input; give the evidence as a substring instead"
                    )
            if not 0 <= a < b or (prompt is not None and b > len(prompt)):
                raise RecorderError(f"evidence {label!r}: character range {span!r} is empty or outside the prompt")
            begin, end = offset + a, offset + b
        hit = (starts[:-1] < end) & (starts[1:] > begin)
        if not hit.any():
            raise RecorderError(f"evidence {label!r} covers no prompt token")
        for i in np.flatnonzero(hit):
            labels[i] = label
    return labels


def generation_config(model: Any, kwargs: Mapping[str, Any]) -> Any:
    """The generation config generate will use (its own merge of the config and the kwargs)."""
    options = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    config = options.pop("generation_config", None)
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is None:
        config = copy.deepcopy(config or model.generation_config)
        config.update(**options)
        return config
    return prepare(config, **options)[0]


def refuse_inexact(config: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise for generation modes whose evictions cannot be attributed to a returned sequence."""
    if (getattr(config, "num_beams", 1) or 1) > 1:
        raise RecorderError(
            f"record does not support beam search (num_beams={config.num_beams}): beams reorder the "
            "cache rows at every step, so an eviction cannot be attributed to a returned sequence "
            "exactly; record greedy or sampled generation (num_beams=1), e.g. with "
            "num_return_sequences for several samples per prompt"
        )
    if getattr(config, "stop_strings", None):
        raise RecorderError(
            "record does not support stop_strings: the recorder cannot observe where generate stopped "
            "each row, so it would log the padding after the stop as generated; cut the answers "
            "after generation instead"
        )
    if kwargs.get("stopping_criteria"):
        raise RecorderError(
            "record does not support custom stopping_criteria: rows they stop are padded by generate "
            "in a way the recorder cannot tell from generated text; stop with eos_token_id or "
            "max_new_tokens instead"
        )


def eos_ids(config: Any) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


class GenerateWatch:
    """Forward pre-hook on the model during one generate call.

    Captures the prefill's ``input_ids`` and ``attention_mask`` (the expanded
    rows and the mask generate really used) and, at each decode forward,
    which rows are still generating: a row is finished once the token it is
    fed is an EOS, or it was fed one before.
    """

    def __init__(self, eos: Sequence[int], ended: torch.Tensor | None = None, width: int | None = None):
        self.eos = list(eos)
        self.ended = ended  # (rows,) bool: rows of a continued generation whose request already ended
        self.width = width  # prompt columns: assisted decoding's first forward adds a draft after them
        self.input_ids: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.finished: torch.Tensor | None = None  # (rows,) bool
        self.alive: torch.Tensor | None = None  # (rows,) bool, rows whose current forward is real

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        if self.input_ids is None:
            mask = kwargs.get("attention_mask")
            if self.width is not None and ids.shape[1] > self.width:
                ids = ids[:, : self.width]
                mask = mask[:, : self.width] if mask is not None and mask.dim() == 2 else mask
            self.input_ids, self.mask = ids, mask
            self.finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
            self.alive = None
            if self.ended is not None:  # a continued generation: its first forward is a decode step
                self.finished = self.ended.to(ids.device)
                self.alive = ~self.finished
            return
        fed = ids[:, 0]  # a verification forward's first token is confirmed, its draft may not be
        if self.eos:
            eos = torch.tensor(self.eos, dtype=fed.dtype, device=fed.device)
            self.finished = self.finished | torch.isin(fed, eos)
        self.alive = ~self.finished

    def prompt_mask(self) -> torch.Tensor:
        """``(rows, width)`` bool: the prompt columns generate attended to."""
        ids, mask = self.input_ids, self.mask
        if mask is None:
            return torch.ones_like(ids, dtype=torch.bool)
        if mask.dim() != 2 or mask.shape != ids.shape:
            raise RecorderError(
                f"record needs generate's 2-D padding mask, got an attention mask of shape "
                f"{tuple(mask.shape)} for input_ids of shape {tuple(ids.shape)}; generate without a "
                "static cache (cache_implementation='static' builds a 4-D mask)"
            )
        return mask.bool()


class StepTimer:
    """A logits processor that only timestamps generate's steps (scores pass through)."""

    def __init__(self):
        self.times: list[float] = []
        self.t0 = 0.0
        self.prefill: float | None = None

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        now = time.perf_counter()
        if not self.times:
            self.prefill = now - self.t0
        self.times.append(now)
        return scores

    def decode_steps(self) -> list[float]:
        return list(np.diff(self.times))
