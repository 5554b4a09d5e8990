"""The cold tier: evicted K/V kept in a cold store and recalled into a window of the hot slots (DESIGN.md §2.13).

:class:`ColdExtension` is an extension of the H2O cache (:mod:`h2o_lens.extension`, DESIGN.md §1.1),
attached by the cache when its config has ``cold=ColdTier(...)``. The policy runs on ``B - r``
slots (the window's ``r`` slots come out of ``heavy`` first, then ``recent``); each layer's storage
gets ``r`` more slots past the rows' capacity (:func:`~h2o_lens.extension.widen`), which the decode
step attends to and never evicts into or from. At the prefill and at every decode step the
evicted key and value go to the layer's :class:`~h2o_lens.cold_store.ColdStore` with their
position and score. Before every ``every``-th decode step the window is refilled: the previous
occupants' scores go back to their cold records, and the ``r`` cold entries the step's queries
attend to most (:func:`select`) are written into the window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import eviction
from .cold_config import PAGE
from .cold_store import ColdStore
from .errors import ConfigError
from .extension import CacheExtension, StepNeeds, widen, write_slots

__all__ = ["ColdExtension", "select", "rank", "top", "cold_summary"]


def rank(qg: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, gqa: str) -> torch.Tensor:
    """The selection value of each entry: ``qg (b, Hs, G, d)`` the step's scaled queries of each
    KV set's group, ``keys (b, Hs, M, d)``, ``valid (b, Hs, M)``. Each query head's softmax over the
    valid entries, aggregated over the group as the policy's (DESIGN.md §2.6); ``-inf`` where not valid."""
    logits = torch.matmul(qg, keys.transpose(-1, -2))  # (b, Hs, G, M)
    return _aggregate_softmax(logits, valid, gqa)


def _aggregate_softmax(logits: torch.Tensor, valid: torch.Tensor, gqa: str) -> torch.Tensor:
    logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros((), dtype=top.dtype))
    e = (logits - top).exp()
    w = e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)
    agg = eviction.aggregate_group(w, "sum" if gqa == "none" else gqa, 2)  # (b, Hs, M)
    return agg.masked_fill(~valid, float("-inf"))


def top(value: torch.Tensor, order_key: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """``(b, Hs, n)`` indices of the ``n`` largest ``value`` among ``valid``, a tie taking the larger
    ``order_key`` (the newer position, the later page); -1 where fewer are valid."""
    newer = order_key.argsort(dim=-1, descending=True, stable=True)
    ranked = value.gather(-1, newer).argsort(dim=-1, descending=True, stable=True)
    idx = newer.gather(-1, ranked)[..., :n]
    ok = valid.gather(-1, idx)
    idx = torch.where(ok, idx, -1)
    if idx.shape[-1] < n:
        idx = torch.nn.functional.pad(idx, (0, n - idx.shape[-1]), value=-1)
    return idx


def page_bounds(qg: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of each query head's q·k over a page: Σ_j max(q_j·min_j, q_j·max_j);
    ``qg (b, Hs, G, d)``, ``low, high (b, Hs, P, d)`` → ``(b, Hs, G, P)``."""
    q = qg[:, :, :, None, :]  # (b, Hs, G, 1, d)
    return torch.maximum(q * low[:, :, None], q * high[:, :, None]).sum(-1)


def select(store: ColdStore, qg: torch.Tensor, gqa: str, recall: int, how: str, scan: int) -> torch.Tensor:
    """The records of ``store`` the window holds next, ``(b, Hs, recall)`` (-1: none), best first.

    ``exact``: :func:`rank` over every cold record. ``pages``: the ``scan`` pages of the best
    aggregated softmax of their :func:`page_bounds` (a tie takes the later page), then :func:`rank`
    over the records of those pages only. Either way the ``recall`` best, a tie taking the newer
    position.
    """
    valid = store.valid
    qg = qg.to("cpu", store.acc)
    if how == "exact" or int(store.count.max()) <= scan * PAGE:  # every page would be read
        keys = store.keys().to(store.acc)
        return top(rank(qg, keys, valid, gqa), store.positions, valid, recall)
    pages = valid.shape[2] // PAGE
    live = valid.unflatten(2, (pages, PAGE)).any(-1)  # (b, Hs, P)
    bound = _aggregate_softmax(page_bounds(qg, store.low, store.high), live, gqa)
    order = torch.arange(pages).expand_as(live)
    chosen = top(bound, order, live, scan)  # (b, Hs, scan)
    rec = (chosen.clamp(min=0)[..., None] * PAGE + torch.arange(PAGE)).flatten(-2)  # (b, Hs, scan·PAGE)
    ok = (chosen >= 0).repeat_interleave(PAGE, -1) & valid.gather(-1, rec)
    keys = store.keys(torch.where(ok, rec, -1)).to(store.acc)
    best = top(rank(qg, keys, ok, gqa), store.positions.gather(-1, rec), ok, recall)
    return torch.where(best >= 0, rec.gather(-1, best.clamp(min=0)), -1)


@dataclass
class _Layer:
    """A layer's cold state: its store, the window's first slot and records, the stash of the prompt."""

    store: ColdStore | None = None
    start: int = 0
    window: torch.Tensor | None = None  # (b, Hs, r) records in the window, -1 empty
    steps: int = 0
    prompt: tuple | None = None  # (key, value) of the prompt, until it is laid
    new: tuple | None = None  # (key, value) of the step's new token
    log: list = field(default_factory=list)


class ColdExtension(CacheExtension):
    """The cold tier of one H2O cache (module docstring); its config is ``cache.config.cold``.

    ``log`` of each layer: per refill, ``(step (b,), positions (b, Hs, r), scores (b, Hs, r),
    fresh (b, Hs, r))`` (-1 positions: an empty window slot; ``fresh``: brought in by this refill).
    """

    #: the prompt forward is the same with or without a cold tier: it keeps what the keep rule
    #: drops and acts at the decode steps, so a prompt forward may be reused (DESIGN.md §12.5)
    observer = True

    def __init__(self) -> None:
        self.layers: dict[int, _Layer] = {}

    def _state(self, layer: Any) -> _Layer:
        return self.layers.setdefault(layer.layer_idx, _Layer())

    def step_needs(self, layer: Any) -> StepNeeds:
        return StepNeeds(candidates=True, journal=True)

    def prompt_chosen(self, layer: Any, choice: Any) -> bool:
        if choice.draft:
            raise ConfigError("the cold tier does not support verification segments (speculative decoding)")
        self._state(layer).prompt = (choice.key, choice.value)
        return False

    def on_prefill(self, layer: Any, event: Any) -> None:
        st = self._state(layer)
        tier = layer.owner.config.cold
        key, value = st.prompt
        st.prompt = None
        if st.store is not None:
            st.store.close()
        b, hs, _, d = key.shape
        st.store = ColdStore(
            tier.store,
            b,
            hs,
            d,
            key.dtype,
            pin=key.is_cuda,
            directory=tier.directory,
            name=f"cold-L{layer.layer_idx}-{id(self):x}",
        )
        gone = torch.where((event.positions >= 0) & ~event.keep, event.positions, -1)
        st.store.append(key, value, event.scores, gone)
        st.start = widen(layer, tier.recall)
        st.window = torch.full((b, hs, tier.recall), -1, dtype=torch.int64)
        st.steps, st.log = 0, []

    def before_step(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        st = self.layers.get(layer.layer_idx)
        if st is None or st.store is None:
            return
        st.new = (key, value)
        tier = layer.owner.config.cold
        due = st.steps % tier.every == 0
        st.steps += 1
        if due:
            self._refill(layer, st, query, tier)

    def _refill(self, layer: Any, st: _Layer, query: torch.Tensor, tier: Any) -> None:
        r, start, store = tier.recall, st.start, st.store
        old = st.window
        store.write_scores(old, layer.scores[:, :, start : start + r])  # the occupants go back
        hs = store.hs
        qg = query.unflatten(1, (hs, query.shape[1] // hs)) * layer.scaling  # (b, Hs, G, d)
        best = select(store, qg, layer.owner.config.gqa, r, tier.select, tier.pages_scanned)
        pos = torch.where(best >= 0, store.positions.gather(-1, best.clamp(min=0)), -1)
        order = torch.where(pos >= 0, pos, torch.iinfo(torch.int64).max).argsort(-1)  # by position
        new = best.gather(-1, order)
        fresh = (new >= 0) & ~(new[..., None] == old[..., None, :]).any(-1)
        k, v = store.entries(new, fresh)
        score = torch.where(new >= 0, store.scores.gather(-1, new.clamp(min=0)), 0.0)
        pos = torch.where(new >= 0, store.positions.gather(-1, new.clamp(min=0)), -1)
        dev = layer.keys.device
        write_slots(layer, start, k.to(dev), v.to(dev), score.to(dev), pos.to(dev))
        st.window = new
        st.log.append((layer.next_pos.detach().to("cpu").clone(), pos, score.clone(), fresh))

    def step_taken(self, layer: Any, step: Any) -> None:
        st = self.layers.get(layer.layer_idx)
        if st is None or st.store is None:
            return
        if step.in_segment:
            raise ConfigError("the cold tier does not support verification segments (speculative decoding)")
        res = step.result
        width = layer.keys.shape[2]
        self_victim = (res.slot >= width)[..., None]  # the new token was its own victim
        key, value = st.new
        gone_key = torch.where(self_victim, key, res.old_key)
        gone_value = torch.where(self_victim, value, res.old_value)
        slot = res.slot[..., None]
        score = res.cand_scores.gather(-1, slot)
        pos = torch.where(res.evicts[..., None], res.cand_positions.gather(-1, slot), -1)
        st.store.append(gone_key[:, :, None], gone_value[:, :, None], score, pos)
        st.new = None

    def rows_moved(self, layer: Any, move, kind: str) -> None:
        st = self.layers.get(layer.layer_idx)
        if st is None or st.store is None:
            return
        st.store.move_rows(move)
        st.window = move(st.window)

    def slots_changed(self, cache: Any, rows: list[int], slots: list[int], kind: str) -> None:
        raise ConfigError(f"the cold tier cannot be combined with the guard's {kind} (the recall window's slots move)")

    def reset(self, layer: Any) -> None:
        st = self.layers.pop(layer.layer_idx, None)
        if st is not None and st.store is not None:
            st.store.close()

    def close(self) -> None:
        """Drop every layer's store (a disk store's files)."""
        for st in self.layers.values():
            if st.store is not None:
                st.store.close()


def cold_summary(cache: Any) -> dict[str, int] | None:
    """A cache's cold tier in numbers: ``written`` and ``read`` bytes of K/V, ``evicted`` entries
    kept cold, ``recalled`` entries brought into a window; None without a cold tier."""
    ext = next((e for e in cache.extensions if isinstance(e, ColdExtension)), None)
    if ext is None:
        return None
    out = {"written": 0, "read": 0, "evicted": 0, "recalled": 0}
    for st in ext.layers.values():
        if st.store is not None:
            out["written"] += st.store.written
            out["read"] += st.store.read_bytes
            out["evicted"] += int(st.store.count.sum())
        out["recalled"] += sum(int(f.sum()) for *_, f in st.log)
    return out
