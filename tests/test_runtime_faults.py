"""The fault switch: off by default, scoped to its block, and strict about names."""

import pytest

from h2o_lens import faults
from h2o_lens.errors import ConfigError


def test_faults_are_off_by_default_and_scoped():
    for name in faults.KNOWN:
        assert not faults.active(name)
    with faults.inject("scores_not_rolled_back"):
        assert faults.active("scores_not_rolled_back")
        assert not faults.active("prefix_without_copy")
        with faults.inject("prefix_without_copy"):
            assert faults.active("prefix_without_copy")
        assert not faults.active("prefix_without_copy")
    assert not faults.active("scores_not_rolled_back")


def test_fault_is_off_again_after_an_error():
    with pytest.raises(RuntimeError), faults.inject("kv_reorder_without_scores"):
        raise RuntimeError("boom")
    assert not faults.active("kv_reorder_without_scores")


def test_unknown_fault_names_are_errors():
    with pytest.raises(ConfigError, match="unknown fault"), faults.inject("no_such_fault"):
        pass
    with pytest.raises(ConfigError, match="unknown fault"):
        faults.active("scores_not_rolledback")
