"""What a :class:`~h2o_lens.guard.GuardConfig` refuses, in one sentence each (DESIGN.md §18.2):
weights or a bias that are not finite numbers, and a raise target at or below the base budget
(in the library, and on the command line before the model loads)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_model

import h2o_lens
from commands.cli import main
from h2o_lens import H2OConfig
from h2o_lens.errors import ConfigError
from h2o_lens.guard import DEFAULT_WEIGHTS, GuardConfig, guarded


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_weights_that_are_not_finite_are_refused(bad):
    weights = list(DEFAULT_WEIGHTS)
    weights[3] = bad
    with pytest.raises(ConfigError, match=r"weights .* must be finite.*refit"):
        GuardConfig(weights=tuple(weights))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_bias_that_is_not_finite_is_refused(bad):
    with pytest.raises(ConfigError, match=rf"bias={bad}: every weight and the bias must be finite"):
        GuardConfig(bias=bad)


@pytest.mark.parametrize(
    ("guard", "base", "said"),
    [
        (dict(raise_slots=8), dict(heavy=4, recent=4), "raise_slots=8 is not above the base budget of 8 slots"),
        (dict(raise_slots=5), dict(heavy=4, recent=4), "give a target above 8"),
        (dict(raise_ratio=0.2), dict(ratio=0.3), "raise target 0.2 is not above the base keep ratio 0.3"),
        (dict(raise_ratio=0.3), dict(ratio=0.3), "above 0.3, e.g. 0.6"),
    ],
)
@pytest.mark.parametrize("action", ["raise", "refill"])
def test_a_raise_target_at_or_below_the_base_budget_is_refused(guard, base, said, action):
    cfg = GuardConfig(action=action, **guard)
    with pytest.raises(ConfigError, match=said):
        cfg.check_base(H2OConfig(**base))
    cfg.check_base(H2OConfig(heavy=2, recent=2) if "raise_slots" in guard else H2OConfig(ratio=0.1))  # below: fine
    GuardConfig(raise_slots=5).check_base(H2OConfig(heavy=4, recent=4))  # no action: nothing to refuse


def test_the_runtime_refuses_a_raise_that_would_do_nothing_before_the_prefill():
    """A cache built in the guard's block with a base of 8 slots and a raise to 8 is refused
    when it is made, before anything runs."""
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    with (
        h2o_lens.h2o(model, H2OConfig(heavy=4, recent=4)),
        guarded(GuardConfig(action="raise", threshold=0.0, raise_slots=8)),
        pytest.raises(ConfigError, match="not above the base budget of 8 slots"),
        torch.no_grad(),
    ):
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_the_cli_refuses_a_raise_below_the_keep_ratio_in_one_line(tmp_path, capsys):
    """``record --ratio 0.3 --guard raise:0.2``: one ``h2o-lens: error:`` line, exit 2, before the
    model loads (the model path does not exist)."""
    code = main(
        ["record", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "runs"), "--prompt", "x"]
        + ["--ratio", "0.3", "--guard", "raise:0.2"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("h2o-lens: error: guard raise target 0.2 is not above")
    assert not (tmp_path / "runs").exists()
