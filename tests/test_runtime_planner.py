"""The budget planner (DESIGN.md §2.15) on a tiny model whose heads are built to need known budgets.

Layer 0's first KV head attends uniformly (its query weights are zero): 90 % of its mass needs
90 % of the keys a row sees. Every other head reads a few nearby positions (a strong rotary
component, :func:`tiny.local_attention`). The planner must find that out and give the uniform
head the slots.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import local_attention, tiny_model

from h2o_lens import H2OConfig
from h2o_lens.errors import ConfigError
from h2o_lens.planner import _forced_logits, _kl, allocate, plan_budgets

P, ROWS = 64, 32


@pytest.fixture(scope="module")
def built():
    model = local_attention(tiny_model("llama", layers=2, q_heads=4, kv_heads=2), strength=8.0, mix=0.1)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.view(4, 16, -1)[:2] = 0  # KV head 0 of layer 0: uniform
    prompts = [torch.randint(3, 256, (P,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    return model, prompts


def _loss(model, ids, plan):
    from transformers import DynamicCache

    with torch.no_grad():
        new = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, P:].tolist()
        teacher = _forced_logits(model, ids, new, DynamicCache(config=model.config))
    return _kl(model, ids, new, teacher, H2OConfig(plan=plan, backend="torch"))


def test_planner_recovers_the_heads_built_needs(built):
    """Concentration: the uniform head needs 90 % of the keys a row sees for 90 % of its mass (as
    built), the local heads a few. Mass alone gives the uniform head the slots; the calibrating
    sweeps find that halving it costs little (a uniform head's output is the mean of its values,
    which a subset keeps) and give them to the local heads, within the range they measured: a plan
    that loses less than half what the mass plan loses."""
    model, prompts = built
    mass, ev = plan_budgets(model, prompts, 0.25, by="head", steps=0, rows=ROWS)
    k90 = np.array(ev["k90"])
    seen = np.arange(P - ROWS + 1, P + 1)  # the keys each of the last ROWS rows sees
    assert k90[0, 0] == pytest.approx(np.mean(np.ceil(0.9 * seen - 1e-9)) / P, abs=0.02)
    assert (np.delete(k90.ravel(), 0) < 0.2).all()
    shares = np.array(mass.ratios)
    assert shares[0, 0] > 0.7 and (np.delete(shares.ravel(), 0) < 0.12).all()
    assert shares.mean() == pytest.approx(0.25, abs=0.01)
    by_layer, _ = plan_budgets(model, prompts, 0.25, by="layer", steps=0, rows=ROWS)
    assert by_layer.ratios[0][0] > 2 * by_layer.ratios[1][0]

    calibrated, ev = plan_budgets(model, prompts, 0.25, by="head", steps=8, rows=ROWS)
    sens = np.array(ev["sensitivity"])
    assert sens[0, 0] == sens.min() and np.array(calibrated.ratios)[0, 0] == pytest.approx(0.125)  # its floor
    losses = [np.mean([_loss(model, ids, plan) for ids in prompts]) for plan in (calibrated, mass)]
    assert losses[0] < losses[1] / 2, losses


def test_the_sweeps_forced_generation_equals_forced_forwards_and_shares_one_prompt_forward(built):
    """A calibration sweep's KL comes from ``generate`` forced along the teacher's tokens (so that
    every configuration of a prompt starts from one prompt forward): the same as feeding the tokens
    one forward at a time under the same cache, and every sweep after a prompt's first is reused."""
    from transformers import DynamicCache

    import h2o_lens
    from h2o_lens.plan import BudgetPlan

    model, prompts = built
    ids = prompts[0]
    with torch.no_grad():
        new = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, P:].tolist()
        teacher = _forced_logits(model, ids, new, DynamicCache(config=model.config))
    for plan in (BudgetPlan(ratios=[0.25, 0.25]), BudgetPlan(ratios=[[0.1, 0.5], [0.25, 0.125]])):
        config = H2OConfig(plan=plan, backend="torch")
        with h2o_lens.h2o(model, config) as session, torch.no_grad():
            step_by_step = _forced_logits(model, ids, new, session.new_cache())
        want = float((teacher.exp() * (teacher - step_by_step)).sum(-1).mean())
        assert want > 1e-4 and _kl(model, ids, new, teacher, config) == pytest.approx(want, rel=1e-6, abs=1e-9)
    _, ev = plan_budgets(model, prompts[:2], 0.25, by="head", steps=4, rows=ROWS)
    assert ev["sweep"]["prompts_reused"] == 2 * 4  # per prompt: the uniform run's forward, then 4 sets reuse it


def test_allocate_is_greedy_on_concave_curves():
    """Two rows: one saturates after 10 % of the keys, one grows linearly; the total goes where
    it buys coverage, and every row keeps its floor."""
    q = np.arange(201) / 200
    curve = np.stack([np.minimum(q / 0.1, 1.0), q])
    got = allocate(curve, np.ones(2), 0.3)
    assert got.sum() == pytest.approx(0.6) and got[0] == pytest.approx(0.1) and got[1] == pytest.approx(0.5)
    assert (allocate(curve, np.array([1.0, 0.0]), 0.3) >= 0.02).all()


def test_planner_refuses_bad_input(built):
    model, prompts = built
    for kw, needle in [(dict(by="set"), "by must be"), (dict(total=0.0), r"in \(0, 1\]")]:
        with pytest.raises(ConfigError, match=needle):
            plan_budgets(model, prompts, kw.pop("total", 0.2), **kw)
