"""Counterfactual verdicts on the real default model (DESIGN.md §6.10): the delayed first
reference H2O is known for is a scoring failure, pinning the evidence brings the answer back,
and the oracle needs no more slots than H2O. One request, coarse bisection, no replays."""

from __future__ import annotations

import pytest

from analyses import causal_verdicts, connect
from commands.jobs import run_task
from h2o_lens import H2OConfig
from h2o_lens.tasks import get_task
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
