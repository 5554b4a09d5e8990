"""Recording kvpress's per-head and chunk presses (DESIGN.md §17.1): AdaKV, CriticalAdaKV and
DuoAttention mask keys of single KV heads inside a whole cache; ChunkKV and BlockPress keep columns
by their own rule. The checks are independent of the recorder's own:

- a masking press: the mask it left on each attention module (``masked_key_indices``, what
  kvpress's attention patch reads at decode steps) must be, per request, layer and KV head, exactly
  the prompt positions the log lists as evicted, and every column it did not mask holds the key of a
  full-cache prefill, bit for bit;
- a gathering press: every key it left in the cache is matched, bit for bit, to a column of a
  full-cache prefill, and the positions so found are exactly those the log does not list as evicted.

kvpress 0.5.5 needs transformers < 5.3: these run in the 5.2 compatibility venv (``make compat``)
and skip where kvpress is not installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny import left_padded, tiny_model

import recorders
import runlog
from h2o_lens import presses
from h2o_lens.errors import ConfigError
from runlog.errors import RecorderError

pytestmark = pytest.mark.compat

LENGTHS = [24, 15, 20]


@pytest.fixture(scope="module")
def kv():
    return pytest.importorskip("kvpress")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", q_heads=4, kv_heads=2)  # sdpa: the masking presses refuse eager attention


def _snap(kv, ratio=0.5):
    return kv.SnapKVPress(compression_ratio=ratio, window_size=4, kernel_size=3)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _full_keys(model, ids, mask):
    """The full-cache prefill of the batch, positioned as generate positions a left-padded batch."""
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
    return [layer.keys for layer in out.past_key_values.layers]


def _evicted(ev, request: int, layer: int, head: int) -> set[int]:
    sel = ev[(ev.request == request) & (ev.layer == layer) & (ev.kv_head == head)]
    return set(sel.position.tolist())


def _generate(model, press, ids, mask, out, new=1):
    with recorders.record(model, press, out=out, fsync=False) as rec, torch.no_grad():
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0, return_dict_in_generate=True,
        )  # fmt: skip
    return rec, gen


#: a DuoAttention head pattern of the tiny model (2 layers × 2 KV heads): the two lowest scores,
#: layer 0 head 1 and layer 1 head 0, become streaming heads at head_compression_ratio 0.5
SCORES = [[0.9, 0.1], [0.2, 0.7]]
STREAMING = {(0, 1), (1, 0)}


def _pattern(folder, sink=2, recent=4, scores=SCORES):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"sink_size": sink, "recent_size": recent}))
    (folder / "full_attention_heads.tsv").write_text("\n".join("\t".join(map(str, row)) for row in scores) + "\n")
    return str(folder)


def _masking(kv, name, tmp_path):
    from recorders.press import build_press

    return {
        "adakv": lambda: kv.AdaKVPress(_snap(kv)),
        "adakv_knorm": lambda: kv.AdaKVPress(kv.KnormPress(compression_ratio=0.6), alpha_safeguard=0.1),
        "criticaladakv": lambda: kv.CriticalAdaKVPress(_snap(kv)),
        "duo_attention": lambda: build_press(
            presses.PressSpec(
                "DuoAttentionPress", (("head_compression_ratio", 0.5), ("pattern", _pattern(tmp_path / "pattern")))
            )
        ),
    }[name]()


@pytest.mark.parametrize(
    ("name", "lengths"),
    [("adakv", LENGTHS), ("adakv_knorm", LENGTHS), ("criticaladakv", [24]), ("duo_attention", LENGTHS)],
)
def test_a_masking_press_logs_the_mask_it_left_per_kv_head(kv, model, name, lengths, tmp_path):
    # CriticalAdaKV sums its head budgets over the batch (kvpress 0.5.5), so it runs one prompt per call
    press = _masking(kv, name, tmp_path)
    ids, mask = left_padded(lengths, seed=3)
    rec, out = _generate(model, press, ids, mask, tmp_path)
    run = runlog.load_run(rec.run_dir)
    assert run.manifest["status"] == "complete"
    ev, steps = run["evictions"].to_pandas(), run["steps"].to_pandas()
    assert set(ev.phase) == {"prefill"} and ev.score.notna().all() == (name != "duo_attention")
    # the masks kvpress's attention patch applies at decode (a later prefill clears them)
    masks = [a.self_attn.masked_key_indices for a in model.model.layers]
    assert all(m is not None for m in masks)
    with torch.no_grad():  # the same generate without the press: the cache it would leave whole
        plain = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True,
        ).past_key_values  # fmt: skip
    full = [layer.keys for layer in plain.layers]
    starts = (mask == 0).sum(-1).tolist()
    for layer_no in range(len(full)):
        masked = torch.zeros(full[layer_no].shape[:3], dtype=torch.bool)
        masked[masks[layer_no]] = True
        cache = out.past_key_values.layers[layer_no].keys
        for r in range(len(lengths)):
            for h in range(masked.shape[1]):
                gone = set((masked[r, h, starts[r] :].nonzero()[:, 0]).tolist())
                assert _evicted(ev, r, layer_no, h) == gone, (layer_no, r, h)
                held = ~masked[r, h]
                assert torch.equal(_bits(cache[r, h][held]), _bits(full[layer_no][r, h][held]))
    kept = steps.set_index(["request", "layer", "kv_head"]).kept
    for (r, layer_no, h), k in kept.items():
        assert k == lengths[r] - len(_evicted(ev, r, layer_no, h))
    unpadded = steps[steps.request == 0].groupby("layer").kept
    assert unpadded.nunique().max() > 1, "the budgets differ by head"
    if name == "duo_attention":  # a streaming head keeps its 2 sink and 4 recent columns, the others all
        for (r, layer_no, h), k in kept.items():
            assert (k < lengths[r]) == ((layer_no, h) in STREAMING)
        assert set(unpadded.min()) == {6}
    else:  # AdaKV's total per layer is the press's count, int(P · (1 - c)) per head
        assert (unpadded.sum() == 2 * int(lengths[0] * 0.5 if name != "adakv_knorm" else lengths[0] * 0.4)).all()


@pytest.mark.parametrize("name", ["adakv", "criticaladakv", "duo_attention"])
def test_a_masking_press_run_replays_within_the_implementation_check(kv, model, name, tmp_path):
    from recorders.replay import replay

    ids, _ = left_padded([30], seed=5)
    rec, _out = _generate(model, _masking(kv, name, tmp_path), ids, torch.ones_like(ids), tmp_path / "runs", new=8)
    summary = replay(rec.run_dir, model=model, progress=False)
    assert summary.implementation_ok and summary.max_logit_diff <= summary.tolerance, summary
    assert summary.mean_dropped_mass > 0
    con = runlog.open_runs(tmp_path / "runs")
    sizes = con.sql("SELECT count(DISTINCT kept) FROM steps GROUP BY layer").fetchall()
    assert max(n for (n,) in sizes) > 1


def _gathering(kv, name):
    return {
        "chunkkv": lambda: kv.ChunkKVPress(_snap(kv), chunk_length=4),
        "chunkkv_short": lambda: kv.ChunkKVPress(kv.KnormPress(compression_ratio=0.5), chunk_length=32),
        "block": lambda: kv.BlockPress(_snap(kv), block_size=5),
        "block_knorm": lambda: kv.BlockPress(kv.KnormPress(compression_ratio=0.4), block_size=3),
    }[name]()


def _kept_in_cache(cache_keys: torch.Tensor, full: torch.Tensor, start: int) -> set[int]:
    eq = (_bits(cache_keys)[:, None, :] == _bits(full)[None, start:, :]).all(-1)  # (k, n)
    assert bool((eq.sum(-1) <= 1).all()) and bool((eq.sum(0) <= 1).all()), "keys match one to one"
    return set(eq.any(0).nonzero()[:, 0].tolist())


@pytest.mark.parametrize("name", ["chunkkv", "chunkkv_short", "block", "block_knorm"])
def test_a_chunk_or_block_press_logs_the_columns_it_left(kv, model, name, tmp_path):
    ids, mask = left_padded(LENGTHS, seed=3)
    rec, out = _generate(model, _gathering(kv, name), ids, mask, tmp_path)
    run = runlog.load_run(rec.run_dir)
    assert run.manifest["status"] == "complete"
    ev = run["evictions"].to_pandas()
    full = _full_keys(model, ids, mask)
    starts = (mask == 0).sum(-1).tolist()
    evicted = 0
    for layer_no, layer_cache in enumerate(out.past_key_values.layers):
        for r, n in enumerate(LENGTHS):
            for h in range(layer_cache.keys.shape[1]):
                kept = _kept_in_cache(layer_cache.keys[r, h], full[layer_no][r, h], starts[r])
                gone = _evicted(ev, r, layer_no, h)
                assert kept.isdisjoint(gone) and kept | gone == set(range(n)), (layer_no, r, h)
                evicted += len(gone)
    assert evicted > 0


@pytest.mark.parametrize("name", ["chunkkv", "block"])
def test_a_chunk_or_block_press_run_replays_within_the_implementation_check(kv, model, name, tmp_path):
    from recorders.replay import replay

    ids, _ = left_padded([30], seed=5)
    rec, _out = _generate(model, _gathering(kv, name), ids, torch.ones_like(ids), tmp_path, new=8)
    summary = replay(rec.run_dir, model=model, progress=False)
    assert summary.implementation_ok and summary.max_logit_diff <= summary.tolerance, summary
    assert summary.mean_dropped_mass > 0


def test_a_gathering_press_leaving_keys_that_are_not_original_fails_loudly(kv, model, tmp_path):
    class NudgedChunkKV(kv.ChunkKVPress):
        """ChunkKV that leaves one key changed in its last bit."""

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            keys, values = super().compress(module, hidden_states, keys, values, attentions, kwargs)
            keys = keys.clone()
            keys.view(torch.int32)[0, 0, 0, 0] ^= 1
            return keys, values

    press = NudgedChunkKV(_snap(kv), chunk_length=4)
    ids, mask = left_padded([16], seed=4)
    with pytest.raises(RecorderError, match="NudgedChunkKV at layer 0.*not original columns"):
        _generate(model, press, ids, mask, tmp_path)
    (run_dir,) = tmp_path.iterdir()
    assert runlog.read_manifest(run_dir)["status"] == "failed"


# -- sweep names and specs ------------------------------------------------------------------------


def test_the_sweep_builds_a_wrapper_around_snapkv_or_the_scorer_it_names(kv):
    spec = presses.sweep_spec("kvpress:adakv", 0.25)
    assert spec.to_dict() == {
        "press": "AdaKVPress",
        "params": {"press": {"press": "SnapKVPress", "params": {"compression_ratio": 0.75}}},
    }
    assert spec.compression_ratio == 0.75
    assert spec.with_ratio(0.5).compression_ratio == 0.5
    spec = presses.sweep_spec("kvpress:block(press=knorm, block_size=16)", 0.5)
    assert spec.kwargs["block_size"] == 16 and spec.kwargs["press"]["press"] == "KnormPress"
    spec = presses.sweep_spec("kvpress:chunkkv(window_size=8)", 0.5)
    assert spec.kwargs["press"]["params"] == {"window_size": 8, "compression_ratio": 0.5}
    assert "press" in presses.check_args("CriticalAdaKVPress", {"press": "knorm"})
    from recorders.press import build_press

    built = build_press(presses.sweep_spec("kvpress:criticaladakv", 0.4))
    assert isinstance(built, kv.CriticalAdaKVPress) and isinstance(built.press, kv.SnapKVPress)
    assert built.compression_ratio == pytest.approx(0.6)
    import analyses

    colours = [p.colour for p in presses.SUPPORTED] + list(analyses.policy_colours().values())
    assert len(set(colours)) == len(colours), "every press and policy has a colour of its own"
    for name in ("adakv", "criticaladakv", "chunkkv", "block", "duo_attention", "dms"):
        assert presses.find(name) is not None and presses.short_name(presses.find(name).cls) == name


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({"press": "composed"}, "short name of a scorer press"),
        ({"press": "knorm", "window_size": 8}, "KnormPress takes no window_size"),
    ],
)
def test_a_wrapper_with_a_bad_scorer_is_refused(kv, args, why):
    with pytest.raises(ConfigError, match=why):
        presses.check_args("AdaKVPress", args)


def test_a_masking_press_keeps_its_total_in_budgets_that_differ_by_head(kv, model, tmp_path):
    """The steps of a masking run hold unequal kept counts that sum, per layer, to the press's total."""
    ids, _ = left_padded([40], seed=6)
    press = kv.AdaKVPress(kv.KnormPress(compression_ratio=0.75))
    rec, _out = _generate(model, press, ids, torch.ones_like(ids), tmp_path)
    steps = runlog.load_run(rec.run_dir)["steps"].to_pandas()
    assert np.array_equal(steps.groupby("layer").kept.sum().to_numpy(), [2 * 10, 2 * 10])
    assert steps.kept.nunique() > 1


def test_duo_attention_reads_its_local_pattern_names_it_and_sweeps_its_head_share(kv, model, tmp_path):
    from recorders.press import build_press, read_duo_pattern

    folder = _pattern(tmp_path / "pattern")
    spec = presses.sweep_spec(f"kvpress:duo_attention(pattern={folder})", 0.5)
    assert spec.kwargs == {"pattern": folder, "head_compression_ratio": 0.5} and spec.compression_ratio == 0.5
    press = build_press(spec)
    assert isinstance(press, kv.DuoAttentionPress) and type(press).__name__ == "DuoAttentionPress"
    ids, _ = left_padded([20], seed=2)
    rec, _out = _generate(model, press, ids, torch.ones_like(ids), tmp_path / "runs")
    manifest = runlog.load_run(rec.run_dir).manifest
    assert manifest["policy"] == (
        f"kvpress:DuoAttentionPress(head_compression_ratio=0.5, on_the_fly_scoring=False, pattern={folder!r})"
    )
    assert manifest["keep_ratio"] == pytest.approx(0.5)
    assert build_press(presses.PressSpec.from_dict(manifest["config"]["press"])).pattern == folder
    with pytest.raises(ConfigError, match="2 layers × 2 KV heads"):
        read_duo_pattern(_pattern(tmp_path / "wrong", scores=[[0.5, 0.5, 0.5]]), model)
    with pytest.raises(ConfigError, match="config.json"):
        read_duo_pattern(tmp_path / "missing")


def test_dms_logs_its_masks_at_prefill_and_decode_and_a_padded_batch_replays(kv, model, tmp_path):
    """DMS masks, once they leave its sliding window, the positions its scorer puts under the
    threshold, at the prompt's forward and at decode steps; the cache stays whole, so a left-padded
    batch decodes over the positions the press kept (no column shift, unlike a compressing press)."""
    from recorders.replay import replay

    lengths = [30, 22]
    ids, mask = left_padded(lengths, seed=5)
    press = kv.DMSPress(kv.KnormPress(), threshold=-2.5, sliding_window_size=8, decoding=True)
    rec, _out = _generate(model, press, ids, mask, tmp_path, new=10)
    masks = [a.self_attn.masked_key_indices for a in model.model.layers]
    run = runlog.load_run(rec.run_dir)
    ev = run["evictions"].to_pandas()
    assert set(ev.phase) == {"prefill", "decode"}
    starts = (mask == 0).sum(-1).tolist()
    for layer_no, (rows, heads, cols) in enumerate(masks):
        for r, start in enumerate(starts):
            for h in range(2):
                sel = (rows == r) & (heads == h) & (cols >= start)
                assert _evicted(ev, r, layer_no, h) == set((cols[sel] - start).tolist()), (layer_no, r, h)
    assert ((ev.step - ev.position) >= 8).all(), "a position leaves the window of 8 before it is masked"
    summary = replay(rec.run_dir, model=model, progress=False)
    assert summary.implementation_ok and summary.max_logit_diff <= summary.tolerance, summary
    assert summary.mean_dropped_mass > 0


# -- the default model ----------------------------------------------------------------------------

NOTES = (
    "Notes: the orange cable goes to port 7. The backup server is called Heron. The access code for the lab "
    "is 4419. Maria moved to the Lisbon office in May. Question: what is the access code for the lab? Answer:"
)


def _default_press(kv, name, model, tmp_path):
    from recorders.press import build_press

    if name == "duo_attention":
        layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
        scores = np.random.default_rng(0).random((layers, heads)).round(3).tolist()
        folder = _pattern(tmp_path / "pattern", sink=4, recent=8, scores=scores)
        return build_press(
            presses.PressSpec("DuoAttentionPress", (("head_compression_ratio", 0.5), ("pattern", folder)))
        )
    scorer = kv.SnapKVPress(compression_ratio=0.6, window_size=16)
    return {
        "adakv": lambda: kv.AdaKVPress(scorer),
        "criticaladakv": lambda: kv.CriticalAdaKVPress(scorer),
        "chunkkv": lambda: kv.ChunkKVPress(scorer, chunk_length=8),
        "block": lambda: kv.BlockPress(scorer, block_size=16),
    }[name]()


@pytest.mark.model
@pytest.mark.parametrize("name", ["adakv", "criticaladakv", "duo_attention", "chunkkv", "block"])
def test_default_model_kept_sets_are_the_masks_or_the_cache_the_press_left(kv, default_model, name, tmp_path):
    model, tok = default_model
    enc = tok([NOTES], return_tensors="pt")
    press = _default_press(kv, name, model, tmp_path)
    with recorders.record(model, press, out=tmp_path / "runs", tokenizer=tok, fsync=False) as rec, torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id, return_dict_in_generate=True
        )
    masks = [layer.self_attn.masked_key_indices for layer in model.model.layers]
    run = runlog.load_run(rec.run_dir)
    assert run.manifest["status"] == "complete"
    ev = run["evictions"].to_pandas()
    n = enc["input_ids"].shape[1]
    with torch.no_grad():
        plain = model.generate(
            **enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id, return_dict_in_generate=True
        ).past_key_values
    for layer_no in (0, len(masks) // 2, len(masks) - 1):
        full, cache = plain.layers[layer_no].keys, out.past_key_values.layers[layer_no].keys
        for h in range(full.shape[1]):
            if name in ("chunkkv", "block"):
                kept = _kept_in_cache(cache[0, h], full[0, h], 0)
                assert kept | _evicted(ev, 0, layer_no, h) == set(range(n)) and kept.isdisjoint(
                    _evicted(ev, 0, layer_no, h)
                )
            else:
                rows, heads, cols = masks[layer_no]
                assert _evicted(ev, 0, layer_no, h) == set(cols[(rows == 0) & (heads == h)].tolist()), (layer_no, h)
                assert torch.equal(_bits(cache), _bits(full)), "a masking press leaves the cache whole"
    assert len(ev) > 0


@pytest.mark.parametrize("name", ["adakv", "chunkkv"])
def test_explain_takes_a_wrapper_press_run_pins_its_evidence_and_searches_its_scorer_ratio(kv, name, tmp_path):
    from test_recorders_press import _CharTokenizer

    from recorders.counterfactual import explain_request, press_ratio

    model = tiny_model("llama", q_heads=4, kv_heads=2)
    tok = _CharTokenizer()
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    text = tok.decode(ids[0].tolist())
    scorer = kv.SnapKVPress(compression_ratio=0.8, window_size=4)
    press = kv.AdaKVPress(scorer) if name == "adakv" else kv.ChunkKVPress(scorer, chunk_length=2)
    info = {"decoding": {"do_sample": False, "max_new_tokens": 8}}
    evidence = {"fact": text[12:16]}
    with recorders.record(model, press, out=tmp_path, tokenizer=tok, evidence=evidence, info=info) as rec:
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ex = explain_request(model, tok, rec.run_dir, 0, resolution=0.1)
    assert ex.slots == int(40 * (1 - 0.8))
    pinned, budget = ex.outcomes["pinned"], ex.outcomes["policy_budget"]
    assert pinned.ran and budget.ran, (pinned, budget)
    run = runlog.load_run(tmp_path / pinned.run_id)
    assert run.manifest["config"]["pinned"] == [12, 13, 14, 15]
    assert not run["evictions"].to_pandas().position.isin([12, 13, 14, 15]).any()
    bis = budget.bisection
    assert bis.min_slots is not None and bis.min_slots > ex.slots, bis
    ratio = press_ratio(bis.min_slots, 40)  # the scorer's ratio: the wrapper has none of its own
    policy = runlog.load_run(tmp_path / budget.run_id).manifest["policy"]
    assert policy.startswith(f"kvpress:{type(press).__name__}(press=SnapKVPress(compression_ratio={round(ratio, 12)}")


def test_the_speed_bench_times_a_wrapper_around_its_scorer(kv, model, capsys):
    from commands.benchmarks.press import bench_press

    timed = (("AdaKVPress", {"window_size": 8}), ("BlockPress", {"press": "knorm", "block_size": 16}))
    assert bench_press(contexts=(48,), new_tokens=2, rounds=2, model=model, timed=timed) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prompt")]
    assert [r.split()[2] for r in rows] == ["kvpress:AdaKVPress", "kvpress:BlockPress"]


def test_the_speed_bench_times_a_threshold_press(kv, model, capsys):
    """DMSPress keeps what its scorer puts above its threshold (no compression ratio builds it):
    the bench builds it from its own arguments, and refuses it without a threshold in one line."""
    from commands.benchmarks.press import _timed_policy, bench_press
    from h2o_lens import presses
    from h2o_lens.errors import ConfigError

    timed = (_timed_policy(presses, "kvpress:dms(threshold=0.5, press=random, decoding=True, sliding_window_size=8)"),)
    assert timed[0][0] == "DMSPress"
    assert bench_press(contexts=(48,), new_tokens=2, rounds=2, model=model, timed=timed) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prompt")]
    assert (
        len(rows) == 1 and "kvpress:dms(decoding=True, press='random', sliding_window_size=8, threshold=0.5)" in rows[0]
    )
    assert "ratio" in rows[0]
    with pytest.raises(ConfigError, match="threshold"):
        _timed_policy(presses, "kvpress:dms(press=random)")
    with pytest.raises(ConfigError, match="threshold must be a finite number, got 'abc'"):
        _timed_policy(presses, "kvpress:dms(threshold=abc)")
    with pytest.raises(ConfigError, match="compression ratio"):  # the sweep still refuses it
        presses.parse_sweep_policy("kvpress:dms(threshold=0.5)")
