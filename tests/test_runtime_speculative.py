"""Speculative and assisted decoding under H2O (DESIGN.md §14).

A verification forward is processed as plain decode steps and a rejected draft is
taken back exactly: the tokens and every layer's and KV set's kept sets equal plain
greedy decoding under H2O (the FP64 reference on the accepted sequence), in both
modes, with an assistant that is mostly wrong; the injected fault (tests/faulty.py) breaks that.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from faulty import faulty_layer, inject
from runtime_utils import KeptRecorder, assert_same_sets, capture_qk, reference_sets
from tiny import local_attention, tiny_model

import h2o_lens
from h2o_lens import H2OConfig, policies
from h2o_lens.cache import H2OCache, H2OCacheLayer
from h2o_lens.config import pin
from h2o_lens.errors import ConfigError, UnsupportedModelError

HEAVY, RECENT, NEW, PROMPT = 6, 2, 30, 12
FAMILIES = ("llama", "qwen2")


class SegmentKept(KeptRecorder):
    """Kept sets per layer and step of the steps that stood, and the segments seen."""

    def __init__(self):
        super().__init__()
        self.segments = defaultdict(list)  # layer -> [(proposed, accepted, undone events)]

    def on_segment(self, layer, ev):
        if ev.mode == "rollback" and ev.rolled_back:  # those steps were heard, then taken back
            del self.kept[layer][-ev.rolled_back :]
        self.segments[layer].append((ev.proposed, ev.accepted, len(ev.undone)))


def _model(family, seed=0):
    """The main model attends locally (its kept sets keep changing); a drafter stays random."""
    model = tiny_model(family, layers=2, q_heads=4, kv_heads=2, seed=seed).double()
    model.generation_config.eos_token_id = None  # the full NEW tokens, no early stop
    return local_attention(model) if seed == 0 else model


def _prompt(n=PROMPT, seed=0, repeat=False):
    g = torch.Generator().manual_seed(seed)
    if not repeat:
        return torch.randint(3, 256, (1, n), generator=g)
    base = torch.randint(3, 256, (n // 3,), generator=g)
    return torch.cat([base, base, base])[None]  # prompt lookup finds its n-grams


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kw)


def _drafts(family):
    """An assistant that is nearly always wrong, and prompt lookup on a repeating prompt."""
    return {
        "assistant": (dict(assistant_model=_model(family, seed=7)), False),
        "lookup": (dict(prompt_lookup_num_tokens=4), True),  # hits now and then, mostly wrong
    }


def _plain(model, ids):
    rec = KeptRecorder()
    with h2o_lens.h2o(model, heavy=HEAVY, recent=RECENT, listener=rec) as s, capture_qk() as qk:
        out = _generate(model, ids)
    return out, rec, qk, s.last_cache


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["rollback", "defer"])
@pytest.mark.parametrize("draft", ["assistant", "lookup"])
def test_speculative_equals_plain_greedy(family, mode, draft):
    model = _model(family)
    kwargs, repeat = _drafts(family)[draft]
    ids = _prompt(repeat=repeat)
    plain, plain_rec, qk, plain_cache = _plain(model, ids)
    rec = SegmentKept()
    with h2o_lens.h2o(model, heavy=HEAVY, recent=RECENT, listener=rec, speculative=mode) as s:
        out = _generate(model, ids, **kwargs)
    assert torch.equal(out, plain), "speculative decoding changed the tokens"
    segs = rec.segments[0]
    assert sum(p - a for p, a, _ in segs) >= (8 if draft == "assistant" else 1), f"too few rejections: {segs}"
    for layer in range(2):
        assert rec.segments[layer] == segs  # every layer saw the same segments
        reference = reference_sets(qk[layer], 0, ids.shape[1], HEAVY, RECENT, "sum")
        assert_same_sets([st[0] for st in plain_rec.kept[layer]], reference, f"plain layer {layer}")
        assert_same_sets([st[0] for st in rec.kept[layer]], reference, f"{mode} {draft} layer {layer}")
        # the slots themselves, not only the sets: the same layout and the same scores
        a, b = s.last_cache.layers[layer], plain_cache.layers[layer]
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(a.scores, b.scores, rtol=1e-12, atol=1e-12)
        assert a.seen == b.seen and torch.equal(a.next_pos, b.next_pos)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rollback", "defer"])
def test_fault_scores_not_rolled_back_changes_kept_sets(mode):
    """The broken variant keeps rejected attention in the scores: the comparison with plain greedy fails."""
    model = _model("llama")
    ids = _prompt()
    plain, plain_rec, _, _ = _plain(model, ids)
    rec = SegmentKept()
    with inject("scores_not_rolled_back"):
        with h2o_lens.h2o(model, heavy=HEAVY, recent=RECENT, listener=rec, speculative=mode):
            _generate(model, ids, assistant_model=_model("llama", seed=7))
    differs = [rec.kept[layer] != plain_rec.kept[layer] for layer in range(2)]
    assert any(differs), "the injected fault went unnoticed by the kept-set comparison"


# -- the cache alone: a segment then crop equals the accepted steps, bit for bit ------------------


def _cache(config, mode, hq=4, hkv=2, layers=1, layer_class=None):
    text = types.SimpleNamespace(num_hidden_layers=layers, num_attention_heads=hq, num_key_value_heads=hkv)
    return H2OCache(config, text, speculative=mode, layer_class=layer_class)


def _prefill(layer, q, k, v, valid=None):
    layer.update(k, v, kwargs={})
    layer.prefill(q, valid, 0.25)


def _state(layer):
    names = ("keys", "values", "scores", "positions", "history", "fill", "next_pos")
    return {n: getattr(layer, n) for n in names} | {"seen": layer.seen}


def _assert_same_state(a, b, where):
    for name, x in a.items():
        y = b[name]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            assert torch.equal(x, y), f"{where}: {name} differs"
        else:
            assert x == y or (x is None and y is None), f"{where}: {name} {x} vs {y}"


@pytest.mark.parametrize("mode", ["rollback", "defer"])
@pytest.mark.parametrize(
    "config",
    [
        H2OConfig(heavy=4, recent=2),
        H2OConfig(heavy=4, recent=2, gqa="max"),
        H2OConfig(heavy=6, recent=0),  # heavy-only: the new token may be its own victim
        H2OConfig(heavy=3, recent=3, policy="scissorhands"),  # keeps a per-slot history
        H2OConfig(heavy=3, recent=3, policy="tova"),
        H2OConfig(ratio=0.5),  # two prompt lengths, two budgets: the per-budget step
        pin(H2OConfig(heavy=4, recent=2), (1, 4)),  # pins, step by step
        pin(H2OConfig(heavy=1, recent=6), (0,)),  # pins, a full cache: the segment at once
    ],
    ids=["h2o", "h2o-max", "heavy-only", "scissorhands", "tova", "two-budgets", "pinned", "pinned-at-once"],
)
def test_crop_restores_the_state_after_the_accepted_tokens(mode, config):
    torch.manual_seed(0)
    b, p, m, d = 2, 10, 6, 8
    valid = torch.ones(b, p, dtype=torch.bool)
    valid[1, :3] = False  # request 1 is shorter (left padding)
    q, k, v = torch.randn(b, 4, p + m, d) * 2, torch.randn(b, 2, p + m, d) * 2, torch.randn(b, 2, p + m, d)
    assert policies.get(config.policy).evicts
    for rolled_back in (0, 2, m):
        spec, plain = _cache(config, mode), _cache(config, mode)
        _prefill(spec.layers[0], q[:, :, :p], k[:, :, :p], v[:, :, :p], valid)
        _prefill(plain.layers[0], q[:, :, :p], k[:, :, :p], v[:, :, :p], valid)
        layer = spec.layers[0]
        layer.update(k[:, :, p:], v[:, :, p:], kwargs={})
        out = layer.decode_segment(q[:, :, p:], 0.25)
        spec.crop(-rolled_back)
        for t in range(p, p + m - rolled_back):
            plain.layers[0].update(k[:, :, t : t + 1], v[:, :, t : t + 1], kwargs={})
            ref = plain.layers[0].decode(q[:, :, t : t + 1], 0.25)
            assert torch.equal(out[:, t - p : t - p + 1], ref), f"output of token {t}"
        _assert_same_state(_state(layer), _state(plain.layers[0]), f"{mode}, {rolled_back} taken back")
        assert layer.segment is None


def test_fault_leaves_the_scores_of_a_rolled_back_segment():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 14, 8) * 2, torch.randn(1, 2, 14, 8) * 2, torch.randn(1, 2, 14, 8)
    config = H2OConfig(heavy=4, recent=2)
    states = []
    for broken in (False, True):
        cache = _cache(config, "rollback", layer_class=faulty_layer("scores_not_rolled_back") if broken else None)
        layer = cache.layers[0]
        _prefill(layer, q[:, :, :10], k[:, :, :10], v[:, :, :10])
        before = layer.scores.clone()
        layer.update(k[:, :, 10:], v[:, :, 10:], kwargs={})
        layer.decode_segment(q[:, :, 10:], 0.25)
        cache.crop(-4)
        states.append(layer.scores)
    assert torch.equal(states[0], before)
    assert not torch.equal(states[1], before)


class _Watched(H2OCacheLayer):
    """Notes every field of the layer that code of h2o_lens/speculative.py assigns directly."""

    by_segment: list[str] = []

    def __setattr__(self, name, value):
        if Path(sys._getframe(1).f_code.co_filename).name == "speculative.py":
            self.by_segment.append(name)
        super().__setattr__(name, value)


@pytest.mark.parametrize("mode", ["rollback", "defer"])
@pytest.mark.parametrize("recent", [2, 6], ids=["step-by-step", "at-once"])
def test_the_segment_changes_the_layer_only_through_its_interface(mode, recent):
    """The layer is a :class:`~h2o_lens.speculative.SegmentLayer`, and a segment and its crop
    (step by step, or at once) set none of its fields: they go through its verbs."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 16, 8) * 2, torch.randn(1, 2, 16, 8) * 2, torch.randn(1, 2, 16, 8)
    _Watched.by_segment = []
    cache = _cache(H2OConfig(heavy=4, recent=recent), mode, layer_class=_Watched)
    layer = cache.layers[0]
    assert isinstance(layer, h2o_lens.speculative.SegmentLayer)
    _prefill(layer, q[:, :, :10], k[:, :, :10], v[:, :, :10])
    for lo, hi, back in ((10, 14, 2), (12, 16, 0)):
        layer.update(k[:, :, lo:hi], v[:, :, lo:hi], kwargs={})
        layer.decode_segment(q[:, :, lo:hi], 0.25)
        assert (layer.segment.batch is not None) == (recent == 6)
        cache.crop(-back)
    assert _Watched.by_segment == []
    with pytest.raises(KeyError, match="not row state"):
        layer.load_state({"seen": 3})


@pytest.mark.parametrize("mode", ["rollback", "defer"])
def test_the_rollback_journal_is_an_extension_of_the_cache(mode):
    """A step-by-step ``rollback`` segment journals through the cache's extension point: one
    :class:`~h2o_lens.speculative.Journal` is attached at the first segment and kept, it holds
    nothing once the segment closes, and the decode step takes no journal flag of its own;
    ``defer`` attaches none."""
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 18, 8) * 2, torch.randn(1, 2, 18, 8) * 2, torch.randn(1, 2, 18, 8)
    cache = _cache(H2OConfig(heavy=4, recent=2), mode)
    layer = cache.layers[0]
    assert cache.extensions == ()
    _prefill(layer, q[:, :, :10], k[:, :, :10], v[:, :, :10])
    for lo, hi, back in ((10, 14, 2), (12, 16, 1), (15, 18, 3)):
        layer.update(k[:, :, lo:hi], v[:, :, lo:hi], kwargs={})
        layer.decode_segment(q[:, :, lo:hi], 0.25)
        journals = [ext for ext in cache.extensions if isinstance(ext, h2o_lens.speculative.Journal)]
        assert len(journals) == (mode == "rollback") == len(cache.extensions)
        if journals:
            assert len(journals[0]._open[0]) == hi - lo  # one entry per step, from the step events
        cache.crop(-back)
        assert all(not j._open and not j._before for j in journals)
    assert "journal" not in inspect.signature(H2OCacheLayer.decode_once).parameters


def test_crop_errors_say_what_can_be_taken_back():
    cache = _cache(H2OConfig(heavy=4, recent=2), "rollback")
    layer = cache.layers[0]
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    _prefill(layer, q[:, :, :10], k[:, :, :10], v[:, :, :10])
    cache.crop(0)  # nothing open: confirming nothing is fine
    with pytest.raises(UnsupportedModelError, match="no open verification segment"):
        cache.crop(-1)
    from h2o_lens import compat

    # crop(length) is a count of tokens to keep on releases to 5.14 (5 of the 10 seen: remove 5)
    said = "negative count" if compat.crop_count(5, 10) is None else "no open verification segment"
    with pytest.raises(UnsupportedModelError, match=said):
        cache.crop(5)
    layer.update(k[:, :, 10:], v[:, :, 10:], kwargs={})
    layer.decode_segment(q[:, :, 10:], 0.25)
    with pytest.raises(UnsupportedModelError, match="holds 2"):
        cache.crop(-3)
    assert layer.segment is not None and layer.seen == 12  # a refused crop changes nothing
    cache.crop(-2)
    assert layer.segment is None and layer.seen == 10 and int(layer.next_pos) == 10
    with pytest.raises(ConfigError, match="unknown speculative mode"):
        _cache(H2OConfig(heavy=4, recent=2), "later")


# -- recorded: only what stood in evictions, the rest in the segments log -------------------------


def _recorded(model, root, run_id, mode="rollback", recent=RECENT, **kw):
    from recorders import record

    widths = []
    hook = model.register_forward_pre_hook(lambda m, a, k: widths.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        with record(model, heavy=HEAVY, recent=recent, out=str(root), run_id=run_id, speculative=mode, fsync=False):
            out = _generate(model, _prompt(), **kw)
    finally:
        hook.remove()
    return out, widths


def _rows(con, sql, run_id):
    return con.execute(sql, [run_id]).fetchall()


@pytest.mark.slow
@pytest.mark.parametrize("recent", [RECENT, 4], ids=["step-by-step", "at-once"])
def test_recorder_logs_only_what_stood_and_the_segments(tmp_path, recent, monkeypatch):
    """With a recent window of 4 the segments of 4 tokens are verified at once (DESIGN.md §14.1),
    with 2 step by step; either way the log is plain greedy's."""
    from recorders.replay import replay
    from runlog import open_runs

    at_once = []
    run_batched = h2o_lens.speculative.run_batched
    monkeypatch.setattr(
        h2o_lens.speculative, "run_batched", lambda *a: at_once.append(a[2].shape[2]) or run_batched(*a)
    )
    model = _model("llama")
    drafter = _model("llama", seed=7)
    drafter.generation_config.num_assistant_tokens = 3
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0  # always the 3 tokens
    plain, _ = _recorded(model, tmp_path, "plain", recent=recent)
    runs = {
        mode: _recorded(model, tmp_path, mode, mode, recent=recent, assistant_model=drafter)
        for mode in ("rollback", "defer")
    }
    assert max(at_once, default=0) <= recent and (recent < 4 or 4 in at_once), at_once  # those that fit the window
    con = open_runs(tmp_path)
    for table, cols in (
        ("evictions", "step, layer, kv_head, position, score, margin, phase"),
        ("steps", "step, layer, kv_head, min_heavy_score, promoted, exiting_position, kept"),
        ("run_logits", "step, token_id, top1_id"),
        ("tokens", "position, token_id, is_prompt"),
    ):
        sql = f"SELECT {cols} FROM {table} WHERE run_id = ? ORDER BY ALL"
        expected = _rows(con, sql, "plain")
        assert expected, table
        for mode in runs:
            assert _rows(con, sql, mode) == expected, f"{mode}: {table} differs from plain greedy"
    new = plain.shape[1] - PROMPT
    for mode, (out, widths) in runs.items():
        assert torch.equal(out, plain)
        fed = widths[0] - PROMPT + sum(widths[1:])  # tokens fed after the prompt
        in_segments = max(widths[0] - PROMPT, 0) + sum(w for w in widths[1:] if w > 1)
        seg = con.execute(
            "SELECT sum(proposed), sum(accepted), sum(rolled_back), sum(undone_evictions), count(*), "
            "bool_and(rolled_back = proposed - accepted), bool_and(mode = ?) FROM spec_segments WHERE run_id = ?",
            [mode, mode],
        ).fetchone()
        proposed, accepted, rolled_back, undone, count, consistent, same_mode = seg
        assert proposed == in_segments and rolled_back == fed - (new - 1), (mode, seg, widths)
        assert consistent and same_mode and count == sum(1 for w in widths[1:] if w > 1) + (widths[0] > PROMPT)
        assert rolled_back >= 10, "the drafter should be wrong often"
        assert undone == con.execute("SELECT count(*) FROM spec_undone WHERE run_id = ?", [mode]).fetchone()[0]
        assert undone > 0
    # both modes undo the same evictions
    sql = "SELECT segment, step, layer, kv_head, position, score FROM spec_undone WHERE run_id = ? ORDER BY ALL"
    assert _rows(con, sql, "rollback") == _rows(con, sql, "defer")
    # replay reads the speculative run as it reads plain greedy
    got = replay(tmp_path / "rollback", model=model, progress=False)
    ref = replay(tmp_path / "plain", model=model, progress=False)
    assert got.implementation_ok and got.max_logit_diff == ref.max_logit_diff and got.steps == ref.steps == new


def test_spec_views_exist_over_runs_written_before_them():
    from runlog import open_runs

    con = open_runs(Path(__file__).resolve().parents[1] / "sample_runs")
    assert con.execute("SELECT count(*) FROM spec_segments").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM spec_undone").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM evictions").fetchone()[0] > 0


@pytest.mark.model
def test_default_model_prompt_lookup_equals_plain_greedy(default_model):
    """The packaged model in float32: prompt lookup under H2O against the plain path on the same prompt."""
    model, tok = default_model
    text = "Copy this text exactly: the red fox jumps over the lazy dog by the river bank. " * 3
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tok(chat, return_tensors="pt", add_special_tokens=False)["input_ids"]
    config = H2OConfig(heavy=16, recent=16)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
    plain_rec = KeptRecorder()
    with torch.no_grad(), h2o_lens.h2o(model, config, listener=plain_rec):
        plain = model.generate(ids, **kw)
    for mode in ("rollback", "defer"):
        rec = SegmentKept()
        with torch.no_grad(), h2o_lens.h2o(model, config, listener=rec, speculative=mode):
            out = model.generate(ids, prompt_lookup_num_tokens=6, **kw)
        assert torch.equal(out, plain), mode
        segs = rec.segments[0]
        assert sum(a for _, a, _ in segs) >= 8 and sum(p - a for p, a, _ in segs) >= 1, segs  # hits and misses
        for layer in range(model.config.num_hidden_layers):
            assert rec.kept[layer] == plain_rec.kept[layer], f"{mode}, layer {layer}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rollback", "defer"])
def test_lifecycle_check_passes_speculative_runs_and_catches_the_fault(tmp_path, mode):
    """The state lifecycle check (DESIGN.md §15.1) on speculative runs: exact when the rollback is
    right, a lifecycle error when the scores are not rolled back."""
    import analyses
    from recorders.lifecycle import check_lifecycle

    model = _model("llama")
    drafter = _model("llama", seed=7)
    good, _ = _recorded(model, tmp_path, "good", mode, assistant_model=drafter)
    with inject("scores_not_rolled_back"):
        bad, _ = _recorded(model, tmp_path, "bad", mode, assistant_model=drafter)
    assert check_lifecycle(tmp_path / "good", model, tolerance=0.0).ok
    result = check_lifecycle(tmp_path / "bad", model)
    assert not result.ok, "the lifecycle check missed scores that were not rolled back"
    (failed,) = result.failed
    assert failed.first_bad_step is not None and failed.first_bad_step >= PROMPT
    data = analyses.report_data(tmp_path, "bad")  # the report shows it too
    assert data["lifecycle"]["ok"] is False
    assert {c["name"]: c["status"] for c in data["verdict"]["checks"]}["lifecycle_errors"] == "fail"
