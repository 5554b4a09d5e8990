"""The policy registry and the FP64 references of TOVA and ScissorHands (DESIGN.md §2.9, §2.10)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from h2o_lens import policies
from h2o_lens.errors import ConfigError
from h2o_lens.policies import scissorhands, tova
from h2o_lens.policies.base import StepContext
from h2o_lens.reference import simulate as h2o_simulate

REPO = Path(__file__).resolve().parents[1]


def _logits(rows: dict[int, dict[int, float]], n: int) -> np.ndarray:
    """``(1, n, n)`` logits whose softmax over the given keys of row t gives the given weights."""
    x = np.zeros((1, n, n))
    for t, w in rows.items():
        for i, wi in w.items():
            x[0, t, i] = np.log(wi)
    return x


# -- the registry -----------------------------------------------------------------------------------


def test_registry_names_and_lookup():
    assert policies.names()[:6] == ("h2o", "full", "local", "heavy", "sink", "random")
    assert {"tova", "scissorhands"} <= set(policies.names())
    assert policies.get("tova") is tova.TOVA and policies.get(tova.TOVA) is tova.TOVA
    assert [p.name for p in policies.evicting()] == [n for n in policies.names() if n != "full"]
    assert policies.baselines() == ("local", "heavy", "sink", "random")  # the demo's, DESIGN.md §2.5
    assert policies.alternatives() == ("tova", "scissorhands")
    with pytest.raises(ConfigError, match="unknown policy 'lru'.*h2o, full"):
        policies.get("lru")


def test_registry_entries_are_complete():
    colours = set()
    for p in policies.all_policies():
        assert p.label and p.summary and p.colour.startswith("#") and len(p.colour) == 7, p.name
        colours.add(p.colour)
        if p.evicts:  # every evicting policy ranks the prompt and the decode step
            assert type(p).prefill_scores is not policies.Policy.prefill_scores, p.name
            assert type(p).decode_scores is not policies.Policy.decode_scores, p.name
        if p.accumulates or p.prefill != "none":
            assert p.scored, f"{p.name} reads attention but is not marked scored"
    assert len(colours) == len(policies.names())  # one colour each


def test_splits_at_the_same_slot_count():
    got = {p.name: p.split(5, 3, 2) for p in policies.evicting()}
    assert got == {
        "h2o": (5, 3, 0),
        "local": (0, 8, 0),
        "heavy": (8, 0, 0),
        "sink": (0, 6, 2),
        "random": (5, 3, 0),
        "tova": (5, 3, 0),
        "scissorhands": (5, 3, 0),
        "oracle": (8, 0, 0),
    }
    assert policies.get("sink").check_budget(2, 2, 4) is not None
    assert policies.get("sink").check_budget(2, 3, 4) is None


def test_ratio_slots_and_half_split():
    assert policies.ratio_slots(0.2, 100) == 20
    assert policies.ratio_slots(0.01, 10) == 2  # never below two slots
    assert policies.ratio_slots(0.25, 10) == 2  # round half to even, as round() does: 2.5 -> 2
    assert policies.half_split(7) == (3, 4) and policies.half_split(2) == (1, 1)


def test_registry_imports_without_torch():
    code = (
        "import sys, h2o_lens.policies as p; p.get('scissorhands'); "
        "bad = [m for m in ('torch', 'transformers', 'triton') if m in sys.modules]; "
        "print(bad); sys.exit(bool(bad))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# -- TOVA -------------------------------------------------------------------------------------------


def test_tova_ranks_by_the_current_step_alone():
    """B = 2 (heavy 1, recent 1). The prompt keeps its last row's heaviest key; at step 4 the lowest
    current weight among the eligible leaves, although its cumulative score is the highest."""
    x = _logits({3: {0: 0.1, 1: 0.5, 2: 0.3, 3: 0.1}, 4: {1: 0.2, 3: 0.5, 4: 0.3}}, 5)
    kept = tova.simulate(x, prefill=4, heavy=1, recent=1)
    assert kept == [[1, 3], [3, 4]]  # step 4: eligible {1, 3}, current weights .2 and .5: 1 leaves
    h2o = h2o_simulate(x, prefill=4, heavy=1, recent=1)
    assert h2o[1] != kept[1]  # H2O keeps 1 on its accumulated score


def test_tova_ties_and_recent_zero():
    x = _logits({2: {0: 0.25, 1: 0.5, 2: 0.25}, 3: {1: 0.4, 2: 0.4, 3: 0.2}}, 4)
    # prompt: recent {2}, top-1 of {0, 1} by the last row: 1; step 3: eligible {1, 2} tie at .4, the older 1 leaves
    assert tova.simulate(x, prefill=3, heavy=1, recent=1) == [[1, 2], [2, 3]]
    # recent = 0 (the original method): the prompt keeps 1 and, on a tie (.25/.25), the newer 2;
    # step 3 evicts the lowest current weight, the new token itself (.2)
    assert tova.simulate(x, prefill=3, heavy=2, recent=0) == [[1, 2], [1, 2]]


# -- ScissorHands -----------------------------------------------------------------------------------


def test_scissorhands_counts_low_steps_in_the_window():
    """window 2, B = 2 (heavy 1, recent 1), one head: the share of a step is 1/|D|."""
    x = _logits(
        {1: {0: 0.6, 1: 0.4}, 2: {0: 0.45, 1: 0.1, 2: 0.45}, 3: {0: 0.3, 2: 0.4, 3: 0.3}, 4: {2: 0.5, 3: 0.1, 4: 0.4}},
        5,
    )
    kept = scissorhands.simulate(x, prefill=3, heavy=1, recent=1, window=2)
    # prompt rows 1-2: key 1 low twice (.4 < 1/2, .1 < 1/3), key 0 never: keep 0 and the recent 2
    # step 3: key 0 low (.3 < 1/3) in the window {2, 3}, key 2 never: 0 leaves (H2O would drop 2)
    # step 4: window {3, 4}: key 3 low at 3 (.3) and 4 (.1), key 2 never: 3 leaves
    assert kept == [[0, 2], [2, 3], [2, 4]]
    assert h2o_simulate(x, prefill=3, heavy=1, recent=1)[1] == [0, 3]


def test_scissorhands_window_forgets_and_share_follows_gqa():
    # window 1: only the prompt's last row counts: key 1 (.2 < 1/3) is low, key 0 (.5) is not
    x = _logits({1: {0: 0.1, 1: 0.9}, 2: {0: 0.5, 1: 0.2, 2: 0.3}}, 3)
    assert scissorhands.simulate(x, prefill=3, heavy=1, recent=1, window=1) == [[0, 2]]
    # window 2 adds row 1, where key 0 (.1 < 1/2) is low: a tie of one low step each keeps the newer
    assert scissorhands.simulate(x, prefill=3, heavy=1, recent=1, window=2) == [[1, 2]]
    # two heads: the share is G/|D| for sum, 1/|D| for max. Row 2: key 0 gets .34 and .30
    # (sum .64 < 2/3: low; max .34 >= 1/3: not low), key 1 .30 and .30 (low both ways)
    two = np.zeros((2, 3, 3))
    two[0, 2] = np.log([0.34, 0.30, 0.36])
    two[1, 2] = np.log([0.30, 0.30, 0.40])
    assert scissorhands.simulate(two, prefill=3, heavy=1, recent=1, gqa="sum", window=2) == [[1, 2]]
    assert scissorhands.simulate(two, prefill=3, heavy=1, recent=1, gqa="max", window=2) == [[0, 2]]
    with pytest.raises(ValueError, match="window"):
        scissorhands.simulate(x, prefill=3, heavy=1, recent=1, window=64)


@pytest.mark.parametrize("simulate", [tova.simulate, scissorhands.simulate], ids=["tova", "scissorhands"])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    n=st.integers(2, 40),
    prefill=st.integers(1, 40),
    heavy=st.integers(0, 6),
    recent=st.integers(0, 6),
    groups=st.integers(1, 3),
    gqa=st.sampled_from(["sum", "max"]),
    seed=st.integers(0, 2**16),
)
def test_reference_invariants(simulate, n, prefill, heavy, recent, groups, gqa, seed):
    if heavy + recent == 0:
        heavy = 1
    prefill = min(prefill, n)
    logits = np.random.default_rng(seed).normal(size=(groups, n, n)) * 3
    kept = simulate(logits, prefill, heavy, recent, gqa)
    b = heavy + recent
    assert len(kept) == n - prefill + 1
    evicted: set[int] = set()
    for k, s in enumerate(kept):
        seen = prefill + k
        assert len(s) == min(seen, b)  # kept count = min(seen, B)
        assert len(set(s)) == len(s) and s == sorted(s)
        assert set(range(max(0, seen - recent), seen)) <= set(s)  # the recent window is kept
        assert not (set(s) & evicted)  # an evicted position never returns
        evicted |= set(range(seen)) - set(s)


def test_scissorhands_prefill_hook_equals_reference_with_padding():
    """The torch prefill history (bits of the last rows, padding excluded) ranks as the reference."""
    g = torch.Generator().manual_seed(3)
    pol = scissorhands.SCISSORHANDS
    w = pol.history
    for p, pad, group, gqa in ((40, 0, 2, "sum"), (40, 5, 2, "max"), (20, 3, 1, "sum")):
        logits = torch.randn(group, p - pad, p - pad, generator=g, dtype=torch.float64) * 3
        causal = torch.ones(p - pad, p - pad, dtype=torch.bool).tril()
        weights = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)  # (G, P', P')
        agg = weights.sum(0) if gqa == "sum" else weights.amax(0)
        full = torch.zeros(p, p, dtype=torch.float64)
        full[pad:, pad:] = agg  # left padding: zero rows and columns
        positions = torch.cat([torch.full((pad,), -1), torch.arange(p - pad)])[None, None]
        r = min(w, p)
        rank, hist = pol.prefill_scores(
            None,
            full[None, None, -r:],
            positions,
            StepContext(step=positions.amax(-1, keepdim=True), gqa=gqa, group=group),
        )
        # the reference's rank: window − low steps among the last `w` real rows
        share = group if gqa == "sum" else 1
        for i in range(p - pad):
            low = sum(1 for u in range(max(i, p - pad - w), p - pad) if agg[u, i] * (u + 1) < share)
            assert rank[0, 0, pad + i].item() == w - low, (p, pad, i)
            assert bin(hist[0, 0, pad + i].item()).count("1") == low
        assert (rank[0, 0, :pad] == w).all()  # padding: never low


def test_analyses_read_scored_and_colours_from_the_registry():
    import analyses

    assert [analyses.scored_policy(p) for p in ("h2o", "heavy", "tova", "scissorhands")] == [True] * 4
    assert [analyses.scored_policy(p) for p in ("local", "sink", "random", "full", "lru")] == [False] * 5
    assert analyses.scored_policy(None)  # no policy in the manifest: every verdict stays open
    assert analyses.policy_colours() == {p.name: p.colour for p in policies.all_policies()}


def test_sweep_grid_from_the_command_line(capsys):
    from commands.cli import main
    from commands.jobs import SWEEP_POLICIES
    from commands.sweep import sweep_grid

    assert (
        sweep_grid(None)
        == SWEEP_POLICIES
        == (("h2o", "sum"), ("h2o", "max"), ("local", "sum"), ("heavy", "sum"), ("sink", "sum"), ("random", "sum"))
    )
    assert sweep_grid(["h2o:max", "tova", "scissorhands:sum"]) == (
        ("h2o", "max"),
        ("tova", "sum"),
        ("scissorhands", "sum"),
    )
    assert main(["sweep", "--policies", "lru"]) == 2
    assert "unknown policy 'lru'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown gqa 'mean'"):
        sweep_grid(["tova:mean"])


def test_a_new_policy_is_one_new_file(tmp_path):
    """Adding a policy touches one file: a module in h2o_lens/policies/ declaring a Policy object.
    The registry finds it, and the config, the CLI's help and the runtime's split read it."""
    import shutil

    shutil.copytree(REPO / "h2o_lens", tmp_path / "h2o_lens", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "h2o_lens" / "policies" / "oldest.py").write_text(
        "from .local import Unscored\n\n"
        "OLDEST = Unscored(name='oldest', rank=50, label='oldest first', colour='#000001',\n"
        "                  summary='evicts the oldest eligible position')\n"
    )
    code = (
        "from h2o_lens import policies; from h2o_lens.config import H2OConfig; "
        "c = H2OConfig(policy='oldest', heavy=2, recent=3); "
        "print(policies.names()[-1], policies.alternatives()[-1], c.split, c.spec.label)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["oldest", "oldest", "(2,", "3,", "0)", "oldest", "first"]
