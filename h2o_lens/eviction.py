"""The eviction math of H2O, pure: tensors in, tensors out, no state, no I/O.

One contract shared by the FP64 reference (:mod:`h2o_lens.reference`), the
torch runtime (:mod:`h2o_lens.cache`) and the Triton kernels. Shapes use
``...`` for any leading batch dims (request, KV set), ``S`` for the slots of
a candidate set D and ``G`` for the query heads sharing a KV head.

Tie rules (DESIGN.md §2): at a decode step the lowest score is evicted and a
tie evicts the *older* original position; at prefill the top-``heavy`` are
kept and a tie keeps the *newer* position. Both prefer newer positions, so
the result never depends on the physical slot order.

Empty slots carry position ``-1``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "EMPTY",
    "aggregate_group",
    "aggregate_heads",
    "eligible_mask",
    "select_victim",
    "prefill_keep",
    "StepStats",
    "step_stats",
]

EMPTY = -1


def aggregate_group(
    weights: torch.Tensor, mode: str, dim: int, rows: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """The GQA rule (DESIGN.md §2.6), on an axis that holds one group's query heads.

    ``"sum"`` adds the group's weights, ``"max"`` takes the largest; ``"none"`` has
    groups of one head, so both read the same. ``dim`` is the group axis (it is
    removed); ``rows``, if given, are further axes summed after the aggregation
    (query rows of a prompt: column sums). For ``"sum"`` the two sums are one
    reduction, whose order the callers' results depend on bit for bit.
    """
    if mode not in ("sum", "max", "none"):
        raise ValueError(f"unknown gqa mode {mode!r}; expected sum, max or none")
    if rows is None:
        if weights.shape[dim] == 1:
            return weights.select(dim, 0)
        return weights.amax(dim) if mode == "max" else weights.sum(dim)
    rows = (rows,) if isinstance(rows, int) else tuple(rows)
    if mode != "max":
        return weights.sum(dim=(*rows, dim))
    nd = weights.dim()
    d = dim % nd
    return weights.amax(d).sum(dim=tuple(r % nd - (r % nd > d) for r in rows))


def aggregate_heads(weights: torch.Tensor, group: int, mode: str) -> torch.Tensor:
    """Aggregate attention weights of the ``group`` query heads sharing a KV head.

    Parameters
    ----------
    weights : Tensor ``(..., Hq, K)``
        Softmax weights per query head over K keys (several rows may be summed
        already only for ``mode="sum"``).
    group : int
        Query heads per KV head, ``G = Hq // Hkv``; heads ``g*G .. g*G+G-1``
        share KV head ``g`` (the transformers ``repeat_kv`` layout).
    mode : {"sum", "max", "none"}
        ``"none"`` returns the weights unchanged (one set per query head).

    Returns
    -------
    Tensor ``(..., Hkv, K)`` (``(..., Hq, K)`` for ``"none"``).
    """
    if mode not in ("sum", "max", "none"):
        raise ValueError(f"unknown gqa mode {mode!r}; expected sum, max or none")
    if mode == "none" or group == 1:
        return weights
    *lead, hq, k = weights.shape
    return aggregate_group(weights.reshape(*lead, hq // group, group, k), mode, -2)


def eligible_mask(
    positions: torch.Tensor,
    step: torch.Tensor | int,
    recent: torch.Tensor | int,
    sink: torch.Tensor | int = 0,
    *,
    all_live: bool = False,
    pinned: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slots that may be evicted at query position ``step``.

    ``positions (..., S)``; ``step``, ``recent`` and ``sink`` ints or tensors
    broadcastable to ``(..., 1)`` (per-request budgets). A slot is eligible when
    it holds a position outside the ``recent`` newest (``pos <= step - recent``),
    outside the first ``sink`` and not among the ``pinned`` positions (a 1-D
    tensor, or ``(b, 1, K)`` per row, DESIGN.md §2.11). ``all_live`` says that no slot is empty (a full
    cache), which spares the check.
    """
    ok = positions <= step - recent
    if not all_live:
        ok = (positions >= 0) & ok
    if isinstance(sink, torch.Tensor) or sink:
        ok &= positions >= sink
    if pinned is not None and pinned.numel():
        ok &= ~_among(positions, pinned)
    return ok


def _among(positions: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """``positions (..., S)`` that are among ``pinned``: a 1-D tensor for every row, or
    ``(b, 1, K)`` per row (padded with -2, which no slot holds)."""
    if pinned.dim() > 1:
        return (positions[..., None] == pinned[..., None, :]).any(-1)
    return torch.isin(positions, pinned.to(positions.dtype))


def select_victim(
    scores: torch.Tensor, positions: torch.Tensor, eligible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest score among eligible slots; a tie evicts the older position.

    Parameters
    ----------
    scores : Tensor ``(..., S)`` float
    positions : Tensor ``(..., S)`` integer, unique per row among valid slots
    eligible : Tensor ``(..., S)`` bool

    Returns
    -------
    index : Tensor ``(...)`` int64, slot of the victim (where none is eligible: the slot of
        the oldest position, which no caller evicts since ``found`` is False)
    found : Tensor ``(...)`` bool, whether any slot was eligible

    This is the decode step's hot path: ineligible slots take the largest finite score,
    so they never tie with an eligible one and no extra mask is needed.
    """
    s = torch.where(eligible, scores, torch.finfo(scores.dtype).max)  # (..., S)
    tied = s == s.amin(-1, keepdim=True)
    return torch.where(tied, positions, torch.iinfo(positions.dtype).max).argmin(-1), eligible.any(-1)


def prefill_keep(
    scores: torch.Tensor,
    positions: torch.Tensor,
    heavy: int,
    recent: int,
    sink: int = 0,
    pinned: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slots kept after a prefill, in one shot.

    Keeps the ``recent`` newest valid positions, the first ``sink`` positions,
    the ``pinned`` positions (DESIGN.md §2.11) and the top-``heavy`` of the rest
    by score (a tie keeps the newer).

    Parameters
    ----------
    scores : Tensor ``(..., P)`` float, column sums of the prefill attention
    positions : Tensor ``(..., P)`` int64, ``-1`` for padding
    heavy, recent, sink : int
    pinned : positions never evicted: a 1-D Tensor, or ``(b, 1, K)`` per row (padded with
        -2) for ``scores (b, Hs, P)``; None: none

    Returns
    -------
    Tensor ``(..., P)`` bool, True for kept slots (at most heavy+recent+sink+len(pinned)).
    """
    valid = positions >= 0
    last = positions.amax(-1, keepdim=True)  # (..., 1) newest position
    keep = valid & (positions > last - recent)
    if sink:
        keep |= valid & (positions < sink)
    if pinned is not None and pinned.numel():
        keep |= valid & _among(positions, pinned)
    if heavy:
        rest = valid & ~keep
        # order: score descending, then position descending (newer wins a tie)
        neg_inf = torch.finfo(scores.dtype).min
        s = scores.masked_fill(~rest, neg_inf)
        by_pos = torch.argsort(positions, dim=-1, descending=True, stable=True)
        s_sorted = s.gather(-1, by_pos)
        by_score = torch.argsort(s_sorted, dim=-1, descending=True, stable=True)
        order = by_pos.gather(-1, by_score)  # slot indices, best first
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
        )
        keep |= rest & (rank < heavy)
    return keep


class StepStats(NamedTuple):
    """Per (request, KV set) facts of one decode step, for the recorder.

    All tensors have the leading shape ``(...)`` of the step.
    """

    victim_position: torch.Tensor  # positions dtype, -1 where nothing was evicted
    victim_score: torch.Tensor  # float32
    margin: torch.Tensor  # float32, NaN where no eligible slot survives
    min_heavy_score: torch.Tensor  # float32, NaN where no heavy slot
    exiting_position: torch.Tensor  # positions dtype, position leaving the recent window, -1 if none
    promoted: torch.Tensor  # bool, the exiting position survived
    survivors: torch.Tensor | None = None  # (..., S) bool, the eligible slots that stay: the heavy slots


def step_stats(
    scores: torch.Tensor,
    positions: torch.Tensor,
    eligible: torch.Tensor,
    victim: torch.Tensor,
    evicts: torch.Tensor,
    step: torch.Tensor | int,
    recent: int,
) -> StepStats:
    """Recorder facts of one decode step over the candidate set D.

    ``scores, positions, eligible (..., S)`` describe D after the score update,
    ``victim (...)`` the chosen slot and ``evicts (...)`` whether it is evicted.
    """
    vpos = positions.gather(-1, victim[..., None])[..., 0]
    vscore = scores.gather(-1, victim[..., None])[..., 0].float()
    survivors = eligible.clone()
    survivors.scatter_(-1, victim[..., None], (~evicts)[..., None] & eligible.gather(-1, victim[..., None]))
    inf = torch.finfo(scores.dtype).max
    low = scores.masked_fill(~survivors, inf).amin(-1).float()
    low = torch.where(survivors.any(-1), low, torch.full_like(low, float("nan")))
    margin = torch.where(evicts, low - vscore, torch.full_like(low, float("nan")))
    exiting = (torch.as_tensor(step, device=positions.device) - recent).to(positions.dtype)
    exiting = exiting.expand_as(vpos)  # step broadcasts to (...), e.g. (b, 1)
    present = (positions == exiting[..., None]).any(-1)
    exiting = torch.where(present & (exiting >= 0), exiting, torch.full_like(exiting, EMPTY))
    promoted = (exiting >= 0) & ~(evicts & (vpos == exiting))
    return StepStats(
        victim_position=torch.where(evicts, vpos, torch.full_like(vpos, EMPTY)),
        victim_score=vscore,
        margin=margin,
        min_heavy_score=low,
        exiting_position=exiting,
        promoted=promoted,
        survivors=survivors,
    )
