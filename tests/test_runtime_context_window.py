"""A generation past the model's context window is said once, by the runtime or the recorder."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny import tiny_model

import recorders
from h2o_lens import H2OConfig, h2o
from h2o_lens.models import ContextWarning, context_window, planned_positions


@pytest.fixture
def model():
    m = tiny_model("llama", layers=1)
    m.config.max_position_embeddings = 24
    return m


def _generate(model, new: int, **kw):
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **kw)


def _context_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if issubclass(w.category, ContextWarning)]


def test_within_the_window_nothing_is_said(model, tmp_path):
    assert context_window(model) == 24
    with h2o(model, heavy=4, recent=4):
        assert _context_warnings(lambda: _generate(model, 8)) == []  # 16 + 8 = 24 positions


@pytest.mark.parametrize("policy", ["h2o", "full"])
def test_past_the_window_one_warning_per_generate(model, tmp_path, policy):
    config = H2OConfig(heavy=4, recent=4) if policy == "h2o" else H2OConfig(policy="full")
    with h2o(model, config):
        said = _context_warnings(lambda: _generate(model, 9))
    assert len(said) == (1 if policy == "h2o" else 0)  # a full cache is transformers' own generate
    if said:
        assert "25 positions" in said[0] and "context window of 24" in said[0]
    with recorders.record(model, config, out=tmp_path, fsync=False):
        said = _context_warnings(lambda: _generate(model, 9))
    assert len(said) == 1, said  # the recorder or the session, never both
    assert "25 positions" in said[0]


def test_planned_positions_reads_max_new_tokens_or_max_length(model):
    assert planned_positions(model, 16, {"max_new_tokens": 5}) == 21
    assert planned_positions(model, 16, {"max_length": 30}) == 30
    assert planned_positions(model, 16, {"max_length": 8}) == 16
    model.generation_config.max_new_tokens = 7
    assert planned_positions(model, 16, {}) == 23
