"""explain's ``plan`` variant (DESIGN.md §6.12): the run's total slots shared out by a budget plan,
re-run once; its answer is the one the plan gives generated on its own, its run names the plan,
and the verdict, explain's table and JSON and the report say whether the plan fixes the answer."""

from __future__ import annotations

import json

import pytest
import torch
from test_recorders_counterfactual_recall import NEW, _parent

import h2o_lens
import runlog
from analyses import causal_verdicts, connect
from h2o_lens import H2OConfig
from h2o_lens.cold_config import ColdTier
from h2o_lens.errors import ConfigError
from h2o_lens.plan import BudgetPlan
from recorders.counterfactual import explain_request, load_parent
from recorders.counterfactual_plan import plan_config, plan_digest


def _alone(model, tok, parent_dir, config):
    parent = load_parent(parent_dir, 0)
    ids = torch.tensor([parent.prompt_ids])
    with h2o_lens.h2o(model, config), torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1] :].tolist())


def test_the_plans_shares_are_scaled_to_the_runs_slots(tmp_path):
    """Shares relative to their mean, times the run's 8 slots per set: a layer plan of 0.1 and 0.3
    gives 4 and 12 slots (32 in all, the run's 2 layers x 2 sets x 8); per-set entries too, with
    the rounding's total reported and at least 2 slots per entry."""
    model, _tok, parent_dir = _parent(tmp_path)
    parent = load_parent(parent_dir, 0)
    config, total, run_total = plan_config(parent, BudgetPlan(ratios=[[0.1], [0.3]]), 2, 2)
    assert config.plan.slots == ((4,), (12,)) and (total, run_total) == (32, 32)
    assert (config.policy, config.gqa, config.sink) == (parent.config.policy, parent.config.gqa, parent.config.sink)
    config, total, _ = plan_config(parent, BudgetPlan(ratios=[[0.01, 0.3], [0.3, 0.3]]), 2, 2)
    assert config.plan.slots == ((2, 11), (11, 11)) and total == 35  # 0.04 x 8 rounds to 0: at least 2
    with pytest.raises(ConfigError, match="3 layers, the model 2"):
        plan_config(parent, BudgetPlan(ratios=[[0.2]] * 3), 2, 2)
    with pytest.raises(ConfigError, match="give 1 or 2"):
        plan_config(parent, BudgetPlan(ratios=[[0.2, 0.2, 0.2]] * 2), 2, 2)
    assert plan_digest(BudgetPlan(ratios=[[0.1], [0.3]])) == plan_digest(BudgetPlan(ratios=[[0.2], [0.6]]))
    assert plan_digest(BudgetPlan(ratios=[[0.1], [0.3]])) != plan_digest(BudgetPlan(ratios=[[0.3], [0.1]]))


@pytest.mark.slow  # a few tiny generations and their replays
def test_the_plan_variant_reruns_under_the_plan_and_says_whether_it_fixes_the_answer(tmp_path):
    from analyses._base import plain
    from analyses._markdown import why_section
    from commands.explain import format_verdicts

    model, tok, parent_dir = _parent(tmp_path)
    plan_file = tmp_path.parent / f"{tmp_path.name}-plan.json"
    BudgetPlan(ratios=[[0.1], [0.3]]).save(plan_file)
    ex = explain_request(model, tok, parent_dir, 0, bisect=False, plan=str(plan_file))
    full, got = ex.outcomes["full"], ex.outcomes["plan"]
    assert full.ran and full.passed and got.ran, got.error
    digest = plan_digest(BudgetPlan(ratios=[[0.1], [0.3]]))
    assert got.plan == digest and got.run_id.endswith(f"-plan-p{digest}") and got.slots == 8
    manifest = runlog.read_manifest(tmp_path / got.run_id)
    assert manifest["config"]["plan"] == {"slots": [[4], [12]]}
    cf = manifest["counterfactual"]
    assert (cf["kind"], cf["plan"], cf["plan_total"], cf["run_total"]) == ("plan", digest, 32, 32)
    # the answer is the plan's own, generated alone; its pass test is agreement with the full cache
    planned = H2OConfig(plan=BudgetPlan(slots=[[4], [12]]))
    assert got.answer == _alone(model, tok, parent_dir, planned)
    assert got.passed == (got.answer.strip() == full.answer.strip())
    (v,) = causal_verdicts(connect(tmp_path), ex.parent_run)
    assert v.plan["fixed"] is got.passed and v.plan["plan_total"] == 32 and v.plan["run_id"] == got.run_id
    said = "fixes it" if got.passed else "does not fix it"
    assert f"plan {digest} {said} at the same total slots (32 slots in all, the run 32)" == v.plan["text"]
    assert v.verdict in ("scoring", "budget", "not_the_cache")  # the plan variant does not decide it
    assert any(r["variant"] == "plan" and r["kl_mean"] is not None for r in v.table)  # replayed
    shown = format_verdicts([v])
    assert f"  plan: {v.plan['text']}" in shown.splitlines()
    (row,) = json.loads(format_verdicts([v], "json"))
    assert row["plan"]["fixed"] is got.passed and row["plan"]["plan"] == digest
    md = "\n".join(why_section({"why": [plain(v.to_dict())]})).replace("\\", "")
    assert f"Budget plan: {v.plan['text']}" in md, md
    # explained again: the run is reused; another plan is a run of its own beside it
    again = explain_request(model, tok, parent_dir, 0, bisect=False, replay=False, plan=str(plan_file))
    assert again.outcomes["plan"].run_id == got.run_id and again.outcomes["plan"].answer == got.answer
    other = explain_request(
        model, tok, parent_dir, 0, bisect=False, replay=False, plan=BudgetPlan(ratios=[[0.3], [0.1]])
    )
    assert other.outcomes["plan"].run_id != got.run_id and (tmp_path / got.run_id).is_dir()
    assert runlog.read_manifest(tmp_path / other.outcomes["plan"].run_id)["config"]["plan"] == {"slots": [[12], [4]]}


@pytest.mark.slow
def test_a_cold_parent_gets_no_plan_rerun_and_says_why(tmp_path):
    model, tok, parent_dir = _parent(tmp_path, H2OConfig(heavy=4, recent=4, cold=ColdTier(recall=2)))
    ex = explain_request(model, tok, parent_dir, 0, bisect=False, replay=False, plan=BudgetPlan(ratios=[[1], [1]]))
    got = ex.outcomes["plan"]
    assert not got.ran and got.run_id is None and "cold tier with a budget plan" in got.error
    assert not list(tmp_path.glob("*-plan-*"))


def test_explain_refuses_a_plan_that_does_not_fit_the_model_before_anything_runs(tmp_path, capsys):
    from commands.cli import main
    from commands.explain import explain_run

    model, tok, parent_dir = _parent(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    wrong = tmp_path.parent / f"{tmp_path.name}-wrong.json"
    BudgetPlan(ratios=[[0.2]] * 3).save(wrong)
    with pytest.raises(ConfigError, match="--plan: the budget plan has 3 layers, the model 2"):
        explain_run(str(parent_dir), model=model, tokenizer=tok, plan=str(wrong), force=True)
    missing = tmp_path.parent / f"{tmp_path.name}-none.json"
    assert main(["explain", str(parent_dir), "--plan", str(missing), "--quiet", "--force"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read the budget plan" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing re-run
