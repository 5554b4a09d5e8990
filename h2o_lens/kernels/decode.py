"""Fused H2O decode step: attention, score update, victim choice and slot write.

One program per (request, KV set) does the whole of :func:`h2o_lens.ops.decode_step`
(DESIGN.md §2) in two passes over the ``B`` slots:

1. logits of the ``G`` query heads against the slots (empty slots masked) and
   the new token, online softmax and the output; the FP32 logits go to a
   scratch row so that the keys are read once;
2. FP32 weights from the scratch, aggregated over the group (sum or max) and
   added to the scores; the victim is the lowest eligible score, a tie evicts
   the older position (and, as ``argmin`` does, the lower slot among equal
   positions); with ``recent == 0`` the new token competes too.

Then the chosen slot (the victim, or the first empty slot of a row that is not
full) takes the new token's K, V, score and position. Triton is imported on
first use, so this module imports on machines without it.
"""

from __future__ import annotations

import functools

import torch

from .. import ops, policies
from ._checks import KernelInputError, check_step_inputs, dot_options, next_pow2, rows_table

__all__ = ["decode_step_triton"]

_POS_MAX = 2**62  # larger than any position: "no position" in the victim search


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_step(
        q_ptr,
        kn_ptr,
        vn_ptr,
        k_ptr,
        v_ptr,
        s_ptr,
        p_ptr,
        step_ptr,
        fill_ptr,
        out_ptr,
        logit_ptr,
        slot_ptr,
        evict_ptr,
        rows_ptr,
        B,
        HQ,
        HEAD_DIM,
        scale,
        recent,
        sink,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SCORED: tl.constexpr,
        AGG_MAX: tl.constexpr,
        HAS_FILL: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
        POS_MAX: tl.constexpr,
    ):
        bi = tl.program_id(0)
        hs = tl.program_id(1)
        row = bi * tl.num_programs(1) + hs  # (request, KV set)
        g = tl.arange(0, G_PAD)
        gmask = g < G
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < HEAD_DIM
        heads = bi * HQ + hs * G + g  # (G_PAD,) rows of query / out
        q = tl.load(
            q_ptr + heads[:, None] * HEAD_DIM + dd[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0
        )  # (G_PAD, D)
        if DOT_F32:
            q = q.to(tl.float32)
        kn = tl.load(kn_ptr + row * HEAD_DIM + dd, mask=dmask, other=0.0)  # (D,)
        vn = tl.load(vn_ptr + row * HEAD_DIM + dd, mask=dmask, other=0.0)
        step = tl.load(step_ptr + bi).to(tl.int64)
        slot_base = row.to(tl.int64) * B
        cap = B
        if HAS_ROWS:  # this (request, KV set)'s own capacity, recent window and sink
            cap = tl.load(rows_ptr + row * 3).to(tl.int32)
            recent = tl.load(rows_ptr + row * 3 + 1)
            sink = tl.load(rows_ptr + row * 3 + 2)

        # pass 1: online softmax seeded with the new token (never masked)
        l_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], axis=1) * scale  # (G_PAD,)
        m_i = l_new
        l_i = tl.full([G_PAD], 1.0, tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_D], tl.float32) + vn.to(tl.float32)[None, :]
        for start in range(0, B, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < B
            pos = tl.load(p_ptr + slot_base + n, mask=nmask, other=-1)
            live = nmask & (pos >= 0)
            kv_off = (slot_base + n)[:, None] * HEAD_DIM + dd[None, :]
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)  # (BLOCK_N, D)
            if DOT_F32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # (G_PAD, BLOCK_N)
            s = tl.where(live[None, :], s, float("-inf"))
            tl.store(
                logit_ptr + (row * G + g)[:, None].to(tl.int64) * B + n[None, :],
                s,
                mask=gmask[:, None] & nmask[None, :],
            )
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            if DOT_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + heads[:, None] * HEAD_DIM + dd[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=gmask[:, None] & dmask[None, :],
        )
        tl.debug_barrier()  # the scratch logits are read back by other threads

        # pass 2: weights, score update, victim search
        w_new = tl.where(gmask, tl.exp(l_new - m_i) / l_i, 0.0)  # (G_PAD,)
        if SCORED:
            if AGG_MAX:
                new_score = tl.max(w_new, axis=0)
            else:
                new_score = tl.sum(w_new, axis=0)
        else:
            new_score = tl.full([], 0.0, tl.float32)
        limit = step - recent
        best_s = tl.full([], float("inf"), tl.float32)
        best_p = tl.full([], POS_MAX, tl.int64)
        best_i = tl.full([], 0, tl.int32)
        found = tl.full([], 0, tl.int32)
        for start in range(0, B, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < B
            sc = tl.load(s_ptr + slot_base + n, mask=nmask, other=0.0)  # (BLOCK_N,)
            if SCORED:
                lg = tl.load(
                    logit_ptr + (row * G + g)[:, None].to(tl.int64) * B + n[None, :],
                    mask=gmask[:, None] & nmask[None, :],
                    other=float("-inf"),
                )
                w = tl.exp(lg - m_i[:, None]) / l_i[:, None]
                w = tl.where(gmask[:, None], w, 0.0)  # (G_PAD, BLOCK_N)
                if AGG_MAX:
                    sc = sc + tl.max(w, axis=0)
                else:
                    sc = sc + tl.sum(w, axis=0)
                tl.store(s_ptr + slot_base + n, sc, mask=nmask)
            pos = tl.load(p_ptr + slot_base + n, mask=nmask, other=-1).to(tl.int64)
            elig = nmask & (pos >= 0) & (pos <= limit) & (pos >= sink)
            s_el = tl.where(elig, sc, float("inf"))
            low = tl.min(s_el, axis=0)
            tied = elig & (s_el == low)
            low_p = tl.min(tl.where(tied, pos, POS_MAX), axis=0)
            low_i = tl.min(tl.where(tied & (pos == low_p), n, B + BLOCK_N), axis=0)
            better = (low < best_s) | ((low == best_s) & (low_p < best_p))
            best_s = tl.where(better, low, best_s)
            best_p = tl.where(better, low_p, best_p)
            best_i = tl.where(better, low_i, best_i)
            found = tl.maximum(found, tl.max(elig.to(tl.int32), axis=0))
        # recent == 0: the new token (position step, slot B) competes as well
        new_elig = (step <= limit) & (step >= sink) & (step >= 0)
        better = new_elig & ((new_score < best_s) | ((new_score == best_s) & (step < best_p)))
        best_i = tl.where(better, B, best_i)
        found = tl.maximum(found, new_elig.to(tl.int32))
        if HAS_FILL:
            fill = tl.load(fill_ptr + bi).to(tl.int32)
            full = fill >= cap
            slot = tl.where(full, best_i, fill)
            evicts = full & (found > 0)
        else:
            slot = best_i
            evicts = found > 0
        tl.store(slot_ptr + row, slot.to(tl.int64))
        tl.store(evict_ptr + row, evicts)

        # overwrite the chosen slot (slot == B: the new token evicted itself, write nothing)
        tl.debug_barrier()
        write = slot < B
        write_d = dmask & ((dd * 0 + slot) < B)  # (vector form: a scalar & vector mask trips the interpreter)
        dst = (slot_base + slot) * HEAD_DIM + dd
        tl.store(k_ptr + dst, kn, mask=write_d)
        tl.store(v_ptr + dst, vn, mask=write_d)
        tl.store(s_ptr + slot_base + slot, new_score, mask=write)
        tl.store(p_ptr + slot_base + slot, step.to(p_ptr.dtype.element_ty), mask=write)

    return _decode_step


def decode_step_triton(
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
    args: ops.PolicyArgs,
    *,
    layer: int = 0,
    block_n: int | None = None,
    num_warps: int = 4,
    rows: ops.RowBudgets | None = None,
) -> ops.DecodeResult:
    """Fused H2O decode step; same contract and in-place effects as :func:`h2o_lens.ops.decode_step`.

    Parameters
    ----------
    query : ``(b, Hq, d)`` fp16/bf16/fp32, the new token's queries (after RoPE)
    key, value : ``(b, Hs, d)`` same dtype, the new token's key/value
    keys, values : ``(b, Hs, B, d)`` same dtype, slot storage, updated in place
    scores : ``(b, Hs, B)`` float32 cumulative scores, updated in place
    positions : ``(b, Hs, B)`` int32/int64 original positions, ``-1`` empty, in place
    step : ``(b,)`` int32/int64, the query position of each request
    fill : ``(b,)`` int32/int64 used slots per request, or None when every slot is used
    scaling : float
    args : :class:`h2o_lens.ops.PolicyArgs`; a policy whose registry entry has no ``"decode"``
        kernel (``random``, ``tova``, ``scissorhands``) runs the torch path
    layer : the layer index, which keys the ``random`` policy's draw (unused otherwise)
    block_n : slots per block (a power of two >= 16); default from ``B`` and ``d``
    num_warps : Triton launch option
    rows : :class:`h2o_lens.ops.RowBudgets` whose ``capacity``, ``recent`` and ``sink`` give each
        request (``(b, 1, 1)``) or each request and KV set (``(b, Hs, 1)``, a budget plan's ragged
        layer, DESIGN.md §2.14) its own: it uses its first ``capacity`` slots (the others hold
        position ``-1``), ``args``' split is unused; a new token that evicts itself reports slot ``B``

    Returns
    -------
    :class:`h2o_lens.ops.DecodeResult` with ``out (b, Hq, d)``, ``slot (b, Hs)`` int64
    (``B``: the new token evicted itself, nothing written) and ``evicts (b, Hs)`` bool;
    the ``cand_*`` fields are None.

    Empty slots (position ``-1``) are masked whether or not ``fill`` is given (the torch
    path masks them only with ``fill``; the two agree whenever ``fill is None`` means
    every slot is used, as the contract says). Logits stay in FP32 for every input
    dtype, so in fp16/bf16 the kernel is closer to FP64 than the torch path, whose
    logits are rounded to the input dtype.
    """
    fn = "decode_step_triton"
    spec = args.spec
    if not spec.evicts:
        raise KernelInputError(
            f"{fn}: policy {args.policy!r} does not evict, so it has no decode step; "
            f"expected one of {', '.join(p.name for p in policies.evicting())}"
        )
    if "decode" not in spec.kernels:
        # its scores have one implementation, the torch path's (the random draw's hash, the
        # current weights, the history); this kernel implements accumulating and unscored policies
        if spec.history:
            raise KernelInputError(
                f"{fn}: policy {args.policy!r} keeps a per-slot history, which this "
                "launcher does not carry; call h2o_lens.ops.decode_step with history="
            )
        return ops.decode_step(
            query, key, value, keys, values, scores, positions, step, fill, scaling, args, layer=layer
        )
    if spec.scored and not spec.accumulates:
        raise KernelInputError(
            f"{fn}: policy {args.policy!r} is marked with a decode kernel but its scores "
            "do not accumulate; the kernel adds weights (SCORED) or leaves scores alone; "
            f"fix its entry in h2o_lens/policies (known: {', '.join(policies.names())})"
        )
    b, hs, cap, d, hq = check_step_inputs(fn, query, key, value, keys, values, scores, positions, step, fill)
    if block_n is None:
        block_n = 64 if d > 64 else 128
        block_n = max(16, min(block_n, next_pow2(cap)))
    if block_n < 16 or block_n & (block_n - 1):
        raise KernelInputError(f"{fn}: block_n={block_n}; expected a power of two >= 16")

    group = hq // hs
    out = torch.empty_like(query)
    if b == 0:
        empty = torch.empty(0, hs, dtype=torch.int64, device=keys.device)
        return ops.DecodeResult(out=out, slot=empty, evicts=empty.bool())
    table = None if rows is None else rows_table(rows, b, hs, keys.device)  # (b, Hs, 3)
    logits = torch.empty(b, hs, group, cap, dtype=torch.float32, device=keys.device)  # scratch
    slot = torch.empty(b, hs, dtype=torch.int64, device=keys.device)
    evicts = torch.empty(b, hs, dtype=torch.bool, device=keys.device)
    _kernels()[(b, hs)](
        query,
        key,
        value,
        keys,
        values,
        scores,
        positions,
        step,
        step if fill is None else fill,
        out,
        logits,
        slot,
        evicts,
        step if table is None else table,
        cap,
        hq,
        d,
        float(scaling),
        args.recent,
        args.sink,
        G=group,
        G_PAD=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(d)),
        SCORED=spec.accumulates,
        AGG_MAX=args.gqa == "max",
        HAS_FILL=fill is not None,
        HAS_ROWS=table is not None,
        POS_MAX=_POS_MAX,
        **dot_options(keys.dtype),
        num_warps=num_warps,
    )
    return ops.DecodeResult(out=out, slot=slot, evicts=evicts)
