"""The guard's signals, recomputed by brute force in FP64, and the guard leaves H2O exact (DESIGN.md §18)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from runtime_utils import KeptRecorder
from tiny import local_attention, tiny_model

import h2o_lens
from h2o_lens import H2OConfig, compat, ops, reference
from h2o_lens.errors import ConfigError
from h2o_lens.guard import (
    SIGNALS,
    GuardConfig,
    GuardState,
    TokenCues,
    combine,
    dropped_share,
    guarded,
    layer_signals,
)


def _state(seed: int, b: int = 2, hs: int = 2, g: int = 2, cap: int = 7, d: int = 8, step: int = 30):
    """A full H2O layer state at query position ``step``: distinct kept positions, positive scores."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.empty(b, hs, cap, dtype=torch.int32)
    for r in range(b):
        for s in range(hs):
            positions[r, s] = torch.randperm(step, generator=gen)[:cap].to(torch.int32)
    return dict(
        q=torch.randn(b, hs * g, d, generator=gen, dtype=torch.float64),
        k=torch.randn(b, hs, d, generator=gen, dtype=torch.float64),
        v=torch.randn(b, hs, d, generator=gen, dtype=torch.float64),
        keys=torch.randn(b, hs, cap, d, generator=gen, dtype=torch.float64),
        values=torch.randn(b, hs, cap, d, generator=gen, dtype=torch.float64),
        scores=torch.rand(b, hs, cap, generator=gen, dtype=torch.float64) * 3,
        positions=positions,
        step=torch.full((b,), step, dtype=torch.int32),
    )


def _brute(st: dict, r: int, s: int, g: int, recent: int, prompt: int, scaling: float) -> dict[str, float]:
    """Every per-layer signal of one (row, KV set), from the definitions, with numpy loops."""
    q = st["q"][r, s * g : (s + 1) * g].numpy()
    keys = st["keys"][r, s].numpy()
    pos = st["positions"][r, s].tolist()
    t = int(st["step"][r])
    cap = len(pos)
    cand = pos + [t]
    logits = np.array([[q[h] @ kk * scaling for kk in list(keys) + [st["k"][r, s].numpy()]] for h in range(g)])
    w = reference.softmax(logits)  # (G, |D|)
    agg = reference.aggregate(w, "sum")
    score = {p: float(st["scores"][r, s, i]) + agg[i] for i, p in enumerate(pos)}
    score[t] = float(agg[-1])
    victim = reference.evict(score, t, recent)
    others = [score[p] for p in cand if p <= t - recent and p != victim]
    margin = score[victim] / min(others)
    p = agg / agg.sum()
    far = 1.0 - sum(p[i] for i, x in enumerate(cand) if x > t - recent)
    entropy = -sum(x * math.log(x) for x in p) / math.log(len(cand))
    life = sum(1.0 / (u + 1) for u in range(victim, prompt)) + sum(
        1.0 / (cap + 1) for u in range(max(prompt, victim), t + 1)
    )
    ratio = score[victim] / (g * life)
    return {"margin": margin, "uniform": ratio / (1 + ratio), "far": far, "entropy": entropy}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_signals_equal_brute_force(seed):
    """margin, uniform, far and entropy of a decode step equal their definitions, per row and KV set."""
    g, recent, prompt, scaling = 2, 3, 20, 0.7
    st = _state(seed, g=g)
    b, hs, cap = st["positions"].shape
    before = {k: v.clone() for k, v in st.items()}
    args = ops.PolicyArgs("h2o", cap - recent, recent, 0, "sum")
    res = ops.decode_step(
        st["q"],
        st["k"],
        st["v"],
        st["keys"],
        st["values"],
        st["scores"],
        st["positions"],
        st["step"],
        None,
        scaling,
        args,
        want_candidates=True,
    )
    rows = torch.full((b,), recent)
    got = layer_signals(
        res.weights,
        res.cand_scores,
        res.cand_positions,
        res.slot,
        res.evicts,
        st["step"],
        rows,
        torch.zeros(b, dtype=torch.int64),
        torch.full((b,), cap),
        torch.full((b,), float(prompt)),
        "sum",
        True,
    )
    for r in range(b):
        for s in range(hs):
            want = _brute(before, r, s, g, recent, prompt, scaling)
            for i, name in enumerate(("margin", "uniform", "far", "entropy")):
                assert got[r, s, i].item() == pytest.approx(want[name], rel=1e-9, abs=1e-12), (name, r, s)


@pytest.mark.parametrize("seed", [0, 3])
def test_dropped_share_equals_brute_force(seed):
    """The canary estimate: the reservoir's attention over the step's normaliser, scaled by
    evicted / held, as M / (1 + M), averaged over the group's heads."""
    gen = torch.Generator().manual_seed(seed)
    b, hs, g, d, cap, res_n = 2, 2, 3, 8, 6, 4
    qg = torch.randn(b, hs, g, d, generator=gen, dtype=torch.float64)
    keys = torch.randn(b, hs, cap, d, generator=gen, dtype=torch.float64)
    key = torch.randn(b, hs, d, generator=gen, dtype=torch.float64)
    reservoir = torch.randn(b, hs, res_n, d, generator=gen, dtype=torch.float64)
    held = torch.tensor([[4, 2], [0, 3]])
    evicted = torch.tensor([[9, 2], [0, 30]])
    new = torch.einsum("bsgd,bsd->bsg", qg, key)[..., None]
    logits = torch.cat([torch.einsum("bsgd,bscd->bsgc", qg, keys), new], -1)
    w_new = torch.softmax(logits, -1)[..., -1]
    got = dropped_share(qg, key, w_new, reservoir, held, evicted)
    for r in range(b):
        for s in range(hs):
            n = int(held[r, s])
            if n == 0:
                assert got[r, s].item() == 0.0
                continue
            shares = []
            for h in range(g):
                z = sum(math.exp(float(x)) for x in logits[r, s, h])
                m = sum(math.exp(float(qg[r, s, h] @ reservoir[r, s, j])) for j in range(n)) / z
                m *= int(evicted[r, s]) / n
                shares.append(m / (1 + m))
            assert got[r, s].item() == pytest.approx(sum(shares) / g, rel=1e-5)


def test_combine_is_the_logistic_of_the_weighted_signals():
    x = torch.tensor([[0.2, 0.4, 0.1, 0.9, 0.5, 0.05, 1.0, 0.0, 0.3]], dtype=torch.float64)
    w = (1.0, -2.0, 0.5, 3.0, 0.0, 7.0, 1.0, 2.0, 4.0)
    z = -1.5 + sum(a * b for a, b in zip(x[0].tolist(), w))
    assert combine(x, w, -1.5).item() == pytest.approx(1 / (1 + math.exp(-z)))


def test_config_errors_name_the_value_and_the_fix():
    with pytest.raises(ConfigError, match="'lift' is not known; expected one of none, raise, refill, canary"):
        GuardConfig(action="lift")
    with pytest.raises(ConfigError, match="'raise' needs a target: raise_slots=N or raise_ratio"):
        GuardConfig(action="raise")
    with pytest.raises(ConfigError, match="'refill' needs a target"):
        GuardConfig(action="refill")
    with pytest.raises(ConfigError, match="threshold=1.5"):
        GuardConfig(threshold=1.5)
    with pytest.raises(ConfigError, match="weights has 2 values"):
        GuardConfig(weights=(1.0, 2.0))
    assert GuardConfig(action="raise", raise_ratio=0.35).target(capacity=10, prompt_len=100) == 35
    assert GuardConfig(action="raise", raise_slots=8).target(capacity=10, prompt_len=100) == 10


def _run(model, ids, cfg, guard=None, new=16, listener=None):
    with h2o_lens.h2o(model, cfg, listener=listener) as session:
        if guard is None:
            out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
            return out, session.last_cache, None
        with guarded(guard) as g:
            out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
        return out, session.last_cache, g


def test_guard_without_action_changes_nothing():
    """The guard's layer takes the same steps: the same tokens and kept sets, step by step; its
    reservoir holds only evicted keys, at most max(1, ⌈share · B⌉) of them; every row gets a
    risk per step."""
    model = local_attention(tiny_model("llama", layers=2))
    ids = torch.randint(3, 250, (2, 30), generator=torch.Generator().manual_seed(1))
    cfg = H2OConfig(heavy=6, recent=4)
    plain, guarded_rec = KeptRecorder(), KeptRecorder()
    out_a, _, _ = _run(model, ids, cfg, listener=plain)
    out_b, cache, g = _run(model, ids, cfg, GuardConfig(reservoir=0.2), listener=guarded_rec)
    assert torch.equal(out_a, out_b)
    assert plain.kept == guarded_rec.kept
    state = g.last
    assert state in cache.extensions and cache.guard is state
    # a row per request at the prefill (step P - 1), then per decode step
    assert state.scored == 15 and len(state.risk_rows()) == 32
    assert [r["step"] for r in state.risk_rows()[:2]] == [29, 29]
    assert state.seconds > 0 and not state.events
    for row in state.risk_rows():
        assert 0.0 <= row["risk"] <= 1.0 and set(SIGNALS) <= set(row)
    layer = cache.layers[0]
    pool = state.reservoirs[0]
    assert pool.keys.shape[2] == math.ceil(0.2 * 10)
    # each held key is the key of a position the layer no longer holds: layer 0's keys depend on
    # the token and its position only, so a prefill of the whole output with room for all gives them
    with h2o_lens.h2o(model, H2OConfig(heavy=1000, recent=4)) as full, torch.no_grad():
        model(out_b, use_cache=True, **compat.cache_kwargs(full.new_cache()))
    all_keys = full.last_cache.layers[0].keys  # (b, Hs, N, d): every position, in order
    for r in range(2):
        for s in range(pool.keys.shape[1]):
            kept = set(layer.positions[r, s].tolist())
            for j in range(int(pool.held[r, s])):
                close = (all_keys[r, s] - pool.keys[r, s, j]).abs().amax(-1) < 1e-5
                match = close.nonzero()[:, 0].tolist()
                assert match and not (set(match) & kept), (r, s, j, match)
    assert int(pool.evicted.min()) > 0


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "the", "key", "mentioned", "above", "is", "{", "}", "x", "=", "1", "cat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>"), words


def test_token_cues_read_the_prompt_and_the_last_generated_tokens():
    tokenizer, words = _word_tokenizer()
    ix = {w: i for i, w in enumerate(words)}
    with guarded(GuardConfig(cue_window=2)) as g:
        cues = TokenCues(g, tokenizer)
        assert cues.refer[ix["above"]] and cues.refer[ix["mentioned"]] and not cues.refer[ix["cat"]]
        assert cues.structure[ix["{"]] and cues.structure[ix["="]] and not cues.structure[ix["x"]]
        state = GuardState(g.config, cache=None, cues=torch.zeros(2, 2))
        g.states.append(state)
        prompt = torch.tensor([[ix["the"], ix["key"], ix["mentioned"], ix["above"]], [ix["the"], ix["cat"], 1, 2]])
        scores = torch.zeros(2, len(words))
        assert cues(torch.cat([prompt, torch.tensor([[ix["{"]], [ix["x"]]])], 1), scores) is scores
        assert state.cues.tolist() == [[1.0, 1.0], [0.0, 0.0]]
        later = torch.cat([prompt, torch.tensor([[ix["{"], ix["x"], ix["x"]], [ix["x"], ix["="], ix["1"]]])], 1)
        cues(later, scores)
        assert state.cues.tolist() == [[0.0, 1.0], [1.0, 0.0]]  # "{" left the window of 2


def test_the_refer_cue_reads_the_question_not_the_top_of_the_prompt():
    """``refer`` reads the prompt's last ``tail`` tokens: a refer-back word in the instruction at the
    top of a prompt does not count, one in the question does; with ``tail`` 0 the whole prompt
    counts. The same holds for the prompts given to ``guard.cues`` (the prefill's row)."""
    tokenizer, words = _word_tokenizer()
    ix = {w: i for i, w in enumerate(words)}
    top = [ix["above"], ix["the"], ix["key"], ix["x"], ix["cat"], ix["x"], ix["cat"]]
    question = [ix["the"], ix["key"], ix["x"], ix["cat"], ix["x"], ix["mentioned"], ix["cat"]]
    prompts = torch.tensor([top, question])
    for tail, want in ((4, [False, True]), (7, [True, True]), (0, [True, True])):
        with guarded(GuardConfig(tail=tail)) as g:
            cues = g.cues(tokenizer, prompts)
            assert cues.refers(prompts).tolist() == want, tail
            assert g.prompt_cues[:, 1].tolist() == [float(w) for w in want], tail


def test_token_cues_reach_every_scored_step():
    """Through generate: a prompt with a refer-back word has ``refer`` = 1 from the first decode
    step on; one without has 0."""
    tokenizer, words = _word_tokenizer()
    model = tiny_model("llama", layers=1, vocab=len(words))
    ix = {w: i for i, w in enumerate(words)}
    ids = torch.tensor(
        [[ix["the"], ix["key"], ix["x"], ix["cat"]] * 3, [ix["the"], ix["key"], ix["mentioned"], ix["above"]] * 3]
    )
    with h2o_lens.h2o(model, H2OConfig(heavy=2, recent=2)), guarded(GuardConfig()) as g, torch.no_grad():
        model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, logits_processor=[g.cues(tokenizer)])
    rows = [r for r in g.last.risk_rows() if r["step"] >= ids.shape[1]]  # the decode steps
    assert len(rows) == 8
    assert [r["refer"] for r in rows if r["request"] == 1] == [1.0] * 4
    assert [r["refer"] for r in rows if r["request"] == 0] == [0.0] * 4


def test_stride_scores_every_other_layer_and_changes_nothing():
    """stride=2 on a 2-layer model: layer 1 computes no signals and closes each step; the tokens
    are the plain run's, every step has a risk, and the signals are layer 0's alone."""
    model = local_attention(tiny_model("llama", layers=2))
    ids = torch.randint(3, 250, (1, 24), generator=torch.Generator().manual_seed(2))
    cfg = H2OConfig(heavy=5, recent=3)
    plain, _, _ = _run(model, ids, cfg, new=10)
    out, cache, g = _run(model, ids, cfg, GuardConfig(stride=2, reservoir=0.0), new=10)
    _, _, every = _run(model, ids, cfg, GuardConfig(stride=1, reservoir=0.0), new=10)
    assert torch.equal(plain, out)
    assert not g.last.scores_layer(1) and g.last.scores_layer(0)
    rows, all_rows = g.last.risk_rows(), every.last.risk_rows()
    assert [r["step"] for r in rows] == list(range(23, 33))  # the prefill's row, then each decode step
    assert any(abs(a["far"] - b["far"]) > 1e-6 for a, b in zip(rows, all_rows))  # one layer vs the mean of two


def test_token_cues_given_the_prompts_reach_the_prefill():
    """With the prompts given to ``cues``, the prefill's row already carries ``refer`` and its risk
    counts it; the decode steps carry it as before."""
    tokenizer, words = _word_tokenizer()
    model = tiny_model("llama", layers=1, vocab=len(words))
    ix = {w: i for i, w in enumerate(words)}
    ids = torch.tensor(
        [[ix["the"], ix["key"], ix["x"], ix["cat"]] * 3, [ix["the"], ix["key"], ix["mentioned"], ix["above"]] * 3]
    )
    cfg = GuardConfig()
    with h2o_lens.h2o(model, H2OConfig(heavy=2, recent=2)), guarded(cfg) as g, torch.no_grad():
        cues = g.cues(tokenizer, ids)
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, logits_processor=[cues])
    rows = g.last.risk_rows()
    first = {r["request"]: r for r in rows if r["step"] == ids.shape[1] - 1}
    assert first[0]["refer"] == 0.0 and first[1]["refer"] == 1.0
    for r in (0, 1):
        z = cfg.bias + sum(w * first[r][name] for w, name in zip(cfg.weights, SIGNALS))
        assert first[r]["risk"] == pytest.approx(1 / (1 + math.exp(-z)), rel=1e-5)
    assert [r["refer"] for r in rows if r["request"] == 1 and r["step"] >= ids.shape[1]] == [1.0, 1.0]
