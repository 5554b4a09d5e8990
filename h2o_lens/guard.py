"""The guard: an online failure risk per request and decode step, and what to do about it (DESIGN.md §18).

>>> with h2o_lens.h2o(model, H2OConfig(ratio=0.2)), guarded(GuardConfig(action="raise", raise_ratio=0.35)) as g:
...     model.generate(**inputs, max_new_tokens=64, logits_processor=[g.cues(tokenizer)])
...     g.last.risk_rows(), g.last.event_rows()

Inside :func:`guarded` every H2O cache is built with :class:`GuardLayer`, a layer that
computes the guard's signals from what its own decode step has: the step's softmax
weights, the candidate set D with its updated scores, the victim, the query and the key
it overwrote. Nothing of a full-cache teacher is read. After the last layer of a step the
per-layer signals are averaged, combined into one risk in [0, 1], logged, and the action
of the :class:`GuardConfig` runs on the rows whose risk reached the threshold:

- ``none``: the risk is only logged;
- ``raise``: the row's slot count grows to its target for the rest of the generation
  (:func:`grow_rows`); the positions evicted so far stay evicted and the event says how many;
- ``refill``: the row's prompt and generated tokens are prefilled again at its target and the
  row goes on from that state (:mod:`h2o_lens.refill`; pass ``guard.refill(model)`` to ``generate``).

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
with nothing evicted yet, no recompute).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import eviction, ops
from .cache import H2OCache, H2OCacheLayer, use_layer_class
from .errors import ConfigError
from .events import decode_stats
from .policies.base import ratio_slots

__all__ = [
    "SIGNALS",
    "ACTIONS",
    "GuardConfig",
    "Guard",
    "GuardLayer",
    "GuardState",
    "TokenCues",
    "Canary",
    "guarded",
    "grow_rows",
    "cue_masks",
    "combine",
    "prefill_lost",
    "head_signal",
]

#: the signals, in the order of :attr:`GuardConfig.weights` and of the logged rows
SIGNALS = ("margin", "trend", "uniform", "far", "entropy", "dropped", "structure", "refer", "prefill", "canary")
#: the actions a guard can take (DESIGN.md §18.2)
ACTIONS = ("none", "raise", "refill", "canary")
#: what the ``canary`` action does to a request whose risk reaches the threshold (DESIGN.md §18.2)
FALLBACKS = ("none", "raise", "refill")
#: per-layer signals, averaged over the layers and KV sets of a step
_LAYER_SIGNALS = ("margin", "uniform", "far", "entropy", "dropped")

#: the neighbours on each side that a rescued position brings along (a fact spans a few tokens)
_POOL = 7
#: the weights and bias of the logistic combination (DESIGN.md §18.3)
DEFAULT_WEIGHTS = (1.0, 2.0, 2.0, 2.0, 1.0, 4.0, 1.0, 1.0, 16.0, 6.0)
DEFAULT_BIAS = -5.0

#: text pieces of structured output (code, JSON, markup, tables) and "refer back" words
STRUCTURE_MARKS = ("`", "{", "}", "[", "]", "<", ">", "|", "=", "\t")
REFER_WORDS = (
    "above",
    "earlier",
    "previous",
    "previously",
    "mentioned",
    "beginning",
    "recall",
    "repeat",
    "quote",
    "verbatim",
    "exact",
    "exactly",
    "passage",
    "document",
    "text",
    "first",
)


@dataclass(frozen=True)
class GuardConfig:
    """What the guard computes and does.

    Parameters
    ----------
    action : ``none`` (log the risk only), ``raise`` (grow the slot count), ``refill`` (prefill
        the tokens so far again at the target) or ``canary`` (a share of the batch also runs at the
        target; their KL and agreement feed the risk, and ``fallback`` acts on it, DESIGN.md §18.2)
    threshold : the risk in [0, 1] at which the action runs on a row
    raise_slots : slots per KV set after a raise or refill (at least the row's current count), or
    raise_ratio : a keep ratio of the row's prompt length after it (one of the two with ``raise``
        and ``refill``)
    reservoir : the share of a row's slots kept as a sampled reservoir of evicted keys, e.g. 0.02
        (0, the default, turns the ``dropped`` signal off: it predicted no failure in
        ``bench guard`` and its upkeep costs a few per cent of a decode step, DESIGN.md §18.3);
        the reservoir holds ``max(1, ⌈share · B⌉)`` keys
    weights, bias : the logistic combination of :data:`SIGNALS` into the risk
    span : steps of the exponential average of ``trend``
    cue_window : the last generated tokens that the ``structure`` cue looks at
    seed : of the reservoir's sampling
    stride : the layers that compute decode-time signals, ``0, stride, 2·stride, …`` (1: every
        layer; 8 by default); the per-layer signals are averaged over those (fewer layers, less
        cost, DESIGN.md §18.1; the ``prefill`` signal reads every layer)
    tail : the prompt's last rows whose attention the guard reads at the prefill (the rescue's
        rows; 0 turns the ``prefill`` signal off)
    signal_rows : the last of the ``tail`` rows that the ``prefill`` signal averages (the question's
        rows; more rows reach into the text before it, which reads locally, DESIGN.md §18.1)
    heads : ``(layer, KV set)`` pairs whose lost shares the ``prefill`` signal averages, the heads
        that read back (``bench guard`` fits them on known failures and prints them); () averages
        every layer and KV set
    canary_share : under ``canary``, the share of the batch's requests that get a canary copy
        (at least one; :meth:`Guard.canary_batch` makes them)
    fallback : under ``canary``, what a request (not a canary) whose risk reaches the threshold
        gets: ``none`` (the default: the risk is logged), ``raise`` or ``refill`` to the same target
        as the canaries, as those actions do it (the safe fallback of DESIGN.md §18.2)
    rescue : at a raise at the prefill, the share of the prompt pinned to the positions the
        prompt's last rows read most, pooled over ``±7`` neighbours; the pins come out of the
        raised row's heavy slots (at most all of them), so a rescue larger than the raise trades
        heavy hitters for what the question reads (0: no pins, DESIGN.md §18.2)
    """

    action: str = "none"
    threshold: float = 0.5
    raise_slots: int | None = None
    raise_ratio: float | None = None
    reservoir: float = 0.0
    weights: tuple[float, ...] = DEFAULT_WEIGHTS
    bias: float = DEFAULT_BIAS
    span: int = 8
    cue_window: int = 8
    seed: int = 0
    stride: int = 8
    tail: int = 32
    signal_rows: int = 8
    heads: tuple[tuple[int, int], ...] = ()
    rescue: float = 0.0
    canary_share: float = 0.125
    fallback: str = "none"

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ConfigError(f"guard action {self.action!r} is not known; expected one of {', '.join(ACTIONS)}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"guard threshold={self.threshold} is outside [0, 1]; give a risk level such as 0.5")
        if self.raise_slots is not None and self.raise_ratio is not None:
            raise ConfigError("give the raise target as raise_slots or raise_ratio, not both")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"guard fallback {self.fallback!r} is not known; expected one of {', '.join(FALLBACKS)}")
        if self.fallback != "none" and self.action != "canary":
            raise ConfigError(
                f"guard fallback={self.fallback!r} is what the 'canary' action does to a risky request; with action "
                f"{self.action!r} leave it out (action='{self.fallback}' acts on the risk itself)"
            )
        if not 0.0 < self.canary_share <= 1.0:
            raise ConfigError(f"canary_share={self.canary_share} is outside (0, 1]; give a share such as 0.125")
        if self.action != "none" and self.raise_slots is None and self.raise_ratio is None:
            raise ConfigError(
                f"guard action {self.action!r} needs a target: raise_slots=N or raise_ratio=R (0 < R <= 1)"
            )
        if self.raise_slots is not None and self.raise_slots < 2:
            raise ConfigError(f"raise_slots={self.raise_slots}; expected at least 2 slots")
        if self.raise_ratio is not None and not 0.0 < self.raise_ratio <= 1.0:
            raise ConfigError(f"raise_ratio={self.raise_ratio} is outside (0, 1]; give a keep ratio such as 0.35")
        if not 0.0 <= self.reservoir <= 0.5:
            raise ConfigError(f"reservoir={self.reservoir} is outside [0, 0.5]; the guard samples 1-2 % (0.01-0.02)")
        if len(self.weights) != len(SIGNALS):
            raise ConfigError(
                f"guard weights has {len(self.weights)} values; expected {len(SIGNALS)}, one per signal "
                f"({', '.join(SIGNALS)})"
            )
        if not 0.0 <= self.rescue <= 1.0:
            raise ConfigError(f"rescue={self.rescue} is outside [0, 1]; give a share of the prompt such as 0.05")
        if self.tail < 0:
            raise ConfigError(f"tail={self.tail}; expected the number of last prompt rows to read (0: off), e.g. 32")
        if self.signal_rows < 1:
            raise ConfigError(f"signal_rows={self.signal_rows}; expected at least 1 of the prompt's last rows, e.g. 8")
        heads = tuple(self.heads)
        if not all(len(h) == 2 and all(isinstance(v, int) and v >= 0 for v in h) for h in heads):
            raise ConfigError(
                f"heads={self.heads!r}: expected (layer, KV set) pairs of indices, such as ((12, 0), (17, 2))"
            )
        object.__setattr__(self, "heads", tuple(tuple(h) for h in heads))
        if self.span < 1 or self.cue_window < 1 or self.stride < 1:
            raise ConfigError(
                f"span={self.span}, cue_window={self.cue_window} and stride={self.stride} must be at least 1"
            )

    @property
    def acting(self) -> str:
        """What a request whose risk reaches the threshold gets: ``raise``, ``refill`` or ``none``
        (the action itself, or the ``canary`` action's fallback)."""
        if self.action in ("raise", "refill"):
            return self.action
        return self.fallback if self.action == "canary" else "none"

    def target(self, capacity: int, prompt_len: int) -> int:
        """Slots per KV set after a raise of a row that holds ``capacity`` slots."""
        n = self.raise_slots if self.raise_slots is not None else ratio_slots(self.raise_ratio, prompt_len)
        return max(int(n), capacity)


def combine(signals: torch.Tensor, weights: tuple[float, ...], bias: float) -> torch.Tensor:
    """The risk ``σ(bias + Σ wᵢ sᵢ)`` of signals ``(..., len(SIGNALS))``, in [0, 1]."""
    w = torch.tensor(weights, dtype=signals.dtype, device=signals.device)
    return torch.sigmoid(bias + (signals * w).sum(-1))


# -- the per-layer signals -------------------------------------------------------------------------


def layer_signals(
    weights: torch.Tensor,
    cand_scores: torch.Tensor,
    cand_positions: torch.Tensor,
    slot: torch.Tensor,
    evicts: torch.Tensor,
    step: torch.Tensor,
    recent: torch.Tensor,
    sink: torch.Tensor,
    capacity: torch.Tensor,
    prompt_len: torch.Tensor,
    gqa: str,
    accumulates: bool,
    pinned: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(b, Hs, 4)``: ``margin, uniform, far, entropy`` of one layer's decode step (DESIGN.md §18.1).

    ``weights (b, Hs, G, B + 1)`` the step's softmax weights per query head,
    ``cand_scores, cand_positions (b, Hs, B + 1)`` the candidate set D after the score update,
    ``slot, evicts (b, Hs)`` the victim slot and whether it left, ``step, recent, sink,
    capacity, prompt_len (b,)`` per row. ``uniform`` is 0 unless the policy ``accumulates``.
    """
    acc = cand_scores.dtype
    agg = eviction.aggregate_group(weights.to(acc), gqa, 2)  # (b, Hs, B+1)
    total = agg.sum(-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)
    p = agg / total  # (b, Hs, B+1), a distribution over D
    live = cand_positions >= 0
    st = step[:, None, None]
    near = live & (cand_positions > st - recent[:, None, None])
    near |= cand_positions == st  # the new token is in the recent window
    far = (1.0 - (p * near).sum(-1)).clamp(0.0, 1.0)
    n = live.sum(-1).to(acc)  # (b, Hs) |D|
    ent = -(p * torch.log(p.clamp_min(torch.finfo(acc).tiny))).sum(-1)
    ent = torch.where(n > 1, ent / torch.log(n.clamp_min(2.0)), torch.zeros_like(ent))
    stats = decode_stats(cand_scores, cand_positions, slot, evicts, step, recent, sink, pinned)
    # the victim's and the lowest survivor's scores in the step's own precision (StepStats rounds to FP32)
    vscore = cand_scores.gather(-1, slot[..., None])[..., 0]
    low = cand_scores.masked_fill(~stats.survivors, torch.finfo(acc).max).amin(-1)
    low = torch.where(stats.survivors.any(-1), low, torch.zeros_like(low))
    ok = evicts & (low > 0)
    margin = torch.where(ok, (vscore / low.clamp_min(torch.finfo(acc).tiny)).clamp(0.0, 1.0), 0.0)
    if accumulates:
        share = float(weights.shape[2]) if gqa == "sum" else 1.0
        vpos = stats.victim_position.to(acc)
        expected = share * uniform_life(vpos, step.to(acc)[:, None], prompt_len.to(acc)[:, None], capacity[:, None])
        ratio = vscore.clamp_min(0.0) / expected.clamp_min(torch.finfo(acc).tiny)
        uniform = torch.where(evicts & (vpos >= 0), ratio / (1.0 + ratio), 0.0)
    else:
        uniform = torch.zeros_like(margin)
    return torch.stack([margin, uniform, far, ent.clamp(0.0, 1.0)], -1)


def uniform_life(position: torch.Tensor, step: torch.Tensor, prompt_len: torch.Tensor, capacity) -> torch.Tensor:
    """The weight a key at ``position`` would have collected by ``step`` under uniform attention,
    per unit of the uniform share: ``Σ_{u ≥ position} 1 / n_u`` over the prompt rows ``u < P``
    (``n_u = u + 1``, a harmonic difference) and over the decode steps ``u`` from
    ``max(P, position)`` to ``step`` (``n_u = B + 1``)."""
    pos = position.clamp_min(0.0)
    prompt = torch.where(
        pos < prompt_len,
        torch.special.digamma(prompt_len + 1.0) - torch.special.digamma(pos + 1.0),
        torch.zeros_like(pos),
    )
    decode_steps = (step - torch.maximum(prompt_len, pos) + 1.0).clamp_min(0.0)
    return prompt + decode_steps / (capacity + 1.0)


def dropped_share(
    qg: torch.Tensor,
    key: torch.Tensor,
    weights_new: torch.Tensor,
    reservoir: torch.Tensor,
    held: torch.Tensor,
    evicted: torch.Tensor,
) -> torch.Tensor:
    """``(b, Hs)``: the canary estimate of the attention share of the evicted keys (DESIGN.md §18.1).

    ``qg (b, Hs, G, d)`` the scaled queries, ``key (b, Hs, d)`` the new token's key and
    ``weights_new (b, Hs, G)`` its softmax weight (the anchor of the step's normaliser:
    ``Z = exp(q·k_new) / w_new``), ``reservoir (b, Hs, R, d)`` the sampled evicted keys of
    which the first ``held (b, Hs)`` are live, ``evicted (b, Hs)`` the keys evicted so far.
    The reservoir's mass ``Σ exp(q·k_j) / Z``, scaled by ``evicted / held``, estimates the
    mass ``M`` of every evicted key; the share they would take back is ``M / (1 + M)``,
    averaged over the group's query heads.
    """
    acc = torch.float64 if qg.dtype == torch.float64 else torch.float32
    lr = torch.matmul(qg.to(acc), reservoir.to(acc).transpose(-1, -2))  # (b, Hs, G, R)
    ln = torch.matmul(qg.to(acc), key.to(acc)[..., None])  # (b, Hs, G, 1)
    r = reservoir.shape[2]
    valid = torch.arange(r, device=held.device) < held[..., None]  # (b, Hs, R)
    e = torch.exp((lr - ln).clamp(max=60.0)).masked_fill(~valid[:, :, None], 0.0)
    mass = e.sum(-1) * weights_new.to(acc)  # (b, Hs, G)
    scale = evicted.to(acc) / held.clamp_min(1).to(acc)  # (b, Hs)
    m = mass * scale[..., None]
    return torch.where(held > 0, (m / (1.0 + m)).mean(-1), 0.0).to(torch.float32)


def prefill_lost(tail: torch.Tensor, keep: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``(b, Hs)``: per KV set, the share of the prompt's last rows' attention that falls on the
    positions the prefill evicts, averaged over the rows (DESIGN.md §18.1).

    ``tail (b, Hs, R, P)`` the last ``R`` prompt rows' attention weights aggregated per KV set
    (:func:`h2o_lens.ops.prefill_rows`; padding rows and keys weigh 0, a padding row counts for
    nothing), ``keep (b, Hs, P)`` the prefill's keep mask, ``positions (b, Hs, P)`` the columns'
    positions (negative: padding).
    """
    acc = tail.dtype
    gone = (~keep) & (positions >= 0)  # (b, Hs, P)
    total = tail.sum(-1)  # (b, Hs, R)
    lost = (tail * gone[:, :, None].to(acc)).sum(-1) / total.clamp_min(torch.finfo(acc).tiny)
    real = (total > 0).to(acc)
    return ((lost * real).sum(2) / real.sum(2).clamp_min(1.0)).clamp(0.0, 1.0).to(torch.float32)


def prefill_signal(tail: torch.Tensor, keep: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``(b,)``: one layer's ``prefill`` signal over all its KV sets, the mean of
    :func:`prefill_lost` (the arguments are the same)."""
    return prefill_lost(tail, keep, positions).mean(1)


def head_signal(heads: torch.Tensor, chosen: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """``(b,)``: the ``prefill`` signal from the lost shares ``heads (b, layers, Hs)``: their mean
    over the ``chosen`` ``(layer, KV set)`` pairs, or over all of them when none are chosen."""
    if not chosen:
        return heads.mean((1, 2))
    n_layers, n_sets = heads.shape[1], heads.shape[2]
    bad = [(layer, s) for layer, s in chosen if layer >= n_layers or s >= n_sets]
    if bad:
        raise ConfigError(
            f"guard heads {bad} are outside this model's {n_layers} layers and {n_sets} KV sets; "
            "fit them on this model (h2o-lens bench guard prints them)"
        )
    idx = torch.tensor([layer * n_sets + s for layer, s in chosen])
    return heads.flatten(1)[:, idx].mean(1)


# -- the guard layer --------------------------------------------------------------------------------


class GuardLayer(H2OCacheLayer):
    """An H2O cache layer whose decode steps feed the guard (DESIGN.md §18).

    The step itself is the torch step of :class:`~h2o_lens.cache.H2OCacheLayer`, unchanged
    (the same kept sets bit for bit); it is asked for its candidate set and, with a
    reservoir, for the key it overwrites. The layer holds the reservoir of sampled evicted
    keys ``(b, Hs, R, d)``.
    """

    def __init__(self, owner: H2OCache, layer_idx: int):
        super().__init__(owner, layer_idx)
        if layer_idx == 0:
            guard = _ACTIVE.get()
            state = GuardState(guard.config if guard is not None else GuardConfig(), owner)
            owner.guard = state
            if guard is not None:
                guard.states.append(state)
                state.pairs = list(guard.pairs)
                if guard.prompt_cues is not None:
                    state.cues = guard.prompt_cues.clone()
        self.reservoir: torch.Tensor | None = None  # (b, Hs, R, d)
        self.held: torch.Tensor | None = None  # (b, Hs) keys held
        self.evicted: torch.Tensor | None = None  # (b, Hs) keys evicted so far
        self._generator: torch.Generator | None = None
        self._last: tuple | None = None
        self._scaling: float | None = None
        self._deferred: tuple | None = None  # a prompt whose slots wait for the prefill's decision
        self._segmenting = False

    def _kernel_step(self, args, want: bool) -> bool:
        # a layer that computes signals reads the torch step's weights; the others keep the backend's step
        return not self.scored and super()._kernel_step(args, want)

    def _step(
        self,
        args,
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
        want,
        history=None,
        rows=None,
        journal=False,
    ):
        if not self.scored:
            self._last = None
            return super()._step(
                args, q, k, v, keys, values, scores, positions, step, fill, scaling, want, history, rows, journal
            )
        journal = journal or self.owner.guard.config.reservoir > 0  # the reservoir samples the overwritten key
        res = super()._step(
            args, q, k, v, keys, values, scores, positions, step, fill, scaling, True, history, rows, journal
        )
        self._last = (q, k, scaling, res)
        return res

    def prefill(self, query, valid, scaling):
        self._scaling = scaling
        return super().prefill(query, valid, scaling)

    def adopt_prompt(self, query, key, value, scores, valid, scaling: float) -> None:
        self._scaling = scaling
        super().adopt_prompt(query, key, value, scores, valid, scaling)

    def prefill_and_segment(self, query, valid, scaling, width):
        # assisted decoding's first forward verifies a draft right after the prompt, in this layer:
        # the prompt cannot wait for the other layers, so the prefill's risk is logged, not acted on
        self._segmenting = True
        try:
            return super().prefill_and_segment(query, valid, scaling, width)
        finally:
            self._segmenting = False

    def _keep_prompt(self, query, key, value, valid, scores, rows) -> None:
        """The prefill's keep rule, with the ``prefill`` signal read first (DESIGN.md §18.1).

        Under ``raise`` or ``refill`` the prompt's slots wait until every layer has given its
        signal: the rows whose prefill risk reaches the threshold get their target slot count
        before anything of their prompt is evicted (:meth:`GuardState.decide_prefill`); under
        ``canary`` the canary rows get theirs."""
        state = self.owner.guard
        cfg = state.config
        if self._scaling is None or (cfg.tail == 0 and cfg.action != "canary"):
            super()._keep_prompt(query, key, value, valid, scores, rows)
            return
        t0 = time.perf_counter()
        positions, count, _, _, keep, _ = self.prompt_keep(query, key, valid, scores, rows)
        tail = None
        lost = torch.zeros(key.shape[0], keep.shape[1])
        if cfg.tail:
            r = min(cfg.tail, query.shape[2])
            tail = ops.prefill_rows(query, key, valid, self._scaling, self.owner.config.gqa, r)  # (b, Hs, R, P)
            lost = prefill_lost(tail[:, :, -cfg.signal_rows :], keep, positions)
        state.add_prefill(self, lost, count, tail, positions)
        state.seconds += time.perf_counter() - t0
        state.act_at_prefill = cfg.action != "none" and not self._segmenting
        if state.act_at_prefill:
            self._deferred = (query, key, value, valid, scores, rows)
        else:
            super()._keep_prompt(query, key, value, valid, scores, rows)
        if self.layer_idx == len(self.owner.layers) - 1:
            state.decide_prefill()

    def lay_prompt(self) -> None:
        """Lay a prompt held back by :meth:`_keep_prompt` into slots, at the rows' budgets now."""
        if self._deferred is not None:
            args, self._deferred = self._deferred, None
            H2OCacheLayer._keep_prompt(self, *args)

    @property
    def scored(self) -> bool:
        """Whether this layer computes signals (:attr:`GuardConfig.stride`)."""
        return self.layer_idx % self.owner.guard.config.stride == 0

    def decode_once(self, query, scaling, *, journal: bool = False, emit: bool = True):
        out = super().decode_once(query, scaling, journal=journal, emit=emit)
        if self.segment is None:  # a verification segment is not scored
            if self._last is not None:
                self.owner.guard.observe(self, *self._last)
            elif self.layer_idx == len(self.owner.layers) - 1:
                self.owner.guard.close_step(self)
        self._last = None
        return out

    def _move_row_state(self, move: Callable[[torch.Tensor], torch.Tensor], names=None) -> None:
        if names is None:
            super()._move_row_state(move)
        else:
            super()._move_row_state(move, names)
        for name in ("reservoir", "held", "evicted"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, move(t))
        if self.layer_idx == 0:
            self.owner.guard.move_rows(move)

    def reset(self) -> None:
        super().reset()
        self.reservoir = self.held = self.evicted = None

    def sample_evicted(self, old_key: torch.Tensor, evicts: torch.Tensor, capacity: int) -> None:
        """Reservoir sampling (Algorithm R) of the keys ``old_key (b, Hs, d)`` evicted where ``evicts``."""
        b, hs, d = old_key.shape
        if self.reservoir is None:
            r = max(1, math.ceil(self.owner.guard.config.reservoir * capacity))
            self.reservoir = old_key.new_zeros(b, hs, r, d)
            self.held = torch.zeros(b, hs, dtype=torch.int64, device=old_key.device)
            self.evicted = torch.zeros(b, hs, dtype=torch.int64, device=old_key.device)
            self._generator = torch.Generator(device=old_key.device)
            self._generator.manual_seed(self.owner.guard.config.seed * 1_000_003 + self.layer_idx)
        r = self.reservoir.shape[2]
        n = self.evicted
        u = torch.rand(b, hs, generator=self._generator, device=old_key.device)
        draw = (u * (n + 1).to(u.dtype)).to(torch.int64).clamp(max=n)  # uniform in [0, n]
        at = torch.where(n < r, n, draw)  # the slot that takes the key, or >= r: dropped
        take = evicts & (at < r)
        idx = at.clamp(max=r - 1)[..., None, None].expand(b, hs, 1, d)
        cur = self.reservoir.gather(2, idx)[:, :, 0]
        self.reservoir.scatter_(2, idx, torch.where(take[..., None], old_key, cur)[:, :, None])
        self.held = torch.where(evicts, (self.held + 1).clamp(max=r), self.held)
        self.evicted = self.evicted + evicts.to(torch.int64)


# -- the per-cache state ----------------------------------------------------------------------------


@dataclass
class GuardState:
    """The guard of one cache: per-row state, the per-step risk log, the events and the cost."""

    config: GuardConfig
    cache: Any
    #: per row: ``trend`` average, prompt length, mean evicted keys per KV set, raised, cues
    ema: torch.Tensor | None = None
    prompt_len: torch.Tensor | None = None
    evicted: torch.Tensor | None = None
    raised: torch.Tensor | None = None
    cues: torch.Tensor | None = None  # (b, 2) structure, refer
    prefill: torch.Tensor | None = None  # (b,) the prefill signal, once the prompt is in
    #: (b, layers, Hs) each layer's and KV set's lost share at the prefill (:func:`prefill_lost`), rows as then
    prefill_heads: torch.Tensor | None = None
    canary: torch.Tensor | None = None  # (b,) the canary signal, set by :class:`Canary` for the next step
    #: (row, its canary's row) of a batch made by :meth:`Guard.canary_batch`
    pairs: list[tuple[int, int]] = field(default_factory=list)
    #: the per-step log: (request ids, step (b,), signals (b, len(SIGNALS)), risk (b,))
    steps: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    #: seconds spent in the guard's own computations, and the steps scored
    seconds: float = 0.0
    scored: int = 0
    #: the steps and events already written to a log (:mod:`recorders.guard_log`)
    written: tuple[int, int] = (0, 0)
    #: ``(seconds, refill_seconds, scored)`` already counted in a log's ``guard_cost``
    cost_written: tuple[float, float, int] = (0.0, 0.0, 0)
    #: refills marked at the last step, done by :class:`~h2o_lens.refill.Refill` before the next one
    pending: list[dict[str, Any]] = field(default_factory=list)
    refiller: bool = False
    refill_seconds: float = 0.0
    _acc: torch.Tensor | None = None
    _budgets: tuple | None = None
    _prefill_lost: list[torch.Tensor] = field(default_factory=list)
    _prompt_counts: torch.Tensor | None = None
    #: whether the prompts wait for the prefill's decision (not in assisted decoding's first forward)
    act_at_prefill: bool = False
    _columns: torch.Tensor | None = None
    _column_positions: torch.Tensor | None = None

    # -- at the prefill -----------------------------------------------------------------------------
    def add_prefill(
        self,
        layer: GuardLayer,
        lost: torch.Tensor,
        count: torch.Tensor,
        tail: torch.Tensor | None,
        positions: torch.Tensor,
    ) -> None:
        """One layer's lost shares ``(b, Hs)`` (:func:`prefill_lost`); ``count (b,)`` the rows' real
        prompt tokens; ``tail (b, Hs, R, P)`` the last rows' weights and ``positions (b, Hs, P)``
        their columns'."""
        if layer.layer_idx == 0:
            self._prefill_lost = []
            self._columns = None
        self._prefill_lost.append(lost.float().cpu())
        self._prompt_counts = count.cpu().to(torch.int64)
        if tail is not None and self.config.rescue > 0 and self.config.acting != "none":
            mass = tail.sum(2).double()  # (b, Hs, P): the last rows' attention per column and KV set
            mass = (mass / mass.sum(-1, keepdim=True).clamp_min(1e-300)).amax(1).cpu()  # the most-reading set
            self._columns = mass if self._columns is None else torch.maximum(self._columns, mass)
            self._column_positions = positions[:, 0].cpu()

    def decide_prefill(self) -> None:
        """After the last layer's prefill: the prefill's risk per row, logged at step ``P − 1``;
        under ``raise`` or ``refill`` the rows that reach the threshold get their target slot
        count before their prompts are laid into slots (nothing is evicted yet: no recompute)."""
        t0 = time.perf_counter()
        cfg = self.config
        cache = self.cache
        self.prefill_heads = heads = torch.stack(self._prefill_lost, 1)  # (b, layers, Hs)
        self._prefill_lost = []
        signal = head_signal(heads, cfg.heads)
        b = signal.shape[0]
        dev = cache.layers[0].budget.device
        self.prefill = signal.float().to(dev)
        step = self._prompt_counts.to(dev) - 1  # (b,) each row's last prompt position
        # the per-row state starts here (the first decode step finds it)
        self.ema = torch.zeros(b, device=dev)
        self.prompt_len = (step + 1).float()
        self.evicted = torch.zeros(b, device=dev)
        self.raised = torch.zeros(b, dtype=torch.bool, device=dev)
        signals = torch.zeros(b, len(SIGNALS), device=dev)
        signals[:, SIGNALS.index("prefill")] = self.prefill
        if self.cues is not None and self.cues.shape[0] == b:  # the prompt's cues, when given up front
            signals[:, SIGNALS.index("refer")] = self.cues[:, 1].to(dev)
        risk = combine(signals, cfg.weights, cfg.bias)
        self.steps.append((self.request_ids(), step.clone(), signals, risk.clone()))
        logged = len(self.steps) - 1
        acted: list[int] = []  # the row of each event taken here
        if not self.act_at_prefill:
            pass  # the prompts are in their slots already: the risk is logged, the decode steps act
        elif cfg.action == "canary":
            if not self.pairs:
                raise ConfigError(
                    "guard action 'canary' runs copies of some requests in the batch; build the batch with "
                    "guard.canary_batch(input_ids, attention_mask) and pass logits_processor=[guard.canary()]"
                )
            rows = [c for _, c in self.pairs]
            caps = cache.row_capacity(cache._rows).tolist()
            ids = self.request_ids()
            slots = [cfg.target(caps[c], int(self.prompt_len[c])) for c in rows]
            raise_prompt(cache, rows, slots)
            canaries: list[dict[str, Any]] = []
            for (base, c), n in zip(self.pairs, slots):
                self.raised[c] = True
                acted.append(base)
                canaries.append(
                    {
                        "request": ids[base],
                        "step": int(step[c]),
                        "risk": float(risk[base]),
                        "action": "canary",
                        "slots_before": int(caps[c]),
                        "slots_after": int(n),
                        "evicted": 0.0,
                        "seconds": 0.0,
                    }
                )
            self.events += canaries
        if self.act_at_prefill and cfg.acting != "none":
            hit = (risk >= cfg.threshold) & ~self.raised  # a canary row is raised already
            rows = torch.nonzero(hit)[:, 0].tolist()
            if rows:
                acts = self._actions(rows, step, risk, "raise")
                pins = [self._rescue_positions(r, a["slots_after"] - a["slots_before"]) for r, a in zip(rows, acts)]
                raise_prompt(cache, rows, [a["slots_after"] for a in acts], pins)
                for a in acts:
                    acted.append(a.pop("row"))
                    self.events.append({**a, "seconds": 0.0})
        for layer in cache.layers:  # the prompts held back, at the budgets decided (a no-op without)
            layer.lay_prompt()
        # a recorder names the rows' requests as their prompts are laid: the prefill's log takes them
        ids = self.request_ids()
        self.steps[logged] = (ids, *self.steps[logged][1:])
        for event, row in zip(self.events[len(self.events) - len(acted) :], acted):
            event["request"] = ids[row]
        self.seconds += time.perf_counter() - t0

    def _rescue_positions(self, row: int, added: int) -> tuple[int, ...]:
        """The prompt positions of ``row`` its last rows read most (per column the most-reading KV set
        and layer, max-pooled over ``±7`` neighbours), outside the recent window and the sink:
        ``⌈rescue · P⌉`` of them, at most the raised row's heavy slots (its heavy slots and the
        ``added`` ones; and the pins it had); () without ``rescue``."""
        if self._columns is None or self.config.rescue <= 0 or added <= 0:
            return ()
        cache = self.cache
        p = int(self._prompt_counts[row])
        args = cache.budgets[int(cache._rows[row])]
        n = min(args.heavy + added, math.ceil(self.config.rescue * p))  # pins come out of heavy slots
        pos = self._column_positions[row]
        mass = torch.zeros(p, dtype=torch.float64)
        real = pos >= 0
        mass[pos[real].long()] = self._columns[row][real]
        pooled = torch.nn.functional.max_pool1d(mass[None, None], 2 * _POOL + 1, stride=1, padding=_POOL)[0, 0]
        open_ = torch.ones(p, dtype=torch.bool)
        open_[: args.sink] = False
        open_[max(0, p - args.recent) :] = False
        if args.pinned:
            open_[list(args.pinned)] = False
        pooled = pooled.masked_fill(~open_, -1.0)
        n = min(n, int(open_.sum()))
        if n <= 0:
            return ()
        top = torch.topk(pooled, n).indices
        return tuple(sorted(set(args.pinned) | set(int(i) for i in top)))

    # -- per layer ------------------------------------------------------------------------------
    def observe(self, layer: GuardLayer, q: torch.Tensor, k: torch.Tensor, scaling: float, res: Any) -> None:
        """Add one layer's signals of the step just taken; after the last layer, finish the step."""
        t0 = time.perf_counter()
        cache = self.cache
        step = layer.next_pos - 1  # (b,) the step just taken
        b, hs = res.slot.shape
        if layer.layer_idx == 0 or self._acc is None:
            self._start_step(layer, step)
        capacity, recent, sink = self._budgets
        if res.weights is None:  # pragma: no cover - the torch step always gives them
            return
        spec = cache.budgets[0].spec
        four = layer_signals(
            res.weights,
            res.cand_scores,
            res.cand_positions,
            res.slot,
            res.evicts,
            step,
            recent,
            sink,
            capacity,
            self.prompt_len,
            cache.config.gqa,
            spec.accumulates,
            cache.pinned_positions(),
        )  # (b, Hs, 4)
        dropped = torch.zeros(b, hs, device=four.device)
        if self.config.reservoir > 0:
            qg = q.reshape(b, hs, -1, q.shape[-1]) * scaling
            if layer.reservoir is not None:
                dropped = dropped_share(qg, k, res.weights[..., -1], layer.reservoir, layer.held, layer.evicted)
            gone = res.evicts & (res.slot < layer.keys.shape[2])  # a key left its slot
            if bool(gone.any()):
                layer.sample_evicted(res.old_key, gone, layer.keys.shape[2])
        per = torch.cat([four, dropped[..., None].to(four.dtype)], -1).mean(1)  # (b, 5)
        self._acc += per.to(self._acc.dtype)
        self.evicted += res.evicts.to(self.evicted.dtype).mean(1) / self._scored_layers()
        if layer.layer_idx == len(cache.layers) - 1:
            self._finish_step(step)
        self.seconds += time.perf_counter() - t0

    def close_step(self, layer: GuardLayer) -> None:
        """Finish the step at the last layer when that layer computes no signals."""
        if self._acc is None:
            return
        t0 = time.perf_counter()
        self._finish_step(layer.next_pos - 1)
        self.seconds += time.perf_counter() - t0

    def _scored_layers(self) -> int:
        return -(-len(self.cache.layers) // self.config.stride)

    def _start_step(self, layer: GuardLayer, step: torch.Tensor) -> None:
        b = step.shape[0]
        dev = step.device
        if self.ema is None:
            self.ema = torch.zeros(b, device=dev)
            self.prompt_len = step.to(torch.float32)  # the first decode step is at position P
            self.evicted = torch.zeros(b, device=dev)
            self.raised = torch.zeros(b, dtype=torch.bool, device=dev)
        if self.cues is None or self.cues.shape[0] != b:  # the cue processor may have set them already
            self.cues = torch.zeros(b, 2, device=dev)
        self.cues = self.cues.to(dev)
        table = torch.tensor([[a.capacity, a.recent, a.sink] for a in self.cache.budgets], device=dev)
        t = table[layer.budget.to(dev)]  # (b, 3)
        self._budgets = (t[:, 0], t[:, 1], t[:, 2])
        self._acc = torch.zeros(b, len(_LAYER_SIGNALS), device=dev)

    def _finish_step(self, step: torch.Tensor) -> None:
        cfg = self.config
        per = self._acc / self._scored_layers()  # (b, 5) margin, uniform, far, entropy, dropped
        alpha = 2.0 / (cfg.span + 1.0)
        self.ema = self.ema + alpha * (per[:, 0] - self.ema)
        prefill = self.prefill if self.prefill is not None else torch.zeros_like(self.ema)
        canary = self.canary.to(prefill.device) if self.canary is not None else torch.zeros_like(self.ema)
        signals = torch.cat(
            [per[:, :1], self.ema[:, None], per[:, 1:], self.cues, prefill[:, None], canary[:, None]], -1
        )
        risk = combine(signals, cfg.weights, cfg.bias)
        self.steps.append((self.request_ids(), step.clone(), signals.clone(), risk.clone()))
        self.scored += 1
        if cfg.acting != "none":
            hit = (risk >= cfg.threshold) & ~self.raised
            for _, c in self.pairs:  # a canary is never acted on
                hit[c] = False
            if bool(hit.any()):
                rows = torch.nonzero(hit)[:, 0].tolist()
                (self._raise if cfg.acting == "raise" else self._mark_refill)(rows, step, risk)

    def _actions(self, rows: list[int], step: torch.Tensor, risk: torch.Tensor, action: str) -> list[dict[str, Any]]:
        caps = self.cache.row_capacity(self.cache.layers[0].budget).tolist()
        ids = self.request_ids()
        out = []
        for r in rows:
            self.raised[r] = True
            out.append(
                {
                    "request": ids[r],
                    "step": int(step[r]),
                    "risk": float(risk[r]),
                    "action": action,
                    "slots_before": int(caps[r]),
                    "slots_after": self.config.target(caps[r], int(self.prompt_len[r])),
                    "evicted": float(self.evicted[r]),
                    "row": r,
                }
            )
        return out

    def _raise(self, rows: list[int], step: torch.Tensor, risk: torch.Tensor) -> None:
        acts = self._actions(rows, step, risk, "raise")
        grow_rows(self.cache, rows, [a["slots_after"] for a in acts])
        for a in acts:
            a.pop("row")
            self.events.append({**a, "seconds": 0.0})

    def _mark_refill(self, rows: list[int], step: torch.Tensor, risk: torch.Tensor) -> None:
        if not self.refiller:
            raise ConfigError(
                "guard action 'refill' re-prefills between steps from generate's logits processors; pass "
                "logits_processor=[guard.refill(model)] to generate"
            )
        self.pending += self._actions(rows, step, risk, "refill")

    # -- rows and tokens ---------------------------------------------------------------------------
    def request_ids(self) -> list[int]:
        ids = self.cache.request_ids
        if ids is not None:
            return list(ids)
        if self.cache.layers[0].keys is None and self._prompt_counts is not None:  # at the prefill, before the slots
            return list(range(len(self._prompt_counts)))
        return list(range(self.cache.batch_size))

    def move_rows(self, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A row reorder, expansion or selection of the cache, applied to the per-row state."""
        for name in ("ema", "prompt_len", "evicted", "raised", "cues", "prefill", "canary"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, move(t))

    def set_cues(self, cues: torch.Tensor) -> None:
        """``cues (b, 2)`` the ``structure`` and ``refer`` cues of each row, for the next steps."""
        self.cues = cues.float() if self.cues is None else cues.to(self.cues.device, self.cues.dtype)

    # -- what the log gets --------------------------------------------------------------------------
    def risk_rows(self, start: int = 0) -> list[dict[str, Any]]:
        """One row per request and scored step (from the ``start``-th step scored on):
        ``request, step, risk`` and every signal."""
        out = []
        for ids, step, signals, risk in self.steps[start:]:
            for r, rid in enumerate(ids):
                row = {"request": int(rid), "step": int(step[r]), "risk": float(risk[r])}
                row.update({name: float(signals[r, i]) for i, name in enumerate(SIGNALS)})
                out.append(row)
        return out

    def event_rows(self) -> list[dict[str, Any]]:
        """The actions taken: ``request, step, risk, action, slots_before, slots_after, evicted,
        seconds`` (the recompute of a refill; 0 for a raise)."""
        return [dict(e) for e in self.events]


# -- raising a row's slot count ---------------------------------------------------------------------


def grow_rows(cache: H2OCache, rows: list[int], slots: list[int]) -> None:
    """Grow the slot count of batch ``rows`` of ``cache`` to ``slots`` per KV set, for the rest
    of the generation (DESIGN.md §18.2).

    The new slots are heavy slots (the recent window and the sink stay as they are); they start
    empty at the end of each row's storage, so the next steps fill them before anything is
    evicted again, as an H2O run whose slot count changed at this step. Positions evicted
    before stay evicted. Call it between decode steps. A listener's ``on_state`` hears a
    ``raise`` event (rows, requests, slots) first.
    """
    first = cache.layers[0]
    if first.budget is None:
        raise ConfigError("grow_rows: the H2O cache has not seen a prompt yet")
    old_caps = cache.row_capacity(first.budget)  # (b,)
    requests = [cache.request_ids[r] for r in rows] if cache.request_ids is not None else list(rows)
    # a listener first hears the rows as they were (the recorder writes its pending steps)
    cache._notify({"event": "raise", "rows": list(rows), "requests": requests, "slots": [int(n) for n in slots]})
    index = first.budget.clone()
    for r, n in zip(rows, slots):
        old = cache.budgets[int(index[r])]
        if n < old.capacity:
            raise ConfigError(f"grow_rows: row {r} holds {old.capacity} slots; a raise to {n} would shrink it")
        new = dataclasses.replace(old, heavy=old.heavy + n - old.capacity)
        if new not in cache.budgets:
            cache.budgets.append(new)
        index[r] = cache.budgets.index(new)
        if cache.request_configs is not None:
            cfg = cache.request_configs[r]
            cache.request_configs[r] = dataclasses.replace(cfg, heavy=int(cfg.heavy) + n - old.capacity)
    cache._rows = index.cpu()
    width = max(a.capacity for a in (cache.budgets[i] for i in set(index.tolist())))
    for layer in cache.layers:
        fill = old_caps.clone() if layer.fill is None else layer.fill.clone()
        layer.budget = index.to(layer.budget.device)
        extra = width - layer.keys.shape[2]
        if extra > 0:
            pad = {"keys": 0.0, "values": 0.0, "scores": 0.0, "history": 0, "positions": eviction.EMPTY}
            for name, value in pad.items():
                t = getattr(layer, name)
                if t is None:
                    continue
                shape = list(t.shape)
                shape[2] = extra
                setattr(layer, name, torch.cat([t, t.new_full(shape, value)], 2))
        layer.fill = fill.to(layer.keys.device)
        layer._groups = layer._row_budgets = None


def raise_prompt(
    cache: H2OCache, rows: list[int], slots: list[int], pinned: list[tuple[int, ...]] | None = None
) -> None:
    """Give batch ``rows`` of ``cache`` ``slots`` per KV set before their prompts are laid into
    slots: from the prefill on, each such row is an H2O run at its new slot count (the extra
    slots are heavy slots), with ``pinned[i]`` (when given) its pinned positions (DESIGN.md §2.11, taken
    out of those slots). A listener's ``on_state`` hears a ``raise`` event first, as with
    :func:`grow_rows`."""
    from .config import pin

    requests = [cache.request_ids[r] for r in rows] if cache.request_ids is not None else list(rows)
    cache._notify({"event": "raise", "rows": list(rows), "requests": requests, "slots": [int(n) for n in slots]})
    index = cache._rows.clone()
    for i, (r, n) in enumerate(zip(rows, slots)):
        old = cache.budgets[int(index[r])]
        cfg = cache.request_configs[r]
        cfg = dataclasses.replace(cfg, heavy=int(cfg.heavy) + n - old.capacity)
        if pinned is not None and pinned[i]:
            cfg = pin(cfg, pinned[i])
        new = ops.PolicyArgs(cfg.policy, *cfg.split, cfg.gqa, cfg.seed, cfg.pinned)
        if new not in cache.budgets:
            cache.budgets.append(new)
        index[r] = cache.budgets.index(new)
        cache.request_configs[r] = cfg
    cache._rows = index
    for layer in cache.layers:
        if layer.budget is not None:
            layer.budget = index.to(layer.budget.device)
        layer._groups = layer._row_budgets = None


# -- token cues -------------------------------------------------------------------------------------


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


# -- the scope --------------------------------------------------------------------------------------


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


_ACTIVE: contextvars.ContextVar[Guard | None] = contextvars.ContextVar("h2o_lens_guard", default=None)


@contextlib.contextmanager
def guarded(config: GuardConfig | None = None) -> Iterator[Guard]:
    """Build the H2O caches made inside the block with :class:`GuardLayer` (DESIGN.md §18).

    Combine it with :func:`h2o_lens.h2o` (either order). On exit, exceptions included, new
    caches are plain again.
    """
    guard = Guard(config or GuardConfig())
    token = _ACTIVE.set(guard)
    try:
        with use_layer_class(GuardLayer):
            yield guard
    finally:
        _ACTIVE.reset(token)
