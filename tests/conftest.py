"""Fixtures shared by the test modules; shared helpers live in plain modules beside them
(``tiny``: tiny random models, ``runtime_utils``: kept sets of a run against the reference,
``faulty``: the runtime's known state bugs as a cache layer subclass, ``logsim``: the numpy H2O
simulator that writes runs, ``app_runs``: the dashboard's runs root), so no test module imports
another."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def app_runs_root(tmp_path_factory) -> Path:
    """A runs root with every case the dashboard must handle (:func:`app_runs.build_runs_root`).

    Imported here, not at the top: app_runs pulls the recorders and DuckDB, which the kernel tests
    on a GPU machine (``make gpu-check``) neither need nor install."""
    from app_runs import build_runs_root

    return build_runs_root(tmp_path_factory.mktemp("app") / "runs")


@pytest.fixture(scope="session")
def large_root(tmp_path_factory) -> Path:
    """A generated runs root of 300 runs (:func:`runlog.synthetic_root.make_root`)."""
    from runlog.synthetic_root import make_root

    return make_root(tmp_path_factory.mktemp("large") / "runs", 300, seed=1)


@pytest.fixture(scope="session")
def shared_default_model():
    """The packaged default model in float32 and its tokenizer, loaded once for the whole session
    (tests take it through :func:`default_model`, or a module fixture that restores what it changes)."""
    import h2o_lens

    return h2o_lens.load_model(progress=False)


@pytest.fixture
def default_model(shared_default_model):
    """``(model, tokenizer)`` of the default model, shared; what a test changes of the attention
    implementation, the generation config and the padding side is put back after it."""
    model, tok = shared_default_model
    attn, side = model.config._attn_implementation, tok.padding_side
    generation = copy.deepcopy(model.generation_config)
    yield model, tok
    if model.config._attn_implementation != attn:
        model.set_attn_implementation(attn)
    model.generation_config, tok.padding_side = generation, side
    assert "generate" not in vars(model), "a test left model.generate wrapped"
