"""Prefill column sums of the causal attention, flash-style (never ``P x P``).

``score_i = Σ_{u>=i} agg_h a_{h,u,i}`` per KV set (DESIGN.md §2), the scores that
:func:`h2o_lens.ops.prefill_attention` returns. Two passes:

1. per query head and row, the running max and denominator of the causal
   softmax, stored as one base-2 log-sum-exp per row;
2. per KV set and block of key columns, the normalised weights recomputed
   row block by row block, aggregated over the group per row (sum or max)
   and summed over the rows.

Padding (``valid`` False) contributes nothing: a padding column is masked,
a padding row adds 0. Triton is imported on first use.
"""

from __future__ import annotations

import functools
import math

import torch

from ._checks import FLOAT_DTYPES, KernelInputError, cdiv, check_device, check_tensor, dot_options, next_pow2

__all__ = ["prefill_scores_triton"]

_LOG2E = 1.0 / math.log(2.0)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _row_lse(
        q_ptr,
        k_ptr,
        valid_ptr,
        lse_ptr,
        P,
        HQ,
        HS,
        HEAD_DIM,
        scale2,
        G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_VALID: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """Base-2 log-sum-exp of each causal row: ``lse (b, Hq, P)``."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)  # b * Hq + h
        bi = bh // HQ
        kv = bi * HS + (bh % HQ) // G
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < P
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < HEAD_DIM
        q = tl.load(
            q_ptr + (bh.to(tl.int64) * P + rows)[:, None] * HEAD_DIM + dd[None, :],
            mask=rmask[:, None] & dmask[None, :],
            other=0.0,
        )  # (BLOCK_M, D)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        end = tl.minimum(P, (pid_m + 1) * BLOCK_M)
        for start in range(0, end, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            cmask = cols < P
            k = tl.load(
                k_ptr + (kv.to(tl.int64) * P + cols)[:, None] * HEAD_DIM + dd[None, :],
                mask=cmask[:, None] & dmask[None, :],
                other=0.0,
            )  # (BLOCK_N, D)
            if DOT_F32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale2  # (BLOCK_M, BLOCK_N)
            ok = (cols[None, :] <= rows[:, None]) & cmask[None, :]
            if HAS_VALID:
                # a padding column is masked; a padding row still sees itself (finite, ignored later)
                cvalid = tl.load(valid_ptr + bi * P + cols, mask=cmask, other=0) != 0
                ok = ok & (cvalid[None, :] | (cols[None, :] == rows[:, None]))
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
            m_i = m_new
        tl.store(lse_ptr + bh.to(tl.int64) * P + rows, m_i + tl.log2(l_i), mask=rmask)

    @triton.jit
    def _col_sums(
        q_ptr,
        k_ptr,
        valid_ptr,
        lse_ptr,
        out_ptr,
        P,
        HQ,
        HS,
        HEAD_DIM,
        scale2,
        G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_VALID: tl.constexpr,
        AGG_MAX: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """Column sums of the group-aggregated weights: ``out (b, Hs, P)``."""
        pid_n = tl.program_id(0)
        bs = tl.program_id(1)  # b * Hs + kv
        bi = bs // HS
        h0 = bi * HQ + (bs % HS) * G  # first query head of the group
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < P
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < HEAD_DIM
        k = tl.load(
            k_ptr + (bs.to(tl.int64) * P + cols)[:, None] * HEAD_DIM + dd[None, :],
            mask=cmask[:, None] & dmask[None, :],
            other=0.0,
        )  # (BLOCK_N, D)
        if DOT_F32:
            k = k.to(tl.float32)
        if HAS_VALID:
            cvalid = tl.load(valid_ptr + bi * P + cols, mask=cmask, other=0) != 0
        else:
            cvalid = cmask
        acc = tl.zeros([BLOCK_N], tl.float32)
        first = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M  # rows u >= i only
        for r0 in range(first, P, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            rmask = rows < P
            if HAS_VALID:
                rvalid = tl.load(valid_ptr + bi * P + rows, mask=rmask, other=0) != 0
            else:
                rvalid = rmask
            ok = (cols[None, :] <= rows[:, None]) & cvalid[None, :] & rvalid[:, None]
            tile = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for g in range(G):
                hrow = (h0 + g).to(tl.int64) * P + rows
                q = tl.load(
                    q_ptr + hrow[:, None] * HEAD_DIM + dd[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0
                )  # (BLOCK_M, D)
                if DOT_F32:
                    q = q.to(tl.float32)
                lse = tl.load(lse_ptr + hrow, mask=rmask, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale2
                w = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)  # (BLOCK_M, BLOCK_N)
                if AGG_MAX:
                    tile = tl.maximum(tile, w)
                else:
                    tile = tile + w
            acc = acc + tl.sum(tile, axis=0)
        tl.store(out_ptr + bs.to(tl.int64) * P + cols, acc, mask=cmask)

    return _row_lse, _col_sums


def prefill_scores_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    gqa: str,
    *,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Per-key column sums of the causal prefill attention, aggregated per KV set.

    Parameters
    ----------
    query : ``(b, Hq, P, d)`` fp16/bf16/fp32, contiguous
    key : ``(b, Hs, P, d)`` same dtype, ``Hq`` a multiple of ``Hs``
    valid : ``(b, P)`` bool or None, False for (left) padding
    scaling : float
    gqa : "sum" | "max" | "none" (``none`` sums a group of one)
    block_m, block_n : rows / columns per block (powers of two >= 16)

    Returns
    -------
    scores : ``(b, Hs, P)`` float32, equal to the scores of :func:`h2o_lens.ops.prefill_attention`.
    """
    fn = "prefill_scores_triton"
    if query.dim() != 4 or key.dim() != 4:
        raise KernelInputError(
            f"{fn}: query {tuple(query.shape)} and key {tuple(key.shape)} must be (b, Hq, P, d) and (b, Hs, P, d)"
        )
    b, hq, p, d = query.shape
    hs = key.shape[1]
    if hs < 1 or hq % hs:
        raise KernelInputError(f"{fn}: query has {hq} heads and key {hs}; Hq must be a multiple of Hs")
    if gqa not in ("sum", "max", "none"):
        raise KernelInputError(f"{fn}: unknown gqa mode {gqa!r}; expected sum, max or none")
    check_tensor(fn, "query", query, (b, hq, p, d), FLOAT_DTYPES)
    check_tensor(fn, "key", key, (b, hs, p, d), (query.dtype,))
    if valid is not None:
        check_tensor(fn, "valid", valid, (b, p), (torch.bool,))
    check_device(fn, query=query, key=key, valid=valid)
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk < 16 or blk & (blk - 1):
            raise KernelInputError(f"{fn}: {name}={blk}; expected a power of two >= 16")
    group = hq // hs
    scores = torch.empty(b, hs, p, dtype=torch.float32, device=query.device)
    if p == 0 or b == 0:
        return scores
    lse = torch.empty(b, hq, p, dtype=torch.float32, device=query.device)
    row_lse, col_sums = _kernels()
    common = dict(
        G=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(d)),
        HAS_VALID=valid is not None,
        **dot_options(query.dtype),
        num_warps=num_warps,
    )
    vptr = query if valid is None else valid
    scale2 = float(scaling) * _LOG2E
    row_lse[(cdiv(p, block_m), b * hq)](query, key, vptr, lse, p, hq, hs, d, scale2, **common)
    col_sums[(cdiv(p, block_n), b * hs)](
        query, key, vptr, lse, scores, p, hq, hs, d, scale2, AGG_MAX=gqa == "max", **common
    )
    return scores
