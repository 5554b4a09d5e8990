"""Budget plans (DESIGN.md §2.14): slot counts per layer and KV set, exact H2O inside each.

A tiny random model generates under a plan while its own post-RoPE queries and keys are
captured; the FP64 reference, run per KV set with that set's split, gives the kept sets of every
layer and KV set, step by step. A uniform plan keeps what the uniform config keeps, bit for bit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from runtime_utils import KeptRecorder, assert_same_sets, capture_qk, left_pad, reference_sets
from tiny import tiny_model

import h2o_lens
from h2o_lens import H2OConfig, ops
from h2o_lens import plan as budget_plan
from h2o_lens.errors import ConfigError
from h2o_lens.plan import BudgetPlan
from h2o_lens.reference import simulate, simulate_sets

VOCAB = 256


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _run(model, cfg, ids, new, mask=None, backend=None):
    rec = KeptRecorder()
    if backend is not None:
        import dataclasses

        cfg = dataclasses.replace(cfg, backend=backend)
    with h2o_lens.h2o(model, cfg, listener=rec), capture_qk() as qk, torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out, rec, qk


def _split(b: int) -> tuple[int, int]:
    return b // 2, b - b // 2


# -- the FP64 reference --------------------------------------------------------------------------


def test_reference_sets_run_each_set_with_its_own_split():
    """``simulate_sets`` is the uniform reference per KV set, each with its own slot count; a set
    given the prompt's length keeps everything, one of 1 slot keeps the newest position only."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 2, 14, 14))
    got = simulate_sets(logits, 8, [(2, 3), (0, 1), (4, 4)], "sum")
    for s, (h, r) in enumerate([(2, 3), (0, 1), (4, 4)]):
        assert got[s] == simulate(logits[s], 8, h, r, "sum")
    assert got[1][0] == [7] and all(len(k) == 1 for k in got[1])
    assert got[2][0] == list(range(8))
    with pytest.raises(ValueError, match="one split per KV set"):
        simulate_sets(logits, 8, [(2, 3)], "sum")


def test_reference_sets_tie_rules_per_set():
    """Equal logits everywhere: every prefill tie keeps the newer positions and every decode tie
    evicts the older, in each set at its own size (the uniform rules, DESIGN.md §2.4)."""
    logits = np.zeros((2, 1, 12, 12))
    got = simulate_sets(logits, 6, [(1, 1), (2, 2)], "max")
    # prefill: column sums favour older keys (more rows see them); the recent window is the newest
    assert got[0][0] == [0, 5] and got[1][0] == [0, 1, 4, 5]
    for s, kept in enumerate(got):
        assert all(len(k) == (2, 4)[s] for k in kept)


# -- the plan object ------------------------------------------------------------------------------


def test_plan_validates_and_round_trips_through_json(tmp_path):
    plan = BudgetPlan(slots=[4, (2, 6)])
    assert plan.slots == ((4,), (2, 6)) and plan.counts(0, 2) == (4, 4) and plan.total(2) == 16
    path = tmp_path / "plan.json"
    plan.save(path, evidence={"note": 1})
    assert budget_plan.load(path) == plan and json.loads(path.read_text())["evidence"] == {"note": 1}
    assert H2OConfig(plan=str(path)).plan == plan
    ratios = BudgetPlan(ratios=[0.1, (0.2, 0.3)])
    assert ratios.resolve(40).slots == ((4,), (8, 12)) and ratios.resolve(5).slots == ((2,), (2, 2))
    for bad, needle in [
        (dict(slots=[0, 3]), "whole numbers >= 1"),
        (dict(slots=[2.5]), "whole numbers >= 1"),
        (dict(ratios=[1.5]), r"in \(0, 1\]"),
        (dict(slots=[], ratios=None), "empty"),
        (dict(), "either slots or ratios"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            BudgetPlan(**bad)
    with pytest.raises(ConfigError, match="either a plan or a budget"):
        H2OConfig(plan=plan, heavy=2, recent=2)
    with pytest.raises(ConfigError, match="pinned"):
        H2OConfig(plan=plan, pinned=(1,))
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a budget plan"):
        H2OConfig(plan=str(tmp_path / "other.json"))
    cfg = H2OConfig(plan=plan)
    assert H2OConfig(**cfg.to_dict()) == cfg and "plan" not in H2OConfig(heavy=2, recent=2).to_dict()


def test_plan_must_fit_the_model():
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    for plan, needle in [([4, 4, 4], "3 layers, the model 2"), ([4, (2, 3, 4)], "give 1 or 2")]:
        with pytest.raises(ConfigError, match=needle), h2o_lens.h2o(model, H2OConfig(plan=BudgetPlan(slots=plan))):
            model.generate(_ids(12), max_new_tokens=1, do_sample=False, pad_token_id=0)


# -- the runtime ----------------------------------------------------------------------------------


def _layer_kept(rec, layer, request=0):
    return [step[request] for step in rec.kept[layer]]


@pytest.mark.parametrize("gqa", ["sum", "max", "none"])
def test_uniform_plan_keeps_what_the_uniform_config_keeps(gqa):
    """The same slot count in every layer and KV set: the same tokens and kept sets, bit for bit,
    in slots and in ratio form (a batch of different prompt lengths: per-request budgets)."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    out_a, rec_a, _ = _run(model, H2OConfig(heavy=4, recent=5, gqa=gqa), _ids(30), 20)
    sets = 4 if gqa == "none" else 2
    out_b, rec_b, _ = _run(model, H2OConfig(plan=BudgetPlan(slots=[9, (9,) * sets]), gqa=gqa), _ids(30), 20)
    assert torch.equal(out_a, out_b) and rec_a.kept == rec_b.kept
    ids, mask = left_pad([_ids(40, seed=1)[0], _ids(23, seed=2)[0]])
    out_a, rec_a, _ = _run(model, H2OConfig(ratio=0.25, gqa=gqa), ids, 12, mask)
    out_b, rec_b, _ = _run(model, H2OConfig(plan=BudgetPlan(ratios=[0.25, 0.25]), gqa=gqa), ids, 12, mask)
    assert torch.equal(out_a, out_b) and rec_a.kept == rec_b.kept


PLANS = {
    "by layer": [3, 12],
    "by KV set": [(4, 9), (13, 2)],
    "mixed": [7, (1, 10)],
}


@pytest.mark.parametrize("gqa", ["sum", "max"])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_equals_the_reference_per_layer_and_set(name, gqa):
    """Each layer and KV set keeps what the FP64 reference keeps at that set's own slot count
    (the prompt, 20 tokens, is longer than some sets and shorter than others)."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    plan = BudgetPlan(slots=PLANS[name])
    _, rec, qk = _run(model, H2OConfig(plan=plan, gqa=gqa), _ids(20, seed=5), 24)
    for layer in range(2):
        sets = [reference_sets(qk[layer], 0, 20, *_split(b), gqa) for b in plan.counts(layer, 2)]
        expected = [[sets[s][t][s] for s in range(2)] for t in range(len(sets[0]))]
        assert_same_sets(_layer_kept(rec, layer), expected, f"{name} gqa={gqa} layer {layer}")


def test_plan_in_a_padded_batch_equals_each_request_alone():
    """Ragged layers in a left-padded batch with ratio-resolved plans (each request its own
    table): every request keeps what it keeps alone."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    cfg = H2OConfig(plan=BudgetPlan(ratios=[(0.1, 0.4), 0.3]))
    seqs = [_ids(36, seed=7)[0], _ids(21, seed=8)[0]]
    ids, mask = left_pad(seqs)
    out, rec, _ = _run(model, cfg, ids, 10, mask)
    for r, seq in enumerate(seqs):
        alone, rec1, _ = _run(model, cfg, seq[None], 10)
        assert torch.equal(out[r, -10:], alone[0, -10:])
        for layer in range(2):
            assert _layer_kept(rec, layer, r) == _layer_kept(rec1, layer), f"request {r} layer {layer}"


def test_layer_args_and_row_budgets():
    """A layer's budget under a plan: its own split, per KV set where they differ; the row budgets
    of a ragged layer are ``(b, Hs, 1)``."""
    cfg = H2OConfig(plan=BudgetPlan(slots=[6, (3, 8)]))
    args = budget_plan.policy_args(cfg)
    assert args.capacity == 8 and args.plan == (((3, 3, 0),), ((1, 2, 0), (4, 4, 0)))
    assert budget_plan.layer_args(args, 0) == ops.PolicyArgs("h2o", 3, 3, 0, "sum")
    ragged = budget_plan.layer_args(args, 1)
    assert ragged.capacity == 8 and ragged.sets == ((1, 2, 0), (4, 4, 0))
    rows = budget_plan.row_budgets([ragged], torch.tensor([0, 0]), 2)
    assert rows.capacity[:, :, 0].tolist() == [[3, 8], [3, 8]] and rows.recent[:, :, 0].tolist() == [[2, 4]] * 2


@pytest.mark.kernel
def test_ragged_decode_kernel_equals_the_torch_step():
    """The Triton step (interpreter) with per-(request, KV set) capacities, recent windows and
    fills equals the torch step: slots, evictions, scores, positions and output."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernels run on CPU under TRITON_INTERPRET=1 only")
    from h2o_lens.kernels import decode_step_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    b, hs, g, cap, d = 2, 3, 2, 9, 16
    sets = ((1, 2, 0), (4, 5, 0), (2, 0, 0))
    args = ops.PolicyArgs("h2o", 4, 5, 0, "sum", sets=sets)
    rows = budget_plan.row_budgets([args], torch.tensor([0, 0]), hs)
    for fill in (torch.tensor([6, 9]), None):
        positions = torch.full((b, hs, cap), -1, dtype=torch.int32)
        for s, (h, r, _) in enumerate(sets):
            n = min(h + r, 6 if fill is not None else h + r)
            positions[:, s, :n] = torch.arange(n, dtype=torch.int32) * 2
        keys = torch.randn(b, hs, cap, d, generator=gen)
        values = torch.randn(b, hs, cap, d, generator=gen)
        scores = torch.rand(b, hs, cap, generator=gen).round(decimals=1)
        state = [keys, values, scores, positions]
        q, k, v = (
            torch.randn(b, hs * g, d, generator=gen),
            torch.randn(b, hs, d, generator=gen),
            torch.randn(b, hs, d, generator=gen),
        )
        step = torch.tensor([20, 20], dtype=torch.int32)
        if fill is not None:
            fill = torch.minimum(fill, torch.tensor(9))
        mine = [t.clone().to(dev) for t in state]
        ref = [t.clone() for t in state]
        a = ops.decode_step(q, k, v, *ref, step, fill, 0.25, args, rows=rows)
        on = [x.to(dev) for x in (q, k, v)]
        got = decode_step_triton(
            *on, *mine, step.to(dev), None if fill is None else fill.to(dev), 0.25, args, rows=rows
        )
        assert torch.equal(got.slot.cpu(), a.slot) and torch.equal(got.evicts.cpu(), a.evicts)
        assert torch.equal(mine[3].cpu(), ref[3])
        torch.testing.assert_close(mine[2].cpu(), ref[2])
        torch.testing.assert_close(got.out.cpu(), a.out)


def _final_sets(model, cfg, ids, new):
    """Tokens and the final kept positions per layer and KV set, with no listener (so the fused
    step runs where the backend has one), and the cache's backend."""
    with h2o_lens.h2o(model, cfg), torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    cache = out.past_key_values
    sets = [[sorted(p for p in row.tolist() if p >= 0) for row in layer.positions[0]] for layer in cache.layers]
    return out.sequences, sets, cache.backend


@pytest.mark.kernel
def test_plan_on_the_triton_backend_keeps_what_the_torch_backend_keeps():
    """A tiny model under a plan with a ragged layer and a layer of one count, on the Triton
    backend (the interpreter on CPU; the fused step, no listener): the same tokens and kept sets
    as the torch backend."""
    pytest.importorskip("triton")
    import dataclasses
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernels run on CPU under TRITON_INTERPRET=1 only")
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    cfg = H2OConfig(plan=BudgetPlan(slots=[(3, 11), 6]))
    seq_t, sets_t, back_t = _final_sets(model, dataclasses.replace(cfg, backend="torch"), _ids(9, seed=4), 12)
    seq_k, sets_k, back_k = _final_sets(model, dataclasses.replace(cfg, backend="triton"), _ids(9, seed=4), 12)
    assert (back_t, back_k) == ("torch", "triton")
    assert torch.equal(seq_t, seq_k) and sets_t == sets_k
    assert [len(s) for s in sets_k[0]] == [3, 11] and [len(s) for s in sets_k[1]] == [6, 6]


def test_a_generation_under_a_plan_saves_and_restores(tmp_path):
    """Save and restore (DESIGN.md §15.2) carry the plan's table: the restored generation
    continues exactly as the uninterrupted one."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    cfg = H2OConfig(plan=BudgetPlan(ratios=[(0.2, 0.5), 0.3]))
    ids, mask = left_pad([_ids(22, seed=9)[0], _ids(17, seed=10)[0]])
    kw = dict(do_sample=False, pad_token_id=0)
    with h2o_lens.h2o(model, cfg) as session, torch.no_grad():
        full = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, cache=session.new_cache(), **kw)
        part = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, cache=session.new_cache(), **kw)
        session.save(tmp_path / "state.pt")
    with h2o_lens.h2o(model, cfg) as session, torch.no_grad():
        cache = session.restore(tmp_path / "state.pt")
        assert cache.budgets[0].plan is not None
        ext = torch.cat([mask, torch.ones(2, part.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        rest = model.generate(input_ids=part, attention_mask=ext, max_new_tokens=6, cache=cache, **kw)
    assert rest.tolist() == full.tolist()
