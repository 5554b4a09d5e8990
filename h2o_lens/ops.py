"""Torch implementation of the H2O prefill and decode step (DESIGN.md §2).

These functions are the torch path of the runtime and the contract the
Triton kernels (:mod:`h2o_lens.kernels`) implement. Notation:

``b`` requests, ``Hq`` query heads, ``Hs`` KV sets (``Hkv`` for gqa sum/max,
``Hq`` for gqa none), ``G = Hq // Hs``, ``B`` slots, ``P`` prompt columns,
``d`` head dim. Empty slots hold position ``-1``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from . import eviction, policies
from .errors import ConfigError
from .slot_blocks import ALIGN_SHARE, DECODE_BLOCK, block_storage
from .slot_blocks import blocks as _blocks

__all__ = [
    "PolicyArgs",
    "prefill_attention",
    "prefill_rowwise",
    "prefill_rows",
    "prefill_scores",
    "random_scores",
    "prefill_select",
    "decode_step",
    "attend_rows",
    "DecodeResult",
    "RowBudgets",
    "DECODE_BLOCK",
    "ALIGN_SHARE",
    "block_storage",
]

_NEG = float("-inf")


@dataclass(frozen=True)
class PolicyArgs:
    """What the math needs of an :class:`~h2o_lens.config.H2OConfig`, resolved."""

    policy: str  # a name of the policy registry (h2o_lens.policies)
    heavy: int
    recent: int
    sink: int
    gqa: str  # sum | max | none
    seed: int = 0  # of the random policy
    #: positions never evicted, inside the capacity: the budget reserves their slots; the cache's
    #: :class:`~h2o_lens.pins.Pins` extension protects them (DESIGN.md §2.11)
    pinned: tuple[int, ...] = ()
    #: a budget plan's ``(heavy, recent, sink)`` per layer and KV set (DESIGN.md §2.14); the split
    #: above is then the widest entry's. Read per layer with :func:`h2o_lens.plan.layer_args`.
    plan: tuple[tuple[tuple[int, int, int], ...], ...] | None = None
    #: one layer's ``(heavy, recent, sink)`` per KV set when its sets differ (the split above is
    #: then the widest set's): a ragged layer (:mod:`h2o_lens.plan`)
    sets: tuple[tuple[int, int, int], ...] | None = None

    @property
    def capacity(self) -> int:
        """Slots per KV set: the policy's split plus the pinned positions (the widest set's)."""
        return self.heavy + self.recent + self.sink + len(self.pinned)

    @functools.cached_property
    def spec(self) -> policies.Policy:
        """The policy's entry in the registry: its scores, kernels and history."""
        return policies.get(self.policy)

    @property
    def scored(self) -> bool:
        """Whether attention drives eviction (the registry's ``Policy.scored``)."""
        return self.spec.scored


def _group_view(x: torch.Tensor, sets: int) -> torch.Tensor:
    """``(b, Hq, ...)`` → ``(b, Hs, G, ...)``."""
    b, hq = x.shape[:2]
    return x.view(b, sets, hq // sets, *x.shape[2:])


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    gqa: str,
    chunk: int = 128,
    need_scores: bool = True,
    lse: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention over a prompt and the per-key column sums of its weights.

    Parameters
    ----------
    query : ``(b, Hq, P, d)``
    key, value : ``(b, Hs, P, d)``
    valid : ``(b, P)`` bool or None, False for (left) padding
    scaling : float, usually ``d ** -0.5``
    gqa : "sum" | "max" | "none"
    chunk : query rows per block; memory is ``O(chunk · P)``, never ``P²``

    Returns
    -------
    out : ``(b, P, Hq, d)`` in the query dtype (the layout attention modules expect)
    scores : ``(b, Hs, P)`` float32, ``score_i = Σ_{u≥i} agg_h a_{h,u,i}``,
        padding rows and columns contribute 0; None when ``need_scores`` is False.

    ``lse``: a dict that the CPU flash path fills with ``"lse"``, each row's log-sum-exp
    ``(b, Hq, P)`` float32 (0 on padding rows), from which :func:`prefill_columns` gives the
    column sums of another aggregation with the same bits; left empty on the other paths.

    On CPU (float32, bfloat16, float16) the output and each row's log-sum-exp come from
    the fused flash kernel and the column sums from one pass over L2-sized score tiles;
    a padded row is cut to its real span and runs alone, so its bits do not depend on
    the batch (DESIGN.md §2.3). Elsewhere, and for padding with holes, the chunked
    softmax of :func:`_prefill_masked`, the reference the fast path is tested against.
    """
    if query.device.type == "cpu" and query.dtype in _FLASH_CPU_DTYPES:
        spans = None if valid is None else _contiguous_spans(valid)
        if valid is None or spans is not None:
            out, scores, rows_lse = _prefill_flash_cpu(query, key, value, spans, scaling, gqa, chunk, need_scores)
            if lse is not None:
                lse["lse"] = rows_lse
            return out, scores
    if not need_scores:  # the scores come from elsewhere (the Triton kernel): a fused attention
        return _prefill_sdpa(query, key, value, valid, scaling, SDPA_BLOCK_ROWS), None
    return _prefill_masked(query, key, value, valid, scaling, gqa, chunk)


def prefill_rowwise(query: torch.Tensor, valid: torch.Tensor | None) -> bool:
    """Whether :func:`prefill_attention` runs each row alone on the CPU flash path, so that a
    request's output and column sums have the bits of its prompt forwarded alone, unpadded."""
    cpu = query.device.type == "cpu" and query.dtype in _FLASH_CPU_DTYPES
    return cpu and (valid is None or _contiguous_spans(valid) is not None)


def _prefill_masked(query, key, value, valid, scaling, gqa, chunk):
    """The chunked path: each block of ``chunk`` query rows takes its softmax over all its
    keys at once (any padding pattern, any dtype and device); the reference of the others."""
    b, hq, p, d = query.shape
    hs = key.shape[1]
    qg = _group_view(query, hs)  # (b, Hs, G, P, d)
    kt = key.transpose(-1, -2)[:, :, None]  # (b, Hs, 1, d, P)
    vg = value[:, :, None]  # (b, Hs, 1, P, d)
    out = torch.empty(b, hs, hq // hs, p, d, dtype=query.dtype, device=query.device)
    acc = torch.promote_types(query.dtype, torch.float32)  # FP32, or FP64 for FP64 inputs
    scores = torch.zeros(b, hs, p, dtype=acc, device=query.device)
    pad = None if valid is None else ~valid[:, None, None, None, :]  # (b,1,1,1,P)
    for s in range(0, p, chunk):
        e = min(p, s + chunk)
        logits = torch.matmul(qg[..., s:e, :], kt[..., :e]) * scaling  # (b,Hs,G,c,e)
        rows = torch.arange(s, e, device=query.device)[:, None]
        cols = torch.arange(e, device=query.device)[None, :]
        masked = cols > rows  # (c, e) future keys
        if pad is not None:
            masked = masked | pad[..., :e]
            # a padding query row sees nothing: let it see itself to stay finite
            masked = masked & ~((cols == rows) & pad[..., s:e].transpose(-1, -2))
        logits = logits.masked_fill(masked, _NEG)
        w = torch.softmax(logits, dim=-1, dtype=acc)  # (b,Hs,G,c,e)
        out[..., s:e, :] = torch.matmul(w.to(value.dtype), vg[..., :e, :])
        if pad is not None:
            w = w.masked_fill(pad[..., s:e].transpose(-1, -2), 0.0)
        scores[..., :e] += eviction.aggregate_group(w, gqa, 2).sum(-2)  # (b,Hs,c,e) summed over rows
    out = out.view(b, hq, p, d).transpose(1, 2)
    return out, scores


_FLASH_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Query rows per masked SDPA call of a padded prompt without scores.
SDPA_BLOCK_ROWS = 512


def _prefill_sdpa(query, key, value, valid, scaling, chunk):
    """Causal prompt attention without scores through ``scaled_dot_product_attention``.

    Without padding the fused kernels take the query group as is (``enable_gqa``).
    With padding, blocks of ``chunk`` query rows get a boolean mask of their keys
    (never ``P²`` at once; a padding row sees only itself, which keeps it finite),
    and the keys and values are repeated per query head once: GQA with a mask would
    fall back to the math kernel, which builds the whole weight block.
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    group = query.shape[1] // key.shape[1]
    p = query.shape[2]
    if valid is None:
        try:
            return sdpa(query, key, value, is_causal=True, scale=scaling, enable_gqa=True).transpose(1, 2)
        except TypeError:  # torch < 2.5 has no enable_gqa
            pass
    if group > 1:
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    if valid is None:
        return sdpa(query, key, value, is_causal=True, scale=scaling).transpose(1, 2)
    out = torch.empty_like(query)
    for s in range(0, p, chunk):
        e = min(p, s + chunk)
        rows = torch.arange(s, e, device=query.device)[:, None]
        cols = torch.arange(e, device=query.device)[None, :]
        see = (cols <= rows) & valid[:, None, None, :e]  # (b,1,c,e)
        see = see | ((cols == rows) & ~valid[:, None, s:e, None])
        out[:, :, s:e] = sdpa(query[:, :, s:e], key[:, :, :e], value[:, :, :e], attn_mask=see, scale=scaling)
    return out.transpose(1, 2)


def _upper(c: int, device) -> torch.Tensor:
    """``(c, c)`` True strictly above the diagonal."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu_(1)


def _contiguous_spans(valid: torch.Tensor) -> list[tuple[int, int]] | None:
    """Each row's real tokens as one ``[start, end)`` span, or None when a row has holes."""
    count = valid.sum(-1)
    start = valid.to(torch.int8).argmax(-1)
    spans = [(int(s), int(s) + int(c)) for s, c in zip(start.tolist(), count.tolist())]
    for r, (s, e) in enumerate(spans):
        if e == s or not bool(valid[r, s:e].all()):
            return None
    return spans


def _prefill_flash_cpu(query, key, value, spans, scaling, gqa, chunk, need_scores):
    """On CPU: the fused flash kernel gives the output and each row's log-sum-exp; the
    column sums are a second pass over L2-sized score tiles, ``exp(q·k·s − lse)`` (DESIGN.md §2.3).

    ``spans`` is None (no padding) or each row's real span: padding is cut away and the
    row runs alone, so a request's output and scores are the same bits in any batch.
    A padding query row sees only itself (its output is its own value), as on the
    masked path.
    """
    b, hq, p, d = query.shape
    hs = key.shape[1]
    if spans is None and b == 1:
        spans = [(0, p)]
    if spans is not None:
        out = torch.empty(b, p, hq, d, dtype=query.dtype, device=query.device)
        scores = torch.zeros(b, hs, p, dtype=torch.float32, device=query.device) if need_scores else None
        lse = torch.zeros(b, hq, p, dtype=torch.float32, device=query.device)
        group = hq // hs
        for r, (s, e) in enumerate(spans):
            o, c, row_lse = _flash_cpu_rows(
                query[r : r + 1, :, s:e],
                key[r : r + 1, :, s:e],
                value[r : r + 1, :, s:e],
                scaling,
                gqa,
                chunk,
                need_scores,
            )
            out[r, s:e] = o[0]
            lse[r, :, s:e] = row_lse[0]
            if need_scores:
                scores[r, :, s:e] = c[0]
            for a, z in ((0, s), (e, p)):  # padding rows: their own value
                if z > a:
                    out[r, a:z] = value[r, :, a:z].repeat_interleave(group, 0).transpose(0, 1)
        return out, scores, lse
    return _flash_cpu_rows(query, key, value, scaling, gqa, chunk, need_scores)


def prefill_columns(
    query: torch.Tensor,
    key: torch.Tensor,
    lse: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    gqa: str,
    chunk: int = 128,
) -> torch.Tensor | None:
    """The column sums :func:`prefill_attention` gives under ``gqa``, from a CPU flash prefill's
    row log-sum-exps (its ``lse`` dict) instead of a new attention pass: the same column pass
    on the same inputs, so the same bits (DESIGN.md §12.5). ``key (b, Hs, P, d)`` in the KV
    sets of ``gqa`` (repeated per query head for ``"none"``). Returns ``(b, Hs, P)`` float32,
    or None where the prefill would not take the CPU flash path (it gives no ``lse`` there)."""
    b, hq, p, d = query.shape
    if not (query.device.type == "cpu" and query.dtype in _FLASH_CPU_DTYPES):
        return None
    spans = None if valid is None else _contiguous_spans(valid)
    if valid is not None and spans is None:
        return None
    if spans is None and b > 1:
        return _column_pass(query, key, lse, scaling, gqa, chunk)
    spans = spans or [(0, p)]
    scores = torch.zeros(b, key.shape[1], p, dtype=torch.float32, device=query.device)
    for r, (s, e) in enumerate(spans):
        rows = slice(r, r + 1)
        scores[r, :, s:e] = _column_pass(
            query[rows, :, s:e], key[rows, :, s:e], lse[rows, :, s:e], scaling, gqa, chunk
        )[0]
    return scores


#: Query positions and keys per score tile of the CPU column pass: a tile of
#: ``(COLUMN_ROWS · G) × KEY_BLOCK`` float32 weights per KV set stays in L2.
COLUMN_ROWS = 128
KEY_BLOCK = 256


def _flash_cpu_rows(query, key, value, scaling, gqa, chunk, need_scores):
    """:func:`_prefill_flash_cpu` on rows without padding: ``out``, the column sums (or None)
    and each row's log-sum-exp ``(b, Hq, P)``."""
    hq, hs = query.shape[1], key.shape[1]
    group = hq // hs
    k = key.repeat_interleave(group, dim=1) if group > 1 else key
    v = value.repeat_interleave(group, dim=1) if group > 1 else value
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.contiguous(), k.contiguous(), v.contiguous(), 0.0, True, scale=scaling
    )[:2]  # (b,Hq,P,d), (b,Hq,P)
    out = out.transpose(1, 2)
    scores = _column_pass(query, key, lse, scaling, gqa, chunk) if need_scores else None
    return out, scores, lse


def _column_pass(query, key, lse, scaling, gqa, chunk):
    """The column sums of the rows ``query (b, Hq, P, d)`` over ``key (b, Hs, P, d)`` from their
    log-sum-exps ``lse (b, Hq, P)``: one pass over L2-sized tiles ``exp(q·k·s − lse)``."""
    b, hq, p, d = query.shape
    hs = key.shape[1]
    group = hq // hs
    # rows ordered (position, head) so that a block of positions is a view
    qg = _group_view(query.float() * scaling, hs).transpose(2, 3).reshape(b * hs, p * group, d)  # (b·Hs, P·G, d)
    lse = _group_view(lse.float(), hs).transpose(2, 3).reshape(b * hs, p * group, 1)
    kt = key.float().reshape(b * hs, p, d).transpose(1, 2)  # (b·Hs, d, P)
    scores = torch.zeros(b * hs, 1, p, dtype=torch.float32, device=query.device)
    step = max(1, min(chunk, COLUMN_ROWS))
    ones = torch.ones(b * hs, 1, step * group, dtype=torch.float32, device=query.device)
    for s in range(0, p, step):
        e = min(p, s + step)
        c = e - s
        qs, ls = qg[:, s * group : e * group], lse[:, s * group : e * group]
        for j in range(0, e, KEY_BLOCK):
            je = min(e, j + KEY_BLOCK)
            # w = exp(q·k·scaling − lse): the softmax weights of one tile
            w = torch.bmm(qs, kt[:, :, j:je])  # (b·Hs, c·G, je − j)
            w.sub_(ls).exp_()
            if je > s + 1:  # the tile reaches the diagonal: future keys weigh 0
                rows = torch.arange(s, e, device=query.device)[:, None, None]
                w.view(b * hs, c, group, je - j).masked_fill_(torch.arange(j, je, device=query.device) > rows, 0.0)
            if gqa == "max" and group > 1:
                scores[:, 0, j:je] += w.view(b * hs, c, group, je - j).amax(2).sum(1)
            else:  # the sum over rows and heads as one matrix-vector product
                scores[:, :, j:je] += torch.bmm(ones[:, :, : c * group], w)
    return scores.view(b, hs, p)


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mix (xorshift-multiply), on int64 values below ``2**32``.

    The multipliers are below ``2**31``, so no product leaves the int64 range.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)


def random_scores(seed: int, layer: int, positions: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
    """The ``random`` policy's draw for each slot: a counter-based hash, float32 in ``[0, 1)``.

    A value depends only on ``(seed, layer, KV set, original position, step)``, never on
    the batch row, the physical slot or an RNG stream, so a request draws the same
    victims alone or in any batch.

    Parameters
    ----------
    seed, layer : int
    positions : ``(b, Hs, S)`` integer original positions (``-1`` empty: drawn, never eligible)
    step : int or tensor broadcastable to ``(b, Hs, 1)``, the query position
    """
    dev = positions.device
    kv_set = torch.arange(positions.shape[1], device=dev, dtype=torch.int64)[None, :, None]
    h = torch.tensor((seed ^ (seed >> 32)) & _MASK32, dtype=torch.int64, device=dev)
    for v in (
        torch.tensor(layer, dtype=torch.int64, device=dev),
        kv_set,
        positions.to(torch.int64),
        torch.as_tensor(step, device=dev).to(torch.int64),
    ):
        h = _mix32(h ^ (v & _MASK32))
    return (h >> 8).to(torch.float32) / float(1 << 24)  # 24 bits: exact in float32


def prefill_rows(
    query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor | None, scaling: float, gqa: str, rows: int
) -> torch.Tensor:
    """Aggregated attention weights of the last ``rows`` prompt rows, ``(b, Hs, R, P)``.

    ``query (b, Hq, Q, d)`` the queries of the prompt's last ``Q`` positions (all ``P`` of
    them, or at least ``R``), ``key (b, Hs, P, d)``.
    ``R = min(rows, P)``; row ``r`` is the query at column ``P - R + r``. The softmax
    is in FP32 (FP64 for FP64 inputs) over the row's real keys; future keys, padding
    keys and padding rows weigh 0. Memory is ``O(R · P)``.
    """
    b, hs, p, d = key.shape
    r = min(rows, p)
    if query.shape[2] < r:
        raise ValueError(f"prefill_rows: {query.shape[2]} query rows for the last {r} rows of the prompt")
    acc = torch.promote_types(query.dtype, torch.float32)
    qg = _group_view(query[:, :, query.shape[2] - r :], hs)  # (b, Hs, G, R, d)
    logits = torch.matmul(qg.to(acc), key.to(acc).transpose(-1, -2)[:, :, None]) * scaling  # (b,Hs,G,R,P)
    row = torch.arange(p - r, p, device=query.device)[:, None]
    masked = torch.arange(p, device=query.device)[None, :] > row  # (R, P) future keys
    if valid is not None:
        masked = masked | ~valid[:, None, None, None, :]
        masked = masked & ~(row == torch.arange(p, device=query.device))  # a padding row sees itself
    w = torch.softmax(logits.masked_fill(masked, _NEG), dim=-1)
    if valid is not None:
        w = w.masked_fill(~valid[:, None, None, p - r :, None] | ~valid[:, None, None, None, :], 0.0)
    return eviction.aggregate_group(w, gqa, 2)  # (b, Hs, R, P)


def prefill_scores(
    columns: torch.Tensor | None,
    rows: torch.Tensor | None,
    positions: torch.Tensor,
    args: PolicyArgs,
    layer: int = 0,
    dtype: torch.dtype = torch.float32,
    group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ranking values that drive a prefill choice, and the policy's history.

    ``columns (b, Hs, P)`` the prompt's column sums (policies that rank by them,
    ``Policy.prefill == "columns"``), ``rows (b, Hs, R, P)`` the last rows' weights
    (:func:`prefill_rows`, ``"rows"``), ``positions (b, Hs, P)`` (``-1`` padding),
    ``group`` the query heads per KV set (1 under ``gqa="none"``). Returns ``(b, Hs, P)``
    scores in ``dtype`` (zeros for a policy that ranks by position alone: ties keep the
    newest) and the ``(b, Hs, P)`` int64 history or None.
    """
    last = positions.amax(-1, keepdim=True)  # (b, Hs, 1) the last prompt position
    ctx = policies.StepContext(step=last, layer=layer, seed=args.seed, gqa=args.gqa, group=group)
    scores, history = args.spec.prefill_scores(columns, rows, positions, ctx)
    scores = torch.zeros(positions.shape, dtype=dtype, device=positions.device) if scores is None else scores.to(dtype)
    return scores, history


def prefill_select(
    scores: torch.Tensor,
    positions: torch.Tensor,
    args: PolicyArgs,
    layer: int = 0,
    protected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which prompt positions each KV set keeps, ``(b, Hs, P)`` bool.

    ``scores (b, Hs, P)`` are the prefill column sums, ``positions (b, Hs, P)``
    the original positions (``-1`` for padding); the choice is made on the
    policy's ranking values (:func:`prefill_scores`) by :func:`h2o_lens.eviction.prefill_keep`.
    ``protected`` the positions kept whatever their rank (a 1-D tensor, or ``(b, 1, K)`` per
    row padded with -2; the cache's extensions', DESIGN.md §1.1), None: none.
    """
    if args.spec.prefill == "rows":
        raise ConfigError(
            f"policy {args.policy!r} ranks a prompt by the weights of its last rows, not by "
            "column sums; compute them with prefill_rows and rank with prefill_scores"
        )
    drive, _ = prefill_scores(scores, None, positions, args, layer, scores.dtype)
    return eviction.prefill_keep(drive, positions, args.heavy, args.recent, args.sink, protected)


@dataclass
class DecodeResult:
    """Outputs of one decode step besides the in-place cache update.

    ``out (b, Hq, d)``; ``slot (b, Hs)`` the slot written (``B`` = the new token
    itself was evicted and nothing written); ``evicts (b, Hs)`` whether a
    position left the cache; ``cand_scores``/``cand_positions`` describe the candidate set
    D = slots + new token ``(b, Hs, B + 1)`` after the score update, for the
    recorder; ``old_key``/``old_value (b, Hs, d)`` what ``slot`` held before the
    write (asked with ``journal``; meaningless where ``slot == B``), for a rollback
    (DESIGN.md §14); ``weights (b, Hs, G, B + 1)`` the step's softmax weights per query head
    (slots, then the new token) from the torch step, which the guard reads (DESIGN.md §18).
    """

    out: torch.Tensor
    slot: torch.Tensor
    evicts: torch.Tensor
    cand_scores: torch.Tensor | None = None
    cand_positions: torch.Tensor | None = None
    old_key: torch.Tensor | None = None
    old_value: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@dataclass(frozen=True)
class RowBudgets:
    """Per-request slot counts of a batch whose requests' budgets differ (DESIGN.md §2.7).

    ``capacity``, ``recent`` and ``sink`` are ``(b, 1, 1)`` int64 tensors, one value per
    row: row ``r`` uses slots ``0 … capacity_r − 1`` of the storage; the slots beyond are
    never written, never attended and never chosen, so the row steps exactly as if its
    storage were ``capacity_r`` wide. ``self_victim`` says whether some row has no recent
    window (its new token may be its own victim). A layer whose KV sets hold different slot
    counts (a budget plan, DESIGN.md §2.14) has them ``(b, Hs, 1)``, one value per row and set.
    """

    capacity: torch.Tensor
    recent: torch.Tensor
    sink: torch.Tensor
    self_victim: bool
    _past: dict = field(default_factory=dict, compare=False, repr=False)  # beyond(B), once per B

    def beyond(self, cap: int) -> torch.Tensor:
        """``(b, 1, B + 1)`` True for the slots at or past each row's capacity, storage ``B``
        wide (:func:`_beyond`), computed once per width."""
        if cap not in self._past:
            self._past[cap] = _beyond(self.capacity, cap)
        return self._past[cap]

    @classmethod
    def of(cls, budgets: list[PolicyArgs], rows: torch.Tensor) -> RowBudgets:
        """``budgets`` the distinct budgets, ``rows (b,)`` int64 the budget index of each row."""
        table = torch.tensor([[a.capacity, a.recent, a.sink] for a in budgets], dtype=torch.int64)
        t = table.to(rows.device)[rows][:, :, None, None]  # (b, 3, 1, 1)
        used = set(rows.tolist())
        return cls(t[:, 0], t[:, 1], t[:, 2], any(budgets[i].recent == 0 for i in used))


def _per_block(fn, full: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
    """``fn`` on the full blocks and on the padded tail, joined on the block axis (2)."""
    if tail is None:
        return fn(full)
    if full.shape[2] == 0:
        return fn(tail)
    return torch.cat([fn(full), fn(tail)], 2)


def _attend(qg, keys, values, key, value, empty, acc):
    """Softmax attention of ``qg (b, Hs, G, d)`` (scaled) over the slots and the new token.

    ``keys, values (b, Hs, B, d)``, ``key, value (b, Hs, d)``, ``empty (b, Hs, B)`` True
    for slots that hold nothing (masked), or None. Returns ``out (b, Hs, G, d)`` and the
    weights ``(b, Hs, G, B + 1)`` in ``acc`` (slots, then the new token). Every product and
    sum over slots runs per block of :data:`DECODE_BLOCK` slots and the block sums add up in
    order (a cumulative sum), so empty slots past a row's last live slot change nothing,
    bit for bit, whatever the storage width.
    """
    return _attend_logits(block_logits(qg, keys, acc), qg, values, key, value, empty, acc)


def block_logits(qg: torch.Tensor, keys: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``(b, Hs, n, G, K)`` the logits of ``qg (b, Hs, G, d)`` against ``keys (b, Hs, B, d)`` as
    :func:`_attend` computes them: one matmul per block of :data:`DECODE_BLOCK` slots (the last
    one zero-padded), in ``acc``."""
    q = qg[:, :, None]  # (b,Hs,1,G,d)
    return _per_block(lambda k: torch.matmul(q, k.transpose(-1, -2)), *_blocks(keys)).to(acc)


def _attend_logits(logits, qg, values, key, value, empty, acc, cap=None):
    """:func:`_attend` from its block logits ``(b, Hs, n, G, K)`` (contiguous; the padding of
    the last block is overwritten). ``values (b, Hs, B, d)``, or already in zero-padded blocks
    ``(b, Hs, n, K, d)`` (contiguous; then ``cap`` is ``B``): one matmul for all blocks."""
    if cap is None:
        cap = values.shape[2]
    n = logits.shape[2]
    if empty is not None:  # empty slots and the tail's padding
        dead = torch.nn.functional.pad(empty, (0, n * DECODE_BLOCK - cap), value=True)  # (b,Hs,n·K)
        logits = logits.masked_fill(dead.unflatten(-1, (n, DECODE_BLOCK))[..., None, :], _NEG)
    elif cap % DECODE_BLOCK:  # the tail's padding
        logits[:, :, -1, :, cap % DECODE_BLOCK :] = _NEG
    new = torch.matmul(qg, key[..., None]).to(acc)  # (b,Hs,G,1)
    top = torch.maximum(logits.amax((2, 4)), new[..., 0])[..., None]  # (b,Hs,G,1)
    e = (logits - top[:, :, None]).exp_()  # (b,Hs,n,G,K)
    e_new = (new - top).exp_()  # (b,Hs,G,1)
    ev = e if e.dtype == values.dtype else e.to(values.dtype)
    if values.dim() == 5:
        parts = torch.matmul(ev, values)  # (b,Hs,n,G,d)
    else:
        full, tail = _blocks(values)
        nf = full.shape[2]
        parts = torch.matmul(ev[:, :, :nf], full) if nf else None
        if tail is not None:
            last = torch.matmul(ev[:, :, nf:], tail)
            parts = last if parts is None else torch.cat([parts, last], 2)
    parts = torch.cat([parts.to(acc), (e_new * value[:, :, None].to(acc))[:, :, None]], 2)
    sums = torch.cat([e.sum(-1), e_new.transpose(-1, -2)], 2)  # (b,Hs,n+1,G)
    total = sums.cumsum(2)[:, :, -1, :, None]  # (b,Hs,G,1) in order: block by block, then the new token
    out = parts.cumsum(2)[:, :, -1] / total  # (b,Hs,G,d)
    w = torch.cat([e.transpose(2, 3).flatten(-2)[..., :cap], e_new], -1) / total  # (b,Hs,G,B+1)
    return out, w


def attend_rows(qg, keys, values, key, value, acc, logits=None, cap=None):
    """The decode step's attention for rows that each bring their own storage: ``qg (b, R, G, d)``
    scaled queries, ``keys, values (b, R, B, d)`` every row's slots, ``key, value (b, R, d)``
    its own token. It is :func:`_attend` itself (the same block splits, the same matmul calls),
    so each row has the bits of a decode step over its slots (DESIGN.md §14.1). ``logits``: the
    rows' :func:`block_logits`, when the caller has them (``keys`` is then unused); ``values``
    may then come in zero-padded blocks ``(b, R, n, K, d)`` with ``cap`` = ``B`` (one matmul
    for all blocks: the caller checks it gives the same bits). Returns ``out (b, R, G, d)`` and
    the weights ``(b, R, G, B + 1)`` (slots, then the row's token)."""
    if logits is None:
        return _attend(qg, keys, values, key, value, None, acc)
    return _attend_logits(logits, qg, values, key, value, None, acc, cap)


def decode_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    positions: torch.Tensor,
    step: torch.Tensor,
    fill: torch.Tensor | None,
    scaling: float,
    args: PolicyArgs,
    *,
    layer: int = 0,
    history: torch.Tensor | None = None,
    want_candidates: bool = False,
    rows: RowBudgets | None = None,
    journal: bool = False,
    protected: torch.Tensor | None = None,
) -> DecodeResult:
    """One decode step for one layer, updating the cache in place.

    Parameters
    ----------
    query : ``(b, Hq, d)`` the new token's queries (after RoPE)
    key, value : ``(b, Hs, d)`` the new token's key/value
    keys, values : ``(b, Hs, B, d)`` slot storage, updated in place
    scores : ``(b, Hs, B)`` float32 ranking values (H2O: cumulative scores), updated in place
    positions : ``(b, Hs, B)`` integer original positions, ``-1`` empty, in place
    step : ``(b,)`` the query position of each request
    fill : ``(b,)`` number of used slots per request, or None when every slot
        is used (then every request evicts)
    scaling : float
    args : :class:`PolicyArgs`
    layer : int, the layer index (keys the ``random`` policy's draw, :func:`random_scores`)
    history : ``(b, Hs, B)`` int64 per-slot history of a policy that keeps one
        (``Policy.history``), updated in place; None otherwise
    rows : :class:`RowBudgets` when the rows' budgets differ: row ``r`` steps on its first
        ``capacity_r`` slots with its own recent window and sink (``args``' split is then
        unused), exactly as alone; None: every row uses ``args`` and all ``B`` slots
    journal : also return the K/V the write overwrites (``old_key``, ``old_value``)
    protected : positions never eligible (a 1-D tensor, or ``(b, 1, K)`` per row padded with -2):
        what the cache's extensions protect, the pins among them (DESIGN.md §1.1, §2.11); None: none

    Order (DESIGN.md §2): append → softmax over D → aggregate over the group and
    update the ranking values by the policy's rule (H2O: add; the new token's own
    weight seeds its score) → output over all of D → evict the lowest eligible
    value (tie: older position; ``protected`` positions, the pins, are never eligible) →
    overwrite the victim slot with the new token's K, V, score, history and position.
    """
    spec = args.spec
    b, hs, cap, d = keys.shape
    qg = _group_view(query, hs) * scaling  # (b, Hs, G, d)
    empty = positions < 0 if fill is not None or rows is not None else None  # (b,Hs,B)
    out, w = _attend(qg, keys, values, key, value, empty, scores.dtype)  # (b,Hs,G,d), (b,Hs,G,B+1)

    step_col = step[:, None, None]  # (b,1,1)
    new_pos = step_col.expand(b, hs, 1)
    if new_pos.dtype != positions.dtype:
        new_pos = new_pos.to(positions.dtype)
    agg = eviction.aggregate_group(w, args.gqa, 2) if spec.scored else None  # (b,Hs,B+1)
    ctx = policies.StepContext(step=step_col, layer=layer, seed=args.seed, gqa=args.gqa, group=qg.shape[2])
    new_score, new_history = spec.decode_scores(scores, history, agg, positions, ctx)  # (b,Hs,1)

    slot, evicts, c_scores, c_pos = _choose_slot(
        scores, positions, new_score, new_pos, step_col, fill, args, rows, protected
    )
    cands = {}
    if want_candidates:
        if c_scores is None:
            c_scores, c_pos = torch.cat([scores, new_score], -1), torch.cat([positions, new_pos], -1)
        cands = dict(cand_scores=c_scores, cand_positions=c_pos)
    if journal:
        idx = slot.clamp(max=cap - 1)[..., None, None].expand(b, hs, 1, d)
        cands.update(old_key=keys.gather(2, idx)[:, :, 0], old_value=values.gather(2, idx)[:, :, 0])
    _write_slot(
        keys,
        values,
        scores,
        positions,
        slot,
        key,
        value,
        new_score,
        new_pos,
        may_skip=args.recent == 0 if rows is None else rows.self_victim,
        history=history,
        new_history=new_history,
    )
    out = out.reshape(b, hs * qg.shape[2], d).to(query.dtype)
    return DecodeResult(out=out, slot=slot, evicts=evicts, weights=w, **cands)


def _choose_slot(
    scores, positions, new_score, new_pos, step_col, fill, args: PolicyArgs, rows: RowBudgets | None, protected=None
):
    """The slot each row and KV set writes its new token into ``(b, Hs)`` and whether a position
    leaves the cache there ``(b, Hs)``, with the candidate set D's scores and positions
    ``(b, Hs, B + 1)`` when the choice built it (else None): the lowest eligible ranking value (tie:
    older position; ``protected`` positions are never eligible) once a row is full, its next free slot before."""
    b, hs, cap = positions.shape
    pins = protected
    if rows is None and args.recent > 0:  # one budget with a recent window: the new token is never a victim
        c_scores = c_pos = None
        elig = eviction.eligible_mask(positions, step_col, args.recent, args.sink, all_live=fill is None, pinned=pins)
        victim, found = eviction.select_victim(scores, positions, elig)
    else:  # D = slots + the new token, eligible only in a row without a recent window
        recent, sink = (args.recent, args.sink) if rows is None else (rows.recent, rows.sink)
        c_scores = torch.cat([scores, new_score], -1)  # (b,Hs,B+1)
        c_pos = torch.cat([positions, new_pos], -1)
        elig = eviction.eligible_mask(c_pos, step_col, recent, sink, pinned=pins)
        beyond = None if rows is None else rows.beyond(cap)
        if beyond is not None:  # a slot past the row's capacity is never a victim (an extension's, DESIGN.md §1.1)
            elig &= ~beyond
        # a slot past the row's capacity never wins the tie of "nothing eligible" either (the new
        # token's position is above every slot's, so it wins it only where no slot does, as alone)
        big = torch.iinfo(c_pos.dtype).max
        tie_pos = c_pos if beyond is None else c_pos.masked_fill(beyond, big)
        victim, found = eviction.select_victim(c_scores, tie_pos, elig)
    if fill is None:
        return victim, found, c_scores, c_pos
    full = fill[:, None] >= (cap if rows is None else rows.capacity[..., 0])  # (b,1), or (b,Hs) per KV set
    slot = torch.where(full, victim, fill[:, None].expand(b, hs))
    return slot, full.expand(b, hs) & found, c_scores, c_pos


def _beyond(capacity: torch.Tensor, cap: int) -> torch.Tensor:
    """``(b, 1, B + 1)`` True for the slots at or past each row's ``capacity (b, 1, 1)``
    (the new token's column ``B`` is never past)."""
    idx = torch.arange(cap + 1, device=capacity.device)
    return (idx >= capacity) & (idx < cap)


def _write_slot(
    keys,
    values,
    scores,
    positions,
    slot,
    key,
    value,
    new_score,
    new_pos,
    may_skip: bool = False,
    history=None,
    new_history=None,
) -> None:
    """Overwrite ``slot (b, Hs)`` with the new token; ``slot == B`` writes nothing."""
    cap = keys.shape[2]
    if may_skip and bool((slot >= cap).any()):
        keep_old = slot >= cap  # (b,Hs)
        slot = slot.clamp(max=cap - 1)
        if history is not None:
            new_history = torch.where(keep_old[..., None], history.gather(2, slot[..., None]), new_history)
        idx = slot[..., None, None].expand(-1, -1, 1, keys.shape[-1])
        key = torch.where(keep_old[..., None], keys.gather(2, idx)[:, :, 0], key)
        value = torch.where(keep_old[..., None], values.gather(2, idx)[:, :, 0], value)
        new_score = torch.where(keep_old[..., None], scores.gather(2, slot[..., None]), new_score)
        new_pos = torch.where(keep_old[..., None], positions.gather(2, slot[..., None]), new_pos)
    idx = slot[..., None, None].expand(-1, -1, 1, keys.shape[-1])
    keys.scatter_(2, idx, key[:, :, None, :])
    values.scatter_(2, idx, value[:, :, None, :])
    scores.scatter_(2, slot[..., None], new_score)
    positions.scatter_(2, slot[..., None], new_pos)
    if history is not None:
        history.scatter_(2, slot[..., None], new_history)
