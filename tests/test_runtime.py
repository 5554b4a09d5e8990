"""The torch runtime on tiny random models of each supported family."""

from __future__ import annotations

import pytest
import torch
from runtime_utils import KeptRecorder, assert_same_sets, capture_qk, reference_sets
from runtime_utils import left_pad as _left_pad
from tiny import FAMILIES, tiny_model

import h2o_lens
from h2o_lens import H2OConfig, compat
from h2o_lens.errors import ConfigError, UnsupportedModelError

VOCAB = 256


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, new=12, **kw):
    with torch.no_grad():
        return model.generate(
            ids,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_runtime_equals_reference(family, gqa):
    """Every layer and KV head keeps exactly what the FP64 reference keeps on the run's own q/k."""
    model = tiny_model(family, layers=2, q_heads=4, kv_heads=2)
    heavy, recent, prompt, new = 5, 3, 20, 16
    rec = KeptRecorder()
    with h2o_lens.h2o(model, H2OConfig(heavy=heavy, recent=recent, gqa=gqa), listener=rec), capture_qk() as qk:
        _greedy(model, _ids(prompt), new)
    for layer in range(2):
        runtime = [step[0] for step in rec.kept[layer]]
        expected = reference_sets(qk[layer], 0, prompt, heavy, recent, gqa)
        assert_same_sets(runtime, expected, f"{family} layer {layer}")


def test_runtime_equals_reference_gqa_none():
    """gqa='none' keeps one set per query head, each equal to a single-head reference."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    rec = KeptRecorder()
    with h2o_lens.h2o(model, heavy=4, recent=2, gqa="none", listener=rec) as s, capture_qk() as qk:
        _greedy(model, _ids(16), 10)
    assert s.last_cache.layers[0].keys.shape[1] == 4  # K/V duplicated per query head
    for layer in range(2):
        runtime = [step[0] for step in rec.kept[layer]]
        assert_same_sets(runtime, reference_sets(qk[layer], 0, 16, 4, 2, "none"), f"layer {layer}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_budget_covering_sequence_equals_full_cache(family, attn):
    model = tiny_model(family, attn=attn)
    ids = _ids(24, seed=1)
    ref = _greedy(model, ids, 16)
    assert model.config._attn_implementation == attn
    with h2o_lens.h2o(model, heavy=20, recent=20):
        got = _greedy(model, ids, 16)
    assert torch.equal(ref.sequences, got.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits))
    assert diff < 1e-4
    assert model.config._attn_implementation == attn


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_rows_are_independent(family):
    """A left-padded batch of prompts of unequal length equals each prompt run alone."""
    model = tiny_model(family)
    seqs = [_ids(n, seed=n)[0] for n in (22, 9, 15)]
    ids, mask = _left_pad(seqs)
    cfg = H2OConfig(heavy=4, recent=3)
    rec = KeptRecorder()
    with h2o_lens.h2o(model, cfg, listener=rec):
        with torch.no_grad():
            batch = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0
            )
    for i, s in enumerate(seqs):
        alone_rec = KeptRecorder()
        with h2o_lens.h2o(model, cfg, listener=alone_rec):
            alone = _greedy(model, s[None], 12).sequences[0]
        assert torch.equal(batch[i, ids.shape[1] - len(s) :], alone), f"request {i}"
        for layer in alone_rec.kept:
            assert [st[i] for st in rec.kept[layer]] == [st[0] for st in alone_rec.kept[layer]]


def test_batch_with_padding_equals_reference():
    model = tiny_model("llama")
    seqs = [_ids(n, seed=n)[0] for n in (18, 11)]
    ids, mask = _left_pad(seqs)
    rec = KeptRecorder()
    with h2o_lens.h2o(model, heavy=3, recent=3, listener=rec), capture_qk() as qk:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    for r, s in enumerate(seqs):
        off = ids.shape[1] - len(s)
        for layer in range(2):
            runtime = [st[r] for st in rec.kept[layer]]
            assert_same_sets(
                runtime, reference_sets(qk[layer], r, len(s), 3, 3, "sum", offset=off), f"request {r} layer {layer}"
            )


def test_physical_cache_holds_budget_slots():
    model = tiny_model("llama", q_heads=4, kv_heads=2, head_dim=16)
    with h2o_lens.h2o(model, heavy=6, recent=4) as s:
        out = _greedy(model, _ids(40), 10)
    cache = s.last_cache
    layer = cache.layers[0]
    assert layer.keys.shape == (1, 2, 10, 16) and layer.values.shape == (1, 2, 10, 16)
    assert layer.get_seq_length() == out.sequences.shape[1] - 1  # logical length, not slots
    b = cache.nbytes()
    full = h2o_lens.runtime.full_kv_bytes(model, out.sequences.shape[1] - 1)
    assert b["kv"] / full == pytest.approx(10 / 49)
    assert b["metadata"] / full <= 2 / 16


def test_exception_inside_scope_restores_model():
    from transformers import AttentionInterface

    model = tiny_model("llama")
    ids = _ids(20)
    before = _greedy(model, ids).sequences
    impl, gen = model.config._attn_implementation, model.generate
    with pytest.raises(RuntimeError, match="boom"):
        with h2o_lens.h2o(model, heavy=2, recent=2):
            assert model.config._attn_implementation == "h2o_lens"
            _greedy(model, ids)
            raise RuntimeError("boom")
    assert model.config._attn_implementation == impl
    assert "generate" not in vars(model) and model.generate == gen
    assert "h2o_lens" not in AttentionInterface._global_mapping
    assert torch.equal(_greedy(model, ids).sequences, before)


@pytest.mark.slow
def test_local_sink_heavy_random_baselines():
    model = tiny_model("llama")
    ids = _ids(30)
    kept = {}
    for name, cfg in {
        "local": H2OConfig(policy="local", heavy=3, recent=5),
        "sink": H2OConfig(policy="sink", heavy=3, recent=5, sink=2),
        "heavy": H2OConfig(policy="heavy", heavy=3, recent=5),
        "random": H2OConfig(policy="random", heavy=3, recent=5, seed=1),
        "random2": H2OConfig(policy="random", heavy=3, recent=5, seed=2),
    }.items():
        rec = KeptRecorder()
        with h2o_lens.h2o(model, cfg, listener=rec) as s:
            _greedy(model, ids, 8)
        assert s.last_cache.layers[0].keys.shape[2] == 8  # same slot count for every baseline
        kept[name] = rec.kept[0]
    last = 30 + 8 - 2  # last processed position
    assert kept["local"][-1][0][0] == list(range(last - 7, last + 1))
    assert kept["sink"][-1][0][0] == [0, 1] + list(range(last - 5, last + 1))
    assert len(kept["heavy"][-1][0][0]) == 8
    assert kept["random"] != kept["random2"]
    rec = KeptRecorder()
    with h2o_lens.h2o(model, H2OConfig(policy="random", heavy=3, recent=5, seed=1), listener=rec):
        _greedy(model, ids, 8)
    assert rec.kept[0] == kept["random"]  # seeded: reproducible


def test_heavy_only_equals_reference():
    """recent=0: the new token competes at once and may evict itself."""
    model = tiny_model("llama")
    rec = KeptRecorder()
    with h2o_lens.h2o(model, heavy=5, recent=0, listener=rec), capture_qk() as qk:
        _greedy(model, _ids(12), 14)
    for layer in range(2):
        assert_same_sets(
            [st[0] for st in rec.kept[layer]], reference_sets(qk[layer], 0, 12, 5, 0, "sum"), f"layer {layer}"
        )


def test_full_policy_leaves_model_untouched():
    model = tiny_model("llama")
    ids = _ids(20)
    ref = _greedy(model, ids).sequences
    with h2o_lens.h2o(model, policy="full") as s:
        assert model.config._attn_implementation == "sdpa"
        assert torch.equal(_greedy(model, ids).sequences, ref)
    assert s.last_cache is None


@pytest.mark.slow
def test_beam_search_and_sampling():
    model = tiny_model("llama")
    ids = _ids(20)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
        with h2o_lens.h2o(model, heavy=20, recent=20):
            got = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
        assert torch.equal(ref, got)  # scores and positions reorder with the KV
        with h2o_lens.h2o(model, heavy=3, recent=3):
            small = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
            torch.manual_seed(5)
            s1 = model.generate(ids, max_new_tokens=8, do_sample=True, pad_token_id=0)
            torch.manual_seed(5)
            s2 = model.generate(ids, max_new_tokens=8, do_sample=True, pad_token_id=0)
    assert small.shape == ref.shape
    assert torch.equal(s1, s2)


def test_ratio_budget_is_resolved_once():
    model = tiny_model("llama")
    with h2o_lens.h2o(model, ratio=0.25) as s:
        _greedy(model, _ids(40), 4)
    cfg = s.last_cache.resolved_config
    assert (cfg.heavy, cfg.recent) == (5, 5)
    assert s.last_cache.layers[0].keys.shape[2] == 10


def test_bad_input_errors():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="whole number"):
        with h2o_lens.h2o(model, heavy=1.5, recent=2):
            pass
    with pytest.raises(UnsupportedModelError, match="transformers causal LM"):
        with h2o_lens.h2o(torch.nn.Linear(2, 2), heavy=2, recent=2):
            pass
    with pytest.raises(ConfigError, match="either a config or keyword"):
        with h2o_lens.h2o(model, H2OConfig(heavy=1, recent=1), heavy=2):
            pass
    assert model.config._attn_implementation == "sdpa"
    # outside generate, a forward without an H2O cache is refused, never silently full
    with h2o_lens.h2o(model, heavy=2, recent=2):
        with pytest.raises(UnsupportedModelError, match="without an H2O cache"):
            model(_ids(5))
    # a cache whose K/V went through another attention (the model switched inside the session)
    # is refused at the next forward, never decoded as if it held the prompt
    with h2o_lens.h2o(model, heavy=2, recent=2) as session:
        model.set_attn_implementation("sdpa")
        with pytest.raises(UnsupportedModelError, match="before H2O's attention took the last ones"):
            _greedy(model, _ids(8), 3, **compat.cache_kwargs(session.new_cache()))
    # a sliding-window model past its window is refused
    import transformers as tf

    cfg = tf.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
    )
    mistral = tf.MistralForCausalLM(cfg).eval()
    with h2o_lens.h2o(mistral, heavy=4, recent=4):
        with pytest.raises(UnsupportedModelError, match="sliding-window"):
            _greedy(mistral, _ids(12), 2)


@pytest.mark.kernel
@pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1 (set by `make test`)",
)
@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_triton_backend_equals_torch_backend(gqa):
    """backend='triton' (the fused step and the prefill-score kernel) gives the same run."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    ids = _ids(18, seed=3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    runs = {}
    for backend in ("torch", "triton"):
        with h2o_lens.h2o(model, H2OConfig(heavy=4, recent=3, gqa=gqa, backend=backend)) as s:
            out = _greedy(model, ids.to(device), 10)
        assert s.last_cache.backend == backend
        runs[backend] = (out.sequences, [layer.positions.sort(-1).values for layer in s.last_cache.layers])
    assert torch.equal(runs["torch"][0], runs["triton"][0])
    for a, b in zip(runs["torch"][1], runs["triton"][1]):
        assert torch.equal(a, b)


def test_auto_backend_is_torch_on_cpu():
    model = tiny_model("llama")
    with h2o_lens.h2o(model, heavy=4, recent=4) as s:
        _greedy(model, _ids(10), 2)
    assert s.last_cache.backend == "torch"
