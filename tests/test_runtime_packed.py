"""Packed linear layers for batched decode steps on CPU (DESIGN.md §16).

Inside ``packed_linears(model, rows)`` every float32 CPU ``nn.Linear`` takes MKL's packed
product for inputs of exactly ``rows`` rows and ``F.linear`` for anything else. The packed
product may round differently, nothing more; every layer's own forward must be back when the
block ends; the H2O session must use it for the decode steps of a batch and only for them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import left_padded, tiny_model

import h2o_lens
from h2o_lens import H2OConfig, packed
from h2o_lens.packed import ENV_SWITCH, packed_linears, packing_available

pytestmark = pytest.mark.skipif(
    not packed._kernel_present(), reason="this torch has no MKL packed linear (torch.ops.mkl._mkl_linear)"
)


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _counting(monkeypatch):
    """Count the packed products by the rows of their inputs."""
    calls = []
    real = packed._product

    def product(x, pack, module, rows):
        calls.append(x.numel() // module.in_features)
        return real(x, pack, module, rows)

    monkeypatch.setattr(packed, "_product", product)
    return calls


def _outputs(model, names):
    """Inputs and outputs of the named linear layers at their last call."""
    seen = {}
    handles = [
        model.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, (a[0], out)))
        for n in names
    ]
    return seen, handles


def test_decode_forwards_take_the_packed_product_and_agree_to_rounding(monkeypatch):
    model = tiny_model("qwen2")  # q/k/v with bias
    calls = _counting(monkeypatch)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    seen, handles = _outputs(model, names)
    ids = torch.randint(3, 250, (4, 1), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            want = model(input_ids=ids).logits
            with packed_linears(model, 4) as on:
                assert on
                got = model(input_ids=ids).logits
    finally:
        for h in handles:
            h.remove()
    assert len(calls) == len(_linears(model)) and set(calls) == {4}  # every layer, once, 4 rows
    for name in names:
        x, out = seen[name]
        layer = model.get_submodule(name)
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_prompt_pass_is_left_to_f_linear_even_its_last_position_head(monkeypatch):
    model = tiny_model("llama")
    calls = _counting(monkeypatch)
    seen, handles = _outputs(model, ["lm_head", "model.layers.0.mlp.up_proj"])
    ids, mask = left_padded((9, 6, 9), seed=2)
    try:
        with torch.no_grad(), packed_linears(model, 3):
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1)  # the head sees 3 rows
            model.model.layers[0].mlp.up_proj(torch.randn(3, model.config.hidden_size))  # outside a forward
    finally:
        for h in handles:
            h.remove()
    assert calls == []
    for name, (x, out) in seen.items():
        layer = model.get_submodule(name)
        assert torch.equal(out, F.linear(x, layer.weight, layer.bias)), name


def test_the_model_and_every_layer_get_their_own_forward_back_exceptions_included():
    model = tiny_model("qwen2")
    layers = _linears(model)
    with pytest.raises(RuntimeError, match="boom"):
        with packed_linears(model, 3) as on:
            assert on and "forward" in vars(model) and all("forward" in vars(m) for m in layers)
            raise RuntimeError("boom")
    assert "forward" not in vars(model)
    assert not any("forward" in vars(m) for m in layers)
    # a forward set on the instance before the block is put back, not deleted
    mine = layers[0].forward
    layers[0].forward = mine
    with packed_linears(model, 3):
        assert layers[0].forward is not mine
    assert vars(layers[0])["forward"] is mine


@pytest.mark.parametrize(
    "case",
    ["one row", "float64", "switched off", "no room"],
)
def test_nothing_is_packed_where_it_cannot_help_or_is_turned_off(case, monkeypatch):
    model = tiny_model("llama")
    rows = 4
    if case == "one row":
        rows = 1
    elif case == "float64":
        model = model.double()
    elif case == "no room":  # the packed copy would take more than half the free memory
        weights = sum(m.weight.nbytes for m in _linears(model))
        monkeypatch.setattr(packed, "_free_bytes", lambda: 2 * weights - 1)
    else:
        monkeypatch.setenv(ENV_SWITCH, "0")
    assert packing_available(model) == (case == "one row")
    with packed_linears(model, rows) as on:
        assert on is False
        assert not any("forward" in vars(m) for m in _linears(model))


def test_a_weight_changed_in_place_is_packed_again():
    model = tiny_model("llama")
    seen, handles = _outputs(model, ["model.layers.1.self_attn.o_proj"])
    layer = model.model.layers[1].self_attn.o_proj
    ids = torch.randint(3, 250, (2, 1), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            with packed_linears(model, 2):
                model(input_ids=ids)
            layer.weight.mul_(2.0)
            with packed_linears(model, 2):
                model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    x, out = seen["model.layers.1.self_attn.o_proj"]
    torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=1e-5, atol=1e-6)


def test_gradients_still_flow_through_the_plain_product(monkeypatch):
    model = tiny_model("llama")
    calls = _counting(monkeypatch)
    ids = torch.randint(3, 250, (2, 1), generator=torch.Generator().manual_seed(2))
    with packed_linears(model, 2):
        model(input_ids=ids).logits.sum().backward()
    assert calls == []
    assert all(m.weight.grad is not None for m in _linears(model))


def test_an_h2o_generate_packs_its_decode_steps_and_nothing_else(monkeypatch):
    model = tiny_model("llama")
    ids, mask = left_padded((12, 8, 12, 10), seed=4)
    cfg = H2OConfig(heavy=3, recent=3)
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(ENV_SWITCH, switch)
        calls = _counting(monkeypatch)
        with torch.no_grad(), h2o_lens.h2o(model, cfg):
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_scores=True,
            )
        runs[switch] = (out, list(calls))
    # 5 decode steps (the first token comes from the prompt pass), every layer, 4 rows each
    assert runs["1"][1] == [4] * (5 * len(_linears(model)))
    assert runs["0"][1] == []
    assert "forward" not in vars(model) and not any("forward" in vars(m) for m in _linears(model))
    for a, b in zip(runs["1"][0].scores, runs["0"][0].scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_covering_budget_still_equals_the_full_cache_on_a_packed_batch(monkeypatch):
    """With slots for every position nothing is evicted: a padded batch, packed decode steps
    and all, generates the full cache's tokens (transformers' own cache, never packed)."""
    model = tiny_model("llama")
    ids, mask = left_padded((14, 9, 12), seed=6)
    kw = dict(
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    with torch.no_grad():
        ref = model.generate(input_ids=ids, **kw)
        calls = _counting(monkeypatch)
        with h2o_lens.h2o(model, heavy=16, recent=16):
            got = model.generate(input_ids=ids, **kw)
    assert calls and set(calls) == {3}
    assert torch.equal(ref.sequences, got.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits)) < 1e-4
