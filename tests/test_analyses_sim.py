"""The plain-numpy H2O simulator of the analyses tests (``logsim``), checked on the worked example."""

from __future__ import annotations

import numpy as np
from logsim import h2o_log_from_attention, random_attention


def test_worked_example_step_11():
    # The worked example's step (DESIGN.md §2.2), done by the same update rule the simulator uses.
    kept = [1, 3, 5, 8, 9, 10]
    score = dict(zip(kept, [2.4, 1.7, 1.2, 0.3, 0.2, 0.0]))
    d = kept + [11]
    w = np.array([0.20, 0.05, 0.02, 0.08, 0.15, 0.30, 0.20])
    for i, inc in zip(d, w):
        score[i] = score.get(i, 0.0) + inc
    eligible = [i for i in d if i <= 11 - 3]
    victim = min(eligible, key=lambda i: (score[i], i))
    assert victim == 8
    assert np.isclose(min(score[i] for i in eligible if i != victim) - score[victim], 1.22 - 0.38)


def test_simulator_keeps_budget_and_logs_consistently():
    rng = np.random.default_rng(0)
    att = random_attention(rng, 2, 4, 40)
    sim = h2o_log_from_attention(att, prompt_len=20, heavy=4, recent=3, kv_heads=2)
    budget = 7
    for (_, _, _, _, t), d in sim.sets.items():
        assert len(d) <= budget + 1 or t == 19
    ev = sim.evictions
    assert all(m >= 0 for m in ev["margin"])
    assert all(s - p == a for s, p, a in zip(ev["step"], ev["position"], ev["age"]))
    # every decode step evicts exactly one position per KV set once the cache is full
    assert sum(1 for ph in ev["phase"] if ph == "decode") == 2 * 2 * 20
