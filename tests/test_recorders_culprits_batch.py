"""The culprit search with its probes evaluated together (DESIGN.md §19).

* the search alone: with ``batch`` (and ``splits``) it finds the set the one-at-a-time search finds
  on planted monotone tests (random planted sets, 1-minimal by brute force on a small case), never
  hands the test more than ``batch`` sets at once, counts every set it evaluated as a run, and
  keeps its limits;
* on a tiny model: a search whose probes run as the rows of one generate (each row its own pins)
  finds the sequential search's set, every probe both searches made judged alike, through
  ``explain`` with a culprit batch of 2; and ``--culprit-batch`` below 1 is refused in one line.
"""

from __future__ import annotations

import itertools
import random

import pytest
from test_recorders_culprits import _one_minimal, _tiny_parent

from recorders.culprits import explain_culprits, search_culprits


class Counted:
    """A ``test_many`` over a pass rule that records the size of every call."""

    def __init__(self, rule):
        self.rule, self.sizes = rule, []

    def __call__(self, sets):
        self.sizes.append(len(sets))
        return [self.rule(s) for s in sets]


def _planted(seed: int):
    rng = random.Random(seed)
    n = rng.randint(12, 80)
    ranked = rng.sample(range(200), n)
    top = rng.choice([4, 10, n])
    planted = set(rng.sample(ranked[:top], rng.randint(1, min(5, top))))
    max_size = rng.choice([None, n, max(len(planted), n // 2)])
    return ranked, planted, max_size


@pytest.mark.parametrize("seed", range(16))
def test_a_batched_search_finds_the_sequential_set_on_planted_sets(seed):
    ranked, planted, max_size = _planted(seed)
    rule = lambda s: planted <= s  # noqa: E731
    alone = search_culprits(ranked, rule, max_size=max_size, max_runs=500)
    assert alone.calls == alone.runs and alone.batch == 1
    for batch, splits in [(2, 1), (3, 1), (4, 1), (4, 4), (8, 1), (8, 7)]:
        many = Counted(rule)
        got = search_culprits(ranked, test_many=many, batch=batch, splits=splits, max_size=max_size, max_runs=500)
        what = f"seed {seed} batch {batch} splits {splits}"
        assert (got.culprits, got.found, got.minimal) == (alone.culprits, alone.found, alone.minimal), what
        assert max(many.sizes) <= batch and sum(many.sizes) == got.runs and len(many.sizes) == got.calls, what
        assert len({p.positions for p in got.probes}) == got.runs, what  # every set evaluated once
        assert all(p.passed == rule(frozenset(p.positions)) for p in got.probes), what
        if splits == 1:  # the bisection's tests are the sequential ones: fewer calls, never more
            assert got.calls <= alone.calls, what
        again = search_culprits(
            ranked, test_many=Counted(rule), batch=batch, splits=splits, max_size=max_size, max_runs=500
        )
        assert again == got, what  # deterministic, probes and all


def rule_many(rule):
    return lambda sets: [rule(s) for s in sets]


def test_a_batched_search_is_one_minimal_by_brute_force_on_a_small_case():
    ranked = list(range(10))
    rule = lambda s: {1, 8} <= s or {2, 4, 6} <= s  # noqa: E731
    alone = search_culprits(ranked, rule)
    for batch, splits in [(3, 1), (3, 3), (5, 1)]:
        got = search_culprits(ranked, test_many=rule_many(rule), batch=batch, splits=splits)
        assert got.culprits == alone.culprits and got.found and got.minimal and _one_minimal(got.culprits, rule)
        for k in range(len(got.culprits)):  # no smaller subset of the result passes
            assert not any(rule(frozenset(s)) for s in itertools.combinations(got.culprits, k))


def test_a_batched_search_counts_every_row_against_its_limits():
    ranked = list(range(30))
    rule = lambda s: {3, 17, 25} <= s  # noqa: E731
    capped = search_culprits(ranked, test_many=rule_many(rule), batch=4, max_runs=3)
    assert capped.stopped == "max_runs" and not capped.found and capped.runs == 3 and capped.calls == 1
    assert capped.culprits == tuple(range(4))  # the largest set tried, as one at a time
    # prefixes 1..8 at once, then 12, 16 and 24 (the cap leaves three rows): 24 passes, its reduction
    # is cut
    many = Counted(lambda s: {3, 17, 23} <= s)
    cut = search_culprits(ranked, test_many=many, batch=4, max_runs=7)
    assert many.sizes == [4, 3] and cut.found and not cut.minimal and cut.culprits == tuple(range(24))
    timed = search_culprits(ranked, test_many=rule_many(rule), batch=4, seconds=0.0)
    assert timed.stopped == "seconds" and timed.runs == 0
    with pytest.raises(ValueError, match="batch=0"):
        search_culprits(ranked, rule, batch=0)
    d = search_culprits(ranked, test_many=rule_many(rule), batch=4).to_dict()
    assert d["batch"] == 4 and d["calls"] < d["runs"]


# ----------------------------------------------------------------------------- a tiny model


@pytest.mark.slow
def test_explain_with_a_culprit_batch_finds_the_sequential_set(tmp_path):
    import json

    from commands.explain import explain_run, format_verdicts
    from recorders.culprits import search_from_dict
    from runlog import read_manifest

    model, tok, parent = _tiny_parent(tmp_path)
    alone = explain_culprits(model, tok, parent, 0, batch=1, out=tmp_path / "alone")
    assert alone.calls == alone.runs and alone.runs >= 3
    (v,) = explain_run(
        str(parent),
        model=model,
        tokenizer=tok,
        bisect=False,
        replay=False,
        progress=False,
        culprits="on",
        culprit_batch=2,
    )
    got = search_from_dict(read_manifest(tmp_path / v.culprits["run_id"])["counterfactual"]["search"])
    assert got.batch == 2 and got.calls < got.runs
    assert got.culprits == alone.culprits and got.found and got.minimal
    # a set both searches re-ran is judged alike, one row of a batch or alone
    judged = {p.positions: p.passed for p in alone.probes}
    both = [p for p in got.probes if p.positions in judged]
    assert len(both) >= 2 and all(p.passed == judged[p.positions] for p in both)
    assert [c["position"] for c in v.culprits["culprits"]] == list(alone.culprits)
    # explain counts rows as re-runs and says how many batches they took
    (shown,) = json.loads(format_verdicts([v], "json"))
    assert shown["culprit_search"]["runs"] == got.runs and shown["culprit_search"]["calls"] == got.calls
    assert f"{got.runs} re-runs in {got.calls} batches" in format_verdicts([v])


def test_explain_refuses_a_culprit_batch_below_one_in_one_line(tmp_path, capsys):
    from commands.cli import main

    code = main(["explain", str(tmp_path / "run"), "--culprits", "--culprit-batch", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("h2o-lens: error: ") and "--culprit-batch" in err and "\n" not in err
