"""The guard's signals: pure functions of what a decode step or the prefill computed (DESIGN.md §18.1).

Tensors in, tensors out; no state. :class:`h2o_lens.guard_state.GuardState` calls them per layer
and step, ``bench guard`` on recorded prefills.
"""

from __future__ import annotations

import torch

from . import eviction
from .errors import ConfigError
from .events import decode_stats

__all__ = [
    "combine",
    "layer_signals",
    "uniform_life",
    "dropped_share",
    "prefill_lost",
    "prefill_signal",
    "head_signal",
]


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
