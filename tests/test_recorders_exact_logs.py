"""The recorder logs what really happened: inferred masks, samples, EOS, beams, half precision."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from runtime_utils import left_pad as _left_pad
from tiny import tiny_model

import h2o_lens
import recorders
from analyses import Thresholds
from h2o_lens import H2OConfig
from recorders.recorder import record_teacher_forced
from recorders.replay import (
    DEFAULT_TOLERANCE,
    TOLERANCE_ULPS,
    implementation_tolerance,
    replay,
)
from runlog import load_run, open_runs, read_manifest
from runlog.errors import RecorderError

CFG = H2OConfig(heavy=4, recent=3)


def _ids(n, seed):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))[0]


def _rows(run_dir, table):
    return load_run(run_dir, tables=(table,))[table].to_pandas()


def _evictions(run_dir, request):
    ev = _rows(run_dir, "evictions")
    ev = ev[ev.request == request]
    return ev.sort_values(["step", "layer", "kv_head", "position"])[["step", "layer", "kv_head", "position"]].values


def _assert_teacher_forced_equal(model, tmp_path, run_dir, requests):
    """Re-recording each request's own tokens alone gives the same evictions: the log is exact."""
    again = record_teacher_forced(model, run_dir, CFG, out=tmp_path, fsync=False)
    for r in range(requests):
        assert np.array_equal(_evictions(run_dir, r), _evictions(again.run_dir, r)), f"request {r}"


@pytest.mark.slow
def test_inferred_attention_mask_keeps_padding_out_of_the_prompt(tmp_path):
    """Left-padded input_ids without attention_mask: generate infers the mask from pad_token_id."""
    model = tiny_model("llama")
    seqs = [_ids(20, 1), _ids(9, 2)]
    ids, mask = _left_pad(seqs)
    runs = []
    for given in (None, mask):
        with recorders.record(model, CFG, out=tmp_path, fsync=False) as run, torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=given,
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        runs.append(run.run_dir)
    inferred, explicit = runs
    req = _rows(inferred, "requests").sort_values("request")
    assert req.prompt_len.tolist() == [20, 9]
    tok = _rows(inferred, "tokens")
    one = tok[tok.request == 1].sort_values("position")
    assert one.token_id.tolist() == seqs[1].tolist() + out[1, ids.shape[1] :].tolist()
    assert int(one.is_prompt.sum()) == 9
    assert (
        _rows(inferred, "evictions").drop(columns="run_id").equals(_rows(explicit, "evictions").drop(columns="run_id"))
    )
    summary = replay(inferred, model=model, progress=False)
    assert summary.implementation_ok and summary.max_logit_diff < 1e-4


@pytest.mark.slow
def test_num_return_sequences_logs_one_request_per_sample(tmp_path):
    model = tiny_model("qwen3")
    seqs = [_ids(14, 3), _ids(10, 4)]
    ids, mask = _left_pad(seqs)
    torch.manual_seed(0)
    with recorders.record(model, CFG, out=tmp_path, fsync=False) as run, torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=True,
            num_return_sequences=3,
            pad_token_id=0,
            eos_token_id=None,
        )
        model.generate(
            input_ids=_ids(11, 7)[None],
            max_new_tokens=8,
            do_sample=True,
            num_return_sequences=2,
            pad_token_id=0,
            eos_token_id=None,
        )  # a second call continues the numbering
    assert out.shape[0] == 6
    req = _rows(run.run_dir, "requests").sort_values("request")
    assert req.request.tolist() == list(range(8))
    assert req.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert req.sample_index.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert req.prompt_len.tolist() == [14] * 3 + [10] * 3 + [11] * 2 and (req.new_tokens == 8).all()
    tok = _rows(run.run_dir, "tokens")
    for r in range(6):
        got = tok[tok.request == r].sort_values("position").token_id.tolist()
        assert got == seqs[r // 3].tolist() + out[r, ids.shape[1] :].tolist()
    assert len({tuple(out[r, ids.shape[1] :].tolist()) for r in range(3)}) > 1  # the samples differ
    assert set(_rows(run.run_dir, "evictions").request) == set(range(8))
    summary = replay(run.run_dir, model=model, progress=False)
    assert summary.implementation_ok and summary.max_logit_diff < 1e-4 and summary.requests == 8
    _assert_teacher_forced_equal(model, tmp_path, run.run_dir, 8)


@pytest.mark.slow
def test_a_request_ends_at_its_eos(tmp_path):
    model = tiny_model("llama")
    seqs = [_ids(12, 5), _ids(16, 6)]
    ids, mask = _left_pad(seqs)
    with h2o_lens.h2o(model, CFG), torch.no_grad():
        free = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None
        )[:, ids.shape[1] :]
    # an EOS id that request 0 generates early and request 1 never: request 0 stops, request 1 runs on
    ends = [j for j in range(1, 8) if int(free[0, j]) not in free[0, :j].tolist() + free[1].tolist()]
    assert ends, "no token of request 0 can serve as its EOS; change the prompts' seeds"
    n0 = ends[0] + 1
    eos = int(free[0, n0 - 1])
    with recorders.record(model, CFG, out=tmp_path, fsync=False) as run, torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos
        )
    assert out[0, ids.shape[1] + n0 :].eq(0).all() and n0 < 10  # generate padded request 0 after its EOS
    req = _rows(run.run_dir, "requests").sort_values("request")
    assert req.new_tokens.tolist() == [n0, 10]
    tok = _rows(run.run_dir, "tokens")
    assert tok[tok.request == 0].sort_values("position").token_id.tolist() == seqs[0].tolist() + free[0, :n0].tolist()
    logits = _rows(run.run_dir, "run_logits")
    assert (logits.request == 0).sum() == n0 and (logits.request == 1).sum() == 10
    # only the steps that fed request 0's tokens before its EOS are real: prompt 12 -> steps 12 .. 12 + n0 - 2
    ev, steps = _rows(run.run_dir, "evictions"), _rows(run.run_dir, "steps")
    assert ev[ev.request == 0].step.max() == 12 + n0 - 2 == steps[steps.request == 0].step.max()
    assert ev[ev.request == 1].step.max() == 16 + 8
    # the log of request 0 equals that of prompt 0 generated on its own
    with recorders.record(model, CFG, out=tmp_path, fsync=False) as alone, torch.no_grad():
        model.generate(input_ids=seqs[0][None], max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos)
    assert np.array_equal(_evictions(run.run_dir, 0), _evictions(alone.run_dir, 0))
    summary = replay(run.run_dir, model=model, progress=False)
    assert summary.implementation_ok and summary.steps == n0 + 10
    steps_replayed = _rows(run.run_dir, "replay_steps")
    assert (steps_replayed.request == 0).sum() == n0


@pytest.mark.parametrize(
    "options, match",
    [
        ({"num_beams": 3}, "beam search"),
        ({"stop_strings": ["ab"]}, "stop_strings"),
    ],
)
def test_inexact_generation_modes_are_refused(tmp_path, options, match):
    model = tiny_model("llama")
    with (
        pytest.raises(RecorderError, match=match),
        recorders.record(model, CFG, out=tmp_path, fsync=False) as run,
        torch.no_grad(),
    ):
        model.generate(input_ids=_ids(12, 0)[None], max_new_tokens=6, do_sample=False, pad_token_id=0, **options)
    assert read_manifest(run.run_dir)["status"] == "failed"
    assert model.config._attn_implementation == "sdpa" and "generate" not in vars(model)


def test_implementation_tolerance_follows_the_dtype():
    assert implementation_tolerance(torch.float32, 40.0) == DEFAULT_TOLERANCE
    assert implementation_tolerance("bfloat16", 40.0) == pytest.approx(TOLERANCE_ULPS * 2**-7 * 40)
    assert implementation_tolerance(torch.float16, 40.0) == pytest.approx(TOLERANCE_ULPS * 2**-10 * 40)
    assert implementation_tolerance("float16", 0.01) == DEFAULT_TOLERANCE
    with pytest.raises(RecorderError, match="unknown dtype"):
        implementation_tolerance("int8x", 1.0)
    th = Thresholds()
    assert th.logit_bound(None) == th.logit_tolerance and th.logit_bound(0.5) == 0.5


def _half_model(dtype):
    """A tiny model whose logits reach about 8 (like a real LM's scale relative to the rounding)."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(16.0)
        for name, p in model.named_parameters():
            if "o_proj" in name or "v_proj" in name:
                p.mul_(16.0)
    return model.to(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_replay_passes_a_correct_run_and_catches_a_corrupted_log(tmp_path, dtype):
    model = _half_model(dtype)
    ids = _ids(16, 0)[None]
    for heavy in (64, 3):  # no eviction, then evictions at every step
        with (
            recorders.record(model, H2OConfig(heavy=heavy, recent=3), out=tmp_path, fsync=False) as run,
            torch.no_grad(),
        ):
            model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
        summary = replay(run.run_dir, model=model, progress=False)
        assert summary.max_logit_diff > DEFAULT_TOLERANCE  # the old fixed bound called this an error
        assert summary.implementation_ok and summary.max_logit_diff <= summary.tolerance
        assert summary.tolerance > DEFAULT_TOLERANCE
    con = open_runs(tmp_path)
    assert con.execute("SELECT logit_tolerance FROM runs WHERE run_id = ?", [run.run_id]).fetchone()[
        0
    ] == pytest.approx(summary.tolerance)
    # corrupt the log of the evicting run: claim the decode evictions never happened
    bad = tmp_path / "corrupted" / run.run_id
    shutil.copytree(run.run_dir, bad)
    for f in bad.glob("evictions-*.parquet"):
        t = pq.read_table(f)
        keep = [p != "decode" for p in t["phase"].to_pylist()]
        pq.write_table(t.filter(keep).replace_schema_metadata(t.schema.metadata), f)
    caught = replay(bad, model=model, progress=False)
    assert not caught.implementation_ok and caught.max_logit_diff > caught.tolerance
