"""The replay against a brute-force replay: two full forwards over each request's N tokens in FP64.

The replay forwards the prompt once and only the generated rows twice, with the dropped mass,
the oracle columns and the teacher's output from one pass over the score tiles (DESIGN.md §6.1).
Here the teacher is an eager forward with its full N x N weights, the masked forward one with an
explicit N x N visibility mask per layer and head, and every replay table is compared with them.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from tiny import tiny_model

import recorders
from h2o_lens import H2OConfig
from h2o_lens.hooks import attention_implementation
from recorders.replay import replay
from runlog import open_runs

NEVER = 10**9


def _evict_steps(ev, request: int, layers: int, sets: int, n: int, gqa: str) -> np.ndarray:
    """``(L, Hs, N)``: the step at which each position left the cache, from the evictions rows."""
    out = np.full((layers, sets, n), NEVER, np.int64)
    head = "q_head" if gqa == "none" else "kv_head"
    for row in ev[ev.request == request].itertuples():
        at = (row.layer, getattr(row, head), row.position)
        out[at] = min(out[at], row.step)
    return out


def _masked_attention(steps, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Row t sees key i when i <= t and the run still held i at step t; the full N x N mask at once."""
    hq, n = query.shape[1], query.shape[2]
    ev = torch.as_tensor(steps[module.layer_idx])  # (Hs, N)
    per_q = ev.repeat_interleave(hq // ev.shape[0], 0)  # (Hq, N)
    k = key.repeat_interleave(hq // key.shape[1], 1)
    v = value.repeat_interleave(hq // value.shape[1], 1)
    t = torch.arange(n)[:, None]
    visible = (torch.arange(n)[None, :] <= t) & (per_q[:, None, :] >= t)  # (Hq, N, N)
    w = (query @ k.transpose(-1, -2) * scaling).masked_fill(~visible, float("-inf")).softmax(-1)
    return (w @ v).transpose(1, 2), None


def _brute_force(model, ids: np.ndarray, p: int, steps: np.ndarray):
    """Teacher logits and weights ``(L, Hq, N, N)``, masked logits, all from full N-row forwards."""
    x = torch.tensor(ids)[None]
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            full = model(input_ids=x, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation("sdpa")
    fn = functools.partial(_masked_attention, steps)
    with torch.no_grad(), attention_implementation(model, "test_masked", fn, lambda *a, **k: None):
        masked = model(input_ids=x, use_cache=False).logits[0]
    att = torch.stack([a[0] for a in full.attentions])  # (L, Hq, N, N)
    return full.logits[0][p - 1 :], masked[p - 1 :], att


def _df(root, run_id, table, cols):
    order = ", ".join(cols)
    return open_runs(root).execute(f"SELECT {order} FROM {table} WHERE run_id = ? ORDER BY {order}", [run_id]).df()


@pytest.mark.parametrize(
    "gqa, layers, batch",
    [("sum", 3, 2), ("max", 2, 1), ("none", 2, 2)],
    ids=["sum-3-layers-padded-batch", "max", "none-padded-batch"],
)
@pytest.mark.slow
def test_replay_equals_two_full_forwards_in_fp64(tmp_path, gqa, layers, batch):
    model = tiny_model("llama", layers=layers, q_heads=4, kv_heads=2).double()
    ids = torch.randint(3, 256, (batch, 18), generator=torch.Generator().manual_seed(layers))
    mask = torch.ones_like(ids)
    if batch > 1:  # the second request is left-padded: 5 pad tokens, 13 prompt tokens
        mask[1, :5], ids[1, :5] = 0, 0
    with recorders.record(model, H2OConfig(heavy=3, recent=3, gqa=gqa), out=tmp_path, fsync=False) as run:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0)
    summary = replay(tmp_path / run.run_id, model=model, progress=False)
    assert summary.implementation_ok and summary.requests == batch

    tok = _df(tmp_path, run.run_id, "tokens", ["request", "position", "token_id", "is_prompt"])
    q_head = ["q_head"] if gqa == "none" else []
    ev = _df(tmp_path, run.run_id, "evictions", ["request", "step", "layer", "kv_head", "position", *q_head])
    dropped = _df(tmp_path, run.run_id, "replay", ["request", "step", "layer", "q_head", "dropped_mass"])
    per_step = _df(tmp_path, run.run_id, "replay_steps", ["request", "step", "kl", "top1_agree", "teacher_logprob"])
    oracle = _df(
        tmp_path,
        run.run_id,
        "oracle",
        ["request", "step", "layer", "kv_head", "position", "teacher_score", "teacher_future_mass", *q_head],
    )
    hq, group = 4, 2
    sets = hq if gqa == "none" else 2
    checked = 0
    for request in range(batch):
        mine = tok[tok.request == request]
        p, ids_r = int(mine.is_prompt.sum()), mine.token_id.to_numpy()
        n = len(ids_r) - 1  # the last generated token is never fed
        assert p == (13 if request else 18)
        steps = _evict_steps(ev, request, layers, sets, n, gqa)
        teacher, masked, att = _brute_force(model, ids_r[:n], p, steps)

        # KL(teacher ‖ masked), top-1 agreement and the teacher's log-probability, per step
        lt, lm = teacher.log_softmax(-1), masked.log_softmax(-1)
        rows = per_step[per_step.request == request]
        assert rows.step.tolist() == list(range(p - 1, n))
        np.testing.assert_allclose(rows.kl, (lt.exp() * (lt - lm)).sum(-1).clamp(min=0), atol=1e-6)
        assert rows.top1_agree.tolist() == (teacher.argmax(-1) == masked.argmax(-1)).tolist()
        nxt = torch.as_tensor(ids_r[p : n + 1])
        np.testing.assert_allclose(rows.teacher_logprob, lt.gather(-1, nxt[:, None])[:, 0], rtol=1e-6, atol=1e-6)

        # dropped mass: the full row's weight on positions gone before step t
        per_q = torch.as_tensor(steps).repeat_interleave(hq // sets, 1)  # (L, Hq, N)
        t = torch.arange(n)[:, None]
        gone = per_q[:, :, None, :] < t  # (L, Hq, N, N)
        want = (att * gone).sum(-1)  # (L, Hq, N)
        got = dropped[dropped.request == request]
        assert len(got) == layers * hq * (n - p + 1)
        np.testing.assert_allclose(
            got.dropped_mass, want[got.layer.to_numpy(), got.q_head.to_numpy(), got.step.to_numpy()], atol=1e-6
        )
        assert got.dropped_mass.max() > 0.05  # the run did drop attention mass

        # oracle: each victim's aggregated teacher weight up to its eviction step and after it
        agg = att.reshape(layers, hq // group, group, n, n)
        agg = agg.amax(2) if gqa == "max" else agg.sum(2)  # (L, Hkv, N, N)
        rows_o = oracle[oracle.request == request]
        assert len(rows_o) == ((ev.request == request) & (ev.position < n)).sum()
        for r in rows_o.itertuples():
            a = att[r.layer, r.q_head] if gqa == "none" else agg[r.layer, r.kv_head]  # (N, N)
            assert r.teacher_score == pytest.approx(float(a[: r.step + 1, r.position].sum()), abs=1e-5)
            assert r.teacher_future_mass == pytest.approx(float(a[r.step + 1 :, r.position].sum()), abs=1e-5)
            checked += 1
    assert checked > 0


@pytest.mark.slow
def test_replay_memory_stays_within_row_blocks(tmp_path):
    """A long answer replayed 16 rows at a time: no allocation reaches half an M x N float
    matrix (M generated rows fed, N positions); the largest ones are the (M, vocab) logits."""
    from torch.profiler import ProfilerActivity, profile

    model = tiny_model("llama", layers=1, q_heads=4, kv_heads=2, vocab=128)
    p, new = 32, 600
    ids = torch.randint(3, 128, (1, p), generator=torch.Generator().manual_seed(1))
    with recorders.record(model, H2OConfig(heavy=8, recent=8), out=tmp_path, fsync=False) as run:
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        summary = replay(tmp_path / run.run_id, model=model, progress=False, chunk=16)
    assert summary.implementation_ok and summary.steps == new
    n = p + new - 1  # positions fed
    m = n - p  # generated rows of the answer forwards
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest >= m * 128 * 4  # the profiler saw the logits
    assert largest < m * n * 4 / 2, f"an allocation of {largest} bytes; an {m} x {n} float matrix is {m * n * 4}"


def test_replay_of_a_float32_run_takes_the_teacher_weights_from_the_rows_log_sum_exp(tmp_path):
    """On CPU in float32 the kernel that gives the teacher's output also gives each row's
    log-sum-exp, so the tile pass runs no softmax; the tables still match the FP64 replay."""
    from torch.profiler import ProfilerActivity, profile

    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with recorders.record(model, H2OConfig(heavy=6, recent=6), out=tmp_path, fsync=False) as run:
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        summary = replay(tmp_path / run.run_id, model=model, progress=False)
    assert summary.implementation_ok and summary.steps == 24
    softmax = [e.name for e in prof.events() if e.name in ("aten::softmax", "aten::_softmax")]
    assert not softmax, f"the replay ran {len(softmax)} softmax calls"
    cols = ["request", "step", "layer", "q_head", "dropped_mass"]
    got = _df(tmp_path, run.run_id, "replay", cols)
    oracle_cols = ["request", "step", "layer", "kv_head", "position", "teacher_score", "teacher_future_mass"]
    oracle = _df(tmp_path, run.run_id, "oracle", oracle_cols)
    replay(tmp_path / run.run_id, model=model.double(), progress=False)  # the same run in FP64: softmax weights
    np.testing.assert_allclose(got.dropped_mass, _df(tmp_path, run.run_id, "replay", cols).dropped_mass, atol=1e-6)
    want = _df(tmp_path, run.run_id, "oracle", oracle_cols)
    np.testing.assert_allclose(oracle.teacher_score, want.teacher_score, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(oracle.teacher_future_mass, want.teacher_future_mass, rtol=1e-5, atol=1e-6)
    assert got.dropped_mass.max() > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_request_that_lost_nothing_is_forwarded_once(tmp_path, monkeypatch, dtype):
    """With nothing evicted the masked forward would make the teacher's calls on the teacher's
    inputs, so the replay takes the teacher's logits for it: one forward over the answer, and
    the same tables, bit for bit, as with both forwards. A request that lost keys runs both."""
    import recorders.replay as replay_mod

    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2).to(dtype)
    ids = torch.randint(3, 256, (2, 14), generator=torch.Generator().manual_seed(5))
    gen = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    runs = {}
    for name, config in (
        ("full", H2OConfig(policy="full")),
        ("roomy", H2OConfig(heavy=16, recent=16)),  # 32 slots: the 24 positions never fill them
        ("tight", H2OConfig(heavy=3, recent=3)),
    ):
        with recorders.record(model, config, out=tmp_path / name, fsync=False) as run:
            with torch.no_grad():
                model.generate(input_ids=ids, **gen)
        runs[name] = tmp_path / name / run.run_id

    forwards = []  # forwards over an answer's rows (9 fed: the last new token is never fed)

    def count(module, args, kwargs):
        if kwargs["input_ids"].shape == (1, 9):
            forwards.append(1)

    hook = model.model.register_forward_pre_hook(count, with_kwargs=True)
    cols = {
        "replay_steps": ["request", "step", "kl", "top1_agree", "teacher_logprob"],
        "replay": ["request", "step", "layer", "q_head", "dropped_mass"],
    }

    def tables(run_dir):
        return {t: _df(run_dir.parent, run_dir.name, t, c) for t, c in cols.items()}

    try:
        got = {}
        for name, run_dir in runs.items():
            forwards.clear()
            summary = replay(run_dir, model=model, progress=False)
            assert summary.implementation_ok and summary.steps == 2 * 10
            # per request the teacher, and the masked forward only where a key was lost
            assert len(forwards) == 2 * (2 if name == "tight" else 1), name
            got[name] = tables(run_dir)
        assert got["tight"]["replay_steps"].kl.max() > 0
        for name in ("full", "roomy"):
            steps = got[name]["replay_steps"]
            assert (steps.kl == 0).all() and steps.top1_agree.all(), name
            assert (got[name]["replay"].dropped_mass == 0).all(), name

        original = replay_mod._forward
        monkeypatch.setattr(replay_mod, "_forward", lambda *a: original(*a[:7], lost_nothing=False))
        for name in ("full", "roomy"):  # both forwards, as before: the same tables, bit for bit
            forwards.clear()
            replay(runs[name], model=model, progress=False)
            assert len(forwards) == 2 * 2
            both = tables(runs[name])
            for t in cols:
                assert both[t].equals(got[name][t]), (name, t)
    finally:
        hook.remove()
