"""``h2o-lens bench explain --length N`` on a tiny model (DESIGN.md §6.10; no timing asserted).

The prompt is capped at the model's window less the request's new tokens and the header says so;
a length past the window or below what a family can fit is refused in one line; a model whose
full cache answers none of the requests gets one line instead of a figure. A tiny random llama
in a folder, one token per byte, its window widened to 2,048 positions (a filler sentence is some
50 tokens: a family fits its lengths within 2 % from about 1k tokens on).
"""

from __future__ import annotations

import json
import tempfile

import pytest
from tiny import save_tiny

from commands.benchmarks.explain import _explain_candidates, _prompt_tokens
from commands.cli import main
from h2o_lens.models import context_window, load_model
from h2o_lens.tasks.longctx import FULL_CACHE_SOLVES, TOLERANCE

WINDOW = 2048
SOLVED = [f for f, solves in FULL_CACHE_SOLVES.items() if solves]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("model") / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": WINDOW}))
    return str(path), *load_model(path, progress=False)


def test_a_length_at_the_window_is_capped_so_each_prompt_and_its_new_tokens_fit(tiny):
    _, model, tok = tiny
    window = context_window(model)
    assert window == WINDOW
    reqs, capped = _explain_candidates(model, tok, None, window)
    assert [r.meta["family"] for r in reqs] == [f for f in SOLVED for _ in range(3)]  # needle first
    for r in reqs:
        n = _prompt_tokens(tok, r)
        assert n + r.max_new_tokens <= window, (r.name, n)
        # a family's requests share the length asked, each within a filler sentence of it
        assert n >= (window - r.max_new_tokens) * (1 - 3 * TOLERANCE), (r.name, n)
    for family in SOLVED:
        new = next(r.max_new_tokens for r in reqs if r.meta["family"] == family)
        assert capped[family].startswith(f"{family}: --length {window} capped at ")
        assert capped[family].endswith(f"(the window of {window:,} positions less {new} new tokens)")
    assert list(capped) == SOLVED


def test_a_length_that_fits_is_not_capped_and_a_family_asked_for_is_the_only_one(tiny):
    _, model, tok = tiny
    reqs, capped = _explain_candidates(model, tok, "needle", 1500)
    assert capped == {} and [r.meta["family"] for r in reqs] == ["needle"] * 3
    assert all(abs(_prompt_tokens(tok, r) - 1500) <= TOLERANCE * 1500 for r in reqs)
    (req,), capped = _explain_candidates(model, tok, None, None)
    assert req.name == "delayed_recall_1" and capped == {}


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--length", "2049"], "--length 2049 is past the model's window of 2,048 positions"),
        (["--length", "100"], "length must be a whole number of prompt tokens in [256,"),
        (["--length", "0"], "argument --length: expected a whole number >= 1, got 0"),
        (["--length", "1500", "--tasks", "builtin:delayed_recall_1"], "--length takes a long-context family"),
    ],
)
def test_an_absurd_length_is_refused_in_one_line_before_anything_runs(tiny, capsys, argv, says):
    path, _, _ = tiny
    assert main(["bench", "explain", "--model", path, "--rounds", "1", *argv]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading bar
    assert last.startswith("h2o-lens: error: bench explain: ") and says in last, last


def test_a_short_family_with_length_is_refused_before_the_model_loads(capsys):
    """The family check needs no model: a model path that does not exist is never opened."""
    argv = ["bench", "explain", "--model", "/nonexistent/model", "--length", "1500", "--tasks", "builtin:demo"]
    assert main(argv) == 2
    assert "--length takes a long-context family" in capsys.readouterr().err


def test_a_model_whose_full_cache_answers_nothing_gets_one_line_and_no_figure(tiny, capsys, tmp_path, monkeypatch):
    path, _, _ = tiny
    argv = ["bench", "explain", "--model", path, "--tasks", "builtin:needle", "--length", "1500", "--rounds", "1"]
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # the runs go under tmp_path
    assert main(argv) == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "h2o-lens: error: bench explain: the full cache answers none of the 3 requests tried (needle at 1500 tokens)"
    )
    assert [line for line in out.splitlines() if line.startswith("trying ")] == [
        f"trying needle_{i} (needle at 1500 tokens)" for i in range(3)
    ]
    assert "ratio" not in out
    # no H2O run is made for a request the full cache gets wrong: only the three full-cache runs
    runs = list(tmp_path.rglob("manifest.json"))
    assert len(runs) == 3, runs
