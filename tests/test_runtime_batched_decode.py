"""Batched decode with per-request budgets: one computation, each row exactly as if alone (DESIGN.md §2.7).

A batch whose requests have different budgets steps every row in one decode step, each
row on its first ``B_r`` slots with its own split. The tests hold it to the request decoded
alone (its storage ``B_r`` wide): the same output, scores, slots and kept positions, bit for
bit, in FP32 and FP64, for every policy of the registry that decodes on its own.
"""

from __future__ import annotations

import pytest
import torch
from runtime_utils import KeptRecorder
from runtime_utils import left_pad as _left_pad
from tiny import tiny_model

import h2o_lens
from h2o_lens import H2OConfig, ops, policies
from h2o_lens.kernels import triton_available

#: every evicting policy that runs without a teacher table (the oracle ranks by one)
POLICIES = tuple(p.name for p in policies.evicting() if not p.teacher)
#: (heavy, recent) of each request before the policy's own split; the storage is as wide as the largest
BUDGETS = ((3, 2), (40, 35), (7, 6), (1, 2), (5, 0), (2, 3))


def _args(name: str, heavy: int, recent: int, gqa: str) -> ops.PolicyArgs:
    spec = policies.get(name)
    if recent == 0 and spec.split(heavy, 1, 1)[1]:  # a policy with a recent window needs one slot of it
        recent = 1
    return ops.PolicyArgs(name, *spec.split(heavy, recent, 1), gqa, 11)


def _state(caps, hs, d, dtype, gen, history):
    """Slots of each request in a storage as wide as the largest budget: row ``r`` holds a few
    prompt positions in its first slots (some rows not full yet), nothing past ``caps[r]``."""
    b, width = len(caps), max(caps)
    keys = torch.zeros(b, hs, width, d, dtype=dtype)
    values = torch.zeros_like(keys)
    scores = torch.zeros(b, hs, width, dtype=dtype)
    positions = torch.full((b, hs, width), -1, dtype=torch.int32)
    hist = torch.zeros(b, hs, width, dtype=torch.int64) if history else None
    prompt, fill = [], []
    for r, cap in enumerate(caps):
        n = cap if r % 2 == 0 else max(1, cap - 2)  # odd rows leave free slots
        p = n + 3 + r
        prompt.append(p)
        fill.append(n)
        for h in range(hs):
            kept = torch.randperm(p, generator=gen)[:n].sort().values
            positions[r, h, :n] = kept.to(torch.int32)
        keys[r, :, :n] = torch.randn(hs, n, d, generator=gen, dtype=dtype)
        values[r, :, :n] = torch.randn(hs, n, d, generator=gen, dtype=dtype)
        scores[r, :, :n] = torch.rand(hs, n, generator=gen, dtype=dtype)
        if hist is not None:
            hist[r, :, :n] = torch.randint(0, 1 << 20, (hs, n), generator=gen)
    return dict(keys=keys, values=values, scores=scores, positions=positions, history=hist), prompt, fill


def _alone(state, r, cap):
    return {k: None if t is None else t[r : r + 1, :, :cap].clone() for k, t in state.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("gqa", ["sum", "max", "none"])
def test_batched_step_equals_each_request_alone_bit_for_bit(policy, dtype, gqa):
    gen = torch.Generator().manual_seed(3)
    hs, group, d = (4, 1, 16) if gqa == "none" else (2, 3, 16)
    budgets = [_args(policy, h, r, gqa) for h, r in BUDGETS]
    distinct = list(dict.fromkeys(budgets))
    row_budget = torch.tensor([distinct.index(a) for a in budgets])
    caps = [a.capacity for a in budgets]
    width = max(caps)
    history = bool(policies.get(policy).history)
    batch, prompt, fill = _state(caps, hs, d, dtype, gen, history)
    alone = [_alone(batch, r, c) for r, c in enumerate(caps)]
    fill_b = torch.tensor(fill)
    fill_a = [torch.tensor([f]) for f in fill]
    rows = ops.RowBudgets.of(distinct, row_budget)
    b = len(caps)
    for i in range(8):
        q = torch.randn(b, hs * group, d, generator=gen, dtype=dtype) * 2
        k = torch.randn(b, hs, d, generator=gen, dtype=dtype)
        v = torch.randn(b, hs, d, generator=gen, dtype=dtype)
        step = torch.tensor([p + i for p in prompt], dtype=torch.int32)
        full = bool((fill_b >= torch.tensor(caps)).all())
        got = ops.decode_step(
            q, k, v, **batch, step=step, fill=None if full else fill_b, scaling=0.3, args=distinct[0],
            layer=2, want_candidates=True, rows=rows,
        )  # fmt: skip
        for r, cap in enumerate(caps):
            a = alone[r]
            f = None if int(fill_a[r]) >= cap else fill_a[r]
            one = ops.decode_step(
                q[r : r + 1], k[r : r + 1], v[r : r + 1], **a, step=step[r : r + 1], fill=f, scaling=0.3,
                args=budgets[r], layer=2, want_candidates=True,
            )  # fmt: skip
            where = f"{policy} {gqa} request {r} (B={cap}) step {i}"
            assert torch.equal(got.out[r], one.out[0]), where
            assert torch.equal(got.slot[r], torch.where(one.slot[0] == cap, width, one.slot[0])), where
            assert torch.equal(got.evicts[r], one.evicts[0]), where
            for name, t in a.items():
                if t is not None:
                    assert torch.equal(batch[name][r, :, :cap], t[0]), f"{where}: {name}"
            assert bool((batch["positions"][r, :, cap:] == -1).all()), f"{where}: a slot past B_r was written"
            assert torch.equal(got.cand_positions[r, :, :cap], one.cand_positions[0, :, :cap]), where
            assert torch.equal(got.cand_positions[r, :, width], one.cand_positions[0, :, cap]), where
            assert torch.equal(got.cand_scores[r, :, :cap], one.cand_scores[0, :, :cap]), where
            assert torch.equal(got.cand_scores[r, :, width], one.cand_scores[0, :, cap]), where
            fill_a[r] = (fill_a[r] + 1).clamp(max=cap)
        fill_b = torch.minimum(fill_b + 1, torch.tensor(caps))
    assert bool((batch["positions"] >= 0).any(-1).all())  # every row held something throughout


def test_row_budgets_mask_slots_past_each_capacity():
    """A row of a small budget in wide storage: the slots past its capacity are never attended
    (zero weight), never chosen and never written, even when nothing is eligible."""
    args = ops.PolicyArgs(policies.DEFAULT, 1, 1, 0, "sum")
    wide = ops.PolicyArgs(policies.DEFAULT, 4, 4, 0, "sum")
    rows = ops.RowBudgets.of([args, wide], torch.tensor([0, 1]))
    keys = torch.ones(2, 1, 8, 4)
    positions = torch.tensor([[[5, 6, -1, -1, -1, -1, -1, -1]], [[0, 1, 2, 3, 4, 5, 6, 7]]], dtype=torch.int32)
    res = ops.decode_step(
        torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.ones(2, 1, 4), keys, keys.clone(),
        torch.zeros(2, 1, 8), positions, torch.tensor([7, 8], dtype=torch.int32), None, 1.0, args,
        want_candidates=True, rows=rows,
    )  # fmt: skip
    # row 0: D = {5, 6, 7}, three equal weights; 5 is outside the recent window and leaves
    assert res.slot.tolist() == [[0], [0]] and res.evicts.tolist() == [[True], [True]]
    assert positions[0, 0].tolist() == [7, 6, -1, -1, -1, -1, -1, -1]
    assert torch.allclose(res.cand_scores[0, 0, :2], torch.full((2,), 1 / 3))
    assert torch.allclose(res.cand_scores[0, 0, -1], torch.tensor(1 / 3))
    assert bool((res.cand_scores[0, 0, 2:8] == 0).all())


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, mask, new):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)


def _batch_equals_alone(model, cfg, seqs, new=10):
    ids, mask = _left_pad(seqs)
    rec = KeptRecorder()
    with h2o_lens.h2o(model, cfg, listener=rec) as session:
        out = _generate(model, ids, mask, new)
    assert len(session.last_cache.budgets) > 1, "the requests should have different budgets"
    width = ids.shape[1]
    for r, s in enumerate(seqs):
        one = KeptRecorder()
        with h2o_lens.h2o(model, cfg, listener=one):
            seq = _generate(model, s[None], None, new)[0]
        assert torch.equal(out[r, width - len(s) :], seq), f"request {r} generated other tokens"
        for layer in one.kept:
            assert [st[r] for st in rec.kept[layer]] == [st[0] for st in one.kept[layer]], f"request {r} layer {layer}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("policy", POLICIES)
def test_ratio_budgets_batched_equal_alone_on_a_model(policy, dtype):
    """Keep ratios resolve to a budget per request; left-padded prompts of different lengths
    decoded in one batch keep, layer by layer and step by step, what each keeps alone."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2).to(dtype)
    seqs = [_ids(n, seed=n) for n in (11, 40, 23, 31)]
    _batch_equals_alone(model, H2OConfig(policy=policy, ratio=0.3, sink=1, seed=4), seqs)


def test_mixed_budgets_decode_in_one_step_per_layer(monkeypatch):
    """The torch decode of a batch with four budgets is one step per layer and token, not one per budget."""
    calls = []
    real = ops.decode_step

    def counting(*a, **kw):
        calls.append(kw.get("rows"))
        return real(*a, **kw)

    monkeypatch.setattr(ops, "decode_step", counting)
    model = tiny_model("llama", layers=2)
    ids, mask = _left_pad([_ids(n, seed=n) for n in (11, 40, 23, 31)])
    with h2o_lens.h2o(model, ratio=0.3) as session:
        _generate(model, ids, mask, 5)
    assert len(session.last_cache.budgets) == 4
    assert len(calls) == 2 * 4  # layers × decode steps (the first token comes from the prefill)
    assert all(isinstance(r, ops.RowBudgets) for r in calls)


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_backend_batched_equals_alone():
    """The Triton backend (interpreted on CPU) with per-request budgets: each request generates
    and finally keeps what it does alone (no listener, so the fused step runs). The scores are
    not compared: a padded prompt's prefill sums its columns in another order than an unpadded one."""
    from h2o_lens.kernels._checks import interpret_mode

    if not interpret_mode():
        pytest.skip("set TRITON_INTERPRET=1 to run the Triton kernels on CPU")
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    seqs = [_ids(n, seed=n) for n in (9, 30, 17)]
    cfg = H2OConfig(ratio=0.3, backend="triton")
    ids, mask = _left_pad(seqs)
    with h2o_lens.h2o(model, cfg) as session:
        out = _generate(model, ids, mask, 6)
    batch = session.last_cache
    assert batch.backend == "triton" and len(batch.budgets) == 3
    caps = [batch.budgets[i].capacity for i in batch.layers[0].budget.tolist()]
    for r, s in enumerate(seqs):
        with h2o_lens.h2o(model, cfg) as one:
            seq = _generate(model, s[None], None, 6)[0]
        assert torch.equal(out[r, ids.shape[1] - len(s) :], seq), f"request {r}"
        for a, b in zip(batch.layers, one.last_cache.layers):
            assert torch.equal(a.positions[r, :, : caps[r]], b.positions[0]), f"request {r} layer {a.layer_idx}"
