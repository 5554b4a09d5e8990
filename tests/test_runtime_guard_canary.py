"""The guard's ``canary``: copies of some requests run at the target budget in the same batch, and
their KL and agreement feed the risk (DESIGN.md §18.2)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tiny import local_attention, tiny_model

import h2o_lens
from h2o_lens import H2OConfig
from h2o_lens.errors import ConfigError
from h2o_lens.guard import SIGNALS, GuardConfig, guarded

PROMPT, NEW = 24, 10


@pytest.fixture(scope="module")
def model():
    return local_attention(tiny_model("llama", layers=2))


def _ids(batch=4, seed=0):
    return torch.randint(3, 250, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, config, **kw):
    with h2o_lens.h2o(model, config), torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None, **kw)


def test_canary_rows_leave_the_requests_alone_and_feed_the_signal(model):
    """A batch of 4 with one canary (row 0's copy at 12 slots): the requests' tokens are those of
    the batch without it, the canary's those of row 0 alone at 12 slots; one ``canary`` event;
    each step's ``canary`` signal is KL(canary ‖ row) / (1 + KL) of the previous step's logits,
    1 once the tokens differ, and the mean of the pairs for the rows without a canary."""
    ids = _ids()
    cfg = H2OConfig(heavy=4, recent=3)
    plain = _generate(model, ids, cfg)
    gcfg = GuardConfig(action="canary", raise_slots=12, canary_share=0.25, tail=0)
    with guarded(gcfg) as g:
        batch, _ = g.canary_batch(ids)
        assert batch.shape[0] == 5 and g.pairs == [(0, 4)]
        out = _generate(
            model, batch, cfg, logits_processor=[g.canary()], output_scores=True, return_dict_in_generate=True
        )
    assert torch.equal(g.requests(out.sequences), plain)
    alone = _generate(model, ids[:1], H2OConfig(heavy=9, recent=3))
    assert torch.equal(out.sequences[4:], alone)
    events = g.last.event_rows()
    assert [(e["request"], e["step"], e["action"], e["slots_before"], e["slots_after"]) for e in events] == [
        (0, PROMPT - 1, "canary", 7, 12)
    ]
    rows = g.last.risk_rows()
    parted = False
    for t, scores in enumerate(out.scores[:-1]):
        logp = torch.log_softmax(scores.double(), -1)
        kl = float((logp[4].exp() * (logp[4] - logp[0])).sum())
        parted |= int(out.sequences[0, PROMPT + t]) != int(out.sequences[4, PROMPT + t])
        want = 1.0 if parted else kl / (1 + kl)
        step = {r["request"]: r for r in rows if r["step"] == PROMPT + t}
        assert step[0]["canary"] == pytest.approx(want, rel=1e-5, abs=1e-7), t
        assert all(step[r]["canary"] == pytest.approx(want, rel=1e-5, abs=1e-7) for r in (1, 2, 3))
        assert step[4]["canary"] == 0.0
    assert any(r["canary"] > 0 for r in rows)
    assert set(SIGNALS) <= set(rows[0])


def test_canary_needs_its_batch():
    model = local_attention(tiny_model("llama", layers=1))
    with guarded(GuardConfig(action="canary", raise_ratio=1.0)), pytest.raises(ConfigError, match="canary_batch"):
        _generate(model, _ids(2), H2OConfig(heavy=4, recent=3))
    with pytest.raises(ConfigError, match="canary_share=0"):
        GuardConfig(action="canary", raise_ratio=1.0, canary_share=0.0)
    with pytest.raises(ConfigError, match="'canary' needs a target"):
        GuardConfig(action="canary")
    g = GuardConfig(action="canary", raise_ratio=1.0, canary_share=0.3)
    with guarded(g) as guard:
        ids, mask = guard.canary_batch(_ids(8), torch.ones(8, PROMPT, dtype=torch.long))
    assert ids.shape[0] == mask.shape[0] == 8 + math.ceil(0.3 * 8)
    assert [c for _, c in guard.pairs] == [8, 9, 10] and len({r for r, _ in guard.pairs}) == 3


def test_fallback_is_the_canary_actions_alone():
    with pytest.raises(ConfigError, match="fallback 'lift' is not known"):
        GuardConfig(action="canary", raise_ratio=1.0, fallback="lift")
    with pytest.raises(ConfigError, match="leave it out"):
        GuardConfig(action="raise", raise_ratio=1.0, fallback="raise")
    assert GuardConfig(action="canary", raise_ratio=1.0, fallback="refill").acting == "refill"
    assert GuardConfig(action="canary", raise_ratio=1.0).acting == "none"
    assert GuardConfig(action="raise", raise_ratio=1.0).acting == "raise"


def test_fallback_raise_at_the_prefill_is_the_raise_action(model):
    """At threshold 0 every request is raised at the prefill besides its canary, before anything
    is evicted: each request decodes as itself alone at 12 slots, and the log has one ``canary``
    event per copy and one ``raise`` per request."""
    ids = _ids()
    cfg = H2OConfig(heavy=4, recent=3)
    raised = torch.cat([_generate(model, ids[r : r + 1], H2OConfig(heavy=9, recent=3)) for r in range(4)])
    gcfg = GuardConfig(action="canary", fallback="raise", threshold=0.0, raise_slots=12, canary_share=0.25, tail=0)
    with guarded(gcfg) as g:
        batch, _ = g.canary_batch(ids)
        out = _generate(model, batch, cfg, logits_processor=[g.canary()])
    assert torch.equal(g.requests(out), raised)
    events = [(e["request"], e["step"], e["action"], e["slots_after"], e["evicted"]) for e in g.last.event_rows()]
    assert events == [(0, PROMPT - 1, "canary", 12, 0.0)] + [(r, PROMPT - 1, "raise", 12, 0.0) for r in range(4)]


class _GrowAt:
    """A logits processor that grows ``rows`` to ``slots`` after the forward of position ``step``."""

    def __init__(self, guard, step, rows, slots):
        self.guard, self.step, self.rows, self.slots, self.calls = guard, step, rows, slots, 0

    def __call__(self, input_ids, scores):
        from h2o_lens.guard import grow_rows

        if PROMPT - 1 + self.calls == self.step:
            grow_rows(self.guard.last.cache, self.rows, [self.slots] * len(self.rows))
        self.calls += 1
        return scores


@pytest.mark.compat
def test_fallback_raise_acts_when_the_canary_disagrees(model):
    """Only the ``canary`` signal counts (weight 1000, bias set between two of its values): the
    requests are raised at the first step whose canary signal passes the level (every request: the
    rows without a canary take the pair's value), never the canary; the run then equals the
    canary run without fallback whose rows are grown by hand after that step's forward."""
    ids = _ids()
    cfg = H2OConfig(heavy=4, recent=3)
    logging = GuardConfig(action="canary", raise_slots=12, canary_share=0.25, tail=0)
    with guarded(logging) as g:
        batch, _ = g.canary_batch(ids)
        plain = _generate(model, batch, cfg, logits_processor=[g.canary()])
    values = [(r["step"], r["canary"]) for r in g.last.risk_rows() if r["request"] == 0 and r["step"] >= PROMPT]
    distinct = sorted({v for _, v in values})
    assert len(distinct) >= 3, values  # the tiny model's canary drifts from its request
    level = (distinct[-2] + distinct[-3]) / 2  # crossed at some step, not at the first
    onset = next(s for s, v in values if v >= level)
    weights = tuple(1000.0 if n == "canary" else 0.0 for n in SIGNALS)
    gcfg = dataclasses.replace(logging, fallback="raise", weights=weights, bias=-1000.0 * level)
    with guarded(gcfg) as g:
        batch, _ = g.canary_batch(ids)
        out = _generate(model, batch, cfg, logits_processor=[g.canary()])
    events = g.last.event_rows()
    assert [(e["request"], e["step"], e["action"]) for e in events] == [(0, PROMPT - 1, "canary")] + [
        (r, onset, "raise") for r in range(4)
    ]
    assert all(e["risk"] >= 0.5 and (e["slots_before"], e["slots_after"]) == (7, 12) for e in events[1:])
    with guarded(logging) as g:
        batch, _ = g.canary_batch(ids)
        by_hand = _generate(model, batch, cfg, logits_processor=[g.canary(), _GrowAt(g, onset, [0, 1, 2, 3], 12)])
    assert torch.equal(out, by_hand)
    assert torch.equal(out[:, : onset + 2], plain[:, : onset + 2])  # the same until the raise acts


def test_fallback_refill_refills_the_risky_requests(model):
    """Under ``fallback="refill"`` the requests whose risk passes the level are refilled at the
    target (an event with its recompute's seconds); the canary row is not."""
    ids = _ids()
    cfg = H2OConfig(heavy=4, recent=3)
    weights = tuple(1000.0 if n == "canary" else 0.0 for n in SIGNALS)
    gcfg = GuardConfig(
        action="canary", fallback="refill", raise_slots=12, canary_share=0.25, tail=0, weights=weights, bias=-1e-3
    )
    with guarded(gcfg) as g:
        batch, _ = g.canary_batch(ids)
        _generate(model, batch, cfg, logits_processor=[g.refill(model), g.canary()])
    events = g.last.event_rows()
    assert events[0]["action"] == "canary"
    refills = events[1:]
    assert refills and {e["action"] for e in refills} == {"refill"}
    assert {e["request"] for e in refills} == {0, 1, 2, 3}  # any drift of the pair passes 1e-6
    assert all(e["seconds"] > 0 and e["slots_after"] == 12 and e["step"] >= PROMPT for e in refills)
    assert g.last.cache.row_capacity(g.last.cache.layers[0].budget).tolist() == [12] * 5


def test_a_recorded_canary_run_with_its_fallback_passes_the_strict_check(model, tmp_path):
    """The copies are requests of the log, the canary raise and the requests' fallback raises at the
    prefill are two state events, and the run's tables agree with its manifest."""
    import recorders
    from runlog.store import check_run, load_run

    ids = _ids()
    gcfg = GuardConfig(action="canary", fallback="raise", threshold=0.0, raise_slots=12, canary_share=0.25, tail=0)
    with guarded(gcfg) as g, recorders.record(model, H2OConfig(heavy=4, recent=3), out=tmp_path, fsync=False) as run:
        batch, _ = g.canary_batch(ids)
        with torch.no_grad():
            model.generate(batch, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    check_run(tmp_path / run.run_id)
    loaded = load_run(tmp_path / run.run_id)
    events = loaded["guard_events"].to_pandas()
    assert sorted(events["action"]) == ["canary"] + ["raise"] * 4
    assert loaded["requests"].to_pandas()["heavy"].tolist() == [9] * 5  # every row raised to 12 slots
