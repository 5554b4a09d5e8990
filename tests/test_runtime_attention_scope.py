"""The attention-registration scope shared by the runtime and the replay (h2o_lens.hooks)."""

from __future__ import annotations

import importlib

import pytest
import torch
from tiny import tiny_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import h2o_lens
from h2o_lens import hooks
from h2o_lens.errors import ImplementationError

replay_mod = importlib.import_module("recorders.replay")  # the package's `replay` is the function


def _registered(name: str) -> tuple[object, object]:
    return AttentionInterface._global_mapping.get(name), AttentionMaskInterface._global_mapping.get(name)


def _counting_sdpa(calls: list):
    sdpa = AttentionInterface._global_mapping["sdpa"]

    def attention(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    return attention


def test_scope_runs_the_function_and_restores_everything_after_an_exception():
    model = tiny_model("llama")
    ids = torch.arange(1, 9)[None]
    name = "h2o_lens_test_probe"
    earlier = (lambda *a, **k: None, lambda *a, **k: None)  # what the registries held before
    AttentionInterface._global_mapping[name], AttentionMaskInterface._global_mapping[name] = earlier
    calls: list = []
    mask = AttentionMaskInterface._global_mapping["sdpa"]
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with hooks.attention_implementation(model, name, _counting_sdpa(calls), mask):
                assert model.config._attn_implementation == name
                with torch.no_grad():
                    model(input_ids=ids)
                assert len(calls) == model.config.num_hidden_layers
                raise RuntimeError("boom")
        assert model.config._attn_implementation == "sdpa"
        assert _registered(name) == earlier
        assert name not in hooks._users
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


def test_nested_runtime_and_replay_scopes_restore_in_order():
    model = tiny_model("llama")
    state = replay_mod._State()
    with h2o_lens.h2o(model, heavy=2, recent=2):
        assert model.config._attn_implementation == hooks.ATTN_NAME
        with h2o_lens.h2o(model, heavy=2, recent=2):  # reference counted: the inner exit keeps it
            pass
        assert model.config._attn_implementation == hooks.ATTN_NAME
        assert _registered(hooks.ATTN_NAME) == (hooks.h2o_attention, hooks.h2o_mask)
        with replay_mod._replay_attention(model, state):
            assert model.config._attn_implementation == replay_mod.REPLAY_ATTN
            assert _registered(replay_mod.REPLAY_ATTN)[1] is replay_mod._no_mask
            assert _registered(hooks.ATTN_NAME) == (hooks.h2o_attention, hooks.h2o_mask)
        assert model.config._attn_implementation == hooks.ATTN_NAME
        assert _registered(replay_mod.REPLAY_ATTN) == (None, None)
        out = model.generate(torch.arange(1, 9)[None], max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 11)
    assert model.config._attn_implementation == "sdpa"
    assert _registered(hooks.ATTN_NAME) == (None, None)
    assert hooks.ATTN_NAME not in hooks._users and replay_mod.REPLAY_ATTN not in hooks._users


def test_nested_scope_with_other_functions_under_the_same_name_is_refused():
    model = tiny_model("llama")
    with h2o_lens.h2o(model, heavy=2, recent=2):
        with pytest.raises(ImplementationError, match="already registered with other functions"):
            with hooks.attention_implementation(model, hooks.ATTN_NAME, _counting_sdpa([]), hooks.h2o_mask):
                pass
        assert model.config._attn_implementation == hooks.ATTN_NAME
        assert _registered(hooks.ATTN_NAME) == (hooks.h2o_attention, hooks.h2o_mask)
    assert model.config._attn_implementation == "sdpa"
    assert _registered(hooks.ATTN_NAME) == (None, None)
