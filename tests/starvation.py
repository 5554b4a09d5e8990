"""A policy case of budget starvation: the answer needs more evidence positions than the slots
hold, so even the oracle fails at the case's budget (DESIGN.md §6.10)."""

from __future__ import annotations

import numpy as np

from h2o_lens.tasks.attention_cases import PolicyCase, _noise, _tokens


def budget_starvation(seed: int = 0) -> PolicyCase:
    """The answer needs more evidence positions than the slots hold.

    The answer query looks at 40 evidence positions (one token) and at itself with about
    2.1 times the weight of one of them: with everything visible the evidence holds 95 % of
    its weight, with k of them kept ``k / (k + 2.1)``, above the toy model's 0.9 only from
    k ≈ 19 on (fewer with the noisiest, i.e. strongest, ones kept). At 8 slots no policy, not
    even the oracle, keeps enough, and the 40 pins do not fit.
    """
    rng = np.random.default_rng([seed, 9])
    n, p = 96, 64
    spots = tuple(range(8, 48))
    logits = _noise(rng, (1, 1, 1, n, n), 0.3)
    logits[..., n - 1, list(spots)] += 10.0
    logits[..., n - 1, n - 1] += 10.0 + np.log(2.1)
    evidence = {"facts": spots}
    ids, vocab = _tokens(rng, n, evidence)
    return PolicyCase("budget_starvation", "needs 40 evidence positions", logits, p, evidence, n - 1, ids, vocab, 4, 4)
