"""The policies as the analyses and the dashboard read them from the registry."""

from __future__ import annotations

import pytest

import analyses
from h2o_lens import policies as registry


@pytest.mark.parametrize("policy", registry.names())
def test_effective_split_is_the_registry_split_and_keeps_the_slot_count(policy):
    got = analyses.effective_split(policy, 17, 18, 4)
    assert got == registry.get(policy).split(17, 18, 4)
    assert sum(got) == 35 or not registry.get(policy).evicts


def test_effective_split_is_unknown_for_a_ratio_budget_or_a_policy_the_registry_lacks():
    assert analyses.effective_split("h2o", None, None) is None
    assert analyses.effective_split("h2o", float("nan"), 18) is None
    assert analyses.effective_split("kvpress:SnapKVPress(compression_ratio=0.5)", 17, 18) is None
    assert analyses.effective_split("local", 17, 18, None) == (0, 35, 0)
