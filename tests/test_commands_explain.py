"""Counterfactual verdicts on the real default model (DESIGN.md §6.10).

The delayed first reference H2O is known for is a scoring failure, pinning the evidence brings
the answer back, and the oracle needs no more slots than H2O. At long context (a 1.8k-token
``restated_fact`` request under H2O at 7.5 %), the oracle keeps the answer with the run's own
slots in words of its own: judged by the request's checker like every other variant it makes
the verdict ``scoring``, with the evidence labelled (pinning it does not help) and without.
Judged teacher-forced, as before, it failed (one of its tokens is not the teacher's) and the
verdict was ``budget``. One request each, coarse bisection or none, no replays of the re-runs.
"""

from __future__ import annotations

import dataclasses

import pytest

from analyses import causal_verdicts, connect
from commands.explain import format_verdicts
from commands.jobs import run_task
from h2o_lens import H2OConfig
from h2o_lens.tasks import get_task
from h2o_lens.tasks.longctx import LONG_FAMILIES
from recorders.counterfactual import explain_request

pytestmark = pytest.mark.model


def test_delayed_recall_fails_under_h2o_for_its_scores_not_its_budget(default_model, tmp_path):
    model, tok = default_model
    task = get_task("delayed_recall_1")  # fails under H2O at 20 % (h2o_lens/tasks/real.py)
    parent = run_task(model, tok, task, H2OConfig(ratio=0.2), tmp_path, ratio=0.2, replay=False)
    assert not parent.correct
    ex = explain_request(model, tok, parent.run_dir, 0, replay=False, resolution=0.1)
    assert ex.outcomes["full"].passed and ex.outcomes["pinned"].passed
    (v,) = causal_verdicts(connect(tmp_path), parent.run_id)
    assert v.verdict == "scoring", v.reason
    assert v.passes["pinned"] is True and v.runs["pinned"] in v.decided_by
    assert v.min_slots["oracle"] is not None and v.min_slots["policy"] is not None
    assert v.min_slots["oracle"] <= v.min_slots["policy"]
    assert v.slots < v.min_slots["policy"]  # the run's own budget fails


@pytest.fixture(scope="module")
def long_request(tmp_path_factory, shared_default_model):
    """A 1.8k-token request, its full-cache run (as a sweep's full cell would hold it) and two
    parents under H2O at 7.5 %: with its evidence labels and without any (the default model
    as loaded: nothing here changes it)."""
    model, tok = shared_default_model
    root = tmp_path_factory.mktemp("long")
    (task,) = LONG_FAMILIES["restated_fact"](length=1800, count=1, tokenizer=tok)
    full = run_task(model, tok, task, H2OConfig(policy="full"), root, replay=False)
    assert full.correct
    parents = {}
    for labels in (True, False):
        t = task if labels else dataclasses.replace(task, evidence={})
        parents[labels] = run_task(model, tok, t, H2OConfig(ratio=0.075), root, ratio=0.075, replay=True)
        assert not parents[labels].correct
    return model, tok, root, full, parents


def _explained(long_request, labels: bool):
    model, tok, root, full, parents = long_request
    parent = parents[labels]
    ex = explain_request(model, tok, parent.run_dir, 0, bisect=False, replay=False)
    (v,) = causal_verdicts(connect(root), parent.run_id)
    return ex, v, {r["variant"]: r for r in v.table}, full


def _oracle_keeps_the_answer_in_its_own_words(ex, v, rows):
    oracle, full = rows["oracle"], rows["full"]
    assert v.verdict == "scoring", v.reason
    assert v.passes["oracle"] is True and v.runs["oracle"] in v.decided_by
    assert oracle["right"] is True and oracle["answer"] != full["answer"]  # its own answer, judged
    k, n = oracle["teacher_agreement"]
    assert 0 < k < n  # fed the teacher's tokens, its top-1 departs from them somewhere
    line = next(x for x in format_verdicts([v]).splitlines() if x.strip().startswith("oracle "))
    assert f"{k}/{n} steps" in line and "yes" in line.split()


def _full_was_copied(ex, full):
    assert ex.full_copied_from == full.run_id  # the root's full-cache run, not generated again


@pytest.mark.slow
def test_long_request_with_labels_is_scoring_when_the_oracle_keeps_the_answer(long_request):
    ex, v, rows, full = _explained(long_request, labels=True)
    _oracle_keeps_the_answer_in_its_own_words(ex, v, rows)
    assert v.passes["pinned"] is False  # pinning the five statements does not bring it back
    _full_was_copied(ex, full)


@pytest.mark.slow
def test_long_request_without_labels_is_scoring_when_the_oracle_keeps_the_answer(long_request):
    ex, v, rows, full = _explained(long_request, labels=False)
    _oracle_keeps_the_answer_in_its_own_words(ex, v, rows)
    pinned = ex.outcomes["pinned"]  # nothing to pin: not run, so it decides nothing
    assert not pinned.ran and "labels no evidence" in pinned.error and "pinned" not in v.passes
    _full_was_copied(ex, full)
