"""The eviction step per position that the replay and the policy-case writer rebuild (runlog.eviction_steps)."""

from __future__ import annotations

import numpy as np
import pytest

from runlog.eviction_steps import NEVER, evict_steps


@pytest.mark.parametrize("gqa_none", [False, True])
def test_evict_steps_matches_a_plain_loop(gqa_none):
    rng = np.random.default_rng(3)
    layers, sets, n, rows = 2, 3, 12, 40
    ev = {
        "layer": rng.integers(0, layers, rows),
        "kv_head": rng.integers(0, sets, rows),
        "q_head": rng.integers(0, sets, rows),
        "position": rng.integers(0, n + 3, rows),
        "step": rng.integers(0, 30, rows),
    }
    expected = np.full((layers, sets, n), NEVER, np.int64)
    for i in range(rows):
        head = ev["q_head"][i] if gqa_none else ev["kv_head"][i]
        if ev["position"][i] < n:  # positions never fed to the model are left out
            cell = (ev["layer"][i], head, ev["position"][i])
            expected[cell] = min(expected[cell], ev["step"][i])
    got = evict_steps(ev, layers, sets, n, gqa_none)
    assert got.dtype == np.int64 and got.shape == (layers, sets, n)
    np.testing.assert_array_equal(got, expected)
    assert (got == NEVER).any() and (got < NEVER).any()
