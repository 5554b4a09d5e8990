"""The long-context task families (h2o_lens.tasks.longctx; docs/DESIGN.md §11)."""

from __future__ import annotations

import json

import pytest

from h2o_lens.models import load_tokenizer
from h2o_lens.tasks.builtins import FAMILIES, family
from h2o_lens.tasks.longctx import FULL_CACHE_SOLVES, LONG_FAMILIES, TOLERANCE, filler_sentences

NAMES = (
    "needle",
    "multi_needle",
    "delayed_reference",
    "restated_fact",
    "variable_tracking",
    "topic_switch_long",
    "long_generation",
)


@pytest.fixture(scope="module")
def tok():
    """The default model's tokenizer alone (no weights)."""
    return load_tokenizer()


def _tokens(tok, task) -> int:
    return len(tok(task.chat_text(tok), add_special_tokens=False)["input_ids"])


def test_registry_lists_the_families():
    assert set(NAMES) <= set(FAMILIES)
    assert set(LONG_FAMILIES) == set(NAMES) == set(FULL_CACHE_SOLVES)
    for name in NAMES:
        assert family(name) is LONG_FAMILIES[name]
    for name, solves in FULL_CACHE_SOLVES.items():  # an unsolved family says so where it is listed
        assert ("NOT solved" in LONG_FAMILIES[name].__doc__.splitlines()[0]) is not solves


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_per_seed(tok, name):
    a = LONG_FAMILIES[name](seed=3, length=1024, count=2, tokenizer=tok)
    b = LONG_FAMILIES[name](seed=3, length=1024, count=2, tokenizer=tok)
    c = LONG_FAMILIES[name](seed=4, length=1024, count=2, tokenizer=tok)
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    assert a[0].prompt != a[1].prompt  # index varies the request
    assert [t.prompt for t in a] != [t.prompt for t in c]
    assert json.loads(json.dumps(a[0].to_json())) == a[0].to_json()  # meta is plain JSON


@pytest.mark.parametrize("length", [1024, 8192])
@pytest.mark.parametrize("name", NAMES)
def test_length_within_tolerance(tok, name, length):
    tasks = LONG_FAMILIES[name](seed=0, length=length, count=2, tokenizer=tok)
    for task in tasks:
        measured = _tokens(tok, task)
        assert task.meta["tokens"] == measured
        assert task.meta["length"] == length and task.meta["family"] == name and task.meta["seed"] == 0
        assert abs(measured - length) <= TOLERANCE * length, (task.name, measured)
        assert task.meta["full_cache_solves"] is FULL_CACHE_SOLVES[name]
        for label, (start, end) in task.evidence.items():
            assert 0 <= start < end <= len(task.prompt), label
    if name == "long_generation":
        assert all(t.max_new_tokens >= 512 for t in tasks)


def test_filler_is_varied():
    import random

    sentences = filler_sentences(random.Random(0), 3000)
    assert len(set(sentences)) > 1000  # 32k tokens are not a few sentences repeated
    assert not any(ch.isdigit() for s in sentences for ch in s)  # never a code-like number


@pytest.mark.parametrize("length", [1024, 8192])
@pytest.mark.parametrize("depth", [0.1, 0.35, 0.5, 0.8, 0.95])
def test_needle_at_the_stated_depth(tok, depth, length):
    (task,) = LONG_FAMILIES["needle"](seed=1, length=length, count=1, tokenizer=tok, depth=depth)
    start, end = task.evidence["needle"]
    assert task.prompt[start:end] == f"The secret code is {task.answer}."
    assert task.meta["depth"] == depth
    assert abs(start / len(task.prompt) - depth) <= 0.02
    token_depth = task.meta["evidence_tokens"]["needle"] / task.meta["tokens"]
    assert abs(token_depth - depth) <= 0.04  # the chat template adds a few tokens at the start
    chat = task.chat_text(tok)
    prefix = chat[: chat.index(task.prompt) + start]
    assert len(tok(prefix, add_special_tokens=False)["input_ids"]) == task.meta["evidence_tokens"]["needle"]


def test_needle_count_spreads_depths(tok):
    tasks = LONG_FAMILIES["needle"](seed=0, length=1024, count=5, tokenizer=tok)
    depths = [t.meta["depth"] for t in tasks]
    assert depths == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    for t in tasks:
        start, _ = t.evidence["needle"]
        assert abs(start / len(t.prompt) - t.meta["depth"]) <= 0.02


def test_evidence_spans_hold_the_facts(tok):
    (multi,) = LONG_FAMILIES["multi_needle"](seed=2, length=2048, count=1, tokenizer=tok)
    asked = multi.answer["all"][0]
    start, end = multi.evidence["needle"]
    assert asked in multi.prompt[start:end]
    distractors = [k for k in multi.evidence if k.startswith("distractor_")]
    assert len(distractors) == 3
    assert sorted(multi.prompt[slice(*multi.evidence[k])].split()[-1].rstrip(".") for k in distractors) == sorted(
        multi.answer["none"]
    )
    assert multi.check(f"The code is {asked}.") and not multi.check(multi.answer["none"][0])

    (restated,) = LONG_FAMILIES["restated_fact"](seed=2, length=2048, count=1, tokenizer=tok)
    spans = [restated.evidence[f"fact_{k}"] for k in range(5)]
    assert all(restated.answer in restated.prompt[s:e] for s, e in spans)
    assert [s for s, _ in spans] == sorted(s for s, _ in spans)  # spread along the text
    assert spans[-1][0] / len(restated.prompt) > 0.8

    (chain,) = LONG_FAMILIES["variable_tracking"](seed=2, length=2048, count=1, tokenizer=tok)
    order = sorted(chain.evidence, key=lambda k: chain.evidence[k][0])
    assert order.index("assign_X1") < order.index("assign_X2") < order.index("assign_X3")
    assert chain.answer["all"][0] in chain.prompt[slice(*chain.evidence["assign_X1"])]

    for name in ("delayed_reference", "topic_switch_long", "long_generation"):
        (task,) = LONG_FAMILIES[name](seed=2, length=2048, count=1, tokenizer=tok)
        start, _ = task.evidence["fact"]
        assert start / len(task.prompt) < 0.05  # stated once, at the start
        assert task.meta["evidence_tokens"]["fact"] < 0.05 * task.meta["tokens"]


def test_bad_options_are_clear_errors(tok):
    with pytest.raises(ValueError, match="length must be"):
        LONG_FAMILIES["needle"](length=10, tokenizer=tok)
    with pytest.raises(ValueError, match="depth must be in"):
        LONG_FAMILIES["needle"](depth=1.5, tokenizer=tok)
    with pytest.raises(ValueError, match="count must be"):
        LONG_FAMILIES["needle"](count=0, tokenizer=tok)


@pytest.mark.model
@pytest.mark.slow
def test_long_generation_freezes_late_at_20_percent_keep(default_model, tmp_path):
    """One ~1k-token long_generation request on the default model, H2O at 20 % keep, recorded:
    at least one KV set's freeze onset (DESIGN.md §6.5) falls after step 100 of the generation."""
    import torch

    from analyses.dynamics import freeze_onset
    from h2o_lens.policies import DEFAULT
    from h2o_lens.tasks.real import budget
    from recorders.recorder import record

    model, tok = default_model
    (task,) = LONG_FAMILIES["long_generation"](seed=0, length=1024, count=1, tokenizer=tok)
    enc = tok(task.chat_text(tok), return_tensors="pt", add_special_tokens=False)
    prompt_len = enc["input_ids"].shape[1]
    config = budget(DEFAULT, 0.2, prompt_len)
    with (
        torch.no_grad(),
        record(model, config, out=str(tmp_path), tokenizer=tok, evidence=task.evidence, prompts=[task.prompt]) as run,
    ):
        ids = model.generate(**enc, max_new_tokens=task.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    generated = ids.shape[1] - prompt_len
    assert generated >= 300, f"the model stopped after {generated} new tokens"
    rel = freeze_onset(str(tmp_path), run.run_id)
    rows = [dict(zip(rel.columns, r)) for r in rel.fetchall()]
    assert len(rows) == model.config.num_hidden_layers * model.config.num_key_value_heads
    # the first logged step is the prefill's (position P - 1): generation step = onset_step - (P - 1)
    onsets = [r["onset_step"] - (prompt_len - 1) for r in rows if r["frozen"]]
    # frozen for good from after step 100, for at least four 16-step windows (not just the tail)
    assert any(100 < o <= generated - 64 for o in onsets), sorted(onsets)
