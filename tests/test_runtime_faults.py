"""Known state bugs live in a test-only layer subclass (tests/faulty.py), never in the live runtime.

Besides the cache's extensions (which observe and never replace a verb, DESIGN.md §1.1), the tests'
hook is the layer class a new cache gets (:func:`h2o_lens.cache.use_layer_class`):
plain outside a block, the block's class inside it (in its own thread only), restored on exit and
after an error. A fault-free subclass runs exactly as the plain layer.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
from faulty import KNOWN, FaultyLayer, faulty_layer, inject
from tiny import tiny_model

import h2o_lens
from h2o_lens import H2OConfig
from h2o_lens.cache import H2OCache, H2OCacheLayer, current_layer_class, use_layer_class
from h2o_lens.errors import ConfigError

TEXT = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CFG = H2OConfig(heavy=4, recent=2)


def _layer_class() -> type:
    return type(H2OCache(CFG, TEXT).layers[0])


def test_caches_get_the_plain_layer_outside_a_block_and_the_blocks_class_inside():
    assert _layer_class() is H2OCacheLayer and current_layer_class() is H2OCacheLayer
    with inject("scores_not_rolled_back") as outer:
        assert _layer_class() is outer and outer.faults == {"scores_not_rolled_back"}
        with inject("prefix_without_copy") as inner:
            assert _layer_class() is inner and inner.faults == {"prefix_without_copy"}
        assert _layer_class() is outer
    assert _layer_class() is H2OCacheLayer
    # an explicit class wins over the block's
    with inject("prefix_without_copy"):
        assert type(H2OCache(CFG, TEXT, layer_class=H2OCacheLayer).layers[0]) is H2OCacheLayer


def test_the_block_is_undone_after_an_error_and_does_not_reach_other_threads():
    with pytest.raises(RuntimeError), inject("kv_reorder_without_scores"):
        raise RuntimeError("boom")
    assert _layer_class() is H2OCacheLayer
    seen = []
    with inject("kv_reorder_without_scores") as cls:
        thread = threading.Thread(target=lambda: seen.append(_layer_class()))
        thread.start()
        thread.join()
        assert _layer_class() is cls
    assert seen == [H2OCacheLayer]


def test_unknown_faults_and_other_classes_are_errors():
    with pytest.raises(ConfigError, match="unknown fault"), inject("no_such_fault"):
        pass
    with pytest.raises(ConfigError, match="subclass of it"), use_layer_class(dict):
        pass
    with pytest.raises(ConfigError, match="subclass of it"):
        H2OCache(CFG, TEXT, layer_class=object)
    assert set(KNOWN) == {"scores_not_rolled_back", "kv_reorder_without_scores", "prefix_without_copy"}


def test_a_fault_free_subclass_runs_exactly_as_the_plain_layer():
    """The subclass changes only the verbs of the faults it names: with none, the tokens and every
    layer's final state are the plain layer's, bit for bit (beam search reorders the rows)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    states = []
    for cls in (H2OCacheLayer, faulty_layer()):
        with use_layer_class(cls), h2o_lens.h2o(model, CFG) as session, torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, num_beams=2, pad_token_id=0)
        assert all(isinstance(layer, cls) for layer in session.last_cache.layers)
        names = ("keys", "values", "scores", "positions")
        states.append([out] + [getattr(layer, n) for layer in session.last_cache.layers for n in names])
    assert issubclass(faulty_layer(), FaultyLayer)
    for a, b in zip(*states):
        assert torch.equal(a, b)


def test_the_runtime_has_no_fault_switch():
    import importlib.util

    assert importlib.util.find_spec("h2o_lens.faults") is None
