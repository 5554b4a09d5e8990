"""A model's shape from its config and the KV sets of an aggregation (h2o_lens/shape.py)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from tiny import FAMILIES, tiny_model

from h2o_lens import H2OConfig, compat, h2o
from h2o_lens.cache import H2OCache
from h2o_lens.config import GQA_MODES
from h2o_lens.errors import ConfigError, UnsupportedModelError
from h2o_lens.models import model_info
from h2o_lens.runtime import check_model, full_kv_bytes
from h2o_lens.shape import ModelShape, kv_sets, model_shape


@pytest.mark.parametrize("family", FAMILIES)
def test_model_shape_reads_each_familys_config(family):
    model = tiny_model(family, layers=3, q_heads=6, kv_heads=2, head_dim=8)
    shape = model_shape(model.config)
    assert shape == ModelShape(layers=3, q_heads=6, kv_heads=2, head_dim=8)
    assert shape.group == 3
    # the attention modules agree: q and k projections of that many heads of that size
    attn = model.model.layers[0].self_attn
    proj = attn.q_proj if hasattr(attn, "q_proj") else attn.qkv_proj
    assert proj.out_features in (6 * 8, (6 + 2 * 2) * 8)


def test_model_shape_of_plain_configs():
    mha = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=32)
    assert model_shape(mha) == ModelShape(2, 4, 4, 8)  # no KV head count: one per query head
    gqa = types.SimpleNamespace(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=None, head_dim=None)
    assert model_shape(gqa) == ModelShape(1, 4, 4, None)
    with pytest.raises(UnsupportedModelError, match="6 query heads are not a multiple of 4 KV heads"):
        model_shape(types.SimpleNamespace(num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=4))
    with pytest.raises(UnsupportedModelError, match="num_attention_heads"):
        model_shape(types.SimpleNamespace(hidden_size=8))


def test_kv_sets_per_aggregation():
    assert [kv_sets(g, 12, 4) for g in ("sum", "max", "none")] == [4, 4, 12]
    shape = ModelShape(layers=2, q_heads=12, kv_heads=4)
    assert [shape.sets(g) for g in ("sum", "max", "none")] == [4, 4, 12]
    assert [shape.copies(g) for g in ("sum", "max", "none")] == [1, 1, 3]  # K/V repeated per query head
    assert [shape.heads_per_set(g) for g in ("sum", "max", "none")] == [3, 3, 1]
    with pytest.raises(ConfigError, match="unknown gqa mode 'mean'"):
        kv_sets("mean", 12, 4)


@pytest.mark.parametrize("gqa", ["sum", "none"])
def test_the_runtime_reads_the_shape_from_the_one_helper(gqa):
    """The manifest's model fields, the full-cache size and the cache's KV sets all come from
    :func:`model_shape`, and the model check refuses the heads it refuses."""
    model = tiny_model("qwen3", layers=3, q_heads=6, kv_heads=2, head_dim=8).to(torch.bfloat16)
    shape = model_shape(model.config)
    info = model_info(model)
    assert (info["num_layers"], info["num_query_heads"], info["num_kv_heads"], info["head_dim"]) == (3, 6, 2, 8)
    assert full_kv_bytes(model, 10, batch=2) == 2 * 3 * 2 * 8 * 10 * 2 * 2  # K and V, bf16
    cache = H2OCache(H2OConfig(heavy=2, recent=2, gqa=gqa), model.config)
    assert (len(cache.layers), cache.num_query_heads, cache.num_kv_heads) == (3, 6, 2)
    assert cache.shape == shape and cache.shape.sets(gqa) == (6 if gqa == "none" else 2)
    check_model(model)
    model.config.num_key_value_heads = 4
    with pytest.raises(UnsupportedModelError, match="6 query heads are not a multiple of 4 KV heads"):
        check_model(model)


@pytest.mark.parametrize(
    ("family", "q_heads", "kv_heads"),
    [("llama", 4, 2), ("qwen2", 4, 2), ("qwen3", 6, 2), ("qwen3", 6, 1), ("llama", 4, 4)],
    ids=["llama-gqa", "qwen2-gqa", "qwen3-gqa", "qwen3-mqa", "llama-mha"],
)
def test_the_helpers_agree_with_the_real_caches(family, q_heads, kv_heads):
    """What the helpers say is what the caches hold: transformers' own cache has
    ``model_shape`` layers of ``(batch, kv_heads, tokens, head_dim)`` keys and values, as many
    bytes as ``full_kv_bytes``, and the H2O cache keeps ``kv_sets`` sets per layer under each
    aggregation."""
    model = tiny_model(family, layers=3, q_heads=q_heads, kv_heads=kv_heads, head_dim=8)
    shape = model_shape(model.config)
    batch, tokens, budget = 2, 12, 6
    ids = torch.randint(3, 256, (batch, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=True).past_key_values
    assert len(full.layers) == shape.layers
    held = 0
    for layer in full.layers:
        assert tuple(layer.keys.shape) == tuple(layer.values.shape) == (batch, kv_heads, tokens, shape.head_dim)
        held += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    assert full_kv_bytes(model, tokens, batch=batch) == held
    for gqa in GQA_MODES:
        with h2o(model, H2OConfig(heavy=budget // 2, recent=budget // 2, gqa=gqa)) as session:
            cache = session.new_cache()
            with torch.no_grad():
                model(input_ids=ids, use_cache=True, **compat.cache_kwargs(cache))
        assert len(cache.layers) == shape.layers
        sets = kv_sets(gqa, shape.q_heads, shape.kv_heads)
        assert sets == (q_heads if gqa == "none" else kv_heads)
        for layer in cache.layers:
            assert tuple(layer.keys.shape) == (batch, sets, budget, shape.head_dim), gqa
            assert tuple(layer.positions.shape) == (batch, sets, budget), gqa
            kept = layer.positions[layer.positions >= 0]
            assert len(kept) == batch * sets * budget  # every set full: the prompt is longer than the budget


def test_model_info_leaves_the_shape_null_without_head_counts():
    text = types.SimpleNamespace(model_type="ssm", num_hidden_layers=2, hidden_size=8)  # no attention heads
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(get_text_config=lambda decoder=False: text, _name_or_path="ssm")
    model.dtype = torch.float32
    info = model_info(model)
    assert [info[k] for k in ("num_layers", "num_query_heads", "num_kv_heads", "head_dim")] == [None] * 4
    assert (info["model_type"], info["num_parameters"]) == ("ssm", 6)


def test_the_shape_module_imports_without_torch():
    code = (
        "import sys, h2o_lens.shape as s; s.kv_sets('none', 4, 2); "
        "bad = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
