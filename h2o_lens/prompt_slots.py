"""The prompt into slots: the prefill's keep rule and laying the kept positions (DESIGN.md §2.3, §15.4).

Functions of an :class:`~h2o_lens.cache.H2OCacheLayer` (passed as ``layer``), split from the cache
module: :func:`keep_rule` runs the policy's keep rule over a whole prompt, :func:`lay` lays the kept
positions into slots, :func:`suffix_prefill` computes a request's suffix against a shared prompt
prefix (copy-on-write of the prefix's column sums).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import eviction, ops, slot_blocks
from . import plan as _plan
from .events import PrefillEvent

__all__ = [
    "POS_DTYPE",
    "SharedPrefix",
    "prompt_attention",
    "hand_on_prompt",
    "keep_rule",
    "lay",
    "prefix_forward",
    "suffix_prefill",
]

POS_DTYPE = torch.int32


@dataclass
class SharedPrefix:
    """A prompt prefix computed once (DESIGN.md §15.4): ``key, value (1, Hs, P0, d)``, ``scores (1, Hs, P0)``
    the column sums of the prefix's own rows. Read-only: each request adds its suffix to a copy."""

    key: torch.Tensor
    value: torch.Tensor
    scores: torch.Tensor


def prompt_attention(layer: Any, query, key, value, valid, scaling: float):
    """Full causal attention over the prompt on the cache's backend: ``(out (b, P, Hq, d), scores,
    rows)`` with ``scores (b, Hs, P)`` the column sums for a policy that ranks the prompt by them
    and ``rows`` the last rows' weights for one that ranks by those (each None otherwise). The
    torch path hands the prompt forward to the cache's ``prompt_capture`` and ``prompt_sink``."""
    owner = layer.owner
    gqa = owner.config.gqa
    spec = owner.config.spec
    scores = None  # column sums, for a policy that ranks the prompt by them
    if owner.resolve_backend(key.device) == "triton":
        out, _ = ops.prefill_attention(query, key, value, valid, scaling, gqa, need_scores=False)
        if spec.prefill == "columns":
            from .kernels import prefill_scores_triton

            scores = prefill_scores_triton(query.contiguous(), key.contiguous(), valid, scaling, gqa)
    else:
        lse = {} if owner.prompt_capture is not None else None
        out, scores = ops.prefill_attention(query, key, value, valid, scaling, gqa, chunk=owner.prefill_chunk, lse=lse)
        if owner.prompt_capture is not None:  # kept for the next configuration (DESIGN.md §12.5)
            repeat = owner.shape.copies(gqa)  # K/V repeated per query head by update() under gqa="none"
            owner.prompt_capture(layer.layer_idx, query, key, value, scores, valid, scaling, repeat, lse.get("lse"))
        if owner.prompt_sink is not None:
            hand_on_prompt(layer, query, key, value, scores, valid)
        if spec.prefill != "columns":
            scores = None
    rows = ops.prefill_rows(query, key, valid, scaling, gqa, spec.prefill_rows) if spec.prefill == "rows" else None
    return out, scores, rows


def hand_on_prompt(layer: Any, query, key, value, scores, valid) -> None:
    """Give the prompt sink the layer's prompt K/V and column sums when they have the bits of a
    replay's prompt forward: the row-by-row CPU path with the replay's row blocks."""
    owner = layer.owner
    if owner.prefill_chunk >= ops.COLUMN_ROWS and ops.prefill_rowwise(query, valid):
        step = owner.shape.copies(owner.config.gqa)  # the K/V were repeated per query head
        owner.prompt_sink(layer.layer_idx, key[:, ::step], value[:, ::step], scores, valid)


def prefix_forward(layer: Any, query, key, value, scaling: float) -> tuple[torch.Tensor, SharedPrefix]:
    """The forward of a shared prompt prefix ``key, value (1, Hs, P0, d)``: full causal attention,
    K, V and column sums kept whole, nothing evicted (DESIGN.md §15.4)."""
    owner = layer.owner
    out, scores = ops.prefill_attention(query, key, value, None, scaling, owner.config.gqa, chunk=owner.prefill_chunk)
    return out, SharedPrefix(key=key, value=value, scores=scores)


def keep_rule(layer: Any, query, key, valid, scores, rows):
    """The policy's prefill keep rule over a whole prompt, without laying anything into slots.

    ``key (b, Hs, P, d)``, ``scores (b, Hs, P)`` the column sums (or None), ``rows`` the last rows'
    weights (or None). Resolves the rows' budgets (once per cache) and returns ``positions (b, Hs, P)``,
    ``count (b,)`` real tokens, ``drive (b, Hs, P)`` the scores that drive the choice, ``history``
    (or None), ``keep`` and ``eligible`` ``(b, Hs, P)`` bool.
    """
    b, hs, p, d = key.shape
    owner = layer.owner
    gqa = owner.config.gqa
    spec = owner.config.spec
    dtype = scores.dtype if scores is not None else torch.promote_types(query.dtype, torch.float32)
    if valid is None:
        pos = torch.arange(p, device=key.device, dtype=POS_DTYPE).expand(b, p)
    else:
        pos = (valid.cumsum(-1) - 1).to(POS_DTYPE).masked_fill(~valid, eviction.EMPTY)
    positions = pos[:, None, :].expand(b, hs, p)  # (b, Hs, P)
    count = pos.amax(-1).to(torch.int64) + 1  # (b,) real tokens
    layer.budget = owner.assign_budgets(count).to(key.device)
    layer.forget_groups()
    last = (count - 1)[:, None, None]  # (b,1,1)
    drive = torch.empty(b, hs, p, dtype=dtype, device=key.device)  # the scores that drive the choice
    history = torch.zeros(b, hs, p, dtype=torch.int64, device=key.device) if spec.history else None
    keep = torch.empty(b, hs, p, dtype=torch.bool, device=key.device)
    eligible = torch.empty_like(keep)
    heads = owner.shape.heads_per_set(gqa)
    protected = layer.protected()  # (b, 1, K): the pins (DESIGN.md §2.11), or None
    for group_rows, args in layer.groups():
        sel = slice(None) if group_rows is None else group_rows
        drive[sel], hist = ops.prefill_scores(
            None if scores is None else scores[sel],
            None if rows is None else rows[sel],
            positions[sel],
            args,
            layer.layer_idx,
            dtype,
            heads,
        )
        if history is not None:
            history[sel] = hist
        pins = None if protected is None else protected[sel]
        keep[sel] = _plan.prefill_keep(drive[sel], positions[sel], args, pins)  # per KV set under a plan
        eligible[sel] = _plan.eligible_mask(positions[sel], last[sel], args, pins)
    return positions, count, drive, history, keep, eligible


def lay(layer: Any, key, value, kept) -> None:
    """Lay the positions ``kept`` (what :func:`keep_rule` returned) into the slots of ``layer``, then
    tell its cache's extensions (:meth:`~h2o_lens.extension.CacheExtension.on_prefill`)."""
    b, hs, p, d = key.shape
    owner = layer.owner
    positions, count, drive, history, keep, eligible = kept
    caps = owner.row_capacity(layer.budget, layer.layer_idx)  # (b,) this layer's (DESIGN.md §2.14)
    cap = max(args.capacity for _, args in layer.groups())
    # slots hold the kept positions in ascending order, then empty slots
    big = torch.iinfo(POS_DTYPE).max
    order = torch.where(keep, positions, big).argsort(-1)[..., :cap]  # (b,Hs,min(P,B))
    kept_pos = torch.where(keep.gather(-1, order), positions.gather(-1, order), eviction.EMPTY)
    n = order.shape[-1]
    if owner.backend in slot_blocks.BLOCK_BACKENDS:  # the torch step reads its blocks in place (DESIGN.md §2.7)
        layer.keys = ops.block_storage(key, b, hs, cap, d)
        layer.values = ops.block_storage(value, b, hs, cap, d)
    else:
        layer.keys = key.new_zeros(b, hs, cap, d)
        layer.values = value.new_zeros(b, hs, cap, d)
    layer.scores = drive.new_zeros(b, hs, cap)
    layer.positions = torch.full((b, hs, cap), eviction.EMPTY, dtype=POS_DTYPE, device=key.device)
    gidx = order[..., None].expand(b, hs, n, d)
    layer.keys[:, :, :n] = key.gather(2, gidx)
    layer.values[:, :, :n] = value.gather(2, gidx)
    layer.scores[:, :, :n] = torch.where(kept_pos >= 0, drive.gather(-1, order), 0.0)
    if history is not None:
        layer.history = history.new_zeros(b, hs, cap)
        layer.history[:, :, :n] = torch.where(kept_pos >= 0, history.gather(-1, order), 0)
    layer.positions[:, :, :n] = kept_pos
    layer.next_pos = count.to(POS_DTYPE)
    # slots used: a pinned position inside the recent window (or the sink) counts once,
    # so a long prompt may leave free slots, which the next steps fill (DESIGN.md §2.11)
    fill = keep.sum(-1).amax(-1).to(torch.int64)  # (b,) the same for every KV set of the same count
    layer.fill = None if bool((fill >= caps).all()) else fill
    layer.is_initialized = True
    if owner.extensions:
        event = PrefillEvent(positions=positions, scores=drive, keep=keep, eligible=eligible, step=count - 1)
        for ext in owner.extensions:
            ext.on_prefill(layer, event)


def suffix_prefill(layer: Any, shared: SharedPrefix, query: torch.Tensor, valid, scaling: float):
    """Each request's suffix against the shared prefix, then the keep rule over its whole prompt.

    The suffix rows attend to the shared prefix K/V (read, never written) and to their
    own suffix; their column sums are added to a copy of the prefix's column sums, one
    copy per request (copy-on-write: the request's first write). The result equals the
    prefill of ``prefix + suffix`` as one prompt, up to the summation order. Returns the suffix
    rows' attention output and the whole prompts' ``key, value, valid`` and column sums (or None),
    for the keep rule.
    """
    key_s, value_s = layer.take_pending()  # (b, Hs, S, d)
    b, hs, s_len, d = key_s.shape
    p0 = shared.key.shape[2]
    gqa = layer.owner.config.gqa
    key = torch.cat([shared.key.expand(b, -1, -1, -1), key_s], 2)  # (b, Hs, P0 + S, d)
    value = torch.cat([shared.value.expand(b, -1, -1, -1), value_s], 2)
    ok = torch.ones(b, s_len, dtype=torch.bool, device=key.device) if valid is None else valid.bool()
    valid_all = torch.cat([torch.ones(b, p0, dtype=torch.bool, device=key.device), ok], 1)
    qg = ops._group_view(query, hs)  # (b, Hs, G, S, d)
    acc = torch.promote_types(query.dtype, torch.float32)
    logits = torch.matmul(qg, key.transpose(-1, -2)[:, :, None]) * scaling  # (b, Hs, G, S, P0 + S)
    rows = torch.arange(p0, p0 + s_len, device=key.device)[:, None]
    cols = torch.arange(p0 + s_len, device=key.device)[None, :]
    masked = (cols > rows) | ~valid_all[:, None, None, None, :]
    masked = masked & ~((cols == rows) & ~ok[:, None, None, :, None])  # a padding row sees itself
    w = torch.softmax(logits.masked_fill(masked, ops._NEG), dim=-1, dtype=acc)
    out = torch.matmul(w.to(value.dtype), value[:, :, None]).reshape(b, -1, s_len, d).transpose(1, 2)
    w = w.masked_fill(~ok[:, None, None, :, None], 0.0)
    contrib = eviction.aggregate_group(w, gqa, 2).sum(-2)  # (b, Hs, P0 + S): the suffix rows' share
    scores = torch.empty(b, hs, p0 + s_len, dtype=acc, device=key.device)
    scores[:, :, p0:] = contrib[:, :, p0:]
    base = shared.scores[0]  # (Hs, P0), read-only
    for r in range(b):
        mine = layer.own_prefix_scores(base)
        mine += contrib[r, :, :p0]
        scores[r, :, :p0] = mine
    return out, key, value, valid_all, scores if layer.owner.config.spec.prefill == "columns" else None
