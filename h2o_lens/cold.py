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

A gated tier (``ColdExtension(tier, gated=True)``, the guard's ``recall`` action, DESIGN.md §18.2)
is no part of the config's budget: every eviction is stored, but a row's window is closed (no slot,
nothing attended, nothing read) until :meth:`ColdExtension.open_rows` opens it with its own number of
slots, added past the rows' capacity; from the next decode step on it is refilled as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import eviction
from .cold_config import PAGE
from .cold_store import ColdStore
from .errors import ConfigError
from .extension import CacheExtension, StepNeeds, widen, write_window

__all__ = ["ColdExtension", "select", "rank", "top", "next_window", "cold_summary", "cold_extension"]

_IN_PAGE = torch.arange(PAGE)  # a record's place in its page
_ARANGE = torch.arange(4096)  # slot numbers of a window


def rank(qg: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None, gqa: str) -> torch.Tensor:
    """The selection value of each entry: ``qg (b, Hs, G, d)`` the step's scaled queries of each
    KV set's group, ``keys (b, Hs, M, d)``, ``valid (b, Hs, M)`` (None: all). Each query head's softmax over the
    valid entries, aggregated over the group as the policy's (DESIGN.md §2.6); ``-inf`` where not valid."""
    logits = torch.matmul(qg, keys.transpose(-1, -2))  # (b, Hs, G, M)
    return _aggregate_softmax(logits, valid, gqa)


def _aggregate_softmax(logits: torch.Tensor, valid: torch.Tensor | None, gqa: str) -> torch.Tensor:
    mode = "sum" if gqa == "none" else gqa
    if valid is None:  # every entry valid: no masks
        return eviction.aggregate_group(torch.softmax(logits, -1), mode, 2)
    invalid = ~valid
    w = torch.softmax(logits.masked_fill(invalid[:, :, None], float("-inf")), -1)  # (a row of none: NaN)
    return eviction.aggregate_group(w, mode, 2).masked_fill_(invalid, float("-inf"))  # (b, Hs, M)


def top(value: torch.Tensor, order_key, valid: torch.Tensor | None, n: int) -> torch.Tensor:
    """``(b, Hs, n)`` indices of the ``n`` largest ``value`` among ``valid`` (None: all), a tie
    taking the larger ``order_key`` (the newer position, the later page; a callable giving it is
    called only when a tie decides); -1 where fewer are valid. The order of the indices is not part
    of the result."""
    m = value.shape[-1]
    if 0 < n < m:  # one partial selection; a tie across its boundary (or too few valid) takes the sort below
        best, idx = value.topk(n, dim=-1, sorted=False)
        edge = best.amin(-1, keepdim=True)  # an invalid entry's -inf at the edge counts every entry
        if int((value >= edge).sum()) == n * value[..., 0].numel():
            return idx
    order_key = order_key() if callable(order_key) else order_key
    newer = order_key.argsort(dim=-1, descending=True, stable=True)
    ranked = value.gather(-1, newer).argsort(dim=-1, descending=True, stable=True)
    idx = newer.gather(-1, ranked)[..., :n]
    if valid is not None:
        idx = torch.where(valid.gather(-1, idx), idx, -1)
    if idx.shape[-1] < n:
        idx = torch.nn.functional.pad(idx, (0, n - idx.shape[-1]), value=-1)
    return idx


def page_bounds(qg: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of each query head's q·k over a page: Σ_j max(q_j·min_j, q_j·max_j);
    ``qg (b, Hs, G, d)``, ``low, high (b, Hs, P, d)`` → ``(b, Hs, G, P)``."""
    up = qg.clamp(min=0)  # q_j > 0 takes max_j, q_j < 0 takes min_j
    return torch.matmul(up, high.transpose(-1, -2)) + torch.matmul(qg - up, low.transpose(-1, -2))


def select(store: ColdStore, qg: torch.Tensor, gqa: str, recall: int, how: str, scan: int) -> torch.Tensor:
    """The records of ``store`` the window holds next, ``(b, Hs, recall)`` (-1: none), in no set order.

    ``exact``: :func:`rank` over every cold record. ``pages``: the ``scan`` pages of the best
    aggregated softmax of their :func:`page_bounds` (a tie takes the later page), then :func:`rank`
    over the records of those pages only. Either way the ``recall`` best, a tie taking the newer
    position.
    """
    qg = qg.to("cpu", store.acc)
    n, least = store.most, store.least
    if how == "exact" or n <= scan * PAGE:  # every page would be read
        valid = store.valid[..., :n] if least < n else None  # records are dense: all valid when counts agree
        keys = store.keys().to(store.acc)
        return top(rank(qg, keys, valid, gqa), store.positions[..., :n], valid, recall)
    if not store.summaries:
        raise ValueError("select(how='pages') needs a store that keeps its page summaries")
    pages = -(-n // PAGE)
    live = torch.arange(pages) * PAGE < store.count[..., None] if least < n else None  # (b, Hs, P)
    bound = _aggregate_softmax(page_bounds(qg, store.low[:, :, :pages], store.high[:, :, :pages]), live, gqa)
    chosen = top(bound, lambda: torch.arange(pages).expand_as(bound), live, scan)  # -1: a row with fewer pages
    if live is not None:  # (with every row's pages live, every chosen page is one)
        chosen_ok, chosen = (chosen >= 0).repeat_interleave(PAGE, -1), chosen.clamp(min=0)
    rec = (chosen[..., None] * PAGE + _IN_PAGE).flatten(-2)  # (b, Hs, scan·PAGE)
    ok = rec < store.count[..., None]
    if live is not None:
        ok &= chosen_ok
    records = int(ok.sum())
    keys = store.page_keys(chosen, records).to(store.acc)
    ok = None if records == ok.numel() else ok
    best = top(rank(qg, keys, ok, gqa), lambda: store.positions.gather(-1, rec), ok, recall)
    if live is None and (scan - 1) * PAGE + 1 >= recall:  # every row read >= recall records: no -1
        return rec.gather(-1, best)
    return rec.gather(-1, best.clamp(min=0)).masked_fill_(best < 0, -1)


def _member(values: np.ndarray, among: np.ndarray) -> np.ndarray:
    """Whether each of ``values`` is one of ``among`` (one sort and one binary search)."""
    ordered = np.sort(among, axis=None)
    at = np.minimum(np.searchsorted(ordered, values), ordered.size - 1)
    return ordered[at] == values


def next_window(old: np.ndarray, best: np.ndarray, positions: np.ndarray, scores: np.ndarray):
    """The window after a refill, per row (one request's KV set) of ``old, best (R, r)``: the
    records in the window and the ones selected (-1: none), ``positions, scores (R, N)`` the
    store's. An occupant that stays keeps its slot; the selected records not in the window, in
    ascending position order, take the freed slots in ascending slot order. Returns ``(new,
    filled, score, position)``, each ``(R, r)``: the records per slot, the slots given a new
    entry, and each slot's score and position (0 and -1 where empty). Plain numpy: the arrays are
    small and these are many small steps."""
    rows, r = old.shape
    n = positions.shape[1]
    base = np.arange(rows)[:, None]
    offset = base * (n + 1)  # a row's records apart from the next's
    kept = (old >= 0) & _member(old + offset, best + offset)
    fresh = (best >= 0) & ~_member(best + offset, old + offset)
    flat_pos, flat_score = positions.reshape(-1), scores.reshape(-1)
    key = np.where(fresh, flat_pos[np.maximum(best, 0) + base * n], np.iinfo(np.int64).max)
    order = np.argsort(key, axis=1, kind="stable")
    incoming = np.where(fresh[base, order], best[base, order], -1)
    slots = np.argsort(kept, axis=1, kind="stable")  # the free slots first, in slot order
    new = np.where(kept, old, -1)
    take = np.arange(r)[None, :] < (~kept).sum(1, keepdims=True)
    new[np.nonzero(take)[0], slots[take]] = incoming[take]
    empty = new < 0
    at = np.maximum(new, 0) + base * n
    score = np.where(empty, 0, flat_score[at]).astype(scores.dtype)
    position = np.where(empty, -1, flat_pos[at])
    return new, ~kept & ~empty, score, position


def _slots(st: _Layer, n: int) -> torch.Tensor:
    """``st.slot_of`` for the window ``st.window`` and a store of ``n`` records per row, rebuilt
    when either changed since it was built."""
    rows, r = st.window.shape[0] * st.window.shape[1], st.window.shape[2]
    if st.mapped is not st.window or st.slot_of is None or st.slot_of.shape[1] != n + 1:
        window = st.window.reshape(rows, r)
        st.slot_of = torch.full((rows, n + 1), -1, dtype=torch.int64)
        st.slot_of.scatter_(1, window.masked_fill(window < 0, n), torch.arange(r).expand(rows, r))
        st.slot_of[:, n] = -1
        st.mapped = st.window
    return st.slot_of


def _swap(st: _Layer, best: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`next_window`'s ``new`` and ``filled`` for a full window and a full choice (no -1 in
    either), in torch: ``best (R, r)``, ``positions (R, N)`` the store's; updates ``st.slot_of``."""
    old = st.window.reshape(best.shape)
    rows, r = best.shape
    slot_of = _slots(st, positions.shape[1])
    at = slot_of.gather(1, best)  # the slot of each chosen record already in the window, else -1
    fresh = at < 0
    big = torch.iinfo(torch.int64).max
    key, order = positions.gather(1, best).masked_fill_(~fresh, big).sort(1)  # the incoming by position
    stays = torch.zeros(rows, r + 1, dtype=torch.bool).scatter_(1, at.masked_fill(fresh, r), True)
    free = stays[:, :r].to(torch.uint8).argsort(dim=1, stable=True)  # the freed slots first, in slot order
    new = old.scatter(1, free, torch.where(key < big, best.gather(1, order), old.gather(1, free)))
    slot_of.scatter_(1, old, -1)
    slot_of.scatter_(1, new, _ARANGE[:r].expand(rows, r) if r <= _ARANGE.numel() else torch.arange(r).expand(rows, r))
    return new, new != old


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
    owner: Any = None  # the cache
    full: bool = False  # every window slot holds an entry
    slot_of: torch.Tensor | None = None  # (b·Hs, N + 1) each record's window slot (-1: none; the last column: none)
    mapped: torch.Tensor | None = None  # the window ``slot_of`` was built from
    fused: bool = False  # the refill and append take the compiled calls (ColdExtension._fused)


class ColdExtension(CacheExtension):
    """The cold tier of one H2O cache (module docstring); its config is ``tier``, or
    ``cache.config.cold`` when not given.

    ``log`` of each layer: per refill, ``(step (b,), positions (b, Hs, r), scores (b, Hs, r),
    fresh (b, Hs, r))`` (-1 positions: an empty window slot; ``fresh``: brought in by this refill).

    ``gated``: the window is not taken out of the budget and each row's is closed until
    :meth:`open_rows` opens it (``tier.recall`` is then unused; :attr:`width` the window slots the
    layers hold, the most any open row has; :attr:`open` each row's).
    """

    #: the prompt forward is the same with or without a cold tier: it keeps what the keep rule
    #: drops and acts at the decode steps, so a prompt forward may be reused (DESIGN.md §12.5)
    observer = True

    def __init__(self, tier: Any = None, gated: bool = False) -> None:
        self.layers: dict[int, _Layer] = {}
        self.tier, self.gated = tier, gated
        self.width = 0
        self.open: torch.Tensor | None = None  # (b,) int64 window slots per row, gated only (0: closed)

    def tier_of(self, cache: Any) -> Any:
        """The :class:`~h2o_lens.cold_config.ColdTier` this extension runs (``cache`` its cache)."""
        return self.tier if self.tier is not None else cache.config.cold

    def open_rows(self, rows: list[int], slots: list[int], batch: int) -> None:
        """Open (or widen) the windows of batch ``rows`` (of ``batch``) to ``slots`` each, for the
        rest of the generation (gated only): each layer's storage grows to the widest window, and
        the window is refilled from the next decode step on. Call it between decode steps, or at
        the prefill before the prompts are laid."""
        if not self.gated:
            raise ConfigError("open_rows opens a gated cold tier's windows; this tier's window is always open")
        if self.open is None or self.open.shape[0] != batch:
            self.open = torch.zeros(batch, dtype=torch.int64)
        for r, n in zip(rows, slots):
            self.open[r] = max(int(self.open[r]), int(n))
        width = int(self.open.max())
        for idx, st in self.layers.items():
            if st.store is None or width <= st.window.shape[-1]:
                continue
            extra = width - st.window.shape[-1]
            start = widen(st.owner.layers[idx], extra)
            if st.window.shape[-1] == 0:
                st.start = start
            st.window = torch.nn.functional.pad(st.window, (0, extra), value=-1)
            st.full = False
        self.width = max(self.width, width)

    def _state(self, layer: Any) -> _Layer:
        return self.layers.setdefault(layer.layer_idx, _Layer())

    def step_needs(self, layer: Any) -> StepNeeds:
        return StepNeeds(candidates=True, journal=True)

    def prompt_chosen(self, layer: Any, choice: Any) -> bool:
        if choice.draft:
            raise ConfigError("the cold tier does not support verification segments (speculative decoding)")
        if self.gated and layer.layer_idx == 0:  # a new prompt: every window closed
            self.open, self.width = None, 0
        self._state(layer).prompt = (choice.key, choice.value)
        return False

    def on_prefill(self, layer: Any, event: Any) -> None:
        st = self._state(layer)
        tier = self.tier_of(layer.owner)
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
            summaries=tier.select == "pages",
        )
        gone = torch.where((event.positions >= 0) & ~event.keep, event.positions, -1)
        st.store.append(key, value, event.scores, gone)
        width = self.width if self.gated else tier.recall
        st.start = widen(layer, width)
        st.window = torch.full((b, hs, width), -1, dtype=torch.int64)
        st.full = False
        st.steps, st.log, st.owner = 0, [], layer.owner
        st.fused = self._fused(layer, st)

    def before_step(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        st = self.layers.get(layer.layer_idx)
        if st is None or st.store is None:
            return
        st.new = (key, value)
        tier = self.tier_of(layer.owner)
        due = st.steps % tier.every == 0
        st.steps += 1
        if due and (not self.gated or (st.window.shape[-1] and self.open is not None and bool(self.open.any()))):
            self._refill(layer, st, query, tier)  # a gated tier with every window closed reads nothing

    def _fused(self, layer: Any, st: _Layer) -> bool:
        """Whether the layer's refill and append take the compiled calls (a cache on the fused CPU
        step, DESIGN.md §2.8): an FP32-scored store on the host, no per-slot history, no gate.
        Decided once per prefill (none of it changes while the store lives)."""
        return (
            layer.owner.backend == "cpp"
            and not self.gated
            and layer.history is None
            and st.store.acc == torch.float32
            and layer.keys.device.type == "cpu"
        )

    def _refill(self, layer: Any, st: _Layer, query: torch.Tensor, tier: Any) -> None:
        if st.fused:
            from .kernels.cpu import cold_refill_cpu

            scan = tier.pages_scanned if tier.select == "pages" else None
            agg_max = layer.owner.config.gqa == "max"
            got = cold_refill_cpu(query, st.store, st.window, layer, st.start, agg_max, scan)
            new, filled, score, held, keys_read, entries = got
            st.store.count_read(keys_read, entries)
            st.window, st.full, st.slot_of, st.mapped = new, False, None, None
            st.log.append((layer.next_pos.detach().to("cpu").clone(), held, score, filled))
            return
        r, start, store = st.window.shape[-1], st.start, st.store
        old = st.window
        store.write_scores(old, layer.scores[:, :, start : start + r], every=st.full)  # the occupants go back
        hs = store.hs
        qg = query.unflatten(1, (hs, query.shape[1] // hs)) * layer.scaling  # (b, Hs, G, d)
        best = self._choose(store, qg, layer.owner.config.gqa, r, tier)
        b = best.shape[0]
        fast = st.full and int(best.min()) >= 0  # a full window and a full choice: the torch fast path
        if fast:
            new, filled = _swap(st, best.view(b * hs, r), store.positions.view(b * hs, -1))
            new, filled = new.view(b, hs, r), filled.view(b, hs, r)
            score, held = store.scores.gather(2, new), store.positions.gather(2, new)
        else:
            new, filled, score, held = (
                torch.from_numpy(a).view(b, hs, r)
                for a in next_window(
                    old.reshape(b * hs, r).numpy(),
                    best.reshape(b * hs, r).numpy(),
                    store.positions.reshape(b * hs, -1).numpy(),
                    store.scores.reshape(b * hs, -1).numpy(),
                )
            )
            st.full = bool((new >= 0).all())
        bi, hi, si = filled.nonzero(as_tuple=True)
        rows = bi * hs + hi
        records = new.view(-1)[rows * r + si]
        # the fast path changes only the filled slots (an occupant that stays has the score it
        # just wrote back and its position); the other path may also empty a slot
        write_window(layer, start, None if fast else (score, held), (rows, si), *store.entries_at(rows, records))
        st.window = new
        if fast:
            st.mapped = new  # the fast path kept st.slot_of in step with this window
        st.log.append((layer.next_pos.detach().to("cpu").clone(), held, score, filled))

    def _choose(self, store: ColdStore, qg: torch.Tensor, gqa: str, r: int, tier: Any) -> torch.Tensor:
        """:func:`select` of ``r`` records per row; gated, each open row's own window (-1 past it)
        and none for a closed row (a batch's rows share the scoring: a closed row's keys are scored
        with the open rows' and count as read, DESIGN.md §18.2)."""
        if not self.gated:
            return select(store, qg, gqa, r, tier.select, tier.pages_scanned)
        out = torch.full((store.b, store.hs, r), -1, dtype=torch.int64)
        for n in sorted(set(self.open.tolist()) - {0}):
            rows = self.open == n
            best = select(store, qg, gqa, n, tier.select, tier.pages_scanned)
            out[rows, :, :n] = best[rows]
        return out

    def step_taken(self, layer: Any, step: Any) -> None:
        st = self.layers.get(layer.layer_idx)
        if st is None or st.store is None:
            return
        if step.in_segment:
            raise ConfigError("the cold tier does not support verification segments (speculative decoding)")
        res = step.result
        width = layer.keys.shape[2]
        if st.fused:
            st.store.append_fused(res, *st.new, width)
            st.new = None
            return
        gone_key, gone_value = res.old_key, res.old_value
        if int(res.slot.max()) >= width:  # the new token was its own victim somewhere
            self_victim = (res.slot >= width)[..., None]
            key, value = st.new
            gone_key, gone_value = torch.where(self_victim, key, gone_key), torch.where(self_victim, value, gone_value)
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
        st.full = bool((st.window >= 0).all())
        if self.open is not None and layer.layer_idx == min(self.layers):
            self.open = move(self.open)

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
    ext = cold_extension(cache)
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


def cold_extension(cache: Any) -> ColdExtension | None:
    """The cache's cold tier (its config's, or a gated one the guard attached), or None."""
    return next((e for e in cache.extensions if isinstance(e, ColdExtension)), None)
