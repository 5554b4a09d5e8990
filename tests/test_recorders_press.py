"""Recording kvpress presses (DESIGN.md §17): the logged kept sets are the cache the press left.

Each press runs on a tiny GQA model over a left-padded batch. The check is independent of the
recorder's own: every key the press left in the cache is matched, bit for bit, to a column of a
full-cache prefill of the same batch, and the positions so found must be exactly the prompt
positions the log does not list as evicted, per request, layer and KV head. kvpress 0.5.5 needs
transformers < 5.3, so these run in the 5.2 compatibility venv (``make compat``) and skip where
kvpress is not installed. ``explain`` on a failed SnapKV request (DESIGN.md §17.3) gets a verdict
from its re-runs on the tiny model (with the bisection) and on the default model.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch
from tiny import left_padded, tiny_model

import recorders
import runlog
from h2o_lens import presses
from h2o_lens.errors import ConfigError, MissingExtraError
from runlog.errors import RecorderError

pytestmark = pytest.mark.compat

LENGTHS = [24, 15, 20]


@pytest.fixture(scope="module")
def kv():
    return pytest.importorskip("kvpress")


@pytest.fixture(scope="module")
def model():
    # eager attention: the full-cache reference computes the same keys as every press's run
    return tiny_model("llama", q_heads=4, kv_heads=2, attn="eager")


def _presses(kv):
    return {
        "snapkv": kv.SnapKVPress(compression_ratio=0.5, window_size=4, kernel_size=3),
        "streaming_llm": kv.StreamingLLMPress(compression_ratio=0.4, n_sink=2),
        "tova": kv.TOVAPress(compression_ratio=0.5),
        "observed_attention": kv.ObservedAttentionPress(compression_ratio=0.6),
        "knorm": kv.KnormPress(compression_ratio=0.3),
        "pyramidkv": kv.PyramidKVPress(compression_ratio=0.5, window_size=4, kernel_size=3),
        "composed": kv.ComposedPress(
            [kv.StreamingLLMPress(compression_ratio=0.25, n_sink=2), kv.KnormPress(compression_ratio=0.4)]
        ),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _full_keys(model, ids, mask):
    """The full-cache prefill of the batch, positioned as generate positions a left-padded batch."""
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
    return [layer.keys for layer in out.past_key_values.layers]


def _kept_in_cache(cache_keys: torch.Tensor, full: torch.Tensor, start: int) -> set[int]:
    """The prompt positions whose full keys the cache holds, ``(k, d)`` against ``(W, d)`` (padding
    columns are left out: their keys are of no position)."""
    eq = (_bits(cache_keys)[:, None, :] == _bits(full)[None, start:, :]).all(-1)  # (k, n)
    assert bool((eq.sum(-1) <= 1).all()) and bool((eq.sum(0) <= 1).all()), "keys match one to one"
    return set(eq.any(0).nonzero()[:, 0].tolist())


def _evicted(run, request: int, layer: int, head: int) -> set[int]:
    ev = run["evictions"].to_pandas()
    sel = ev[(ev.request == request) & (ev.layer == layer) & (ev.kv_head == head)]
    return set(sel.position.tolist())


@pytest.mark.parametrize(
    "name", ["snapkv", "streaming_llm", "tova", "observed_attention", "knorm", "pyramidkv", "composed"]
)
def test_kept_positions_are_the_keys_the_press_left(kv, model, name, tmp_path):
    press = _presses(kv)[name]
    ids, mask = left_padded(LENGTHS, seed=3)
    with recorders.record(model, press, out=tmp_path, fsync=False) as rec, torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True,
        )  # fmt: skip
    run = runlog.load_run(rec.run_dir)
    assert run.manifest["status"] == "complete"
    assert run.manifest["policy"] == presses.policy_text(type(press).__name__, recorders.press.press_spec(press).kwargs)
    full = _full_keys(model, ids, mask)
    starts = (mask == 0).sum(-1).tolist()
    evicted_any = 0
    for layer, layer_cache in enumerate(out.past_key_values.layers):
        for r, n in enumerate(LENGTHS):
            for h in range(layer_cache.keys.shape[1]):
                kept = _kept_in_cache(layer_cache.keys[r, h], full[layer][r, h], starts[r])
                evicted = _evicted(run, r, layer, h)
                assert kept.isdisjoint(evicted)
                assert kept | evicted == set(range(n)), (layer, r, h)
                evicted_any += len(evicted)
    assert evicted_any > 0, "the press pruned nothing"
    ev = run["evictions"].to_pandas()
    assert set(ev.phase) == {"prefill"}
    assert (ev.step == ev.request.map(lambda q: LENGTHS[q] - 1)).all()
    steps = run["steps"].to_pandas()
    assert len(steps) == len(LENGTHS) * 2 * 2  # one row per request, layer and KV head
    kept_counts = steps.set_index(["request", "layer", "kv_head"]).kept
    for (r, layer, h), kept in kept_counts.items():
        assert kept == LENGTHS[r] - len(_evicted(run, r, layer, h))
    if name != "composed":  # one score decided: every victim scored at most the lowest kept score
        assert (ev.margin >= 0).all() and ev.score.notna().all()


def test_a_press_spec_records_like_the_press_and_names_its_policy(kv, model, tmp_path):
    spec = presses.PressSpec("SnapKVPress", (("compression_ratio", 0.6), ("window_size", 4)))
    ids, mask = left_padded([20], seed=1)
    with recorders.record(model, spec, out=tmp_path, fsync=False) as rec, torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    con = runlog.open_runs(tmp_path)
    ((policy, keep, backend),) = con.sql("SELECT policy, keep_ratio, backend FROM runs").fetchall()
    assert policy == "kvpress:SnapKVPress(compression_ratio=0.6, window_size=4, kernel_size=5)"
    assert keep == pytest.approx(0.4) and backend == "kvpress"
    assert rec.run_id.split("-")[2:4] == ["kvpress", "snapkv"]
    # 20 positions at ratio 0.6 keep int(20 * 0.4) = 8 in every layer and KV head
    assert con.sql("SELECT DISTINCT kept FROM steps").fetchall() == [(8,)]


def test_a_decoding_press_logs_its_decode_evictions(kv, model, tmp_path):
    press = kv.DecodingPress(base_press=kv.KnormPress(), compression_interval=3, target_size=10)
    ids, mask = left_padded([14], seed=2)
    with recorders.record(model, press, out=tmp_path, fsync=False) as rec, torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=9, min_new_tokens=9, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True,
        )  # fmt: skip
    run = runlog.load_run(rec.run_dir)
    ev = run["evictions"].to_pandas()
    assert set(ev.phase) == {"decode"}
    steps = run["steps"].to_pandas()
    # 8 decode forwards feed positions 14..21; every third compresses: after feeding 16 and 19
    assert sorted(set(steps.step)) == [16, 19]
    assert set(steps.kept) == {10}
    for _, group in ev.groupby(["layer", "kv_head"]):
        assert group.position.is_unique, "an evicted position never returns"
        assert (group.position <= group.step).all()
        # 17 positions (0..16) stand at the first compression, 10 + 3 at the second
        assert group.groupby("step").size().to_dict() == {16: 7, 19: 3}
    # the cache it leaves: the 10 kept at step 19, then positions 20 and 21
    assert {layer.keys.shape[2] for layer in out.past_key_values.layers} == {12}


def test_a_press_keeping_other_keys_than_its_choice_fails_loudly(kv, model, tmp_path):
    from kvpress.utils import compute_n_kept

    @dataclasses.dataclass
    class LowestKnorm(kv.KnormPress):
        """Keeps the lowest of its knorm scores, against kvpress's own rule."""

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            keep = (-scores).topk(compute_n_kept(keys.shape[2], self.compression_ratio), dim=-1).indices
            idx = keep.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
            return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()

    ids, mask = left_padded([16], seed=4)
    press = LowestKnorm(compression_ratio=0.5)
    with pytest.raises(RecorderError, match="LowestKnorm at layer 0.*bit for bit"):
        with recorders.record(model, press, out=tmp_path, fsync=False), torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
    (run_dir,) = tmp_path.iterdir()
    assert runlog.read_manifest(run_dir)["status"] == "failed"
    assert not {"score", "compress", "forward_hook"} & set(vars(press)), "the press is put back"
    assert "generate" not in vars(model) and not model.model.layers[0].self_attn._forward_hooks


@pytest.mark.parametrize(
    ("build", "cls", "why"),
    [
        (lambda kv: kv.ThinKPress(key_channel_compression_ratio=0.5), "ThinKPress", "key channels"),
        (lambda kv: kv.KVzipPress(compression_ratio=0.5), "KVzipPress", "block exits"),
        (
            lambda kv: kv.ComposedPress([kv.KnormPress(0.3), kv.ThinKPress(key_channel_compression_ratio=0.5)]),
            "ComposedPress",
            "its inner ThinKPress",
        ),
        (lambda kv: kv.KeyRerotationPress(kv.KnormPress(0.3)), "KeyRerotationPress", "rotates"),
    ],
)
def test_a_press_that_does_not_select_positions_is_refused_in_one_line(kv, model, tmp_path, build, cls, why):
    press = build(kv)
    with pytest.raises(ConfigError) as err:
        with recorders.record(model, press, out=tmp_path / "runs"):
            pass
    msg = str(err.value)
    assert "\n" not in msg and cls in msg and why in msg and "DESIGN.md §17" in msg
    assert not (tmp_path / "runs").exists(), "nothing is written for a refused press"


def test_without_kvpress_a_press_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress raises ImportError
    with pytest.raises(MissingExtraError) as err:
        presses.import_kvpress()
    assert "pip install 'h2o-lens[kvpress]'" in str(err.value) and "\n" not in str(err.value)
    model = tiny_model("llama")
    with pytest.raises(MissingExtraError, match=r"h2o-lens\[kvpress\]"):
        with recorders.record(model, presses.PressSpec("SnapKVPress", (("compression_ratio", 0.5),)), out=tmp_path):
            pass
    assert not any(tmp_path.iterdir())


# -- replay and the layers above (DESIGN.md §17) ------------------------------------------------


@pytest.mark.parametrize("name", ["snapkv", "decoding"])
def test_a_press_run_replays_within_the_implementation_check(kv, name, tmp_path):
    from recorders.replay import replay

    model = tiny_model("llama", q_heads=4, kv_heads=2)
    press = {
        "snapkv": kv.SnapKVPress(compression_ratio=0.6, window_size=4),
        "decoding": kv.DecodingPress(base_press=kv.KnormPress(), compression_interval=3, target_size=16),
    }[name]
    ids, _ = left_padded([30], seed=5)
    with recorders.record(model, press, out=tmp_path, fsync=False) as rec, torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    summary = replay(rec.run_dir, model=model, progress=False)
    assert summary.implementation_ok and summary.max_logit_diff <= summary.tolerance, summary
    assert summary.mean_dropped_mass > 0  # the generated rows lost attention to what the press dropped
    con = runlog.open_runs(tmp_path)
    ((policy, diff),) = con.sql("SELECT policy, max_logit_diff FROM runs").fetchall()
    assert policy.startswith(f"kvpress:{type(press).__name__}(") and diff == pytest.approx(summary.max_logit_diff)
    assert con.sql("SELECT count(*) FROM replay WHERE dropped_mass > 0").fetchall()[0][0] > 0


def test_a_padded_batch_decoding_after_a_press_warns_and_fails_the_check(kv, tmp_path):
    """kvpress compresses padded rows, then transformers masks the compressed cache by column as if it
    were not: the recorder warns, and the replay's implementation check catches those rows."""
    from recorders.replay import replay

    model = tiny_model("llama", q_heads=4, kv_heads=2)
    ids, mask = left_padded([30, 22], seed=5)
    with pytest.warns(runlog.RecorderWarning, match="left-padded batch"):
        with recorders.record(model, kv.SnapKVPress(compression_ratio=0.5, window_size=4), out=tmp_path) as rec:
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    summary = replay(rec.run_dir, model=model, progress=False)
    assert not summary.implementation_ok and summary.max_logit_diff > summary.tolerance


def test_press_policies_have_a_colour_and_a_scored_flag():
    import analyses

    snap = "kvpress:SnapKVPress(compression_ratio=0.6, window_size=64, kernel_size=5)"
    assert analyses.policy_colour(snap) == presses.find("snapkv").colour
    assert analyses.policy_colour("kvpress:KnormPress(compression_ratio=0.5)") == presses.find("knorm").colour
    other = analyses.policy_colour("kvpress:SomeNewPress(compression_ratio=0.5)")
    assert other == analyses.policy_colour("kvpress:SomeNewPress(compression_ratio=0.2)")  # one press, one colour
    assert other not in {p.colour for p in presses.SUPPORTED} | set(analyses.policy_colours().values())
    assert analyses.policy_colour("h2o") == analyses.policy_colours()["h2o"]
    assert analyses.policy_colour("no_such_policy") is None
    assert analyses.scored_policy(snap) and not analyses.scored_policy("kvpress:StreamingLLMPress(n_sink=4)")


@pytest.mark.model
@pytest.mark.parametrize("name", ["snapkv", "streaming_llm", "tova", "observed_attention", "knorm", "pyramidkv"])
def test_default_model_kept_sets_are_its_cache(kv, default_model, name, tmp_path):
    model, tok = default_model
    prompts = ["Say hello to the team.", "Notes: the access code for the lab is 4419. The backup server is Heron."]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    mask = enc["attention_mask"]
    assert (mask[0] == 0).any()
    press = _presses(kv)[name]
    with recorders.record(model, press, out=tmp_path, tokenizer=tok, fsync=False) as rec, torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id, return_dict_in_generate=True
        )
    run = runlog.load_run(rec.run_dir)
    previous = model.config._attn_implementation
    if name == "observed_attention":  # it ran under eager attention (DESIGN.md §17): so must the reference
        model.set_attn_implementation("eager")
    try:
        full = _full_keys(model, enc["input_ids"], mask)
    finally:
        model.set_attn_implementation(previous)
    lengths = mask.sum(-1).tolist()
    starts = (mask == 0).sum(-1).tolist()
    evicted = 0
    for layer in (0, len(full) // 2, len(full) - 1):
        keys = out.past_key_values.layers[layer].keys
        for r, n in enumerate(lengths):
            for h in range(keys.shape[1]):
                kept = _kept_in_cache(keys[r, h], full[layer][r, h], starts[r])
                gone = _evicted(run, r, layer, h)
                assert kept.isdisjoint(gone) and kept | gone == set(range(n))
                evicted += len(gone)
    assert evicted > 0  # the short prompt may lose only padding: a press scores the padded columns too
    assert np.array_equal(np.sort(run["requests"].to_pandas().prompt_len), np.sort(lengths))


@pytest.mark.model
def test_default_model_snapkv_run_replays_within_the_implementation_check(kv, default_model, tmp_path):
    from recorders.replay import replay

    model, tok = default_model
    notes = (
        "Notes: the orange cable goes to port 7. The backup server is called Heron. The access code for the lab "
        "is 4419. Maria moved to the Lisbon office in May. The printer on floor two needs toner. The weekly "
        "meeting moved to Thursday at ten. Question: what is the access code for the lab? Answer:"
    )
    enc = tok([notes], return_tensors="pt")
    assert enc["input_ids"].shape[1] > 64  # SnapKV's default window of 64 queries fits in the prompt
    press = kv.SnapKVPress(compression_ratio=0.6)
    with recorders.record(model, press, out=tmp_path, tokenizer=tok, fsync=False) as rec, torch.no_grad():
        model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    summary = replay(rec.run_dir, model=model, progress=False)
    assert summary.implementation_ok and summary.max_logit_diff <= summary.tolerance, summary
    con = runlog.open_runs(tmp_path)
    ((policy, ok),) = con.sql("SELECT policy, max_logit_diff <= logit_tolerance FROM runs").fetchall()
    assert policy == "kvpress:SnapKVPress(compression_ratio=0.6, window_size=64, kernel_size=5)" and ok


# -- the differential test against the field (DESIGN.md §17.2) -----------------------------------


def test_observed_attention_and_tova_presses_against_the_toolkits_h2o_and_tova(kv, model, tmp_path):
    """kvpress's ObservedAttentionPress and TOVAPress differ from this toolkit's ``h2o`` and ``tova``
    prefill by the reasons DESIGN.md §17.2 names, and by nothing else: with each reason undone in a
    subclass of the press, the kept sets are the same, set for set."""

    from commands.benchmarks.press import kept_sets, reason_presses, record_each, toolkit_sets

    reasons = reason_presses(kv)
    SummedObserved, GroupTOVA = reasons["summed_observed"], reasons["group_tova_self"]  # noqa: N806
    lengths = [40, 33, 48]
    prompts = [left_padded([n], seed=10 + i)[0] for i, n in enumerate(lengths)]
    ratio = 0.5
    kept = [int(n * (1 - ratio)) for n in lengths]
    h2o0 = toolkit_sets(model, "h2o", prompts, lengths, kept, tmp_path, recent0=True)
    h2o_split = toolkit_sets(model, "h2o", prompts, lengths, kept, tmp_path, recent0=False)
    tova0 = toolkit_sets(model, "tova", prompts, lengths, kept, tmp_path, recent0=True)

    def press(p):
        return kept_sets(record_each(model, p, prompts, tmp_path), lengths)

    observed, summed = press(kv.ObservedAttentionPress(ratio)), press(SummedObserved(ratio))
    tova, group_tova = press(kv.TOVAPress(ratio)), press(GroupTOVA(ratio))
    assert len(h2o0) == len(lengths) * 2 * 2 and all(len(s) == kept[i] for (i, _, _), s in h2o0.items())
    assert summed == h2o0  # the sum over rows: H2O's prefill without its recent window
    assert group_tova == tova0  # per KV group, self weight ranked: the toolkit's tova with recent = 0
    # and each reason matters on its own: the presses as kvpress ships them keep other sets
    assert observed != h2o0 and summed != h2o_split and tova != tova0


# ----------------------------------------------------------------------------- explain (DESIGN.md §17.3)


class _CharTokenizer:
    """One letter per token id: answer text for the pass test, and evidence spans."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(65 + int(i) % 26) for i in ids)


def test_explain_on_a_failed_snapkv_request_returns_a_verdict_with_its_runs(kv, tmp_path):
    from analyses import causal_verdicts, connect
    from recorders.counterfactual import explain_request, press_ratio
    from recorders.replay import replay

    model = tiny_model("llama", q_heads=4, kv_heads=2)
    tok = _CharTokenizer()
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    text = tok.decode(ids[0].tolist())
    info = {"decoding": {"do_sample": False, "max_new_tokens": 8}}
    press = kv.SnapKVPress(compression_ratio=0.8, window_size=4)
    with (
        recorders.record(
            model, press, out=tmp_path, tokenizer=tok, evidence={"fact": text[12:16]}, info=info, fsync=False
        ) as rec,
        torch.no_grad(),
    ):
        model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert replay(rec.run_dir, model=model, progress=False).implementation_ok
    parent = runlog.load_run(rec.run_dir)
    slots = int(40 * (1 - 0.8))

    ex = explain_request(model, tok, rec.run_dir, 0, resolution=0.1)
    full, pinned, budget, oracle = (ex.outcomes[k] for k in ("full", "pinned", "policy_budget", "oracle"))
    assert ex.slots == slots and full.ran and full.passed
    assert parent["requests"].to_pylist()[0]["answer"] != full.answer, "the press changed the answer: a failure"
    assert pinned.ran and oracle.ran and budget.ran and ex.outcomes["oracle_budget"].ran

    # pinned: the same press at the same count, the evidence never evicted
    runs = {k: runlog.load_run(tmp_path / o.run_id) for k, o in ex.outcomes.items() if o.run_id}
    evidence = [12, 13, 14, 15]
    assert runs["pinned"].manifest["policy"] == parent.manifest["policy"]
    assert runs["pinned"].manifest["config"]["pinned"] == evidence
    ev = runs["pinned"]["evictions"].to_pandas()
    assert len(ev) and not ev.position.isin(evidence).any()
    assert (runs["pinned"]["steps"].to_pandas().kept == slots).all()
    assert ev_lost(parent, evidence), "without pins SnapKV evicted some of the evidence"

    # the press's minimal passing compression ratio: the run at the count found keeps that count
    bis = budget.bisection
    assert bis.min_slots is not None and bis.min_slots > slots and bis.probes[slots] is False
    ratio = press_ratio(bis.min_slots, 40)
    assert runs["policy_budget"].manifest["counterfactual"]["compression_ratio"] == pytest.approx(ratio)
    assert f"compression_ratio={round(ratio, 12)}" in runs["policy_budget"].manifest["policy"]
    if bis.min_slots < 40:
        assert (runs["policy_budget"]["steps"].to_pandas().kept == bis.min_slots).all()
    con = connect(tmp_path)
    diffs = con.sql("SELECT run_id, max_logit_diff, logit_tolerance FROM runs WHERE run_id LIKE '%pinned%'").fetchall()
    assert diffs and all(d <= t for _, d, t in diffs)  # the pinned press run replays exactly

    (v,) = causal_verdicts(con, parent.run_id)
    assert set(v.runs) >= {"full", "pinned", "oracle", "policy_budget", "oracle_budget"}
    assert set(v.decided_by) <= set(v.runs.values()) and v.runs["full"] in v.decided_by
    assert (v.verdict == "scoring") == bool(v.passes["pinned"] or v.passes["oracle"]), v.reason
    assert v.verdict in ("scoring", "budget", "not_the_cache"), v.reason
    assert v.min_slots["policy"] == bis.min_slots


def ev_lost(run, positions) -> bool:
    ev = run["evictions"].to_pandas()
    return bool(ev.position.isin(positions).any())


def test_pins_that_do_not_fit_in_the_press_count_are_refused(kv, model, tmp_path):
    ids, _ = left_padded([20], seed=1)
    with pytest.raises(RecorderError, match="pins do not fit"):
        with recorders.record(model, kv.KnormPress(compression_ratio=0.8), out=tmp_path, pinned=range(8)):
            with torch.no_grad():
                model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=0)


@pytest.mark.model
def test_default_model_explains_a_failed_snapkv_request(kv, default_model, tmp_path):
    """SnapKV keeping half of ``delayed_recall_1`` answers wrong; the full cache, the press with the
    evidence pinned and the oracle at its count are re-run and decide the verdict (no bisection)."""
    from analyses import causal_verdicts, connect
    from commands.jobs import run_task
    from h2o_lens.presses import PressSpec
    from h2o_lens.tasks import get_task
    from recorders.counterfactual import explain_request

    model, tok = default_model
    task = get_task("delayed_recall_1")
    spec = PressSpec("SnapKVPress", (("compression_ratio", 0.5),))
    parent = run_task(model, tok, task, spec, tmp_path, replay=True)
    assert parent.policy.startswith("kvpress:SnapKVPress(compression_ratio=0.5") and not parent.correct
    ex = explain_request(model, tok, parent.run_dir, 0, bisect=False, replay=False)
    prompt_len = ex.prompt_len
    assert ex.slots == int(prompt_len * 0.5)
    assert ex.outcomes["full"].passed and ex.outcomes["pinned"].ran and ex.outcomes["oracle"].ran
    pinned = runlog.load_run(tmp_path / ex.outcomes["pinned"].run_id)
    evidence = pinned.manifest["config"]["pinned"]
    assert evidence and not pinned["evictions"].to_pandas().position.isin(evidence).any()
    (v,) = causal_verdicts(connect(tmp_path), parent.run_id)
    # measured: with the secret's positions raised to the top of SnapKV's scores the answer comes back
    assert v.verdict == "scoring" and v.passes["pinned"] is True, v.reason
    assert v.runs["pinned"] in v.decided_by and set(v.decided_by) <= {
        v.runs["full"],
        v.runs["pinned"],
        v.runs["oracle"],
    }


def test_the_speed_bench_reports_a_press_that_cannot_start_and_times_the_rest(kv, model, capsys):
    """DuoAttention without a local head pattern cannot load one offline (kvpress asserts the
    checkpoint is one of its six): ``bench press`` says so in one line per length, times the
    other presses, and exits 1."""
    from commands.benchmarks.press import bench_press

    timed = (("DuoAttentionPress", {}), ("StreamingLLMPress", {"n_sink": 2}))
    assert bench_press(contexts=(48,), new_tokens=2, rounds=1, model=model, timed=timed) == 1
    lines = capsys.readouterr().out.splitlines()
    (bad,) = [line for line in lines if "could not run" in line and line.startswith("prompt")]
    assert "kvpress:DuoAttentionPress" in bad and "AssertionError" in bad
    assert any(line.startswith("prompt") and "kvpress:StreamingLLMPress" in line and "ratio" in line for line in lines)
    assert lines[-1].endswith("could not run: kvpress:DuoAttentionPress")


def test_the_speed_bench_times_each_press_alone_and_recorded(kv, model, capsys):
    """``bench press`` on a tiny model: one line per press and length with both times and the ratio
    of the fastest rounds (the figure itself is the benchmark's; here only its accounting)."""
    from commands.benchmarks.press import bench_press

    timed = (("SnapKVPress", {"window_size": 8}), ("StreamingLLMPress", {"n_sink": 2}))
    assert bench_press(contexts=(48,), new_tokens=2, rounds=2, model=model, timed=timed) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("prompt")]
    assert [r.split()[2] for r in rows] == ["kvpress:SnapKVPress", "kvpress:StreamingLLMPress"]
    ratios = []
    for row in rows:
        f = row.split()
        assert f[3] == "alone" and f[6] == "recorded" and f[9] == "ratio"
        ratios.append(float(f[10]))
        assert float(f[4]) >= 0 and float(f[7]) >= 0 and ratios[-1] > 0  # a tiny model's generate may print 0.00 s
    assert lines[-1] == f"worst ratio {max(ratios):.3f}"
