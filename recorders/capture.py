"""The recorder's per-step capture: the cache's prefill, decode and segment events turned into the
``evictions``, ``steps`` and ``spec_undone`` rows of a run (DESIGN.md §5, §14).

:class:`StepCapture` is the part of :class:`recorders.recorder.Recording` that listens to the
cache (the read-only view on the cache's extension point, :mod:`h2o_lens.extension`): decode events
stay on the device until a flush converts them in one batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from h2o_lens import eviction
from h2o_lens import plan as budget_plan
from h2o_lens.cache import DecodeEvent, PrefillEvent
from h2o_lens.speculative import SegmentEvent

from .cold_log import window_start

__all__ = ["StepCapture", "Pending"]


@dataclass
class Pending:
    """Raw decode events kept on the device until the next flush."""

    layer: list[int] = field(default_factory=list)
    events: list[DecodeEvent] = field(default_factory=list)
    alive: list[torch.Tensor | None] = field(default_factory=list)  # (b,) rows still generating
    ids: list[int] | None = None  # the request of each row when the events were raised


class StepCapture:
    """The capture half of a recording; :class:`~recorders.recorder.Recording` holds the state it
    reads (``writer``, ``session``, the pending events and the row ids)."""

    def on_prefill(self, layer: int, ev: PrefillEvent) -> None:
        self._ids = self._row_ids()
        if getattr(self, "_held", None) is None:  # the prompt's rows go out in one append per table
            self._held = {}
        recent, _ = budget_plan.set_windows(self.session.last_cache.layers[layer])  # (b, Hs)
        group = self.session.last_cache.group
        b, hs, p = ev.positions.shape
        victims = (ev.positions >= 0) & ~ev.keep  # (b, Hs, P)
        survivors = ev.keep & ev.eligible
        inf = torch.finfo(ev.scores.dtype).max
        low = torch.where(survivors, ev.scores, inf).amin(-1)  # (b, Hs)
        low_ok = survivors.any(-1)
        r, h, i = victims.nonzero(as_tuple=True)
        step = ev.step[r].to(torch.int64)
        pos = ev.positions[r, h, i].to(torch.int64)
        score = ev.scores[r, h, i]
        margin = torch.where(low_ok[r, h], low[r, h] - score, torch.full_like(score, float("nan")))
        self._append_evictions(
            r, h, step, pos, score, margin, recent[r.cpu(), h.cpu()], group, layer=layer, phase="prefill"
        )
        # one steps row per (request, set) at the last prompt position
        kept = ev.keep.sum(-1)
        heavy_pos = torch.where(survivors, ev.positions.to(torch.float32), float("nan"))
        age = ev.step[:, None].float() - torch.nanmean(heavy_pos, -1)
        rr, hh = torch.meshgrid(torch.arange(b), torch.arange(hs), indexing="ij")
        self._append_steps(
            rr.reshape(-1),
            hh.reshape(-1),
            ev.step[rr].reshape(-1).to(torch.int64),
            torch.where(low_ok, low, float("nan")).reshape(-1),
            None,
            None,
            kept.reshape(-1),
            age.reshape(-1),
            layer,
            group,
        )
        if layer == self._last_layer:
            self._release()

    def _emit(self, table: str, cols: dict[str, Any]) -> None:
        """Append ``cols`` to ``table``, or hold them while a prompt's layers are still coming."""
        held = getattr(self, "_held", None)
        if held is None:
            self.writer.append(table, cols)
        else:
            held.setdefault(table, []).append(cols)

    def _release(self) -> None:
        """Write the held prompt rows: one append per table (one conversion, not one per layer)."""
        held, self._held = getattr(self, "_held", None), None
        for table, parts in (held or {}).items():
            self.writer.append(table, _concat_columns(parts))

    def on_decode(self, layer: int, ev: DecodeEvent) -> None:
        if self._pending.ids is None:
            self._pending.ids = self._row_ids()
        self._pending.layer.append(layer)
        self._pending.events.append(ev)
        self._pending.alive.append(self._watch.alive if self._watch is not None else None)
        if (
            layer == self._last_layer
            and len(self._pending.events) >= self.flush_every * (self._last_layer + 1)
            and self.session.last_cache.layers[layer].segment is None  # its steps may still be taken back
        ):
            self.flush()

    def on_segment(self, layer: int, ev: SegmentEvent) -> None:
        """A verification segment ended (DESIGN.md §14): the steps taken back leave the pending
        events (evictions and steps hold only what stood) and go to ``spec_undone``; the last
        layer writes the segment's ``spec_segments`` rows."""
        if ev.mode == "rollback" and ev.undone:
            gone = {id(e) for e in ev.undone}
            pend = self._pending
            keep = [i for i, e in enumerate(pend.events) if id(e) not in gone]
            pend.layer = [pend.layer[i] for i in keep]
            pend.events = [pend.events[i] for i in keep]
            pend.alive = [pend.alive[i] for i in keep]
        b = ev.step.shape[0]
        ids = np.asarray(self._row_ids(), np.int32)
        if layer == 0:
            self._segment_no = np.array([self._segments.get(int(q), 0) for q in ids], np.int32)
            self._segment_undone = torch.zeros(b, dtype=torch.int64)
        if ev.undone:
            self._segment_undone = self._segment_undone + self._append_undone(layer, ev.undone, ids)
        if layer != self._last_layer:
            return
        for q in ids:
            self._segments[int(q)] = self._segments.get(int(q), 0) + 1
        self.writer.append(
            "spec_segments",
            {
                "request": ids,
                "segment": self._segment_no,
                "step": ev.step.cpu().numpy().astype(np.int64),
                "proposed": np.full(b, ev.proposed, np.int32),
                "accepted": np.full(b, ev.accepted, np.int32),
                "rolled_back": np.full(b, ev.rolled_back, np.int32),
                "undone_evictions": self._segment_undone.numpy(),
                "mode": ev.mode,
            },
        )

    def _append_undone(self, layer: int, events: list[DecodeEvent], ids: np.ndarray) -> torch.Tensor:
        """``spec_undone`` rows of one layer's rolled-back steps; returns ``(b,)`` counts."""
        cache = self.session.last_cache
        group, pinned = cache.group, _protected(events, "cpu")
        recent, sink = (t.expand(len(events), -1, -1) for t in budget_plan.set_windows(cache.layers[layer]))
        stack = lambda name: torch.stack([getattr(e, name) for e in events]).cpu()  # noqa: E731
        step = stack("step").to(torch.int64)  # (K, b)
        slot, evicts = stack("slot"), stack("evicts")  # (K, b, Hs)
        st = _stats(stack("cand_scores"), stack("cand_positions"), slot, evicts, step, recent, sink, pinned)
        k, b, hs = slot.shape
        req = torch.arange(b)[None, :, None].expand(k, b, hs)[evicts]
        cols = {
            "request": ids[req.numpy()],
            "segment": self._segment_no[req.numpy()],
            "step": step[:, :, None].expand(k, b, hs)[evicts].numpy(),
            "layer": np.full(req.numel(), layer, np.int16),
            **self._heads(torch.arange(hs)[None, None, :].expand(k, b, hs)[evicts], group),
            "position": st.victim_position[evicts].to(torch.int64).numpy(),
            "score": st.victim_score[evicts].float().numpy(),
        }
        if req.numel():
            self.writer.append("spec_undone", cols)
        return torch.bincount(req, minlength=b)

    # -- conversion ------------------------------------------------------------
    def flush(self) -> None:
        """Turn the pending decode events into eviction and step rows (batched)."""
        self._release()
        pend, self._pending = self._pending, Pending()
        if not pend.events:
            return
        cache = self.session.last_cache
        group = cache.group
        self._ids = pend.ids if pend.ids is not None else self._row_ids()
        ev = pend.events
        pinned = _protected(ev, ev[0].step.device)
        stack = lambda name: torch.stack([getattr(e, name) for e in ev])  # noqa: E731
        step = stack("step").to(torch.int64)  # (K, b)
        slot, evicts = stack("slot"), stack("evicts")  # (K, b, Hs)
        c_scores, c_pos = _candidates(ev)  # (K, b, Hs, B+1), B the widest layer's under a budget plan
        start = window_start(cache)
        if start is not None:  # a cold tier's window is no slot of the policy's (DESIGN.md §2.13)
            c_pos = c_pos.clone()
            c_pos[..., start:-1] = -1
        # each event's layer: its recent window and sink per row and KV set (DESIGN.md §2.14)
        windows = {i: budget_plan.set_windows(cache.layers[i]) for i in set(pend.layer)}
        recent = torch.stack([windows[i][0] for i in pend.layer]).to(step.device)  # (K, b, Hs)
        sink = torch.stack([windows[i][1] for i in pend.layer]).to(step.device)
        st = _stats(c_scores, c_pos, slot, evicts, step, recent, sink, pinned)
        k, b, hs = slot.shape
        layer = torch.tensor(pend.layer)[:, None, None].expand(k, b, hs)
        step3 = step[:, :, None].expand(k, b, hs)
        req = torch.arange(b)[None, :, None].expand(k, b, hs)
        head = torch.arange(hs)[None, None, :].expand(k, b, hs)
        ones = torch.ones(b, dtype=torch.bool, device=slot.device)
        alive = torch.stack([ones if a is None else a for a in pend.alive])[:, :, None].expand(k, b, hs)
        # evictions (none of a request that already ended: it fed its EOS or padding)
        sel = evicts & alive
        self._append_evictions(
            req[sel],
            head[sel],
            step3[sel],
            st.victim_position[sel].to(torch.int64),
            st.victim_score[sel],
            st.margin[sel],
            recent[sel].cpu(),
            group,
            layer=layer[sel],
            phase="decode",
        )
        # steps: kept count and mean age of the heavy slots after the step (the eligible survivors:
        # outside the recent window, the sink and the pinned positions)
        kept = (c_pos >= 0).sum(-1) - evicts.to(torch.int64)
        heavy_pos = torch.where(st.survivors, c_pos.to(torch.float32), float("nan"))
        age = step3.float() - torch.nanmean(heavy_pos, -1)
        exiting = st.exiting_position.to(torch.int64)
        has_exit = exiting >= 0
        if not bool(alive.any()):
            return
        self._append_steps(
            req[alive],
            head[alive],
            step3[alive],
            st.min_heavy_score[alive],
            st.promoted[alive],
            exiting[alive],
            kept[alive],
            age[alive],
            layer[alive],
            group,
            has_exit=has_exit[alive],
        )

    def _heads(self, h: torch.Tensor, group: int) -> dict[str, np.ndarray]:
        h = h.numpy().astype(np.int16)
        if self.config.gqa == "none" and group > 1:
            return {"kv_head": h // group, "q_head": h}
        return {"kv_head": h}

    def _append_evictions(self, r, h, step, pos, score, margin, recent, group, *, layer=None, phase: str) -> None:
        if r.numel() == 0:
            return
        step_np = step.numpy()
        pos_np = pos.numpy()
        cols = {
            "request": np.asarray(self._ids, np.int32)[r.numpy()],
            "step": step_np,
            "layer": layer.numpy().astype(np.int16)
            if isinstance(layer, torch.Tensor)
            else np.full(len(pos_np), layer, np.int16),
            **self._heads(h, group),
            "position": pos_np,
            "score": score.float().numpy(),
            "margin": margin.float().numpy(),
            "age": step_np - pos_np,
            "left_recent": pos_np == step_np - recent.numpy(),
            "phase": phase,
        }
        self._emit("evictions", cols)

    def _append_steps(self, r, h, step, min_heavy, promoted, exiting, kept, age, layer, group, has_exit=None) -> None:
        n = r.numel()
        cols = {
            "request": np.asarray(self._ids, np.int32)[r.numpy()],
            "step": step.numpy(),
            "layer": layer.numpy().astype(np.int16) if isinstance(layer, torch.Tensor) else np.full(n, layer, np.int16),
            **self._heads(h, group),
            "min_heavy_score": np.ma.masked_invalid(min_heavy.float().numpy()),
            "kept": kept.numpy().astype(np.int32),
            "heavy_age_mean": np.ma.masked_invalid(age.float().numpy()),
        }
        if promoted is not None:
            mask = ~has_exit.numpy()
            cols["promoted"] = np.ma.MaskedArray(promoted.numpy(), mask=mask)
            cols["exiting_position"] = np.ma.MaskedArray(exiting.numpy(), mask=mask)
        self._emit("steps", cols)


def _concat_columns(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Column dicts of one table (same keys) joined row-wise; a scalar column equal in every part
    stays a scalar (the writer repeats it)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for key in parts[0]:
        vals = [p[key] for p in parts]
        if all(np.ndim(v) == 0 for v in vals) and all(v == vals[0] for v in vals):
            out[key] = vals[0]
        elif any(isinstance(v, np.ma.MaskedArray) for v in vals):
            out[key] = np.ma.concatenate([np.ma.asarray(v) for v in vals])
        else:
            out[key] = np.concatenate([np.asarray(v) for v in vals])
    return out


def _protected(events: list[DecodeEvent], device) -> torch.Tensor | None:
    """``(K, b, 1, W)`` the positions each of ``events`` kept from eviction (the pins, padded with
    -2 to the widest; DESIGN.md §2.11), or None when no event protected any."""
    parts = [e.protected for e in events]
    if all(p is None for p in parts):
        return None
    b = events[0].step.shape[0]
    width = max(p.shape[-1] for p in parts if p is not None)
    out = torch.full((len(parts), b, 1, width), -2, dtype=torch.int64, device=device)
    for i, p in enumerate(parts):
        if p is not None:
            out[i, :, :, : p.shape[-1]] = p.to(device)
    return out


def _candidates(events: list[DecodeEvent]) -> tuple[torch.Tensor, torch.Tensor]:
    """The events' candidate scores and positions stacked ``(K, b, Hs, W)``; under a budget plan
    the layers' storage widths differ, and the narrower ones are padded after their new token's
    column with empty candidates (position -1, score 0: never eligible, never kept), so every
    event's slot indices, the new token's ``B`` included, stay what its layer reported."""
    width = max(e.cand_positions.shape[-1] for e in events)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        extra = width - t.shape[-1]
        return t if extra == 0 else torch.nn.functional.pad(t, (0, extra), value=value)

    scores = torch.stack([pad(e.cand_scores, 0.0) for e in events])
    positions = torch.stack([pad(e.cand_positions, -1) for e in events])
    return scores, positions


def _stats(c_scores, c_pos, slot, evicts, step, recent, sink, pinned) -> eviction.StepStats:
    """:func:`h2o_lens.events.decode_stats` with a recent window and sink per event, row and KV set
    (``recent, sink (K, b, Hs)``; a budget plan's differ by layer and set, DESIGN.md §2.14)."""
    if pinned is not None:
        pinned = pinned.to(c_pos.device, c_pos.dtype)
    eligible = eviction.eligible_mask(c_pos, step[..., None, None], recent[..., None], sink[..., None], pinned=pinned)
    return eviction.step_stats(c_scores, c_pos, eligible, slot, evicts, step[..., None], recent)
