"""The guard's ``raise``: exact H2O before and after a slot count that grows at step s (DESIGN.md §18.2).

A tiny model decodes while its own post-RoPE queries and keys are captured; an FP64 reference whose
slot count changes at step s (built from the reference's own pieces) gives every layer's and KV
set's kept sets, step by step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_utils import KeptRecorder, assert_same_sets, capture_qk, reference_sets
from tiny import local_attention, tiny_model

import h2o_lens
from h2o_lens import H2OConfig, compat, reference
from h2o_lens.errors import ConfigError
from h2o_lens.guard import GuardConfig, grow_rows, guarded

HEAVY, RECENT, PROMPT = 4, 3, 24


def raised_trace(logits, prefill: int, heavy: int, recent: int, at: int, heavy_after: int) -> list[list[int]]:
    """H2O in FP64 (:func:`h2o_lens.reference.trace`) with ``heavy`` grown to ``heavy_after`` from
    decode step ``at`` on: kept sets after the prefill, then after each decode step."""
    x = np.asarray(logits, dtype=np.float64)
    score = {i: 0.0 for i in range(prefill)}
    for u in range(prefill):
        w = reference.aggregate(reference.softmax(x[:, u, : u + 1]), "sum")
        for i in range(u + 1):
            score[i] += w[i]
    keep = reference.keep_prompt(score, prefill, heavy, recent)
    score = {i: score[i] for i in keep}
    kept = [sorted(score)]
    for t in range(prefill, x.shape[1]):
        budget = (heavy_after if t >= at else heavy) + recent
        cand = sorted(score) + [t]
        w = reference.aggregate(reference.softmax(x[:, t, cand]), "sum")
        score[t] = 0.0
        for i, wi in zip(cand, w):
            score[i] += wi
        if len(cand) > budget:
            del score[reference.evict(score, t, recent)]
        kept.append(sorted(score))
    return kept


def _reference(qk, layer, request, at, heavy_after):
    q = torch.cat(qk[layer]["q"], dim=2)[request]
    k = torch.cat(qk[layer]["k"], dim=2)[request]
    group = q.shape[0] // k.shape[0]
    scaling = qk[layer]["scaling"] or q.shape[-1] ** -0.5
    per_set = []
    for s in range(k.shape[0]):
        logits = torch.einsum("hnd,md->hnm", q[s * group : (s + 1) * group], k[s]) * scaling
        per_set.append(raised_trace(logits.numpy(), PROMPT, HEAVY, RECENT, at, heavy_after))
    return [[per_set[s][i] for s in range(k.shape[0])] for i in range(len(per_set[0]))]


@pytest.fixture(scope="module")
def model():
    return local_attention(tiny_model("llama", layers=2))


def _ids(batch=2, seed=0):
    return torch.randint(3, 250, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("at_step", [0, 5])
def test_raise_at_step_s_equals_the_reference(model, at_step):
    """Row 0 grows from 7 to 12 slots before decode step ``PROMPT + at_step``; row 1 keeps 7. Both
    keep what their FP64 references keep at every step, layer and KV set."""
    rec = KeptRecorder()
    with h2o_lens.h2o(model, H2OConfig(heavy=HEAVY, recent=RECENT), listener=rec) as session, capture_qk() as qk:
        cache = session.new_cache()
        with torch.no_grad():
            out = model(_ids(), use_cache=True, **compat.cache_kwargs(cache))
            tok = out.logits[:, -1:].argmax(-1)
            for i in range(14):
                if i == at_step:
                    grow_rows(cache, [0], [12])
                out = model(tok, use_cache=True, **compat.cache_kwargs(cache))
                tok = out.logits[:, -1:].argmax(-1)
    assert cache.row_capacity(cache.layers[0].budget).tolist() == [12, 7]
    assert cache.request_configs[0].heavy == HEAVY + 5 and cache.request_configs[1].heavy == HEAVY
    for layer in range(2):
        got = [step[0] for step in rec.kept[layer]]
        assert_same_sets(got, _reference(qk, layer, 0, PROMPT + at_step, HEAVY + 5), f"raised row, layer {layer}")
        other = [step[1] for step in rec.kept[layer]]
        assert_same_sets(other, reference_sets(qk[layer], 1, PROMPT, HEAVY, RECENT, "sum"), f"row 1, layer {layer}")


def test_guard_raise_logs_the_event_and_stays_exact(model):
    """At threshold 0 every row raises after its first decode step: the event names the request,
    the step, the slots before and after and the positions already gone; the kept sets then
    follow the reference raised from the next step."""
    rec = KeptRecorder()
    cfg = GuardConfig(action="raise", threshold=0.0, raise_ratio=0.5, tail=0)
    with (
        h2o_lens.h2o(model, H2OConfig(heavy=HEAVY, recent=RECENT), listener=rec),
        guarded(cfg) as g,
        capture_qk() as qk,
    ):
        with torch.no_grad():
            model.generate(_ids(seed=3), max_new_tokens=12, do_sample=False, pad_token_id=0)
    events = g.last.event_rows()
    assert [(e["request"], e["step"], e["action"], e["slots_before"], e["slots_after"]) for e in events] == [
        (0, PROMPT, "raise", 7, 12),
        (1, PROMPT, "raise", 7, 12),
    ]
    assert all(e["evicted"] == 1.0 and 0.0 <= e["risk"] <= 1.0 for e in events)
    for layer in range(2):
        for r in range(2):
            got = [step[r] for step in rec.kept[layer]]
            assert_same_sets(got, _reference(qk, layer, r, PROMPT + 1, HEAVY + 5), f"row {r}, layer {layer}")


def test_grow_rows_refuses_to_shrink(model):
    with h2o_lens.h2o(model, H2OConfig(heavy=HEAVY, recent=RECENT)) as session, torch.no_grad():
        cache = session.new_cache()
        model(_ids(1), use_cache=True, **compat.cache_kwargs(cache))
        with pytest.raises(ConfigError, match="holds 7 slots; a raise to 5 would shrink it"):
            grow_rows(cache, [0], [5])
