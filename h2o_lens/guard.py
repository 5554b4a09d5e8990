"""The guard: an online failure risk per request and decode step, and what to do about it (DESIGN.md §18).

>>> with h2o_lens.h2o(model, H2OConfig(ratio=0.2)), guarded(GuardConfig(action="raise", raise_ratio=0.35)) as g:
...     model.generate(**inputs, max_new_tokens=64, logits_processor=[g.cues(tokenizer)])
...     g.last.risk_rows(), g.last.event_rows()

Inside :func:`guarded` every H2O cache built gets a :class:`GuardState`, an extension of the
cache (:mod:`h2o_lens.extension`, DESIGN.md §1.1) that computes the guard's signals from what
each layer's own decode step has: the step's softmax weights, the candidate set D with its
updated scores, the victim, the query and the key it overwrote. Nothing of a full-cache
teacher is read. After the last layer of a step the per-layer signals are averaged, combined
into one risk in [0, 1], logged, and the action of the :class:`GuardConfig` runs on the rows
whose risk reached the threshold:

- ``none``: the risk is only logged;
- ``raise``: the row's slot count grows to its target for the rest of the generation
  (:func:`grow_rows`); the positions evicted so far stay evicted and the event says how many;
- ``refill``: the row's prompt and generated tokens are prefilled again at its target and the
  row goes on from that state (:mod:`h2o_lens.refill`; pass ``guard.refill(model)`` to ``generate``);
- ``recall``: the row's recall window opens (a cold tier that has kept every eviction since the
  prefill, :class:`~h2o_lens.cold.ColdExtension` gated) and brings back, before each later step,
  the evicted entries the queries attend to most.

The signals (:data:`SIGNALS`, each in [0, 1], all defined in DESIGN.md §18.1):

``margin``     the victim's score over the lowest surviving heavy score (1: a tie);
``trend``      an exponential average of ``margin`` (the margins stay small);
``uniform``    the victim's cumulative score against what uniform attention would have given it
               over its life, ``r / (1 + r)`` (0.5: an average key left);
``far``        the attention mass outside the recent window (the query reaches back);
``entropy``    the attention entropy over D, over ``log |D|``;
``dropped``    the canary reservoir's estimate of the share of attention the evicted keys
               would take back, ``M / (1 + M)``;
``structure``  a structured-output token among the last generated ones (:class:`TokenCues`);
``refer``      a "refer back" word in the prompt (:class:`TokenCues`);
``prefill``    the share of the prompt's last rows' attention (the question) on the positions the
               prefill evicts, computed at the prefill, before anything is evicted: over every
               layer and KV set, or over the heads that read back (:attr:`GuardConfig.heads`,
               fitted by ``bench guard``);
``canary``     under the ``canary`` action, ``KL / (1 + KL)`` of the row's next-token distribution
               against its canary's (a copy at the target budget in the same batch), 1 once their
               tokens differ; rows without a canary take the batch's mean (:class:`Canary`).

With ``raise`` or ``refill`` the prefill's risk is acted on before the prompt is evicted: a row
whose prefill risk reaches the threshold keeps its prompt at the target from the start (a raise
with nothing evicted yet, no recompute; logged as the action itself, ``raise`` or ``refill``).

The guard is split along its parts: :mod:`h2o_lens.guard_config` (the signals' and actions' names,
:class:`GuardConfig`), :mod:`h2o_lens.guard_signals` (pure functions), :mod:`h2o_lens.guard_state`
(the per-cache state, the extension), :mod:`h2o_lens.guard_actions` (the raise) and
:mod:`h2o_lens.guard_cues` (the logits processors); this module is the scope and re-exports them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .cold import ColdExtension
from .cold_config import ColdTier
from .errors import ConfigError
from .extension import use_extensions
from .guard_actions import grow_rows, raise_prompt
from .guard_config import (
    ACTIONS,
    DEFAULT_BIAS,
    DEFAULT_WEIGHTS,
    FALLBACKS,
    LOGGED_ACTIONS,
    REFER_WORDS,
    SIGNALS,
    STRUCTURE_MARKS,
    GuardConfig,
)
from .guard_cues import Canary, TokenCues, cue_masks
from .guard_signals import (
    combine,
    dropped_share,
    head_signal,
    layer_signals,
    prefill_lost,
    prefill_signal,
    uniform_life,
)
from .guard_state import GuardState, Reservoir

__all__ = [
    "SIGNALS",
    "ACTIONS",
    "FALLBACKS",
    "LOGGED_ACTIONS",
    "DEFAULT_WEIGHTS",
    "DEFAULT_BIAS",
    "STRUCTURE_MARKS",
    "REFER_WORDS",
    "GuardConfig",
    "Guard",
    "GuardState",
    "Reservoir",
    "TokenCues",
    "Canary",
    "guarded",
    "grow_rows",
    "raise_prompt",
    "cue_masks",
    "combine",
    "layer_signals",
    "uniform_life",
    "dropped_share",
    "prefill_lost",
    "prefill_signal",
    "head_signal",
]


@dataclass
class Guard:
    """Handle of an active :func:`guarded` scope: its config and the states of its caches."""

    config: GuardConfig
    states: list[GuardState] = field(default_factory=list)
    #: (row, its canary's row) of the batch made by :meth:`canary_batch`; the requests it was given
    pairs: list[tuple[int, int]] = field(default_factory=list)
    batch: int | None = None
    #: ``(b, 2)`` the cues known from the prompts (:meth:`cues` given ``input_ids``), for the prefill
    prompt_cues: torch.Tensor | None = None

    def canary_batch(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch for ``generate`` under the ``canary`` action: ``input_ids`` (and the mask) with
        a copy of ``⌈canary_share · b⌉`` of its rows appended (spread over the batch), which the
        guard runs at its target budget. Pass ``logits_processor=[guard.canary()]`` and take the
        requests' rows back with :meth:`requests`. The copies are rows of the cache (and requests of
        a recorded run); keep the batch's row order (no beam search)."""
        b = input_ids.shape[0]
        m = max(1, math.ceil(self.config.canary_share * b))
        picks = sorted({min(b - 1, (i * b) // m) for i in range(m)})
        self.pairs = [(r, b + i) for i, r in enumerate(picks)]
        self.batch = b
        ids = torch.cat([input_ids, input_ids[picks]], 0)
        mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask[picks]], 0)
        return ids, mask

    def requests(self, output: torch.Tensor) -> torch.Tensor:
        """The rows of the requests given to :meth:`canary_batch`, without their canaries."""
        return output if self.batch is None else output[: self.batch]

    def canary(self) -> Canary:
        """The logits processor that feeds the ``canary`` signal (:class:`Canary`)."""
        return Canary(self)

    @property
    def last(self) -> GuardState | None:
        """The state of the last cache built in the scope."""
        return self.states[-1] if self.states else None

    def cues(self, tokenizer: Any, input_ids: torch.Tensor | None = None) -> TokenCues:
        """The logits processor that feeds the token cues (:class:`TokenCues`). Given the batch's
        ``input_ids`` (the prompts ``generate`` gets), the ``refer`` cue is known at the prefill and
        enters its risk; otherwise it starts at the first decode step."""
        cues = TokenCues(self, tokenizer)
        if input_ids is not None:
            cues._prompt, cues._refer = input_ids.shape[1], cues.refers(input_ids)
            self.prompt_cues = torch.stack([torch.zeros_like(cues._refer), cues._refer], -1).float()
        return cues

    def refill(self, model: Any) -> Any:
        """The logits processor that does the ``refill`` action (:class:`h2o_lens.refill.Refill`)."""
        from .refill import Refill

        return Refill(self, model)


def _attach(guard: Guard, cache: Any) -> GuardState:
    """The guard's extension of a new cache (its :class:`GuardState`), also reachable as ``cache.guard``."""
    guard.config.check_base(cache.config)
    state = GuardState(guard.config, cache)
    cache.guard = state
    guard.states.append(state)
    state.pairs = list(guard.pairs)
    if guard.prompt_cues is not None:
        state.cues = guard.prompt_cues.clone()
    return state


@contextlib.contextmanager
def guarded(config: GuardConfig | None = None) -> Iterator[Guard]:
    """Give every H2O cache made inside the block a :class:`GuardState` extension (DESIGN.md §18).

    Combine it with :func:`h2o_lens.h2o` (either order). On exit, exceptions included, new
    caches are plain again.
    """
    guard = Guard(config or GuardConfig())
    factories = [lambda cache: _attach(guard, cache)]
    if guard.config.acting == "recall":  # the cold tier first: it stashes a prompt before the guard lays it
        factories.insert(0, _recall_tier)
    with use_extensions(*factories):
        yield guard


def _recall_tier(cache: Any) -> ColdExtension:
    """The gated cold tier of the ``recall`` action (DESIGN.md §18.2): every eviction kept in host
    memory, exact selection, a refill at every decode step, each row's window closed until the guard
    opens it."""
    if cache.config.cold is not None:
        raise ConfigError(
            "guard action 'recall' brings its own cold tier (each window opened by the guard); leave the "
            "config's cold tier out"
        )
    return ColdExtension(ColdTier(store="cpu", select="exact"), gated=True)
