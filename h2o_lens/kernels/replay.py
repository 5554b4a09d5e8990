"""Dropped mass of a compressed run under the full-cache teacher (DESIGN.md §6).

``m(t, h) = Σ_{i <= t, evict_step[kv(h), i] < t} a_full(h, t, i)``: the share of the
full causal attention of query ``t`` that falls on keys the run no longer held
at step ``t``. A position evicted at step ``s`` was still in the candidate set of
step ``s``, so it counts as dropped from query ``s + 1`` on.

Two implementations of one contract: :func:`replay_dropped_mass_torch` (plain
torch, chunked rows, CPU or GPU) and :func:`replay_dropped_mass_triton`, which
walks the keys once per row block with an online softmax carrying two sums (all
keys, dropped keys) rescaled by the same running max, so it never forms
``N x N``. Triton is imported on first use.

The replay's torch passes over the generated rows (DESIGN.md §6.1) live here too:
:func:`replay_teacher_torch` gives the teacher's attention output together with the
same dropped mass and oracle columns from one pass over the score tiles, and
:func:`replay_masked_torch` the attention of the rows over what the run kept.
"""

from __future__ import annotations

import functools
import math

import torch

from ._checks import (
    FLOAT_DTYPES,
    INT_DTYPES,
    KernelInputError,
    cdiv,
    check_device,
    check_tensor,
    dot_options,
    next_pow2,
)

__all__ = ["replay_dropped_mass_triton", "replay_dropped_mass_torch", "replay_masked_torch", "replay_teacher_torch"]

_LOG2E = 1.0 / math.log(2.0)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _dropped_mass(
        q_ptr,
        k_ptr,
        ev_ptr,
        out_ptr,
        lse_ptr,
        N,
        M,
        HQ,
        HS,
        HEAD_DIM,
        scale2,
        G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        WANT_LSE: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """Dropped mass of the last ``M`` of ``N`` positions (query row ``j`` is position
        ``N - M + j``); with ``WANT_LSE`` also each row's base-2 log-sum-exp."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)  # b * Hq + h
        kv = (bh // HQ) * HS + (bh % HQ) // G
        local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = local < M
        rows = local + (N - M)  # positions
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < HEAD_DIM
        q = tl.load(
            q_ptr + (bh.to(tl.int64) * M + local)[:, None] * HEAD_DIM + dd[None, :],
            mask=rmask[:, None] & dmask[None, :],
            other=0.0,
        )  # (BLOCK_M, D)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_all = tl.zeros([BLOCK_M], tl.float32)
        l_drop = tl.zeros([BLOCK_M], tl.float32)
        end = tl.minimum(N, N - M + (pid_m + 1) * BLOCK_M)
        for start in range(0, end, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            cmask = cols < N
            k = tl.load(
                k_ptr + (kv.to(tl.int64) * N + cols)[:, None] * HEAD_DIM + dd[None, :],
                mask=cmask[:, None] & dmask[None, :],
                other=0.0,
            )  # (BLOCK_N, D)
            if DOT_F32:
                k = k.to(tl.float32)
            ev = tl.load(ev_ptr + kv.to(tl.int64) * N + cols, mask=cmask, other=0).to(tl.int64)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale2  # (BLOCK_M, BLOCK_N)
            ok = (cols[None, :] <= rows[:, None]) & cmask[None, :]
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            gone = ev[None, :] < rows[:, None].to(tl.int64)  # evicted before step t
            l_all = l_all * alpha + tl.sum(p, axis=1)
            l_drop = l_drop * alpha + tl.sum(tl.where(gone, p, 0.0), axis=1)
            m_i = m_new
        tl.store(out_ptr + bh.to(tl.int64) * M + local, l_drop / l_all, mask=rmask)
        if WANT_LSE:
            tl.store(lse_ptr + bh.to(tl.int64) * M + local, m_i + tl.log2(l_all), mask=rmask)

    @triton.jit
    def _oracle(
        q_ptr,
        k_ptr,
        ev_ptr,
        lse_ptr,
        before_ptr,
        after_ptr,
        N,
        M,
        HQ,
        HS,
        HEAD_DIM,
        scale2,
        G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        AGG_MAX: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """Per key: the group-aggregated weight of the query rows, split at the key's eviction
        step (``before``: rows ``t <= evict_step``, ``after``: rows ``t > evict_step``)."""
        pid_n = tl.program_id(0)
        bs = tl.program_id(1)  # b * Hs + kv
        h0 = (bs // HS) * HQ + (bs % HS) * G  # first query head of the group
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < HEAD_DIM
        k = tl.load(
            k_ptr + (bs.to(tl.int64) * N + cols)[:, None] * HEAD_DIM + dd[None, :],
            mask=cmask[:, None] & dmask[None, :],
            other=0.0,
        )  # (BLOCK_N, D)
        if DOT_F32:
            k = k.to(tl.float32)
        ev = tl.load(ev_ptr + bs.to(tl.int64) * N + cols, mask=cmask, other=0).to(tl.int64)
        acc_before = tl.zeros([BLOCK_N], tl.float32)
        acc_after = tl.zeros([BLOCK_N], tl.float32)
        offset = N - M
        first = tl.maximum(pid_n * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M  # rows t >= i only
        for r0 in range(first, M, BLOCK_M):
            local = r0 + tl.arange(0, BLOCK_M)
            rmask = local < M
            rows = local + offset
            ok = (cols[None, :] <= rows[:, None]) & cmask[None, :] & rmask[:, None]
            tile = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for g in range(G):
                hrow = (h0 + g).to(tl.int64) * M + local
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
            gone = ev[None, :] < rows[:, None].to(tl.int64)
            acc_after = acc_after + tl.sum(tl.where(gone, tile, 0.0), axis=0)
            acc_before = acc_before + tl.sum(tl.where(gone, 0.0, tile), axis=0)
        tl.store(before_ptr + bs.to(tl.int64) * N + cols, acc_before, mask=cmask)
        tl.store(after_ptr + bs.to(tl.int64) * N + cols, acc_after, mask=cmask)

    return _dropped_mass, _oracle


def _check(fn: str, query, key, evict_step, for_triton: bool) -> tuple[int, int, int, int, int, int]:
    """Shapes ``(b, Hq, M, d), (b, Hs, N, d), (b, Hs, N)`` with ``M <= N`` (the queries are the
    last M positions); the kernel also needs contiguity and a dtype it computes in (the torch
    path takes float64 too). Returns ``b, Hq, Hs, M, N, d``."""
    if query.dim() != 4 or key.dim() != 4:
        raise KernelInputError(
            f"{fn}: query {tuple(query.shape)} and key {tuple(key.shape)} must be (b, Hq, M, d) and (b, Hs, N, d)"
        )
    b, hq, m, d = query.shape
    hs, n = key.shape[1], key.shape[2]
    if hs < 1 or hq % hs:
        raise KernelInputError(f"{fn}: query has {hq} heads and key {hs}; Hq must be a multiple of Hs")
    if m > n:
        raise KernelInputError(f"{fn}: query has {m} positions and key {n}; expected at most as many")
    dtypes = FLOAT_DTYPES if for_triton else (*FLOAT_DTYPES, torch.float64)
    check_tensor(fn, "query", query, (b, hq, m, d), dtypes, for_triton)
    check_tensor(fn, "key", key, (b, hs, n, d), (query.dtype,), for_triton)
    check_tensor(fn, "evict_step", evict_step, (b, hs, n), INT_DTYPES, for_triton)
    return b, hq, hs, m, n, d


def replay_dropped_mass_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    evict_step: torch.Tensor,
    scaling: float,
    *,
    oracle: str | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
):
    """Dropped mass per query position and head, flash-style; the contract of
    :func:`replay_dropped_mass_torch`.

    Parameters
    ----------
    query : ``(b, Hq, M, d)`` fp16/bf16/fp32, contiguous, the teacher's queries (after RoPE)
        of the last ``M <= N`` positions (query row ``j`` is position ``N − M + j``)
    key : ``(b, Hs, N, d)`` same dtype, ``Hq`` a multiple of ``Hs`` (heads ``h*G..h*G+G-1``
        share KV set ``h``)
    evict_step : ``(b, Hs, N)`` int32/int64, the decode step at which each position left
        the cache of that KV set; a value ``>= N`` if it never did
    scaling : float
    oracle : None, "sum" or "max": also return the per-key weights split at the eviction
        step (``before``, ``after``, each ``(b, Hs, N)`` float32), aggregated over the
        group's query heads; a second kernel walks the rows once per key block with the
        rows' log-sum-exp from the first
    block_m, block_n : rows / keys per block (powers of two >= 16)

    Returns
    -------
    ``(b, Hq, M)`` float32, ``out[b, h, j] = Σ_{i <= t, evict_step[b, kv(h), i] < t} a(h, t, i)``
    with ``t = N − M + j``; with ``oracle``, ``(out, before, after)``.
    """
    fn = "replay_dropped_mass_triton"
    b, hq, hs, m, n, d = _check(fn, query, key, evict_step, for_triton=True)
    check_device(fn, query=query, key=key, evict_step=evict_step)
    if oracle not in (None, "sum", "max"):
        raise KernelInputError(f"{fn}: oracle={oracle!r}; expected None, 'sum' or 'max'")
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk < 16 or blk & (blk - 1):
            raise KernelInputError(f"{fn}: {name}={blk}; expected a power of two >= 16")
    dev = query.device
    out = torch.empty(b, hq, m, dtype=torch.float32, device=dev)
    before = torch.zeros(b, hs, n, dtype=torch.float32, device=dev) if oracle else None
    after = torch.zeros(b, hs, n, dtype=torch.float32, device=dev) if oracle else None
    if b and m:
        dropped, oracle_cols = _kernels()
        lse = torch.empty(b, hq, m, dtype=torch.float32, device=dev) if oracle else out
        common = dict(
            G=hq // hs,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=max(16, next_pow2(d)),
            num_warps=num_warps,
            **dot_options(query.dtype),
        )
        scale2 = float(scaling) * _LOG2E
        dropped[(cdiv(m, block_m), b * hq)](
            query, key, evict_step, out, lse, n, m, hq, hs, d, scale2, WANT_LSE=oracle is not None, **common
        )
        if oracle:
            oracle_cols[(cdiv(n, block_n), b * hs)](
                query, key, evict_step, lse, before, after, n, m, hq, hs, d, scale2, AGG_MAX=oracle == "max", **common
            )
    return out if oracle is None else (out, before, after)


def _check_value(fn: str, value: torch.Tensor, key: torch.Tensor) -> None:
    """``value`` is ``(b, Hs, N, dv)`` like the key, in the key's dtype."""
    b, hs, n, _ = key.shape
    check_tensor(fn, "value", value, (b, hs, n, None), (key.dtype,), False)


def _upper(c: int, device) -> torch.Tensor:
    """``(c, c)`` True strictly above the diagonal: the future keys of a diagonal block."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu_(1)


#: Largest score tile of the teacher's torch pass, in bytes: a tile holds as many KV sets as
#: fit (at least one). glibc serves a block above 32 MiB with a fresh ``mmap`` each time, so a
#: larger tile would fault in every page again at every layer and row block.
TILE_BYTES = 16 << 20

#: Query rows per tile of the teacher's torch pass in the replay. Its tile is read by some ten
#: elementwise passes (mask, exp, gathers, sums), so a tile of fewer rows stays closer to the
#: core: 128 rows took 13 ms a layer against 24 ms at 512 (9 query heads, 512 rows over 1,536
#: keys, two threads) and 20 ms against 25 ms at 4,352 keys; 64 and 256 were slower.
TEACHER_TILE_ROWS = 128


def _teacher_pass(query, key, value, evict_step, scaling, chunk, oracle, widen, lse=None):
    """One pass over the causal score tiles of the last ``M`` rows, ``chunk`` rows at a time.

    Each tile ``(b, S, G, c, end)`` (``S`` KV sets, at most :data:`TILE_BYTES`) gives the
    teacher's weights once; from them come the attention output (when ``value`` is given),
    the dropped mass and the oracle columns. ``widen`` computes the logits in the
    accumulation dtype (FP32, FP64 for FP64 inputs), with the scaling folded into the
    queries, rather than in the input dtype. With ``lse`` (each row's log-sum-exp over its
    keys, ``(b, Hq, M)``) a weight is ``exp(logit − lse)``: no softmax, whose maximum and
    normaliser cost two more passes over the tile. Returns ``out`` (or None), ``dropped``,
    ``before``, ``after`` (None without ``oracle``).

    Per row block the keys fall in three kinds: gone for every row of the block (evicted
    before its first step), for none (evicted at its last step or later, or never) and the
    few evicted within the block's steps (at most one per step and set for a policy that
    evicts one at a time). The first two need no per-row mask: a matrix-vector product gives
    the dropped mass and the column sums give the oracle columns; only the third is masked
    row by row, on the gathered columns (their union over the sets, the same for every tile
    of the block, so a set's figures do not depend on how the sets are split into tiles).
    """
    b, hs, n, d = key.shape
    hq, m = query.shape[1], query.shape[2]
    g = hq // hs
    offset = n - m
    dev = query.device
    acc = torch.promote_types(query.dtype, torch.float32)
    logit_dtype = acc if widen else query.dtype
    qg = query.to(logit_dtype).reshape(b, hs, g, m, d)  # (b, Hs, G, M, d)
    if widen:
        qg, scaling = qg * scaling, 1.0
    kt = key.to(logit_dtype).transpose(-1, -2)  # (b, Hs, d, N), a view
    vg = value.to(acc) if value is not None else None  # (b, Hs, N, dv)
    out = torch.empty(b, hs, g, m, value.shape[-1], dtype=query.dtype, device=dev) if value is not None else None
    dropped = torch.empty(b, hs, g, m, dtype=acc, device=dev)
    before = torch.zeros(b, hs, n, dtype=acc, device=dev) if oracle is not None else None
    after = torch.zeros(b, hs, n, dtype=acc, device=dev) if oracle is not None else None
    lse = lse.to(acc).reshape(b, hs, g, m, 1) if lse is not None else None  # (b, Hs, G, M, 1)
    for s in range(0, m, chunk):
        e = min(m, s + chunk)
        end = offset + e  # keys past the chunk's last position are masked anyway
        ev = evict_step[..., :end]  # (b, Hs, end)
        always = ev < offset + s  # gone for every row of the block
        mixed = (ev >= offset + s) & (ev < end - 1)  # gone for its later rows only
        cols = torch.nonzero(mixed.flatten(0, 1).any(0)).flatten()  # (K,) union over b and sets
        rows = torch.arange(offset + s, end, device=dev)[:, None]  # (c, 1) positions
        mixed_k = mixed[..., cols][:, :, None, :]  # (b, Hs, 1, K)
        gone_k = (ev[..., cols][:, :, None, :] < rows) & mixed_k  # (b, Hs, c, K)
        step = max(1, TILE_BYTES // max(1, b * g * (e - s) * end * acc.itemsize))  # KV sets per tile
        for h0 in range(0, hs, step):
            h = slice(h0, min(hs, h0 + step))
            # the set's G query heads as one (G·c, d) matrix: no copy of the keys per query head
            q_rows = qg[:, h, :, s:e, :].flatten(2, 3)  # (b, S, G·c, d)
            logits = torch.matmul(q_rows, kt[:, h, :, :end]).unflatten(2, (g, e - s))  # (b, S, G, c, end)
            if scaling != 1.0:
                logits *= scaling
            # future keys lie in the diagonal block only
            logits[..., offset + s :].masked_fill_(_upper(e - s, dev), float("-inf"))
            if lse is None:
                w = torch.softmax(logits, dim=-1, dtype=acc)
            else:  # the weights from the rows' log-sum-exp, in place
                w = logits.sub_(lse[:, h, :, s:e]).exp_()
            del logits
            if vg is not None:
                out[:, h, :, s:e, :] = torch.matmul(w.flatten(2, 3), vg[:, h, :end]).unflatten(2, (g, e - s))
            w_k = w[..., cols]  # (b, S, G, c, K)
            dropped[:, h, :, s:e] = torch.matmul(w, always[:, h].to(acc)[:, :, None, :, None])[..., 0] + (
                w_k * gone_k[:, h, None]
            ).sum(-1)
            if oracle is not None:
                agg = w.amax(2) if oracle == "max" else w.sum(2)  # (b, S, c, end)
                col = agg.sum(-2)  # (b, S, end)
                agg_k = agg[..., cols]  # (b, S, c, K)
                after[:, h, :end] += torch.where(always[:, h], col, 0.0)
                before[:, h, :end] += torch.where(always[:, h] | mixed[:, h], 0.0, col)
                after[:, h, cols] += (agg_k * gone_k[:, h]).sum(-2)
                before[:, h, cols] += (agg_k * (mixed_k[:, h] & ~gone_k[:, h])).sum(-2)
    return out, dropped.reshape(b, hq, m), before, after


def replay_dropped_mass_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    evict_step: torch.Tensor,
    scaling: float,
    chunk: int = 256,
    *,
    oracle: str | None = None,
):
    """The same dropped mass in plain torch, ``chunk`` query rows at a time.

    Memory is ``O(b · Hq · chunk · N)``; works on any device. Shapes as in
    :func:`replay_dropped_mass_triton`: ``query (b, Hq, M, d)`` may hold only
    the last ``M <= N`` positions (query row ``j`` is position ``N − M + j``),
    as when replaying the generated part after a shared prompt. Returns
    ``(b, Hq, M)`` float32 (float64 for float64 inputs). The logits are
    computed in the input dtype (the reference of the Triton kernel's contract).

    With ``oracle="sum"`` or ``"max"`` it also returns, per KV set and key
    position, the teacher weight these rows put on the key (aggregated over
    the set's query heads like the run's ``gqa``), split at the key's
    eviction step: ``before (b, Hs, N)`` sums rows ``<= evict_step`` and
    ``after (b, Hs, N)`` rows ``> evict_step`` (the attention a victim would
    still have received).
    """
    fn = "replay_dropped_mass_torch"
    _check(fn, query, key, evict_step, for_triton=False)
    if chunk < 1:
        raise KernelInputError(f"{fn}: chunk={chunk}; expected a positive number of rows")
    if oracle not in (None, "sum", "max"):
        raise KernelInputError(f"{fn}: oracle={oracle!r}; expected None, 'sum' or 'max'")
    _, dropped, before, after = _teacher_pass(query, key, None, evict_step, scaling, chunk, oracle, widen=False)
    return dropped if oracle is None else (dropped, before, after)


def replay_teacher_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    evict_step: torch.Tensor,
    scaling: float,
    chunk: int = 256,
    *,
    oracle: str | None = None,
    output: bool = True,
    lse: torch.Tensor | None = None,
):
    """The teacher's attention of the last ``M`` rows with their dropped mass, from one pass.

    Each ``chunk``-row tile of the teacher's weights (full causal attention) gives
    the attention output, the dropped mass and (with ``oracle``) the oracle columns
    of :func:`replay_dropped_mass_torch`, so the score tiles are computed once.
    The logits and weights are computed in FP32 (FP64 for FP64 inputs) whatever the
    input dtype. Memory is ``O(b · Hq · chunk · N)``.

    Parameters
    ----------
    query : ``(b, Hq, M, d)``, the queries of the last ``M <= N`` positions
    key, value : ``(b, Hs, N, d)`` and ``(b, Hs, N, dv)``, ``Hq`` a multiple of ``Hs``
    evict_step : ``(b, Hs, N)`` integer, the step at which each position left the cache
    scaling : float
    chunk : query rows per tile
    oracle : None, "sum" or "max" (as in :func:`replay_dropped_mass_torch`)
    output : False skips the attention output (``out`` is then None): a caller that takes
        the output from another kernel pays only for the dropped mass and the oracle columns
    lse : ``(b, Hq, M)`` float32, each row's natural log-sum-exp over its keys (full causal
        attention), as :func:`replay_masked_torch` gives it with nothing evicted: the weights
        are then ``exp(logit − lse)`` instead of a softmax over each tile row (equal to
        rounding: the kernel that gave ``lse`` summed in another order)

    Returns
    -------
    ``out (b, Hq, M, dv)`` in the query dtype, ``dropped (b, Hq, M)``; with ``oracle``
    also ``before, after (b, Hs, N)``.
    """
    fn = "replay_teacher_torch"
    _check(fn, query, key, evict_step, for_triton=False)
    _check_value(fn, value, key)
    if chunk < 1:
        raise KernelInputError(f"{fn}: chunk={chunk}; expected a positive number of rows")
    if oracle not in (None, "sum", "max"):
        raise KernelInputError(f"{fn}: oracle={oracle!r}; expected None, 'sum' or 'max'")
    if lse is not None:
        check_tensor(fn, "lse", lse, tuple(query.shape[:3]), (torch.float32, torch.float64), False)
    out, dropped, before, after = _teacher_pass(
        query, key, value if output else None, evict_step, scaling, chunk, oracle, widen=True, lse=lse
    )
    if output:
        out = out.reshape(query.shape[0], query.shape[1], query.shape[2], value.shape[-1])
    return (out, dropped) if oracle is None else (out, dropped, before, after)


def replay_masked_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    evict_step: torch.Tensor,
    scaling: float,
    chunk: int = 256,
    *,
    lse: bool = False,
):
    """Attention of the last ``M`` rows over only the positions the run still held.

    Row ``t`` sees key ``i`` when ``i <= t`` and ``evict_step[i] >= t`` (a position
    evicted at step ``t`` is still seen at ``t``; row ``t`` always sees itself).
    ``scaled_dot_product_attention``, ``chunk`` rows and one KV set at a time, over the
    keys some row of the block still sees: a key evicted before the block's first row
    takes no part. The set's ``G`` query heads share one additive mask ``(b, 1, chunk, K)``
    (0 where seen, −inf where not, in the query dtype: what SDPA makes of a boolean
    mask), never one per query head; memory is ``O(b · G · chunk · N)``, never ``M x N``
    at once (the fused CPU kernel accumulates 16-bit inputs in FP32). A block whose first
    row lost nothing leaves no key out, so a row that lost nothing has the bits of the
    call with nothing evicted (the teacher's). Shapes as in :func:`replay_teacher_torch`;
    returns ``(b, Hq, M, dv)`` in the query dtype.

    With ``lse=True`` it returns ``(out, lse)``: ``lse (b, Hq, M)`` float32 is each row's
    natural log-sum-exp over the keys it saw, from the fused CPU kernel (float32 inputs
    on CPU, the value width equal to the key width; the same kernel SDPA runs there, the
    same bits), else None.
    """
    fn = "replay_masked_torch"
    b, hq, hs, m, n, d = _check(fn, query, key, evict_step, for_triton=False)
    _check_value(fn, value, key)
    if chunk < 1:
        raise KernelInputError(f"{fn}: chunk={chunk}; expected a positive number of rows")
    dev = query.device
    g = hq // hs
    dv = value.shape[-1]
    fused = dev.type == "cpu" and query.dtype == torch.float32 and dv == d  # the kernel that gives the lse
    ninf = torch.tensor(float("-inf"), dtype=query.dtype, device=dev)
    zero = torch.tensor(0.0, dtype=query.dtype, device=dev)
    out = torch.empty(b, hq, m, dv, dtype=query.dtype, device=dev)
    rows_lse = torch.empty(b, hq, m, dtype=torch.float32, device=dev) if lse and fused else None
    for s in range(0, m, chunk):
        e = min(m, s + chunk)
        first, c = n - m + s, e - s  # the block's rows are positions first .. first + c - 1
        rows = torch.arange(first, first + c, device=dev)[:, None]  # (c, 1) positions
        upper = _upper(c, dev)  # the future keys of the block's own positions
        bias = None
        for h in range(hs):
            ev = evict_step[:, h]  # (b, N)
            if bias is None or not torch.equal(ev, evict_step[:, h - 1]):  # else the same keys and mask
                # keys gone for every row of the block take no part; positions >= first always do
                seen = (ev >= first).any(0)  # (N,) over b
                idx = None if bool(seen.all()) else torch.nonzero(seen).flatten()  # (K,)
                ev_k = ev[:, None, None, :] if idx is None else ev[:, idx][:, None, None, :]  # (b, 1, 1, K)
                hidden = ev_k < rows  # (b, 1, c, K): gone before the row's step
                tail = ev_k.shape[-1] - (n - first)  # where position first lies among the keys
                hidden[..., tail : tail + c] |= upper
                hidden[..., tail + c :] = True  # positions after the block's last row
                bias = torch.where(hidden, ninf, zero)
            k_h, v_h = key[:, h : h + 1], value[:, h : h + 1]  # (b, 1, N, d)
            if idx is not None:
                k_h, v_h = k_h.index_select(2, idx), v_h.index_select(2, idx)
            heads = slice(h * g, (h + 1) * g)
            if fused:
                k_h, v_h = k_h.expand(b, g, -1, -1), v_h.expand(b, g, -1, -1)
                o, row_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    query[:, heads, s:e], k_h, v_h, attn_mask=bias, scale=scaling
                )[:2]
                if rows_lse is not None:
                    rows_lse[:, heads, s:e] = row_lse
            else:
                o = torch.nn.functional.scaled_dot_product_attention(
                    query[:, heads, s:e], k_h, v_h, attn_mask=bias, scale=scaling, enable_gqa=g > 1
                )
            out[:, heads, s:e] = o
    return (out, rows_lse) if lse else out
