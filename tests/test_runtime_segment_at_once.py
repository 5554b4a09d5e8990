"""A verification segment computed at once equals its steps one by one, bit for bit (DESIGN.md §14.1).

The segment's rows, ranking values, victims, decode events and the state after any crop are
compared with plain decode steps of the accepted tokens (and with the step-by-step segment),
including segments whose first guess of the victims is wrong.
"""

from __future__ import annotations

import types

import pytest
import torch
from runtime_utils import KeptRecorder
from tiny import tiny_model

import h2o_lens
from h2o_lens import H2OConfig, speculative
from h2o_lens.cache import H2OCache

HQ, HKV, D = 4, 2, 8


class Events:
    """Every decode event, copied when heard."""

    def __init__(self):
        self.events = []

    def on_prefill(self, layer, ev):
        pass

    def on_decode(self, layer, ev):
        fields = ("step", "slot", "evicts", "cand_scores", "cand_positions", "kept")
        self.events.append({f: getattr(ev, f).clone() for f in fields})

    def on_segment(self, layer, ev):
        if ev.mode == "rollback" and ev.rolled_back:  # heard, then taken back
            del self.events[-ev.rolled_back :]


def _cache(config, mode, listener, hq=HQ, hkv=HKV):
    text = types.SimpleNamespace(num_hidden_layers=1, num_attention_heads=hq, num_key_value_heads=hkv)
    return H2OCache(config, text, speculative=mode, listener=listener)


def _inputs(seed, b, p, m, dtype, hq=HQ, hkv=HKV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, p + m, D, generator=g, dtype=dtype) * 2
    k = torch.randn(b, hkv, p + m, D, generator=g, dtype=dtype) * 2
    v = torch.randn(b, hkv, p + m, D, generator=g, dtype=dtype)
    return q, k, v


def _prefilled(config, mode, q, k, v, p, valid, flat_scores):
    listener = Events()
    cache = _cache(config, mode, listener, hq=q.shape[1], hkv=k.shape[1])
    layer = cache.layers[0]
    layer.update(k[:, :, :p], v[:, :, :p], kwargs={})
    layer.prefill(q[:, :, :p], valid, 0.25)
    if flat_scores:  # near ties: the segment's own weights decide the victims, not the prefill's
        layer.scores.copy_(1.0 + 1e-4 * torch.rand(layer.scores.shape, generator=torch.Generator().manual_seed(3)))
    return cache, layer, listener


CONFIGS = {
    "h2o": (H2OConfig(heavy=5, recent=6), HQ, HKV),
    "gqa-max": (H2OConfig(heavy=5, recent=6, gqa="max"), HQ, HKV),
    "gqa-none": (H2OConfig(heavy=5, recent=6, gqa="none"), HQ, HKV),
    "sink-and-pin": (H2OConfig(heavy=4, recent=6, sink=1, pinned=(3,)), HQ, HKV),
    "mha": (H2OConfig(heavy=7, recent=6), 2, 2),
    "three-blocks": (H2OConfig(heavy=60, recent=70), HQ, HKV),  # 130 slots: blocks of 64, 64 and 2
    "two-full-blocks": (H2OConfig(heavy=64, recent=64), HQ, HKV),  # a multiple of the block
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mode", ["rollback", "defer"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("flat", [False, True], ids=["prefill-scores", "near-ties"])
@pytest.mark.parametrize("guess", ["rough", "wrong"])
def test_segment_at_once_equals_plain_steps(name, mode, dtype, flat, guess, monkeypatch):
    """``wrong``: the first guess of the victims comes from reversed ranking values, so the
    rounds must correct it; the result is exact all the same."""
    if guess == "wrong":
        rough = speculative._rough_totals
        monkeypatch.setattr(speculative, "_rough_totals", lambda *a: -rough(*a))
    config, hq, hkv = CONFIGS[name]
    b, m = 2, 6
    p = max(16, config.heavy + config.recent + 8)
    q, k, v = _inputs(0, b, p, m, dtype, hq, hkv)
    valid = torch.ones(b, p, dtype=torch.bool)
    valid[1, :2] = False  # left padding: the second request is shorter, and still fills the cache
    rounds = []
    for rolled_back in (0, 2, m):
        spec, layer, heard = _prefilled(config, mode, q, k, v, p, valid, flat)
        plain, ref_layer, ref_heard = _prefilled(config, mode, q, k, v, p, valid, flat)
        assert speculative.batched(layer, m)
        layer.update(k[:, :, p:], v[:, :, p:], kwargs={})
        out = layer.decode_segment(q[:, :, p:], 0.25)
        assert layer.segment.batch is not None, "the segment ran step by step"
        rounds.append(layer.segment.batch.rounds)
        spec.crop(-rolled_back)
        for t in range(p, p + m - rolled_back):
            ref_layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1], kwargs={})
            ref = ref_layer.decode(q[:, :, t : t + 1], 0.25)
            assert torch.equal(out[:, t - p : t - p + 1], ref), f"output of token {t}"
        for attr in ("keys", "values", "scores", "positions", "next_pos"):
            assert torch.equal(getattr(layer, attr), getattr(ref_layer, attr)), f"{attr}, {rolled_back} taken back"
        assert layer.seen == ref_layer.seen and layer.fill is None and layer.segment is None
        assert len(heard.events) == len(ref_heard.events) == m - rolled_back
        for i, (a, r) in enumerate(zip(heard.events, ref_heard.events)):
            for f in a:
                assert a[f].dtype == r[f].dtype and torch.equal(a[f], r[f]), f"event {i}: {f}"
    if guess == "wrong":
        assert min(rounds) >= 2, rounds


class _Never(dict):
    """A verdict table that says the one-matmul logits never have the step's bits."""

    def __contains__(self, key):
        return True

    def get(self, key, default=None):
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("name", ["h2o", "three-blocks"])
@pytest.mark.parametrize("logits", ["checked", "blocks", "perturbed"])
def test_row_logits_come_from_one_matmul_only_where_it_gives_the_step_bits(name, dtype, logits, monkeypatch):
    """``checked``: the first segment of a shape compares the gathered logits with the block
    matmuls and remembers the verdict; ``blocks``: the verdict is no, every row's block matmuls
    run; ``perturbed``: the one matmul is made slightly wrong, the check says no and the result
    is still exact."""
    verdicts = _Never() if logits == "blocks" else {}
    monkeypatch.setattr(speculative, "_FAST_ROWS", verdicts)
    if logits == "perturbed":
        one = speculative._all_logits
        monkeypatch.setattr(speculative, "_all_logits", lambda *a: one(*a) * (1 + 1e-2))
    config, hq, hkv = CONFIGS[name]
    b, m = 1, 6
    p = max(16, config.heavy + config.recent + 8)
    q, k, v = _inputs(4, b, p, m, dtype, hq, hkv)
    spec, layer, heard = _prefilled(config, "rollback", q, k, v, p, None, False)
    plain, ref_layer, ref_heard = _prefilled(config, "rollback", q, k, v, p, None, False)
    layer.update(k[:, :, p:], v[:, :, p:], kwargs={})
    out = layer.decode_segment(q[:, :, p:], 0.25)
    spec.crop(-2)
    for t in range(p, p + m - 2):
        ref_layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1], kwargs={})
        assert torch.equal(out[:, t - p : t - p + 1], ref_layer.decode(q[:, :, t : t + 1], 0.25)), t
    for attr in ("keys", "values", "scores", "positions"):
        assert torch.equal(getattr(layer, attr), getattr(ref_layer, attr)), attr
    if logits != "blocks":
        assert verdicts, "no verdict was recorded"
    if logits == "perturbed":
        assert not any(verdicts.values()), verdicts


def test_segment_at_once_equals_step_by_step_segment(monkeypatch):
    """The same segment through both implementations: the same state after each crop."""
    config, hq, hkv = CONFIGS["h2o"]
    q, k, v = _inputs(5, 1, 16, 6, torch.float32)
    states = []
    for at_once in (True, False):
        if not at_once:
            monkeypatch.setattr(speculative, "batched", lambda layer, m: False)
        spec, layer, _ = _prefilled(config, "rollback", q, k, v, 16, None, True)
        layer.update(k[:, :, 16:], v[:, :, 16:], kwargs={})
        out = layer.decode_segment(q[:, :, 16:], 0.25)
        assert (layer.segment.batch is not None) == at_once
        spec.crop(-3)
        states.append([out, layer.keys, layer.values, layer.scores, layer.positions, layer.next_pos])
    for a, b in zip(*states):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "config",
    [
        H2OConfig(heavy=5, recent=3),
        H2OConfig(heavy=8, recent=0, policy="heavy"),
        H2OConfig(heavy=4, recent=6, policy="tova"),
    ],
    ids=["recent-below-m", "no-recent", "not-accumulating"],
)
def test_segment_runs_step_by_step_where_a_segment_token_could_be_a_victim(config):
    """A recent window shorter than the segment, or a policy whose score is not a running sum:
    the segment runs step by step (and still equals the plain steps, tests/test_runtime_speculative.py)."""
    q, k, v = _inputs(1, 1, 16, 6, torch.float32)
    _, layer, _ = _prefilled(config, "rollback", q, k, v, 16, None, False)
    assert not speculative.batched(layer, 6)
    layer.update(k[:, :, 16:], v[:, :, 16:], kwargs={})
    layer.decode_segment(q[:, :, 16:], 0.25)
    assert layer.segment.batch is None and layer.segment.steps == 6


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rollback", "defer"])
def test_generate_with_prompt_lookup_verifies_segments_at_once(mode, monkeypatch):
    """Assisted decoding on a tiny model: the tokens and every step's kept sets equal plain greedy."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2, seed=0)
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(2)
    base = torch.randint(3, 256, (8,), generator=g)
    ids = torch.cat([base, base, base, base])[None]
    used = []
    run = speculative.run_batched

    def spy(layer, seg, *a):
        used.append(a[0].shape[2])
        return run(layer, seg, *a)

    monkeypatch.setattr(speculative, "run_batched", spy)
    outs, kept = [], []
    for kw in ({}, {"prompt_lookup_num_tokens": 4}):
        rec = _Stood()
        with torch.no_grad(), h2o_lens.h2o(model, heavy=6, recent=8, listener=rec, speculative=mode):
            outs.append(model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, **kw))
        kept.append(dict(rec.kept))
    assert used, "no segment was verified at once"
    assert torch.equal(outs[0], outs[1])
    assert kept[0] == kept[1]


class _Stood(KeptRecorder):
    def on_segment(self, layer, ev):
        if ev.mode == "rollback" and ev.rolled_back:
            del self.kept[layer][-ev.rolled_back :]
