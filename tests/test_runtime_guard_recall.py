"""The guard's ``recall``: a flagged request's recall window opens on a cold tier that kept every
eviction, an unflagged request stays plain H2O (DESIGN.md §18.2, §2.13).

A tiny model decodes a batch of two under ``GuardConfig(action="recall")`` whose risk is the
``refer`` cue alone (weight 100, bias -50): the row given the cue reaches the threshold, the other
never does. A watching extension keeps every key and value the layers saw and checks the window's
K/V against them, bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny import tiny_model

import h2o_lens
from h2o_lens import H2OConfig
from h2o_lens.cold import ColdExtension, cold_extension, cold_summary
from h2o_lens.cold_config import ColdTier
from h2o_lens.errors import ConfigError
from h2o_lens.extension import CacheExtension, StepNeeds, use_extensions
from h2o_lens.guard import SIGNALS, GuardConfig, guarded
from h2o_lens.policies.base import ratio_slots

PROMPT, NEW, HEAVY, RECENT = 30, 20, 4, 4
REFER = tuple(100.0 if name == "refer" else 0.0 for name in SIGNALS)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2)


def _ids() -> torch.Tensor:
    return torch.randint(3, 250, (2, PROMPT), generator=torch.Generator().manual_seed(1))


class Watch(CacheExtension):
    """Per layer: every K/V seen, the positions evicted so far, and per step each row's window."""

    def __init__(self, cache):
        self.cache = cache
        self.seen, self.gone, self.window = {}, {}, {}
        self.bad, self.unevicted = [], []

    def step_needs(self, layer):
        return StepNeeds(candidates=True)

    def prompt_chosen(self, layer, choice):
        self.seen[layer.layer_idx] = (choice.key.clone(), choice.value.clone())
        return False

    def on_prefill(self, layer, event):
        gone = torch.where(~event.keep & (event.positions >= 0), event.positions, -1)
        self.gone[layer.layer_idx] = [[set(gone[b, h].tolist()) - {-1} for h in range(gone.shape[1])] for b in (0, 1)]
        self.window[layer.layer_idx] = []

    def before_step(self, layer, query, key, value):
        k, v = self.seen[layer.layer_idx]
        self.seen[layer.layer_idx] = (torch.cat([k, key[:, :, None]], 2), torch.cat([v, value[:, :, None]], 2))

    def step_taken(self, layer, step):
        i = layer.layer_idx
        st = cold_extension(self.cache).layers[i]
        win = layer.positions[..., st.start :] if st.window.shape[-1] else layer.positions[..., :0]
        self.window[i].append([set(win[b].flatten().tolist()) - {-1} for b in (0, 1)])
        k, v = self.seen[i]
        for b, h, j in (win >= 0).nonzero().tolist():
            p = int(win[b, h, j])
            if p not in self.gone[i][b][h]:
                self.unevicted.append((i, b, h, p))
            same = torch.equal(layer.keys[b, h, st.start + j], k[b, h, p])
            if not (same and torch.equal(layer.values[b, h, st.start + j], v[b, h, p])):
                self.bad.append((i, b, h, p))
        res = step.result
        gone = torch.where(res.evicts[..., None], res.cand_positions.gather(-1, res.slot[..., None]), -1)
        for b, h in (gone[..., 0] >= 0).nonzero().tolist():
            self.gone[i][b][h].add(int(gone[b, h, 0]))


class FlagAt:
    """A logits processor that gives row 0 the ``refer`` cue from its ``at``-th call on (the guard
    then flags it at the next step)."""

    def __init__(self, guard, at: int):
        self.guard, self.at, self.calls = guard, at, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            for state in self.guard.states:
                state.set_cues(torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
        return scores


def _generate(model, cfg, guard=None, *, prompt_flag=False, flag_at=None):
    with contextlib.ExitStack() as stack:
        g = stack.enter_context(guarded(guard)) if guard is not None else None
        if prompt_flag:
            g.prompt_cues = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
        if guard is not None:
            stack.enter_context(use_extensions(Watch))
        session = stack.enter_context(h2o_lens.h2o(model, cfg))
        kw = {"logits_processor": [FlagAt(g, flag_at)]} if flag_at is not None else {}
        with torch.no_grad():
            out = model.generate(_ids(), max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kw)
    cache = session.last_cache
    watch = next((e for e in cache.extensions if isinstance(e, Watch)), None) if cache is not None else None
    return out, cache, g, watch


def test_a_flagged_row_recalls_evicted_entries_bit_for_bit_and_an_unflagged_row_is_plain_h2o(model):
    """Row 0 is flagged at a decode step: its window is empty before and holds recalled entries
    after (each one its request evicted earlier, its K/V the evicted ones bit for bit); row 1's
    window stays closed and its tokens are plain H2O's. The event is logged as ``recall``."""
    cfg = H2OConfig(heavy=HEAVY, recent=RECENT)
    plain, *_ = _generate(model, cfg)
    guard = GuardConfig(action="recall", raise_slots=6, threshold=0.5, weights=REFER, bias=-50.0)
    out, cache, g, watch = _generate(model, cfg, guard, flag_at=5)
    (event,) = g.last.event_rows()
    assert event["action"] == "recall" and event["request"] == 0
    assert (event["slots_before"], event["slots_after"]) == (8, 14) and event["evicted"] > 0
    at = event["step"] - PROMPT + 1  # the first step whose window can hold anything
    for layer in (0, 1):
        rows = watch.window[layer]
        assert all(not w[0] for w in rows[:at]) and all(w[0] for w in rows[at:])
        assert all(not w[1] for w in rows)  # never opened
    assert watch.bad == [] and watch.unevicted == []
    assert torch.equal(out[1], plain[1])
    ext = cold_extension(cache)
    assert ext.gated and ext.open.tolist() == [6, 0] and cold_summary(cache)["recalled"] > 0


def test_a_window_opened_at_the_prefill_that_holds_everything_gives_row_0_the_full_cache_tokens(model):
    """Flagged at the prefill (step P - 1, nothing evicted yet) with a window larger than all that
    will be evicted: row 0 attends to every position at every step, so its tokens are the full
    cache's (plain H2O's differ); row 1 stays plain H2O."""
    cfg = H2OConfig(heavy=HEAVY, recent=RECENT)
    full, *_ = _generate(model, H2OConfig(policy="full"))
    plain, *_ = _generate(model, cfg)
    guard = GuardConfig(action="recall", raise_slots=100, threshold=0.5, weights=REFER, bias=-50.0)
    out, cache, g, watch = _generate(model, cfg, guard, prompt_flag=True)
    assert [(e["request"], e["step"], e["action"], e["slots_after"], e["evicted"]) for e in g.last.event_rows()] == [
        (0, PROMPT - 1, "recall", 108, 0.0)
    ]
    assert torch.equal(out[0], full[0]) and not torch.equal(plain[0], full[0])
    assert torch.equal(out[1], plain[1])
    assert watch.bad == [] and all(not w[1] for w in watch.window[0])


def test_a_window_given_as_a_share_of_the_prompt(model):
    """``raise_ratio`` under ``recall`` is the window's share of the prompt; threshold 0 opens both rows."""
    guard = GuardConfig(action="recall", raise_ratio=0.2, threshold=0.0)
    _, cache, g, watch = _generate(model, H2OConfig(heavy=HEAVY, recent=RECENT), guard)
    window = ratio_slots(0.2, PROMPT)
    assert [(e["slots_before"], e["slots_after"]) for e in g.last.event_rows()] == [(8, 8 + window)] * 2
    for i, layer in enumerate(cache.layers):  # each window full: far more than the window was evicted
        st = cold_extension(cache).layers[i]
        assert st.window.shape[-1] == window and bool((layer.positions[..., st.start :] >= 0).all())
    assert watch.bad == [] and watch.unevicted == []


def test_a_recall_guard_refuses_what_it_cannot_do(model):
    with pytest.raises(ConfigError, match="'recall' needs a target"):
        GuardConfig(action="recall")
    with pytest.raises(ConfigError, match="recall window raise_slots=0"):
        GuardConfig(action="recall", raise_slots=0)
    with pytest.raises(ConfigError, match="rescue=0.1 pins positions"):
        GuardConfig(action="recall", raise_ratio=0.1, rescue=0.1)
    assert GuardConfig(action="recall", raise_slots=1).window(100) == 1  # one slot is a window
    # its own cold tier, not the config's (whose window is inside the budget)
    cfg = H2OConfig(heavy=HEAVY, recent=RECENT, cold=ColdTier(recall=2))
    with guarded(GuardConfig(action="recall", raise_slots=4)), h2o_lens.h2o(model, cfg) as session:
        with pytest.raises(ConfigError, match="brings its own cold tier"):
            session.new_cache()
    with pytest.raises(ConfigError, match="open_rows opens a gated cold tier"):
        ColdExtension().open_rows([0], [4], 1)
