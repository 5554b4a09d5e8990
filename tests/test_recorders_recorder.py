"""The eviction recorder and replay on tiny models: tables, crash safety, determinism, dropped mass."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import tiny_model

import recorders
from h2o_lens import H2OConfig
from recorders.recorder import locate_evidence, record_teacher_forced
from recorders.replay import replay
from runlog import list_runs, load_run, open_runs, read_manifest

ROOT = Path(__file__).resolve().parents[1]


def _ids(n, seed=0, batch=1):
    return torch.randint(3, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def _gen(model, ids, mask=None, new=10):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)


def _table(root, run_id, table, cols):
    con = open_runs(root)
    order = ", ".join(cols)
    return con.execute(f"SELECT {order} FROM {table} WHERE run_id = ? ORDER BY {order}", [run_id]).df()


EVICT_COLS = ["request", "step", "layer", "kv_head", "position", "score", "margin", "age", "left_recent", "phase"]
STEP_COLS = [
    "request",
    "step",
    "layer",
    "kv_head",
    "min_heavy_score",
    "promoted",
    "exiting_position",
    "kept",
    "heavy_age_mean",
]


def test_record_writes_every_table_and_matches_the_cache(tmp_path):
    model = tiny_model("llama")
    cfg = H2OConfig(heavy=4, recent=3)
    with recorders.record(model, cfg, out=tmp_path, fsync=False, name="demo") as run:
        seq = _gen(model, _ids(20), new=12)
    assert run.status == "complete"
    runs = list_runs(tmp_path)
    assert [r["status"] for r in runs] == ["complete"]
    con = open_runs(tmp_path)
    row = con.execute("SELECT policy, heavy, recent, gqa, prompt_len, new_tokens, requests, name FROM runs").fetchone()
    assert row == ("h2o", 4, 3, "sum", 20, 12, 1, "demo")
    ev = _table(tmp_path, run.run_id, "evictions", EVICT_COLS)
    # 20 prompt tokens -> 7 slots: 13 prefill evictions per (layer, head); then one per decode step
    for (_layer, _head), g in ev.groupby(["layer", "kv_head"]):
        assert (g.phase == "prefill").sum() == 13 and (g.phase == "decode").sum() == 11
        assert (g.age == g.step - g.position).all() and (g.margin >= 0).all()
        assert g.position.is_unique  # an evicted position never returns
        assert set(g[g.phase == "prefill"].step) == {19}
    tokens = _table(tmp_path, run.run_id, "tokens", ["position", "token_id", "is_prompt"])
    assert tokens.token_id.tolist() == seq[0].tolist() and tokens.is_prompt.sum() == 20
    steps = _table(tmp_path, run.run_id, "steps", STEP_COLS)
    assert (steps.kept <= 7).all() and len(steps) == 2 * 2 * 12  # layers x heads x (prefill + 11 steps)
    # the left_recent victims are exactly the non-promoted exits
    dec = steps[steps.step > 19]
    merged = dec.merge(ev[ev.phase == "decode"], on=["request", "step", "layer", "kv_head"])
    assert (merged.left_recent == ~merged.promoted.astype(bool)).all()


def test_evidence_spans_map_to_tokens():
    pieces = ["The", " code", " is", " 44", "19", ".", " Bye"]
    labels = locate_evidence(
        pieces,
        {"code": "4419", "bye": (len("The code is 4419. "), len("The code is 4419. Bye"))},
        prompt="The code is 4419. Bye",
    )
    assert labels == [None, None, None, "code", "code", None, "bye"]
    with pytest.raises(Exception, match="does not occur"):
        locate_evidence(pieces, {"x": "zebra"})


def test_exception_marks_failed_and_restores_model(tmp_path):
    model = tiny_model("llama")
    ids = _ids(16)
    before = _gen(model, ids)
    with pytest.raises(ValueError, match="bad prompt"):
        with recorders.record(model, H2OConfig(heavy=3, recent=3), out=tmp_path, fsync=False) as run:
            _gen(model, ids)
            raise ValueError("bad prompt")
    m = read_manifest(tmp_path / run.run_id)
    assert m["status"] == "failed" and "bad prompt" in m["error"] and m["error_type"] == "ValueError"
    assert model.config._attn_implementation == "sdpa" and "generate" not in vars(model)
    assert torch.equal(_gen(model, ids), before)
    # what was written before the error is readable
    assert open_runs(tmp_path).execute("SELECT count(*) FROM evictions").fetchone()[0] > 0


@pytest.mark.slow
def test_recording_is_deterministic_and_batch_equals_single_runs(tmp_path):
    model = tiny_model("qwen3")
    cfg = H2OConfig(heavy=4, recent=3)
    seqs = [_ids(n, seed=n)[0] for n in (18, 9, 14)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :], mask[i, width - len(s) :] = s, 1
    runs = []
    for _ in range(2):
        with recorders.record(model, cfg, out=tmp_path, fsync=False) as run:
            _gen(model, ids, mask)
        runs.append(run.run_id)
    a, b = (_table(tmp_path, r, "evictions", EVICT_COLS) for r in runs)
    assert len(a) and a.equals(b)
    sa, sb = (_table(tmp_path, r, "steps", STEP_COLS) for r in runs)
    assert sa.equals(sb)
    batch_ev = a
    for i, s in enumerate(seqs):
        with recorders.record(model, cfg, out=tmp_path, fsync=False) as single:
            _gen(model, s[None])
        one = _table(tmp_path, single.run_id, "evictions", EVICT_COLS)
        mine = batch_ev[batch_ev.request == i].assign(request=0).reset_index(drop=True)
        assert np.array_equal(
            one[["step", "layer", "kv_head", "position"]].values, mine[["step", "layer", "kv_head", "position"]].values
        )
        assert np.allclose(one.score.values, mine.score.values, atol=1e-5)


def _brute_force_dropped_mass(model, ids, evictions, prompt_len):
    """Full attention matrices from an eager full-cache forward and explicit kept sets."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation("sdpa")
    n = ids.shape[1]
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    expected = {}
    for layer, att in enumerate(out.attentions):  # (1, Hq, N, N)
        for q in range(att.shape[1]):
            ev = evictions[(evictions.layer == layer) & (evictions.kv_head == q // group)]
            gone_at = dict(zip(ev.position, ev.step))
            for t in range(prompt_len - 1, n):
                dropped = [i for i in range(t + 1) if gone_at.get(i, 10**9) < t]
                expected[(t, layer, q)] = float(att[0, q, t, dropped].sum())
    return expected


def _replay_backends() -> list:
    """torch always; the Triton replay kernels on CUDA or under TRITON_INTERPRET=1."""
    from h2o_lens.kernels import triton_available
    from h2o_lens.kernels._checks import interpret_mode

    ok = triton_available() and (torch.cuda.is_available() or interpret_mode())
    return [
        "torch",
        pytest.param(
            "triton",
            marks=[pytest.mark.kernel]
            + ([] if ok else [pytest.mark.skip(reason="the Triton replay kernels need CUDA or TRITON_INTERPRET=1")]),
        ),
    ]


@pytest.mark.parametrize("backend", _replay_backends())
@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_replay_dropped_mass_equals_brute_force(tmp_path, gqa, backend):
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    ids = _ids(16, seed=4)
    with recorders.record(model, H2OConfig(heavy=3, recent=3, gqa=gqa), out=tmp_path, fsync=False) as run:
        seq = _gen(model, ids, new=12)
    summary = replay(tmp_path / run.run_id, model=model, progress=False, backend=backend)
    assert summary.implementation_ok and summary.max_logit_diff < 1e-4
    ev = _table(tmp_path, run.run_id, "evictions", ["step", "layer", "kv_head", "position"])
    got = _table(tmp_path, run.run_id, "replay", ["step", "layer", "q_head", "dropped_mass"])
    expected = _brute_force_dropped_mass(model, seq[:, :-1], ev, 16)
    assert len(got) == len(expected)
    for row in got.itertuples():
        assert row.dropped_mass == pytest.approx(expected[(row.step, row.layer, row.q_head)], abs=1e-5)
    assert got.dropped_mass.max() > 0.05  # the run did drop attention mass
    steps = _table(tmp_path, run.run_id, "replay_steps", ["step", "kl", "top1_agree", "teacher_logprob"])
    assert len(steps) == 12 and (steps.kl >= 0).all() and steps.kl.iloc[0] == pytest.approx(0, abs=1e-6)
    m = read_manifest(tmp_path / run.run_id)
    assert m["replay"]["implementation_ok"] and m["max_logit_diff"] == summary.max_logit_diff
    assert m["replay"]["backend"] == backend


def test_replay_detects_an_implementation_error(tmp_path):
    """A log that disagrees with what the run really kept is caught by the masked replay."""
    model = tiny_model("llama")
    with recorders.record(model, H2OConfig(heavy=3, recent=3), out=tmp_path, fsync=False) as run:
        _gen(model, _ids(16), new=10)
    run_dir = tmp_path / run.run_id
    # corrupt the log: claim the decode evictions never happened
    import pyarrow.parquet as pq

    for f in run_dir.glob("evictions-*.parquet"):
        t = pq.read_table(f)
        keep = [p != "decode" for p in t["phase"].to_pylist()]
        meta = t.schema.metadata
        pq.write_table(t.filter(keep).replace_schema_metadata(meta), f)
    summary = replay(run_dir, model=model, progress=False)
    assert not summary.implementation_ok and summary.max_logit_diff > 1e-3


def test_teacher_forced_rerecord(tmp_path):
    model = tiny_model("llama")
    cfg = H2OConfig(heavy=4, recent=3)
    with recorders.record(model, cfg, out=tmp_path, fsync=False) as run:
        _gen(model, _ids(20), new=10)
    same = record_teacher_forced(model, tmp_path / run.run_id, cfg, out=tmp_path, fsync=False)
    other = record_teacher_forced(
        model, tmp_path / run.run_id, H2OConfig(heavy=4, recent=3, gqa="max"), out=tmp_path, fsync=False
    )
    assert _table(tmp_path, run.run_id, "evictions", EVICT_COLS).equals(
        _table(tmp_path, same.run_id, "evictions", EVICT_COLS)
    )
    tok = ["position", "token_id"]
    assert _table(tmp_path, run.run_id, "tokens", tok).equals(_table(tmp_path, other.run_id, "tokens", tok))
    con = open_runs(tmp_path)
    assert con.execute("SELECT source_run, gqa FROM runs WHERE run_id = ?", [other.run_id]).fetchone() == (
        run.run_id,
        "max",
    )


KILL_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from tiny import tiny_model
import recorders
from h2o_lens import H2OConfig
model = tiny_model("llama", layers=4)
ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(0))
with recorders.record(model, H2OConfig(heavy=8, recent=8), out=sys.argv[1], run_id="killed-run",
                     flush_every=2, rows_per_segment=50) as run:
    print("started", flush=True)
    model.generate(ids, max_new_tokens=100000, min_new_tokens=100000, do_sample=False, pad_token_id=0)
"""


@pytest.mark.slow
def test_sigkill_mid_generation_leaves_readable_logs(tmp_path):
    script = tmp_path / "kill_me.py"
    script.write_text(KILL_SCRIPT)
    root = tmp_path / "runs"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), str(ROOT / "tests")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        run_dir = root / "killed-run"
        while time.time() < deadline:
            if len(list(run_dir.glob("evictions-*.parquet"))) >= 3:
                break
            if proc.poll() is not None:
                pytest.fail(f"recorder exited early: {proc.stderr.read()[-2000:]}")
            time.sleep(0.2)
        else:
            pytest.fail("no segments appeared")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    import pyarrow.parquet as pq

    files = list(run_dir.glob("*.parquet"))
    assert files and all(pq.read_table(f).num_rows >= 0 for f in files)  # every visible file opens
    assert [r["status"] for r in list_runs(root)] == ["interrupted"]
    # a second, healthy run next to it: SQL over the whole root still works
    model = tiny_model("llama")
    with recorders.record(model, H2OConfig(heavy=3, recent=3), out=root, fsync=False) as ok:
        _gen(model, _ids(12))
    con = open_runs(root)
    counts = dict(con.sql("SELECT run_id, count(*) FROM evictions GROUP BY run_id").fetchall())
    assert counts["killed-run"] > 0 and counts[ok.run_id] > 0
    assert con.execute("SELECT status FROM runs WHERE run_id = 'killed-run'").fetchone()[0] == "interrupted"
    loaded = load_run(run_dir)  # strict load of the killed run works too
    assert loaded["evictions"].num_rows == counts["killed-run"]


@pytest.mark.parametrize("backend", _replay_backends())
def test_replay_oracle_columns_equal_brute_force(tmp_path, backend):
    """teacher_score / teacher_future_mass: full attention on each victim before / after its eviction."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    with recorders.record(model, H2OConfig(heavy=3, recent=3), out=tmp_path, fsync=False) as run:
        seq = _gen(model, _ids(14, seed=2), new=10)
    replay(tmp_path / run.run_id, model=model, progress=False, backend=backend)
    got = _table(
        tmp_path, run.run_id, "oracle", ["step", "layer", "kv_head", "position", "teacher_score", "teacher_future_mass"]
    )
    assert len(got) == len(_table(tmp_path, run.run_id, "evictions", ["step"]))
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = model(input_ids=seq[:, :-1], output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation("sdpa")
    for row in got.itertuples():
        a = att[row.layer][0, 2 * row.kv_head : 2 * row.kv_head + 2].sum(0)  # (N, N) summed over the group
        assert row.teacher_score == pytest.approx(float(a[row.position : row.step + 1, row.position].sum()), abs=1e-4)
        assert row.teacher_future_mass == pytest.approx(float(a[row.step + 1 :, row.position].sum()), abs=1e-4)


def test_heavy_slots_exclude_the_sink(tmp_path):
    """steps.min_heavy_score and heavy_age_mean describe the same heavy slots: the eligible
    survivors, outside the recent window and the sink (one eligibility rule, DESIGN.md §2.9).
    Under `sink` (no heavy slot) a full cache has none: both are null at every decode step."""
    model = tiny_model("llama")
    cfg = H2OConfig(policy="sink", heavy=3, recent=5, sink=2)
    with recorders.record(model, cfg, out=tmp_path, fsync=False) as run:
        _gen(model, _ids(20), new=10)
    steps = _table(tmp_path, run.run_id, "steps", STEP_COLS)
    dec = steps[steps.step > 19]
    assert len(dec) == 2 * 2 * 9
    assert dec.min_heavy_score.isna().all()
    assert dec.heavy_age_mean.isna().all()  # the sink positions 0 and 1 are not heavy slots
    h2o = H2OConfig(heavy=3, recent=5)
    with recorders.record(model, h2o, out=tmp_path, fsync=False) as run:
        _gen(model, _ids(20), new=10)
    steps = _table(tmp_path, run.run_id, "steps", STEP_COLS)
    assert steps.heavy_age_mean.notna().all() and steps.min_heavy_score.notna().all()
