"""The guard's token cues and canary comparison: logits processors that feed signals (DESIGN.md §18.1, §18.2)."""

from __future__ import annotations

from typing import Any

import torch

from .guard_config import REFER_WORDS, STRUCTURE_MARKS

Guard = Any  # h2o_lens.guard.Guard (which imports this module)

__all__ = ["TokenCues", "Canary", "cue_masks"]


class TokenCues:
    """A logits processor that reads the tokens and sets the ``structure`` and ``refer`` cues.

    ``structure`` is 1 when one of the last :attr:`GuardConfig.cue_window` generated tokens
    holds a mark of structured output (:data:`STRUCTURE_MARKS`); ``refer`` is 1 when the
    question, the prompt's last :attr:`GuardConfig.tail` tokens (the whole prompt with ``tail``
    0), holds a "refer back" word (:data:`REFER_WORDS`): an instruction at the top of a long
    prompt ("read the following text") is not the user asking about early content. Pass it to
    ``generate`` as ``logits_processor=[guard.cues(tokenizer)]``; it leaves the scores as they are.
    """

    def __init__(self, guard: Guard, tokenizer: Any):
        self.guard = guard
        self.structure, self.refer = cue_masks(tokenizer)
        self._prompt: int | None = None
        self._refer: torch.Tensor | None = None

    def refers(self, prompts: torch.Tensor) -> torch.Tensor:
        """``(b,)`` bool: whether each prompt's question (its last ``tail`` tokens; left padding
        is not a word) holds a refer-back word."""
        tail = self.guard.config.tail
        ids = prompts.cpu().clamp(0, len(self.refer) - 1)
        return self.refer[ids[:, -tail:] if tail else ids].any(-1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        state = self.guard.last
        if state is None:
            return scores
        ids = input_ids.cpu().clamp(0, len(self.structure) - 1)
        if self._prompt is None or self._refer is None or self._refer.shape[0] != ids.shape[0]:
            self._prompt = ids.shape[1] - 1  # the first call sees the prompt and one new token
            self._refer = self.refers(ids[:, : self._prompt])
        recent = ids[:, max(self._prompt, ids.shape[1] - self.guard.config.cue_window) :]
        structure = self.structure[recent].any(-1)
        state.set_cues(torch.stack([structure, self._refer], -1).float())
        return scores


class Canary:
    """A logits processor that compares each request with its canary (DESIGN.md §18.2).

    At every step, for each pair (row, canary row): the KL divergence of the canary's next-token
    distribution from the row's, as ``KL / (1 + KL)``, or 1 from the first step where their
    tokens differ (from then on they read different texts). That is the row's ``canary`` signal
    for the next step; a row without a canary takes the mean over the batch's pairs, and a canary
    row 0. It leaves the scores as they are.
    """

    def __init__(self, guard: Guard):
        self.guard = guard
        self._parted: set[int] = set()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        state = self.guard.last
        if state is None or not state.pairs:
            return scores
        logp = torch.log_softmax(scores.double(), -1)
        b = scores.shape[0]
        signal = torch.zeros(b, dtype=torch.float32)
        values = []
        for row, can in state.pairs:
            if int(input_ids[row, -1]) != int(input_ids[can, -1]):
                self._parted.add(row)
            if row in self._parted:
                v = 1.0
            else:
                kl = float((logp[can].exp() * (logp[can] - logp[row])).sum().clamp_min(0.0))
                v = kl / (1.0 + kl)
            signal[row] = v
            values.append(v)
        paired = {r for pair in state.pairs for r in pair}
        mean = sum(values) / len(values)
        for r in range(b):
            if r not in paired:
                signal[r] = mean
        state.canary = signal
        return scores


_MASKS: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}


def cue_masks(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(structure, refer)``: bool ``(vocab,)`` masks of the tokens whose text holds a mark of
    :data:`STRUCTURE_MARKS`, and of those that are a word of :data:`REFER_WORDS`; computed once
    per tokenizer (the whole vocabulary is decoded in one call)."""
    hit = _MASKS.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1], hit[2]
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    words = set(REFER_WORDS)
    structure = torch.tensor([any(m in t for m in STRUCTURE_MARKS) for t in texts], dtype=torch.bool)
    refer = torch.tensor([t.strip().lower() in words for t in texts], dtype=torch.bool)
    _MASKS[id(tokenizer)] = (tokenizer, structure, refer)
    return structure, refer
