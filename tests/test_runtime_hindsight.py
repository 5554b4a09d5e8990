"""The oracle policy (DESIGN.md §2.12): brute force = FP64 reference = table schedule = runtime.

A brute-force oracle written with explicit loops over steps and candidates (no shared helper)
pins the definition; the reference (:func:`h2o_lens.policies.oracle.simulate`), the schedule
computed from a teacher table (:func:`h2o_lens.hindsight.schedule`) and the torch runtime's
prefill and decode step under :func:`h2o_lens.hindsight.teacher_scores` must keep exactly its sets
on random logits, in FP64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_utils import slot_kept_sets
from tiny import tiny_model

import h2o_lens
from h2o_lens import ConfigError, H2OConfig, eviction, ops, policies
from h2o_lens.hindsight import (
    NEVER,
    TeacherTable,
    active_table,
    remaining_attention,
    schedule,
    teacher_rows,
    teacher_scores,
)
from h2o_lens.policies import oracle


def brute_force(logits: np.ndarray, prefill: int, slots: int, gqa: str) -> list[list[int]]:
    """The oracle by its definition, one loop per sum, step and candidate."""
    g, n, _ = logits.shape
    a = [[0.0] * n for _ in range(n)]  # a[s][i]: teacher weight of generated row s on key i
    for s in range(prefill, n):
        for h in range(g):
            row = [float(v) for v in logits[h, s, : s + 1]]
            top = max(row)
            e = [math.exp(v - top) for v in row]
            z = sum(e)
            for i in range(s + 1):
                w = e[i] / z
                a[s][i] = a[s][i] + w if gqa == "sum" else max(a[s][i], w)

    def rest(t: int, i: int) -> float:  # remaining attention of key i after step t
        total = 0.0
        for s in range(t + 1, n):
            total += a[s][i]
        return total

    kept: list[int] = []
    pool = list(range(prefill))
    while pool and len(kept) < slots:  # the best remaining prompt position: highest, tie the newer
        best = pool[0]
        for i in pool[1:]:
            if rest(prefill - 1, i) > rest(prefill - 1, best) or (
                rest(prefill - 1, i) == rest(prefill - 1, best) and i > best
            ):
                best = i
        kept.append(best)
        pool.remove(best)
    out = [sorted(kept)]
    for t in range(prefill, n):
        cand = kept + [t]
        if len(cand) > slots:  # the lowest, tie the older
            victim = cand[0]
            for i in cand[1:]:
                if rest(t, i) < rest(t, victim) or (rest(t, i) == rest(t, victim) and i < victim):
                    victim = i
            cand.remove(victim)
        kept = cand
        out.append(sorted(kept))
    return out


def runtime_sets(q, k, v, prefill: int, slots: int, gqa: str, table: TeacherTable) -> list[list[int]]:
    """Kept sets of the torch prefill and decode step (one KV set, FP64) under ``table``."""
    args = ops.PolicyArgs("oracle", *policies.get("oracle").split(slots, 0, 0), gqa)
    pos = torch.arange(prefill, dtype=torch.int32)[None, None]
    with teacher_scores(table):
        scores, _ = ops.prefill_scores(None, None, pos, args, dtype=torch.float64, group=q.shape[1])
        keep = eviction.prefill_keep(scores, pos, args.heavy, args.recent)
        return slot_kept_sets(q, k, v, prefill, args, scores, keep)


def schedule_sets(table: TeacherTable, slots: int) -> list[list[int]]:
    """Kept sets per step of layer 0, set 0, from :func:`schedule`'s leaving steps."""
    leave = schedule(table, slots)[0][0]  # (N,)
    p, n = table.prompt_len, table.positions
    return [[i for i in range(t + 1) if leave[i] > t] for t in range(p - 1, n)]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    n=st.integers(2, 24),
    prefill=st.integers(1, 24),
    slots=st.integers(1, 8),
    group=st.sampled_from([1, 2, 3]),
    gqa=st.sampled_from(["sum", "max", "none"]),
    seed=st.integers(0, 2**16),
)
def test_brute_force_equals_reference_schedule_and_runtime(n, prefill, slots, group, gqa, seed):
    prefill = min(prefill, n)
    if gqa == "none":
        group = 1  # one query head per KV set
    d = 8
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, group, n, d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) * 2
    v = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    logits = (q[0] @ k[0, 0].T).numpy()  # (G, N, N)
    agg = "sum" if gqa == "none" else gqa
    expected = brute_force(logits, prefill, slots, agg)
    assert oracle.simulate(logits, prefill, slots, 0, agg) == expected
    rows = teacher_rows(q[:, :, prefill:], k, 1.0, gqa)[0]  # (1, T, N)
    table = TeacherTable((remaining_attention(rows),), prefill, gqa)
    assert schedule_sets(table, slots) == expected
    assert runtime_sets(q, k, v, prefill, slots, gqa, table) == expected


def test_the_reference_reads_the_slot_count_not_the_split():
    """The oracle has no recent window: any split of B slots gives the same sets."""
    logits = np.random.default_rng(1).normal(size=(2, 14, 14)) * 2
    a = oracle.simulate(logits, 6, 4, 0)
    assert oracle.simulate(logits, 6, 1, 3) == a == brute_force(logits, 6, 4, "sum")
    assert policies.get("oracle").split(1, 3, 4) == (4, 0, 0)


def test_enough_slots_keep_everything():
    logits = np.random.default_rng(2).normal(size=(3, 12, 12))
    for slots in (12, 20):
        assert oracle.simulate(logits, 5, slots, 0, "max") == [list(range(t + 1)) for t in range(4, 12)]


def test_remaining_attention_is_the_suffix_sum():
    rows = torch.rand(2, 5, 7, dtype=torch.float64)
    rem = remaining_attention(rows)
    assert rem.shape == (2, 6, 7)
    for k in range(6):
        torch.testing.assert_close(rem[:, k], rows[:, k:].sum(1))
    table = TeacherTable((rem,), 2)  # T = 5 generated rows over N = 7 positions: P = 2
    pos = torch.tensor([[[0, 4, -1], [6, 2, 1]]])
    got = table.lookup(0, 4, pos)  # step 4 = P − 1 + 3: row 3
    torch.testing.assert_close(got[0, 0], torch.stack([rem[0, 3, 0], rem[0, 3, 4], rem.new_tensor(0.0)]))
    torch.testing.assert_close(got[0, 1], rem[1, 3, [6, 2, 1]])


def test_schedule_never_brings_a_position_back_and_keeps_the_count():
    rng = np.random.default_rng(3)
    rem = remaining_attention(torch.from_numpy(rng.random((2, 3, 9, 15))).float())
    table = TeacherTable(tuple(rem), 6)
    for slots in (1, 4, 15):
        for leave in schedule(table, slots):  # (Hs, N)
            for t in range(5, 15):
                live = ((leave > t) & (torch.arange(15) <= t)).sum(-1)
                assert (live == min(t + 1, slots)).all(), (slots, t)
            assert ((leave == NEVER) | (leave >= 5)).all()
    assert (schedule(table, 15)[0] == NEVER).all()


def test_no_teacher_table_is_a_clear_error():
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match="teacher table.*OracleTeacher"):
        active_table()
    with h2o_lens.h2o(model, H2OConfig(policy="oracle", heavy=4, recent=0)), torch.no_grad():
        with pytest.raises(ConfigError, match="policy 'oracle' ranks slots by the attention a full-cache teacher"):
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_a_table_of_another_prompt_or_beyond_its_steps_is_refused():
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    rem = remaining_attention(torch.zeros(2, 3, 12))  # P = 9, N = 12
    table = TeacherTable((rem, rem), 9)
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    cfg = H2OConfig(policy="oracle", heavy=4, recent=0)
    with teacher_scores(table), h2o_lens.h2o(model, cfg), torch.no_grad():
        with pytest.raises(ConfigError, match="prompt of 9 tokens, the run's prompt has 10"):
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        with pytest.raises(ConfigError, match="reached step 12, outside the teacher's steps 8 … 11"):
            model.generate(ids[:, :9], max_new_tokens=6, do_sample=False, pad_token_id=0)
    with pytest.raises(ConfigError, match="4 rows over 12 positions for a prompt of 8 tokens; expected N − P \\+ 1"):
        TeacherTable((rem,), 8)
