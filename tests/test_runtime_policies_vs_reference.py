"""TOVA and ScissorHands in the runtime keep exactly what their FP64 references keep (DESIGN.md §2.10).

Like H2O's tests in test_runtime.py: a tiny random model generates under the policy while
its own post-RoPE queries and keys are captured; the reference run on those gives the kept
sets of every layer and KV set, step by step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_utils import KeptRecorder, assert_same_sets, capture_qk, reference_sets, slot_kept_sets
from tiny import tiny_model

import h2o_lens
from h2o_lens import H2OConfig, eviction, ops, policies
from h2o_lens.policies import scissorhands

VOCAB = 256
RANKED = ("tova", "scissorhands")


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, new, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **kw)


def _sets_per_set(rec: KeptRecorder, layer: int, request: int, hs: int) -> list[list[list[int]]]:
    return [step[request][:hs] for step in rec.kept[layer]]


@pytest.mark.parametrize("name", RANKED)
@pytest.mark.parametrize("gqa", ["sum", "max", "none"])
def test_runtime_equals_reference(name, gqa):
    """Every layer and KV set keeps what the reference keeps; the prompt (40 tokens) is longer
    than ScissorHands' window (32 steps), and the generation slides it further."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    heavy, recent, prompt, new = 6, 3, 40, 30
    rec = KeptRecorder()
    cfg = H2OConfig(policy=name, heavy=heavy, recent=recent, gqa=gqa)
    with h2o_lens.h2o(model, cfg, listener=rec), capture_qk() as qk:
        _greedy(model, _ids(prompt), new)
    for layer in range(2):
        runtime = [step[0] for step in rec.kept[layer]]
        assert_same_sets(
            runtime,
            reference_sets(qk[layer], 0, prompt, heavy, recent, gqa, policy=name),
            f"{name} gqa={gqa} layer {layer}",
        )


@pytest.mark.parametrize("name", RANKED)
def test_runtime_equals_reference_other_family_and_no_recent_window(name):
    """Qwen3 (its own attention code), and recent = 0: the published TOVA, where the new token
    competes at once and may be its own victim."""
    model = tiny_model("qwen3", layers=2, q_heads=4, kv_heads=1)
    for heavy, recent in ((5, 2), (7, 0)):
        rec = KeptRecorder()
        with h2o_lens.h2o(model, H2OConfig(policy=name, heavy=heavy, recent=recent), listener=rec), capture_qk() as qk:
            _greedy(model, _ids(20, seed=2), 24)
        for layer in range(2):
            assert_same_sets(
                [s[0] for s in rec.kept[layer]],
                reference_sets(qk[layer], 0, 20, heavy, recent, "sum", policy=name),
                f"{name} heavy={heavy} recent={recent} layer {layer}",
            )


@pytest.mark.parametrize("name", RANKED)
def test_batch_with_padding_equals_reference(name):
    """Left padding: each request keeps its own sets, as if alone (padding is never in a set,
    and never counts as a low step of ScissorHands' history)."""
    model = tiny_model("llama")
    seqs = [_ids(36, seed=5)[0], _ids(24, seed=6)[0]]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s) :] = s
        mask[r, width - len(s) :] = 1
    rec = KeptRecorder()
    with h2o_lens.h2o(model, H2OConfig(policy=name, heavy=4, recent=3), listener=rec), capture_qk() as qk:
        _greedy(model, ids, 20, attention_mask=mask)
    for layer in range(2):
        for r, s in enumerate(seqs):
            runtime = [step[r] for step in rec.kept[layer]]
            assert_same_sets(
                runtime,
                reference_sets(qk[layer], r, len(s), 4, 3, "sum", offset=width - len(s), policy=name),
                f"{name} layer {layer} request {r}",
            )


def test_triton_backend_falls_back_to_the_torch_step():
    """backend='triton' under the interpreter: the ranked policies have no decode kernel
    (their registry entries say so) and run the torch step, with the same kept sets."""
    pytest.importorskip("triton")
    from h2o_lens.kernels._checks import interpret_mode

    if not interpret_mode() and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    assert all("decode" not in policies.get(n).kernels for n in RANKED)
    model = tiny_model("llama")
    for name in RANKED:
        out = {}
        for backend in ("torch", "triton"):
            with h2o_lens.h2o(model, H2OConfig(policy=name, heavy=4, recent=3, backend=backend)):
                seq = _greedy(model, _ids(16, seed=3), 10)
            out[backend] = seq
        assert torch.equal(out["torch"], out["triton"]), name


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    n=st.integers(3, 44),
    prefill=st.integers(1, 44),
    heavy=st.integers(0, 5),
    recent=st.integers(0, 5),
    group=st.sampled_from([1, 2, 3]),
    gqa=st.sampled_from(["sum", "max"]),
    name=st.sampled_from(RANKED),
    seed=st.integers(0, 2**16),
)
def test_torch_ops_equal_reference(n, prefill, heavy, recent, group, gqa, name, seed):
    """The torch prefill (last rows' weights) and decode step, in FP64 on raw q/k, equal the reference."""
    if heavy + recent == 0:
        recent = 1
    prefill = min(prefill, n)
    spec = policies.get(name)
    d = 8
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, group, n, d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) * 2
    v = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    expected = spec.reference((q[0] @ k[0, 0].T).numpy(), prefill, heavy, recent, gqa)
    args = ops.PolicyArgs(name, heavy, recent, 0, gqa)
    rows = ops.prefill_rows(q[:, :, :prefill], k[:, :, :prefill], None, 1.0, gqa, spec.prefill_rows)
    pos = torch.arange(prefill, dtype=torch.int32)[None, None]
    scores, hist = ops.prefill_scores(None, rows, pos, args, dtype=torch.float64, group=group)
    keep = eviction.prefill_keep(scores, pos, heavy, recent)
    sets = slot_kept_sets(q, k, v, prefill, args, scores, keep, hist if spec.history else None)
    assert sets[0] == expected[0]
    for t in range(prefill, n):
        got = sets[t - prefill + 1]
        assert got == expected[t - prefill + 1], f"{name} step {t}"


def test_scissorhands_history_is_bounded_by_the_window():
    """The stored history never holds a bit older than the window, and the stored score is
    window − count of set bits (the value the recorder logs)."""
    model = tiny_model("llama")
    with h2o_lens.h2o(model, H2OConfig(policy="scissorhands", heavy=4, recent=3)) as s:
        _greedy(model, _ids(30, seed=4), 45)
    layer = s.last_cache.layers[1]
    w = scissorhands.WINDOW
    assert layer.history is not None and int(layer.history.max()) < 1 << w
    bits = np.array([[[bin(int(x)).count("1") for x in row] for row in req] for req in layer.history])
    live = layer.positions >= 0
    assert np.array_equal(layer.scores[live].numpy(), (w - bits)[live.numpy()].astype(np.float32))
    kv, meta = layer.nbytes()
    assert meta == layer.scores.numel() * 4 + layer.positions.numel() * 4 + layer.history.numel() * 8


def test_prefill_select_refuses_a_policy_that_ranks_by_rows():
    from h2o_lens.errors import ConfigError

    pos = torch.arange(6, dtype=torch.int32)[None, None]
    with pytest.raises(ConfigError, match="last rows"):
        ops.prefill_select(torch.zeros(1, 1, 6), pos, ops.PolicyArgs("tova", 2, 2, 0, "sum"))
    keep = ops.prefill_select(torch.zeros(1, 1, 6), pos, ops.PolicyArgs("local", 2, 2, 0, "sum"))
    assert pos[keep].tolist() == [2, 3, 4, 5]  # no ranking value: the ties keep the newest
