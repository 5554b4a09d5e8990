"""The guard of one cache: its per-row state, risk log and actions, on the cache's extension point (DESIGN.md §18).

:class:`GuardState` is a :class:`~h2o_lens.extension.CacheExtension`; :func:`h2o_lens.guard.guarded`
gives every H2O cache built in its block one. :class:`Reservoir` is one layer's sample of evicted keys.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import ops
from .errors import ConfigError
from .extension import NOTHING, CacheExtension, PromptChoice, StepEvent, StepNeeds
from .guard_actions import grow_rows, raise_prompt
from .guard_config import LAYER_SIGNALS, RESCUE_POOL, SIGNALS, GuardConfig
from .guard_signals import combine, dropped_share, head_signal, layer_signals, prefill_lost

__all__ = ["GuardState", "Reservoir"]


@dataclass
class Reservoir:
    """One layer's reservoir sample (Algorithm R) of the keys its steps evicted: ``keys (b, Hs, R, d)``,
    ``held (b, Hs)`` keys held, ``evicted (b, Hs)`` keys evicted so far."""

    keys: torch.Tensor
    held: torch.Tensor
    evicted: torch.Tensor
    generator: torch.Generator

    @classmethod
    def empty(cls, like: torch.Tensor, share: float, capacity: int, seed: int, layer: int) -> Reservoir:
        """``max(1, ⌈share · capacity⌉)`` keys per row and KV set, shaped after ``like (b, Hs, d)``."""
        b, hs, d = like.shape
        r = max(1, math.ceil(share * capacity))
        gen = torch.Generator(device=like.device)
        gen.manual_seed(seed * 1_000_003 + layer)
        zeros = torch.zeros(b, hs, dtype=torch.int64, device=like.device)
        return cls(like.new_zeros(b, hs, r, d), zeros, zeros.clone(), gen)

    def sample(self, old_key: torch.Tensor, evicts: torch.Tensor) -> None:
        """Take the keys ``old_key (b, Hs, d)`` evicted where ``evicts`` into the sample."""
        b, hs, d = old_key.shape
        r = self.keys.shape[2]
        n = self.evicted
        u = torch.rand(b, hs, generator=self.generator, device=old_key.device)
        draw = (u * (n + 1).to(u.dtype)).to(torch.int64).clamp(max=n)  # uniform in [0, n]
        at = torch.where(n < r, n, draw)  # the slot that takes the key, or >= r: dropped
        take = evicts & (at < r)
        idx = at.clamp(max=r - 1)[..., None, None].expand(b, hs, 1, d)
        cur = self.keys.gather(2, idx)[:, :, 0]
        self.keys.scatter_(2, idx, torch.where(take[..., None], old_key, cur)[:, :, None])
        self.held = torch.where(evicts, (self.held + 1).clamp(max=r), self.held)
        self.evicted = self.evicted + evicts.to(torch.int64)

    def move(self, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Follow a row reorder, expansion or selection of the cache."""
        self.keys, self.held, self.evicted = move(self.keys), move(self.held), move(self.evicted)


@dataclass
class GuardState(CacheExtension):
    """The guard of one cache: per-row state, the per-step risk log, the events and the cost.

    It is the cache's :class:`~h2o_lens.extension.CacheExtension` (DESIGN.md §1.1): the decode
    steps of the layers that compute signals (:attr:`GuardConfig.stride`) give it their candidate
    set and weights (:meth:`step_needs`, :meth:`step_taken`); the prefill's keep rule gives it the
    ``prefill`` signal, and under ``raise`` or ``refill`` the prompts wait for its decision
    (:meth:`prompt_chosen`); row moves carry its per-row state along (:meth:`rows_moved`).
    """

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
    #: layer -> its reservoir of sampled evicted keys (:class:`Reservoir`), once one was evicted
    reservoirs: dict[int, Reservoir] = field(default_factory=dict)
    #: whether the last layer's prefill decides for every layer (the ``prefill`` signal is read)
    _deciding: bool = False

    # -- the extension events (h2o_lens.extension) -------------------------------------------------
    def scores_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` computes signals (:attr:`GuardConfig.stride`)."""
        return layer_idx % self.config.stride == 0

    def step_needs(self, layer: Any) -> StepNeeds:
        # a layer that computes signals reads the step's weights and candidates (the reservoir
        # samples the overwritten key); the others keep the backend's step
        if not self.scores_layer(layer.layer_idx):
            return NOTHING
        return StepNeeds(candidates=True, journal=self.config.reservoir > 0)

    def step_taken(self, layer: Any, step: StepEvent) -> None:
        if step.in_segment:  # a verification segment is not scored
            return
        if self.scores_layer(layer.layer_idx):
            self.observe(layer, step.query, step.key, step.scaling, step.result)
        elif layer.layer_idx == len(self.cache.layers) - 1:
            self.close_step(layer)

    def prompt_chosen(self, layer: Any, choice: PromptChoice) -> bool:
        """The ``prefill`` signal of one layer, read before its prompt is evicted (DESIGN.md §18.1).

        Under ``raise`` or ``refill`` the prompt's slots wait until every layer has given its
        signal: the rows whose prefill risk reaches the threshold get their target slot count
        before anything of their prompt is evicted (:meth:`decide_prefill`); under ``canary`` the
        canary rows get theirs. In assisted decoding's first forward (a draft follows the prompt)
        the prefill's risk is logged, not acted on."""
        cfg = self.config
        if choice.scaling is None or (cfg.tail == 0 and cfg.action != "canary"):
            self._deciding = False
            return False
        t0 = time.perf_counter()
        query, key, keep, positions = choice.query, choice.key, choice.keep, choice.positions
        tail = None
        lost = torch.zeros(key.shape[0], keep.shape[1])
        if cfg.tail:
            r = min(cfg.tail, query.shape[2])
            tail = ops.prefill_rows(query, key, choice.valid, choice.scaling, self.cache.config.gqa, r)  # (b,Hs,R,P)
            lost = prefill_lost(tail[:, :, -cfg.signal_rows :], keep, positions)
        self.add_prefill(layer, lost, choice.count, tail, positions)
        self.seconds += time.perf_counter() - t0
        self.act_at_prefill = cfg.action != "none" and not choice.draft
        self._deciding = True
        if self.act_at_prefill and layer.layer_idx == len(self.cache.layers) - 1:
            self.decide_prefill()  # lays every layer's prompt, this one's included
        return self.act_at_prefill

    def on_prefill(self, layer: Any, event: Any) -> None:
        # a prompt laid at once: after the last layer's (and the listener's event), the risk is logged
        if self._deciding and not self.act_at_prefill and layer.layer_idx == len(self.cache.layers) - 1:
            self.decide_prefill()

    def rows_moved(self, layer: Any, move: Callable[[torch.Tensor], torch.Tensor], kind: str) -> None:
        res = self.reservoirs.get(layer.layer_idx)
        if res is not None:
            res.move(move)
        if layer.layer_idx == 0:
            self.move_rows(move)

    def reset(self, layer: Any) -> None:
        self.reservoirs.pop(layer.layer_idx, None)

    def slots_changed(self, cache: Any, rows: list[int], slots: list[int], kind: str) -> None:
        if kind == "refill":  # a refilled row's reservoir starts over
            for res in self.reservoirs.values():
                res.held[rows] = 0
                res.evicted[rows] = 0

    # -- at the prefill -----------------------------------------------------------------------------
    def add_prefill(
        self,
        layer: Any,
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
        if self.act_at_prefill and cfg.acting == "recall":
            rows = torch.nonzero((risk >= cfg.threshold) & ~self.raised)[:, 0].tolist()
            if rows:  # the windows open before the prompts are laid (nothing is evicted yet)
                acted += self._recall(rows, step, risk)
        elif self.act_at_prefill and cfg.acting != "none":
            hit = (risk >= cfg.threshold) & ~self.raised  # a canary row is raised already
            rows = torch.nonzero(hit)[:, 0].tolist()
            if rows:
                acts = self._actions(rows, step, risk, cfg.acting)  # nothing evicted yet: no recompute
                pins = [self._rescue_positions(r, a["slots_after"] - a["slots_before"]) for r, a in zip(rows, acts)]
                raise_prompt(cache, rows, [a["slots_after"] for a in acts], pins)
                for a in acts:
                    acted.append(a.pop("row"))
                    self.events.append({**a, "seconds": 0.0})
        for layer in cache.layers:  # the prompts held back, at the budgets decided (a no-op without)
            layer.lay_prompt()
        self._deciding = False
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
        width = 2 * RESCUE_POOL + 1
        pooled = torch.nn.functional.max_pool1d(mass[None, None], width, stride=1, padding=RESCUE_POOL)[0, 0]
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
    def observe(self, layer: Any, q: torch.Tensor, k: torch.Tensor, scaling: float, res: Any) -> None:
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
            layer.protected(),
        )  # (b, Hs, 4)
        dropped = torch.zeros(b, hs, device=four.device)
        if self.config.reservoir > 0:
            qg = q.reshape(b, hs, -1, q.shape[-1]) * scaling
            pool = self.reservoirs.get(layer.layer_idx)
            if pool is not None:
                dropped = dropped_share(qg, k, res.weights[..., -1], pool.keys, pool.held, pool.evicted)
            gone = res.evicts & (res.slot < layer.keys.shape[2])  # a key left its slot
            if bool(gone.any()):
                if pool is None:
                    pool = self.reservoirs[layer.layer_idx] = Reservoir.empty(
                        res.old_key, self.config.reservoir, layer.keys.shape[2], self.config.seed, layer.layer_idx
                    )
                pool.sample(res.old_key, gone)
        per = torch.cat([four, dropped[..., None].to(four.dtype)], -1).mean(1)  # (b, 5)
        self._acc += per.to(self._acc.dtype)
        self.evicted += res.evicts.to(self.evicted.dtype).mean(1) / self._scored_layers()
        if layer.layer_idx == len(cache.layers) - 1:
            self._finish_step(step)
        self.seconds += time.perf_counter() - t0

    def close_step(self, layer: Any) -> None:
        """Finish the step at the last layer when that layer computes no signals."""
        if self._acc is None:
            return
        t0 = time.perf_counter()
        self._finish_step(layer.next_pos - 1)
        self.seconds += time.perf_counter() - t0

    def _scored_layers(self) -> int:
        return -(-len(self.cache.layers) // self.config.stride)

    def _start_step(self, layer: Any, step: torch.Tensor) -> None:
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
        self._acc = torch.zeros(b, len(LAYER_SIGNALS), device=dev)

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
                act = {"raise": self._raise, "recall": self._recall}.get(cfg.acting, self._mark_refill)
                act(rows, step, risk)

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
                    "slots_after": self._after(action, int(caps[r]), int(self.prompt_len[r])),
                    "evicted": float(self.evicted[r]),
                    "row": r,
                }
            )
        return out

    def _after(self, action: str, capacity: int, prompt_len: int) -> int:
        """A row's slots per KV set after ``action``: the raise's target, or its slots and the recall window."""
        if action == "recall":
            return capacity + self.config.window(prompt_len)
        return self.config.target(capacity, prompt_len)

    def _recall(self, rows: list[int], step: torch.Tensor, risk: torch.Tensor) -> list[int]:
        """Open the recall windows of ``rows`` (DESIGN.md §18.2): the guard's cold tier (attached by
        :func:`~h2o_lens.guard.guarded`) brings cold entries into them from the next decode step on.
        Returns the rows acted on."""
        from .cold import cold_extension

        tier = cold_extension(self.cache)
        if tier is None or not tier.gated:  # pragma: no cover - guarded attaches it
            raise ConfigError("guard action 'recall' needs the guard's cold tier; build the cache inside guarded()")
        acts = self._actions(rows, step, risk, "recall")
        tier.open_rows(rows, [a["slots_after"] - a["slots_before"] for a in acts], len(self.raised))
        out = []
        for a in acts:
            out.append(a.pop("row"))
            self.events.append({**a, "seconds": 0.0})
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
