"""The guard at the prefill: the ``prefill`` signal and the raise before the prompt is evicted (DESIGN.md §18.1, §18.2).

The signal is recomputed by brute force in FP64 from the captured queries and keys; a row raised at
the prefill is compared with a fresh H2O run at its raised slot count (and its pinned positions,
under ``rescue``), token by token and kept set by kept set.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from runtime_utils import KeptRecorder, capture_qk
from tiny import local_attention, tiny_model

import h2o_lens
from h2o_lens import H2OConfig, reference
from h2o_lens.config import pin
from h2o_lens.guard import SIGNALS, GuardConfig, guarded, prefill_signal

HEAVY, RECENT, PROMPT, TAIL = 4, 3, 24, 5


@pytest.fixture(scope="module")
def model():
    return local_attention(tiny_model("llama", layers=2))


def _ids(batch=2, seed=0):
    return torch.randint(3, 250, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


def _tail_weights(qk, layer: int, request: int, tail: int) -> list[np.ndarray]:
    """Per KV set, the last ``tail`` prompt rows' softmax weights summed over the set's query heads:
    ``(tail, P)`` arrays, by loops over the rows."""
    q = torch.cat(qk[layer]["q"], dim=2)[request, :, :PROMPT].numpy()
    k = torch.cat(qk[layer]["k"], dim=2)[request, :, :PROMPT].numpy()
    group = q.shape[0] // k.shape[0]
    scaling = qk[layer]["scaling"] or q.shape[-1] ** -0.5
    out = []
    for s in range(k.shape[0]):
        w = np.zeros((tail, PROMPT))
        for i, row in enumerate(range(PROMPT - tail, PROMPT)):
            for h in range(s * group, (s + 1) * group):
                w[i, : row + 1] += reference.softmax(q[h, row] @ k[s, : row + 1].T * scaling)
        out.append(w)
    return out


def _prompt_keep(qk, layer: int, request: int, heavy: int) -> list[set[int]]:
    """Per KV set, the positions H2O's prefill keeps with ``heavy`` heavy slots (FP64 reference)."""
    q = torch.cat(qk[layer]["q"], dim=2)[request, :, :PROMPT]
    k = torch.cat(qk[layer]["k"], dim=2)[request, :, :PROMPT]
    group = q.shape[0] // k.shape[0]
    scaling = qk[layer]["scaling"] or q.shape[-1] ** -0.5
    keeps = []
    for s in range(k.shape[0]):
        x = (torch.einsum("hnd,md->hnm", q[s * group : (s + 1) * group], k[s]) * scaling).numpy()
        score = {i: 0.0 for i in range(PROMPT)}
        for u in range(PROMPT):
            w = reference.aggregate(reference.softmax(x[:, u, : u + 1]), "sum")
            for i in range(u + 1):
                score[i] += w[i]
        keeps.append(set(reference.keep_prompt(score, PROMPT, heavy, RECENT)))
    return keeps


def test_prefill_signal_by_brute_force(model):
    """Each row's ``prefill`` signal is the share of its last TAIL rows' attention on the positions
    the prefill evicts, averaged over rows, KV sets and layers; it is logged at step P - 1."""
    with (
        h2o_lens.h2o(model, H2OConfig(heavy=HEAVY, recent=RECENT)),
        guarded(GuardConfig(tail=TAIL)) as g,
        capture_qk() as qk,
        torch.no_grad(),
    ):
        model.generate(_ids(), max_new_tokens=3, do_sample=False, pad_token_id=0)
    rows = [r for r in g.last.risk_rows() if r["step"] == PROMPT - 1]
    assert [r["request"] for r in rows] == [0, 1]
    for r in range(2):
        shares = []
        for layer in range(2):
            keeps = _prompt_keep(qk, layer, r, HEAVY)
            for s, w in enumerate(_tail_weights(qk, layer, r, TAIL)):
                gone = [j for j in range(PROMPT) if j not in keeps[s]]
                shares.append(np.mean([w[i, gone].sum() / w[i].sum() for i in range(TAIL)]))
        want = float(np.mean(shares))
        assert 0.0 < want < 1.0
        assert rows[r]["prefill"] == pytest.approx(want, rel=1e-5)
        assert all(rows[r][name] == 0.0 for name in SIGNALS if name != "prefill")
        w = GuardConfig().weights[SIGNALS.index("prefill")]
        assert rows[r]["risk"] == pytest.approx(1 / (1 + math.exp(-(GuardConfig().bias + w * want))), rel=1e-5)
    # every decode step carries the row's prefill signal
    later = [r for r in g.last.risk_rows() if r["step"] >= PROMPT]
    assert later and all(r["prefill"] == rows[r["request"]]["prefill"] for r in later)


def _lost_by_brute_force(qk, request: int, rows: int) -> np.ndarray:
    """``(layers, KV sets)``: the share of the last ``rows`` prompt rows' attention on the positions
    the prefill evicts, by loops."""
    out = []
    for layer in range(2):
        keeps = _prompt_keep(qk, layer, request, HEAVY)
        per = []
        for s, w in enumerate(_tail_weights(qk, layer, request, TAIL)):
            gone = [j for j in range(PROMPT) if j not in keeps[s]]
            per.append(np.mean([w[i, gone].sum() / w[i].sum() for i in range(TAIL - rows, TAIL)]))
        out.append(per)
    return np.array(out)


@pytest.mark.parametrize("heads", [(), ((1, 0),), ((0, 1), (1, 1))])
def test_prefill_signal_over_the_last_rows_and_chosen_heads(model, heads):
    """With ``signal_rows`` < ``tail`` the signal reads only the last rows; ``prefill_heads`` holds
    every layer's and KV set's lost share, and the signal is their mean over the chosen heads
    (over all of them when none are chosen), each recomputed by brute force."""
    with (
        h2o_lens.h2o(model, H2OConfig(heavy=HEAVY, recent=RECENT)),
        guarded(GuardConfig(tail=TAIL, signal_rows=2, heads=heads)) as g,
        capture_qk() as qk,
        torch.no_grad(),
    ):
        model.generate(_ids(seed=3), max_new_tokens=2, do_sample=False, pad_token_id=0)
    rows = [r for r in g.last.risk_rows() if r["step"] == PROMPT - 1]
    assert g.last.prefill_heads.shape == (2, 2, 2)
    for r in range(2):
        lost = _lost_by_brute_force(qk, r, 2)
        np.testing.assert_allclose(g.last.prefill_heads[r].numpy(), lost, rtol=1e-5)
        want = lost.mean() if not heads else np.mean([lost[a, b] for a, b in heads])
        assert rows[r]["prefill"] == pytest.approx(float(want), rel=1e-5)
    assert not np.allclose(_lost_by_brute_force(qk, 0, 2), _lost_by_brute_force(qk, 0, TAIL))  # the rows matter


def test_prefill_heads_are_checked():
    """Heads that are not (layer, KV set) index pairs are refused when the config is made; heads
    outside the model's layers or KV sets when the prefill reads them, in one sentence."""
    from h2o_lens.errors import ConfigError
    from h2o_lens.guard import head_signal

    for bad in (((1,),), ((0, -1),), ((0.5, 1),)):
        with pytest.raises(ConfigError, match="layer, KV set"):
            GuardConfig(heads=bad)
    with pytest.raises(ConfigError, match="signal_rows"):
        GuardConfig(signal_rows=0)
    assert GuardConfig(heads=[[1, 0]]).heads == ((1, 0),)
    lost = torch.rand(3, 2, 2, generator=torch.Generator().manual_seed(0))
    assert head_signal(lost, ((1, 1), (0, 0))).tolist() == pytest.approx(((lost[:, 1, 1] + lost[:, 0, 0]) / 2).tolist())
    with pytest.raises(ConfigError, match=r"outside this model's 2 layers and 2 KV sets"):
        head_signal(lost, ((2, 0),))


def test_prefill_signal_reads_padding_as_nothing():
    """Padding columns and rows weigh nothing: a padded copy of a case gives the unpadded value."""
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(1, 2, 3, 6, generator=gen, dtype=torch.float64)
    keep = torch.rand(1, 2, 6, generator=gen) > 0.5
    pos = torch.arange(6).expand(1, 2, 6)
    plain = prefill_signal(w, keep, pos)
    wp = torch.cat([torch.zeros(1, 2, 3, 2, dtype=torch.float64), w], -1)
    wp = torch.cat([torch.zeros(1, 2, 1, 8, dtype=torch.float64), wp], 2)  # a padding row weighs nothing
    kp = torch.cat([torch.zeros(1, 2, 2, dtype=torch.bool), keep], -1)
    pp = torch.cat([torch.full((1, 2, 2), -1), pos], -1)
    assert prefill_signal(wp, kp, pp).item() == pytest.approx(plain.item(), rel=1e-6)
    manual = np.mean([[(w[0, s, i] * ~keep[0, s]).sum() / w[0, s, i].sum() for i in range(3)] for s in range(2)])
    assert plain.item() == pytest.approx(float(manual), rel=1e-6)


def _fresh(model, ids, config, new):
    rec = KeptRecorder()
    with h2o_lens.h2o(model, config, listener=rec), torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out, rec


@pytest.mark.parametrize("rescue", [0.0, 0.2, 0.3, 0.5])
def test_prefill_raise_is_a_fresh_run_at_the_target(model, rescue):
    """At threshold 0 each row is raised at the prefill from 7 to 12 slots, before its prompt is
    evicted: one event at step P - 1 with nothing evicted, and from then on the row is a fresh H2O
    run at 12 slots (with the rescued positions pinned under ``rescue``), token by token and at
    every layer, KV set and step. The rescue may take more than the 5 added slots (0.3: 8 pins),
    out of the heavy slots, up to all 9 of them (0.5 asks for 12)."""
    ids = _ids(seed=5)
    rec = KeptRecorder()
    cfg = GuardConfig(action="raise", threshold=0.0, raise_slots=12, rescue=rescue, tail=TAIL)
    with (
        h2o_lens.h2o(model, H2OConfig(heavy=HEAVY, recent=RECENT), listener=rec) as session,
        guarded(cfg) as g,
        torch.no_grad(),
    ):
        out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    cache = session.last_cache
    events = g.last.event_rows()
    assert [
        (e["request"], e["step"], e["action"], e["slots_before"], e["slots_after"], e["evicted"]) for e in events
    ] == [
        (0, PROMPT - 1, "raise", 7, 12, 0.0),
        (1, PROMPT - 1, "raise", 7, 12, 0.0),
    ]
    for r in range(2):
        raised = cache.request_configs[r]
        pins = raised.pinned
        if rescue:
            assert len(pins) == min(HEAVY + 5, math.ceil(rescue * PROMPT))
            assert all(0 <= p < PROMPT - RECENT for p in pins)
        else:
            assert pins == ()
        fresh = (
            pin(H2OConfig(heavy=HEAVY + 5, recent=RECENT), pins) if pins else H2OConfig(heavy=HEAVY + 5, recent=RECENT)
        )
        assert raised.capacity == fresh.capacity == 12
        want, frec = _fresh(model, ids[r : r + 1], fresh, 10)
        assert torch.equal(out[r : r + 1], want)
        for layer in range(2):
            got = [step[r] for step in rec.kept[layer]]
            assert got == [step[0] for step in frec.kept[layer]], (r, layer)


@pytest.mark.parametrize("rescue", [0.2, 0.3])
def test_rescue_pins_what_the_last_rows_read_most(model, rescue):
    """The rescued positions are the top ``⌈rescue · P⌉`` of the last rows' attention (normalised
    per KV set and layer, the most-reading set and layer taken, max-pooled over ±7 neighbours),
    outside the recent window, recomputed by brute force from the captured queries and keys."""
    ids = _ids(batch=1, seed=9)
    cfg = GuardConfig(action="raise", threshold=0.0, raise_slots=12, rescue=rescue, tail=TAIL)
    with (
        h2o_lens.h2o(model, H2OConfig(heavy=HEAVY, recent=RECENT)) as session,
        guarded(cfg),
        capture_qk() as qk,
        torch.no_grad(),
    ):
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    pins = session.last_cache.request_configs[0].pinned
    best = np.zeros(PROMPT)
    for layer in range(2):
        for w in _tail_weights(qk, layer, 0, TAIL):
            col = w.sum(0)
            best = np.maximum(best, col / col.sum())
    pooled = np.array([best[max(0, j - 7) : j + 8].max() for j in range(PROMPT)])
    pooled[PROMPT - RECENT :] = -1.0
    n = min(HEAVY + 5, math.ceil(rescue * PROMPT))
    order = sorted(range(PROMPT), key=lambda j: -pooled[j])
    cut = pooled[order[n - 1]]
    assert all(pooled[p] >= cut - 1e-9 for p in pins) and len(pins) == n
    assert set(j for j in range(PROMPT) if pooled[j] > cut + 1e-9) <= set(pins)


def test_assisted_decoding_logs_the_prefill_risk_and_acts_later(model):
    """Assisted decoding verifies a draft in the prompt's own forward, so the prompt cannot wait for
    the prefill's decision: the prefill's row is logged, no action is taken there, and the run
    completes."""
    drafter = tiny_model("llama", layers=2, seed=7)
    ids = _ids(batch=1, seed=11)
    cfg = GuardConfig(action="raise", threshold=0.0, raise_slots=12, tail=TAIL)
    with h2o_lens.h2o(model, H2OConfig(heavy=HEAVY, recent=RECENT)), guarded(cfg) as g, torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None, assistant_model=drafter
        )
    assert out.shape[1] == PROMPT + 6
    rows = g.last.risk_rows()
    assert rows[0]["step"] == PROMPT - 1 and rows[0]["prefill"] > 0
    assert all(e["step"] >= PROMPT for e in g.last.event_rows())


def test_a_refill_at_the_prefill_is_logged_as_a_refill_with_nothing_recomputed(model):
    """Under ``refill`` a row whose prefill risk reaches the threshold gets its target before its
    prompt is evicted, as a raise does: the event says ``refill`` (the action the config asked for),
    with nothing evicted and no recompute time; the tokens are those of the same run under ``raise``."""
    ids = _ids(seed=5)
    outs, events = [], []
    for action in ("raise", "refill"):
        cfg = GuardConfig(action=action, threshold=0.0, raise_slots=12, tail=TAIL)
        with h2o_lens.h2o(model, H2OConfig(heavy=HEAVY, recent=RECENT)), guarded(cfg) as g, torch.no_grad():
            outs.append(model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
        events.append(g.last.event_rows())
    assert torch.equal(outs[0], outs[1])
    fields = ("request", "step", "action", "slots_after", "evicted", "seconds")
    assert [tuple(e[f] for f in fields) for e in events[1]] == [
        (0, PROMPT - 1, "refill", 12, 0.0, 0.0),
        (1, PROMPT - 1, "refill", 12, 0.0, 0.0),
    ]
    assert [e["action"] for e in events[0]] == ["raise", "raise"]
