"""Tie rules on discrete logits, for the FP64 reference, the torch path and the decode kernel.

Continuous random logits never tie, so the tie rules (DESIGN.md §2: a decode tie
evicts the *older* position, a prefill tie keeps the *newer*) need cases built
for them. Here every attention row puts logit 0 on a power-of-two number of
visible keys and -1000 on the rest: each weight is exactly 1, 1/2, 1/4 or 1/8
(exp(-1000) is 0 in FP32 and FP64), so every score is a short dyadic sum that
every implementation computes exactly and ties are bitwise ties everywhere.

The expected kept sets come from an independent oracle in exact rational
arithmetic (``fractions.Fraction``) that also counts the decisive ties, so a
case that stops exercising the tie rule fails instead of passing vacuously.
The rows are chosen step by step with the oracle's current kept set in hand,
so that the weights over the decode candidates stay dyadic too.
"""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from h2o_lens import ops
from h2o_lens.reference import simulate, trace

NEG = -1000.0  # exp(NEG - 0) underflows to exactly 0 in FP32 and FP64


def _aggregate(per_head: list[dict[int, Fraction]], gqa: str) -> dict[int, Fraction]:
    keys = per_head[0].keys()
    if gqa == "max":
        return {i: max(w[i] for w in per_head) for i in keys}
    return {i: sum(w[i] for w in per_head) for i in keys}


def _row(rng: random.Random, visible: list[int], n: int) -> tuple[np.ndarray, dict[int, Fraction]]:
    """One attention row: logit 0 on 1, 2, 4 or 8 of ``visible`` keys, NEG elsewhere.

    Half the rows look only at the query's own position (the last visible key), so
    that many positions end with the same score and ties are common.
    """
    sizes = [s for s in (1, 2, 4, 8) if s <= len(visible)]
    size = rng.choice(sizes)
    hot = [visible[-1]] if rng.random() < 0.5 else rng.sample(visible, size)
    logits = np.full(n, NEG)
    logits[hot] = 0.0
    return logits, {i: (Fraction(1, len(hot)) if i in hot else Fraction(0)) for i in visible}


def _group_rows(rng: random.Random, logits: np.ndarray, t: int, visible: list[int], gqa: str) -> dict[int, Fraction]:
    """Fill row ``t`` of every head in place; return the aggregated exact weights.

    Half the time all heads share one row (heads that agree keep ties in the sums)."""
    heads, n = logits.shape[0], logits.shape[-1]
    shared = rng.random() < 0.5
    rows = []
    for h in range(heads):
        if shared and h:
            logits[h, t] = logits[0, t]
            rows.append(rows[0])
        else:
            logits[h, t], w = _row(rng, visible, n)
            rows.append(w)
    return _aggregate(rows, gqa)


def discrete_case(seed: int, n: int, prefill: int, heavy: int, recent: int, heads: int, gqa: str):
    """Logits ``(heads, n, n)`` of one KV set and the exact H2O kept sets, per DESIGN.md §2.

    Returns ``(logits, kept, ties)``: ``kept[k]`` the sorted kept set after the
    prefill (k = 0) and after each decode step; ``ties`` counts the decisions
    that a tie settled, ``{"prefill": ..., "decode": ...}``.
    """
    rng = random.Random(seed)
    logits = np.full((heads, n, n), NEG)
    ties = {"prefill": 0, "decode": 0}
    score: dict[int, Fraction] = {i: Fraction(0) for i in range(prefill)}
    for u in range(prefill):
        for i, w in _group_rows(rng, logits, u, list(range(u + 1)), gqa).items():
            score[i] += w
    if prefill > heavy + recent:
        recent_set = set(range(prefill - recent, prefill))
        rest = sorted((i for i in range(prefill) if i not in recent_set), key=lambda i: (-score[i], -i))
        if 0 < heavy < len(rest) and score[rest[heavy - 1]] == score[rest[heavy]]:
            ties["prefill"] += 1
        keep = recent_set | set(rest[:heavy])
        score = {i: s for i, s in score.items() if i in keep}
    kept = [sorted(score)]
    for t in range(prefill, n):
        cand = sorted(score) + [t]
        score[t] = Fraction(0)
        for i, w in _group_rows(rng, logits, t, cand, gqa).items():
            score[i] += w
        if len(cand) > heavy + recent:
            eligible = [i for i in cand if i <= t - recent]
            low = min(score[i] for i in eligible)
            tied = [i for i in eligible if score[i] == low]
            ties["decode"] += len(tied) > 1
            del score[min(tied)]  # a tie evicts the older position
        kept.append(sorted(score))
    return logits, kept, ties


# (n, prefill, heavy, recent) of the cases; several seeds each
SHAPES = [(14, 8, 2, 2), (16, 6, 3, 1), (12, 9, 2, 3), (15, 7, 4, 0)]
SEEDS = range(10)


def _cases(gqa: str, heads: int):
    for n, prefill, heavy, recent in SHAPES:
        for seed in SEEDS:
            logits, kept, ties = discrete_case(seed, n, prefill, heavy, recent, heads, gqa)
            yield (n, prefill, heavy, recent, seed), logits, kept, ties


@pytest.mark.parametrize("gqa, heads", [("sum", 1), ("sum", 3), ("max", 3)])
def test_reference_tie_rules_on_discrete_logits(gqa, heads):
    total = {"prefill": 0, "decode": 0}
    for where, logits, kept, ties in _cases(gqa, heads):
        n, prefill, heavy, recent, _ = where
        got = simulate(logits, prefill, heavy, recent, gqa)
        assert got == kept, f"case {where}: the FP64 reference differs from the exact oracle"
        for k in total:
            total[k] += ties[k]
    # the cases really exercise both tie rules
    assert total["prefill"] >= 3 and total["decode"] >= 5, total


def test_reference_decode_tie_evicts_the_older_by_hand():
    """P = 2, heavy = recent = 1. Row 1 puts all weight on position 1, so after the prefill
    scores are {0: 1, 1: 1}; row 2 is uniform over {0, 1, 2}: {0: 4/3, 1: 4/3, 2: 1/3}.
    Positions 0 and 1 are eligible and tied: the older (0) is evicted."""
    logits = np.array([[[0.0, NEG, NEG], [NEG, 0.0, NEG], [0.0, 0.0, 0.0]]])
    tr = trace(logits, prefill=2, heavy=1, recent=1)
    assert tr.scores[0] == {0: 1.0, 1: 1.0}
    assert tr.victims[1] == [0] and tr.kept[1] == [1, 2]
    assert tr.scores[1] == {1: pytest.approx(4 / 3), 2: pytest.approx(1 / 3)}


def test_reference_prefill_tie_keeps_the_newer_by_hand():
    """P = 4, heavy = 1, recent = 1: positions 0, 1, 2 all end the prefill with score 1
    (each row puts all its weight on its own position); the newest of them (2) is kept."""
    logits = np.full((1, 4, 4), NEG)
    for u in range(4):
        logits[0, u, u] = 0.0
    tr = trace(logits, prefill=4, heavy=1, recent=1)
    assert tr.kept[0] == [2, 3] and tr.victims[0] == [0, 1]


# -- the torch path (the runtime without Triton) -----------------------------------------------


def _torch_path(
    logits_per_set: np.ndarray,
    prefill: int,
    heavy: int,
    recent: int,
    gqa: str,
    dtype: torch.dtype,
    kernel: bool = False,
) -> list[list[list[int]]]:
    """Kept sets per step and KV set from ``ops.prefill_attention/prefill_select/decode_step``.

    ``logits_per_set (Hs, G, N, N)`` are realised exactly as ``q_t · k_i`` with one-hot keys
    (``k_i = e_i``, ``q_t`` = the logit row, scaling 1). With ``kernel`` the decode steps run
    ``decode_step_triton`` instead.
    """
    hs, g, n, _ = logits_per_set.shape
    args = ops.PolicyArgs("h2o", heavy, recent, 0, gqa)
    cap = heavy + recent
    q = torch.tensor(logits_per_set, dtype=dtype).reshape(1, hs * g, n, n)  # (1, Hq, N, d=N)
    k = torch.eye(n, dtype=dtype)[None, None].expand(1, hs, n, n).contiguous()
    v = torch.randn(1, hs, n, n, generator=torch.Generator().manual_seed(n), dtype=dtype)
    valid = torch.ones(1, prefill, dtype=torch.bool)  # the exact (softmax) prefill path
    _, scores = ops.prefill_attention(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], valid, 1.0, gqa, chunk=3)
    pos = torch.arange(prefill, dtype=torch.int32)[None, None].expand(1, hs, prefill)
    keep = ops.prefill_select(scores, pos, args)  # (1, Hs, P)
    history = [[sorted(pos[0, s][keep[0, s]].tolist()) for s in range(hs)]]
    slots = torch.full((1, hs, cap), -1, dtype=torch.int32)
    keys = torch.zeros(1, hs, cap, n, dtype=dtype)
    values = torch.zeros(1, hs, cap, n, dtype=dtype)
    sc = torch.zeros(1, hs, cap, dtype=torch.float32 if dtype != torch.float64 else dtype)
    for s in range(hs):
        for j, p in enumerate(history[0][s]):
            slots[0, s, j] = p
            keys[0, s, j], values[0, s, j], sc[0, s, j] = k[0, s, p], v[0, s, p], scores[0, s, p]
    fill = torch.tensor([len(history[0][0])])
    dev = torch.device("cuda" if kernel and torch.cuda.is_available() else "cpu")
    if kernel:
        from h2o_lens.kernels import decode_step_triton as step_fn

        q, k, v, keys, values, sc, slots, fill = (x.to(dev) for x in (q, k, v, keys, values, sc, slots, fill))
    else:
        step_fn = ops.decode_step
    for t in range(prefill, n):
        step_fn(
            q[:, :, t].contiguous(),
            k[:, :, t].contiguous(),
            v[:, :, t].contiguous(),
            keys,
            values,
            sc,
            slots,
            step=torch.tensor([t], dtype=torch.int32, device=dev),
            fill=fill if fill.item() < cap else None,
            scaling=1.0,
            args=args,
        )
        fill = (fill + 1).clamp(max=cap)
        history.append([sorted(p for p in slots[0, s].tolist() if p >= 0) for s in range(hs)])
    return history


def _sets_case(gqa: str, where, seed_offset: int = 0):
    """Two KV sets of two query heads each (``none``: four sets of one head)."""
    n, prefill, heavy, recent, seed = where
    if gqa == "none":
        per = [discrete_case(seed * 7 + h, n, prefill, heavy, recent, 1, "sum") for h in range(4)]
        return np.stack([p[0] for p in per]), [p[1] for p in per], [p[2] for p in per]
    per = [discrete_case(seed * 7 + s, n, prefill, heavy, recent, 2, gqa) for s in range(2)]
    return np.stack([p[0] for p in per]), [p[1] for p in per], [p[2] for p in per]


def _check_path(gqa: str, dtype: torch.dtype, kernel: bool = False, shapes=SHAPES, seeds=SEEDS):
    total = {"prefill": 0, "decode": 0}
    for n, prefill, heavy, recent in shapes:
        for seed in seeds:
            where = (n, prefill, heavy, recent, seed)
            logits, kept, ties = _sets_case(gqa, where)
            got = _torch_path(logits, prefill, heavy, recent, gqa, dtype, kernel)
            for s, expected in enumerate(kept):
                mine = [step[s] for step in got]
                assert mine == expected, f"case {where}, KV set {s}, gqa={gqa}: kept sets differ from the oracle"
                for key in total:
                    total[key] += ties[s][key]
    return total


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gqa", ["sum", "max", "none"])
def test_torch_path_tie_rules_on_discrete_logits(gqa, dtype):
    total = _check_path(gqa, dtype)
    assert total["prefill"] >= 3 and total["decode"] >= 5, total


def test_torch_decode_tie_evicts_the_older_whatever_the_slot_order():
    """Tied eligible slots in shuffled physical order: the oldest position goes, not the first slot."""
    for order in ([4, 1, 3, 0, 5, 6], [0, 1, 3, 4, 5, 6], [6, 5, 4, 3, 1, 0]):
        positions = torch.tensor([order], dtype=torch.int32)[None]  # (1, 1, 6)
        scores = torch.tensor([[[2.0 if p >= 5 else 1.0 for p in order]]])  # 5, 6 recent anyway
        keys = torch.zeros(1, 1, 6, 4)
        values = torch.randn(1, 1, 6, 4, generator=torch.Generator().manual_seed(0))
        res = ops.decode_step(
            torch.zeros(1, 2, 4),
            torch.zeros(1, 1, 4),
            torch.zeros(1, 1, 4),
            keys,
            values,
            scores,
            positions,
            torch.tensor([7], dtype=torch.int32),
            None,
            1.0,
            ops.PolicyArgs("h2o", 4, 2, 0, "sum"),
        )
        assert order[res.slot.item()] == 0, order  # positions 0, 1, 3, 4 tie; 0 is the oldest
        assert sorted(positions[0, 0].tolist()) == [1, 3, 4, 5, 6, 7]


@pytest.mark.kernel
@pytest.mark.parametrize("gqa", ["sum", "max", "none"])
def test_decode_kernel_tie_rules_on_discrete_logits(gqa):
    import os

    from h2o_lens.kernels import triton_available
    from h2o_lens.kernels._checks import interpret_mode

    if not triton_available():
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and not interpret_mode():
        if "triton" in __import__("sys").modules:
            pytest.skip("triton was imported before TRITON_INTERPRET=1; set it in the environment")
        os.environ["TRITON_INTERPRET"] = "1"
    total = _check_path(gqa, torch.float32, kernel=True, shapes=SHAPES[:2], seeds=range(3))
    assert total["decode"] >= 3, total


# -- the policy contract on batched inputs (leading dims), row by row against brute force ------


def test_aggregate_heads_with_leading_dims_equals_per_group_brute_force():
    from h2o_lens import eviction

    w = torch.rand(2, 3, 6, 5, generator=torch.Generator().manual_seed(1))  # (b, L, Hq=6, K)
    for group in (2, 3):
        for mode, fn in (("sum", sum), ("max", lambda xs: torch.stack(xs).amax(0))):
            got = eviction.aggregate_heads(w, group, mode)
            assert got.shape == (2, 3, 6 // group, 5)
            for g in range(6 // group):
                expected = fn([w[:, :, g * group + j] for j in range(group)])
                assert torch.allclose(got[:, :, g], expected), (group, mode, g)
    assert eviction.aggregate_heads(w, 2, "none") is w
    with pytest.raises(ValueError, match="unknown gqa mode"):
        eviction.aggregate_heads(w, 2, "mean")


def test_select_victim_per_row_with_leading_dims():
    """Each row of a (2, 3, S) batch picks its own lowest eligible slot (tie: older position)."""
    from h2o_lens import eviction

    g = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 3, (2, 3, 6), generator=g).float()  # small set: ties in most rows
    positions = torch.stack([torch.randperm(6, generator=g) for _ in range(6)]).view(2, 3, 6) + 10
    eligible = torch.rand(2, 3, 6, generator=g) < 0.7
    eligible[1, 2] = False  # a row with nothing eligible
    index, found = eviction.select_victim(scores, positions, eligible)
    assert index.shape == found.shape == (2, 3)
    for r in range(2):
        for c in range(3):
            slots = [s for s in range(6) if eligible[r, c, s]]
            assert bool(found[r, c]) == bool(slots)
            if slots:
                best = min(slots, key=lambda s: (scores[r, c, s].item(), positions[r, c, s].item()))
                assert index[r, c].item() == best, (r, c)


def test_eligible_mask_by_hand():
    """Eligible: a valid slot outside the ``recent`` newest positions and the first ``sink``."""
    from h2o_lens import eviction

    pos = torch.tensor([[0, 1, 5, 6, -1], [3, 0, 2, 7, 4]])
    step = torch.tensor([[7], [8]])
    assert eviction.eligible_mask(pos, step, recent=2).tolist() == [
        [True, True, True, False, False],
        [True, True, True, False, True],
    ]
    assert eviction.eligible_mask(pos, 7, recent=0, sink=2).tolist() == [
        [False, False, True, True, False],
        [True, False, True, True, True],
    ]
    assert eviction.eligible_mask(pos, 7, recent=2, sink=2).tolist() == [
        [False, False, True, False, False],
        [True, False, True, False, True],
    ]
