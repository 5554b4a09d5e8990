"""The demo table's verdict column (DESIGN.md §6.10): the causal verdict where a failure was
explained by counterfactual re-runs, the threshold rules' fast estimate, labelled as one, where
nothing was re-run. On the FP64 ``uniform`` policy case the threshold rules of before said
``budget`` where the re-runs say ``scoring``; the estimate now names a cause only on the evidence
DESIGN.md §6.10 asks of it, and here it names the re-runs' one, still labelled as an estimate."""

from __future__ import annotations

from pathlib import Path

from analyses import attribute, causal_verdicts, connect
from commands.jobs import TaskRun, demo_verdicts
from h2o_lens.tasks import policy_case
from recorders.counterfactual_cases import explain_case
from recorders.policy_cases import write_policy_case


def _run(root: Path, run_id: str, *, correct: bool = False, policy: str = "h2o") -> TaskRun:
    return TaskRun("uniform", policy, "sum", None, run_id, root / run_id, "", correct, 0.0)


def test_demo_table_shows_the_causal_verdict_and_labels_the_estimate(tmp_path):
    case = policy_case("uniform")
    explained = explain_case(tmp_path, case).parent_run
    alone = write_policy_case(tmp_path, case, run_id="uniform-not-explained").name
    con = connect(tmp_path)
    (causal,) = causal_verdicts(con, explained)
    (estimate,) = attribute(con, alone)
    assert causal.verdict == estimate.verdict == "scoring"  # the evicted evidence fits the heavy slots

    runs = [_run(tmp_path, explained), _run(tmp_path, alone), _run(tmp_path, alone, correct=True)]
    got = demo_verdicts(tmp_path, runs[:2])
    label = causal.verdict + (f" ({causal.sub_label})" if causal.sub_label else "")
    assert got[explained] == (label, "re-runs")
    assert label.startswith("scoring") and "estimate" not in label
    assert got[alone] == (f"{estimate.verdict} (estimate)", "estimate")
    # a run whose answer is right but whose teacher measures fail it shows no failure cause, only
    # that it drifts; nor does an explained run whose answer is right
    assert demo_verdicts(tmp_path, runs[2:])[alone] == ("ok (drifts from teacher)", None)
    got = demo_verdicts(tmp_path, [_run(tmp_path, explained, correct=True)])[explained]
    assert got == ("ok (drifts from teacher)", None) and estimate.verdict not in got[0]
