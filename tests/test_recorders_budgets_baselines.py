"""Budgets resolved per request, and baselines that log what drove their choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_utils import KeptRecorder, assert_same_sets, capture_qk, reference_sets
from runtime_utils import left_pad as _left_pad
from tiny import tiny_model

import h2o_lens
import recorders
from h2o_lens import H2OConfig
from runlog import open_runs, read_manifest

LENS = (10, 30, 18)  # the request under test is the first; mates longer and shorter


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, mask=None, new=8):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)


def _batch_and_alone(model, cfg, seqs, new=8):
    """Kept sets of every request in one padded batch, and of each request run alone."""
    ids, mask = _left_pad(seqs)
    rec = KeptRecorder()
    with h2o_lens.h2o(model, cfg, listener=rec), capture_qk() as qk:
        out = _generate(model, ids, mask, new)
    alone = []
    for s in seqs:
        one = KeptRecorder()
        with h2o_lens.h2o(model, cfg, listener=one) as session:
            seq = _generate(model, s[None], None, new)
        alone.append((one, seq[0], session.last_cache.resolved_config))
    return ids, out, rec, qk, alone


def test_ratio_budget_is_per_request_alone_equals_batched_and_reference():
    """A keep ratio resolves on each request's own prompt: a 10-token request keeps the
    same slots alone and next to longer and shorter mates, and both equal the FP64 reference."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2)
    seqs = [_ids(n, seed=n) for n in LENS]
    cfg = H2OConfig(ratio=0.4)
    ids, out, rec, qk, alone = _batch_and_alone(model, cfg, seqs)
    width = ids.shape[1]
    for r, s in enumerate(seqs):
        one, seq, resolved = alone[r]
        heavy, recent = resolved.heavy, resolved.recent
        assert heavy + recent == max(2, round(0.4 * len(s)))
        assert torch.equal(out[r, width - len(s) :], seq), f"request {r} generated other tokens"
        for layer in range(2):
            batched = [st[r] for st in rec.kept[layer]]
            assert batched == [st[0] for st in one.kept[layer]], f"request {r} layer {layer}"
            expected = reference_sets(qk[layer], r, len(s), heavy, recent, "sum", offset=width - len(s))
            assert_same_sets(batched, expected, f"request {r} layer {layer}")
            # at most B_r slots are ever held, whatever the batch width
            assert max(len(kv) for st in batched for kv in st) <= heavy + recent


def test_ratio_budgets_are_logged_per_request(tmp_path):
    """The requests table holds each request's own budget; two generate calls in one scope
    each keep theirs, and the run-level budget is null when they differ."""
    model = tiny_model("llama")
    seqs = [_ids(n, seed=n) for n in LENS]
    ids, mask = _left_pad(seqs)
    with recorders.record(model, H2OConfig(ratio=0.4), out=tmp_path, fsync=False) as run:
        _generate(model, ids, mask, 6)
        _generate(model, _ids(25, seed=1)[None], None, 6)
    con = open_runs(tmp_path)
    rows = con.execute("SELECT request, prompt_len, heavy, recent FROM requests ORDER BY request").fetchall()
    assert [r[1] for r in rows] == [*LENS, 25]
    for request, n, heavy, recent in rows:
        total = max(2, round(0.4 * n))
        assert (heavy, recent) == (total // 2, total - total // 2), f"request {request}"
        # the slots the cache actually held: prefill steps row of the request
        (kept,) = con.execute("SELECT max(kept) FROM steps WHERE request = ? AND step = ?", [request, n - 1]).fetchone()
        assert kept == min(n, total)
    m = read_manifest(run.run_dir)
    assert m["heavy"] is None and m["recent"] is None and m["budget_per_request"] is True
    assert m["keep_ratio"] == 0.4


def test_measures_read_each_request_budget_when_the_run_has_none(tmp_path):
    """With per-request budgets ``runs.recent`` is null: the stale-heavy window defaults to the
    widest recent window of the run's requests (not to 1 step)."""
    import analyses

    model = tiny_model("llama")
    seqs = [_ids(n, seed=n) for n in LENS]
    ids, mask = _left_pad(seqs)
    with recorders.record(model, H2OConfig(ratio=0.4), out=tmp_path, fsync=False) as run:
        _generate(model, ids, mask, 24)
    con = open_runs(tmp_path)
    assert con.execute("SELECT recent FROM runs").fetchall() == [(None,)]
    recent = dict(con.execute("SELECT request, recent FROM requests").fetchall())
    assert len(set(recent.values())) > 1
    widest = max(recent.values())
    keys = ["request", "step", "layer", "kv_head"]
    got = analyses.stale_holders(con, run.run_id).df().sort_values(keys, ignore_index=True)
    assert len(got) and int(got["span"].min()) >= widest
    same = analyses.stale_holders(con, run.run_id, window=widest).df().sort_values(keys, ignore_index=True)
    assert got.equals(same)


def test_slot_budget_keeps_run_level_counts(tmp_path):
    model = tiny_model("llama")
    with recorders.record(model, H2OConfig(heavy=3, recent=2), out=tmp_path, fsync=False) as run:
        _generate(model, _ids(12, seed=0)[None], None, 4)
        _generate(model, _ids(20, seed=1)[None], None, 4)
    m = read_manifest(run.run_dir)
    assert (m["heavy"], m["recent"], m["budget_per_request"]) == (3, 2, False)
    rows = open_runs(tmp_path).execute("SELECT heavy, recent FROM requests").fetchall()
    assert rows == [(3, 2), (3, 2)]


def test_ratio_budgets_follow_beam_rows():
    """Beam search expands and reorders the rows; each row keeps its request's budget."""
    model = tiny_model("llama")
    seqs = [_ids(n, seed=n) for n in (10, 30)]
    ids, mask = _left_pad(seqs)
    with h2o_lens.h2o(model, ratio=0.4) as s, torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0
        )
    cache = s.last_cache
    b = cache.request_budgets()
    assert b["heavy"].tolist() == [2, 2, 6, 6] and b["recent"].tolist() == [2, 2, 6, 6]
    assert cache.resolved_config is None  # no single budget for the batch
    layer = cache.layers[0]
    held = (layer.positions >= 0).sum(-1)  # (rows, Hs)
    assert held[:2].max() <= 4 and held[2:].max() <= 12 and layer.keys.shape[2] == 12


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["random", "local", "sink", "heavy"])
def test_baseline_alone_equals_batched(policy):
    """Every baseline, random included, keeps the same sets for a request alone and in a batch."""
    model = tiny_model("llama")
    seqs = [_ids(n, seed=n + 7) for n in (14, 26, 9)]
    cfg = H2OConfig(policy=policy, heavy=3, recent=3, sink=2, seed=5)
    _, out, rec, _, alone = _batch_and_alone(model, cfg, seqs)
    for r in range(len(seqs)):
        one = alone[r][0]
        for layer in one.kept:
            assert [st[r] for st in rec.kept[layer]] == [st[0] for st in one.kept[layer]], f"request {r}"


def test_random_choice_is_a_function_of_seed_layer_set_position():
    from h2o_lens.ops import random_scores

    pos = torch.arange(40).reshape(1, 1, 40).expand(2, 3, 40)
    a = random_scores(7, 1, pos, 39)
    assert a.shape == (2, 3, 40) and a.dtype == torch.float32
    assert bool(((a >= 0) & (a < 1)).all())
    assert torch.equal(a[0], a[1])  # the batch row plays no part
    assert not torch.equal(a[:, 0], a[:, 1])  # the KV set does
    assert not torch.equal(a, random_scores(8, 1, pos, 39))  # the seed does
    assert not torch.equal(a, random_scores(7, 0, pos, 39))  # the layer does
    assert not torch.equal(a, random_scores(7, 1, pos, 40))  # the step does
    # a slot's draw does not depend on where it sits
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(random_scores(7, 1, pos[..., perm], 39), a[..., perm])
    # roughly uniform
    big = random_scores(0, 0, torch.arange(20000).reshape(1, 1, -1), 5)
    assert abs(float(big.mean()) - 0.5) < 0.01


@pytest.mark.parametrize("policy", ["local", "sink", "random"])
def test_baseline_rows_log_the_scores_that_chose(tmp_path, policy):
    """Prefill and decode rows of the unscored baselines carry the quantity that made the
    choice (0 for local/sink, the seeded draw for random), so every margin is >= 0."""
    model = tiny_model("llama")
    seqs = [_ids(n, seed=n) for n in (30, 17)]
    ids, mask = _left_pad(seqs)
    cfg = H2OConfig(policy=policy, heavy=3, recent=4, sink=2, seed=3)
    with recorders.record(model, cfg, out=tmp_path, fsync=False):
        _generate(model, ids, mask, 8)
    ev = (
        open_runs(tmp_path)
        .execute("SELECT request, step, layer, kv_head, position, score, margin, phase FROM evictions")
        .df()
    )
    assert set(ev.phase) == {"prefill", "decode"}
    assert not (ev.margin < 0).any(), ev[ev.margin < 0]  # NaN: no eligible survivor
    if policy == "random":
        from h2o_lens.ops import random_scores

        pre = ev[ev.phase == "prefill"]
        for (layer, head, step), g in pre.groupby(["layer", "kv_head", "step"]):
            pos = torch.tensor(g.position.to_numpy()).reshape(1, 1, -1)
            draw = random_scores(3, int(layer), pos.expand(1, head + 1, -1), int(step))[0, head]
            np.testing.assert_array_equal(g.score.to_numpy(), draw.numpy())
    else:
        assert (ev.score == 0).all() and not (ev.margin > 0).any()


# ----------------------------------------------------------------------------- record CLI


@pytest.fixture
def no_model(monkeypatch):
    """``record`` must refuse bad input before any model is loaded."""
    import h2o_lens.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(h2o_lens.models, "load_model", refuse)


@pytest.mark.parametrize(
    "case, needle",
    [
        ("out_is_file", "is an existing file"),
        ("zero_tokens", "--max-new-tokens must be at least 1, got 0"),
        ("missing_prompt_file", "does not exist"),
        ("unknown_task", "unknown task 'no_such_task_0'"),
        ("empty_prompt", "--prompt is empty"),
        ("blank_prompt_file", "is empty"),
        ("evidence_not_in_prompt", "does not occur in the prompt"),
        ("bad_evidence", "LABEL=TEXT"),
        ("two_prompts", "give one of"),
        ("bad_policy", "unknown policy"),
    ],
)
def test_record_refuses_bad_input_before_loading_the_model(tmp_path, capsys, no_model, case, needle):
    from commands.cli import main

    runs = tmp_path / "runs"
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n", encoding="utf-8")
    afile = tmp_path / "afile"
    afile.write_text("x", encoding="utf-8")
    argv = {
        "out_is_file": ["--out", str(afile)],
        "zero_tokens": ["--max-new-tokens", "0"],
        "missing_prompt_file": ["--prompt-file", str(tmp_path / "nope.txt")],
        "unknown_task": ["--task", "no_such_task_0"],
        "empty_prompt": ["--prompt", ""],
        "blank_prompt_file": ["--prompt-file", str(blank)],
        "evidence_not_in_prompt": ["--prompt", "the code is 4419", "--evidence", "code=5520"],
        "bad_evidence": ["--prompt", "the code is 4419", "--evidence", "code"],
        "two_prompts": ["--prompt", "hello", "--prompt-file", str(blank)],
        "bad_policy": ["--policy", "lru"],
    }[case]
    if "--out" not in argv:
        argv += ["--out", str(runs)]
    rc = main(["record", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h2o-lens: error: ") and needle in lines[0], err
    assert not runs.exists() or not any(runs.iterdir())  # no run folder left behind
    assert afile.read_text() == "x"


def test_record_full_policy_says_the_budget_is_ignored(tmp_path, capsys, no_model):
    from commands.cli import main

    with pytest.raises(AssertionError, match="model was loaded"):  # valid input: it goes on to load
        main(["record", "--policy", "full", "--heavy", "8", "--prompt", "hello", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--policy full keeps every token; --heavy/--recent/--ratio are ignored" in err
    main_args = ["record", "--policy", "full", "--prompt", "hello", "--out", str(tmp_path)]
    with pytest.raises(AssertionError):
        main(main_args)
    assert "ignored" not in capsys.readouterr().err


@pytest.mark.kernel
@pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1 (set by `make test`)",
)
def test_per_request_budgets_on_the_triton_backend():
    """Rows of different budgets step through the fused kernel on their own slots, like torch."""
    model = tiny_model("llama")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    ids, mask = _left_pad([_ids(n, seed=n) for n in LENS])
    runs = {}
    for backend in ("torch", "triton"):
        with h2o_lens.h2o(model, H2OConfig(ratio=0.4, backend=backend)) as s:
            out = _generate(model, ids.to(device), mask.to(device), 8)
        assert s.last_cache.backend == backend and len(s.last_cache.budgets) == 3
        runs[backend] = (out, [layer.positions.sort(-1).values for layer in s.last_cache.layers])
    assert torch.equal(runs["torch"][0], runs["triton"][0])
    for a, b in zip(runs["torch"][1], runs["triton"][1]):
        assert torch.equal(a, b)
