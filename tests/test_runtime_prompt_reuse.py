"""One prompt forward serves every H2O configuration of a batch (DESIGN.md §12.5).

Inside ``reuse_prompts`` a generate of a prompt batch already prefilled under another
configuration skips the model's forward over the prompt. Each configuration must still get
exactly what its own prefill gives it: the same tokens, logits and final cache state, bit
for bit, and a forward that differs in anything the prefill reads must not be reused.
"""

from __future__ import annotations

import pytest
import torch
from faulty import inject
from tiny import left_padded, tiny_model

import h2o_lens
import recorders
from h2o_lens import H2OConfig
from h2o_lens.prompt_reuse import PromptReuse, reuse_prompts

STATE = ("keys", "values", "scores", "positions", "history", "fill", "next_pos", "budget")


def _prompts(lengths=(19, 11, 15), seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded(lengths, seed)


def _generate(model, cfg, ids, mask, new: int = 9):
    """Tokens, per-step logits, the final cache and how many forwards reached the first layer."""
    calls = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad(), h2o_lens.h2o(model, cfg) as session:
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
    finally:
        hook.remove()
    return out, session.last_cache, len(calls)


def _assert_same(a, b, what: str) -> None:
    (out_a, cache_a, _), (out_b, cache_b, _) = a, b
    assert torch.equal(out_a.sequences, out_b.sequences), what
    assert all(torch.equal(x, y) for x, y in zip(out_a.logits, out_b.logits, strict=True)), what
    for i, (la, lb) in enumerate(zip(cache_a.layers, cache_b.layers, strict=True)):
        for name in STATE:
            x, y = getattr(la, name), getattr(lb, name)
            assert (x is None and y is None) or torch.equal(x, y), f"{what}: layer {i} {name}"


CONFIGS = {
    "h2o sum": H2OConfig(heavy=4, recent=4),
    "h2o max": H2OConfig(heavy=4, recent=4, gqa="max"),
    "h2o none": H2OConfig(heavy=5, recent=3, gqa="none"),
    "tova": H2OConfig(policy="tova", heavy=4, recent=4),
    "scissorhands": H2OConfig(policy="scissorhands", heavy=4, recent=4),
    "local": H2OConfig(policy="local", heavy=0, recent=8),
    "random": H2OConfig(policy="random", heavy=4, recent=4, seed=3),
    "ratio per row": H2OConfig(ratio=0.5),
    "pinned": H2OConfig(heavy=4, recent=4, pinned=(0, 2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_reused_prompt_forward_gives_each_configuration_the_bits_of_its_own_prefill(name, dtype):
    model = tiny_model("llama", layers=3).to(dtype)
    ids, mask = _prompts()
    cfg = CONFIGS[name]
    own = _generate(model, cfg, ids, mask)
    # another policy and budget, the same aggregation: its prompt forward is the one to reuse
    primer = H2OConfig(heavy=3, recent=2, gqa=cfg.gqa) if cfg.policy != "h2o" or cfg.heavy != 3 else CONFIGS["local"]
    with reuse_prompts(model) as scope:
        first = _generate(model, primer, ids, mask)
        reused = _generate(model, cfg, ids, mask)
    assert (scope.hits, scope.misses) == (1, 1)
    # the prompt forward ran once: one forward over the prompt, then one per new token after the first
    assert first[2] == 9 and reused[2] == 8 and own[2] == 9
    _assert_same(own, reused, name)
    _assert_same(_generate(model, primer, ids, mask), first, "primer")
    assert "forward" not in vars(model)  # the scope put the model back


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_with_any_gqa_a_prompt_forward_serves_another_aggregation_with_the_bits_of_its_own(name, dtype):
    """``any_gqa``: the column sums of another aggregation come from the kept queries and row
    log-sum-exps (the same column pass on the same inputs)."""
    model = tiny_model("llama", layers=3).to(dtype)
    ids, mask = _prompts()
    cfg = CONFIGS[name]
    own = _generate(model, cfg, ids, mask)
    other = {"sum": "none", "max": "sum", "none": "max"}[cfg.gqa]
    with reuse_prompts(model, keep=1, any_gqa=True) as scope:
        _generate(model, H2OConfig(heavy=3, recent=2, gqa=other), ids, mask)
        reused = _generate(model, cfg, ids, mask)
        again = _generate(model, cfg, ids, mask)  # its columns are now kept: no column pass
    assert (scope.hits, scope.misses) == (2, 1) and reused[2] == again[2] == 8
    _assert_same(own, reused, name)
    _assert_same(own, again, name)
    # without any_gqa another aggregation is another forward
    with reuse_prompts(model, keep=2) as scope:
        _generate(model, H2OConfig(heavy=3, recent=2, gqa=other), ids, mask)
        _generate(model, cfg, ids, mask)
    assert (scope.hits, scope.misses) == (0, 2)


@pytest.mark.slow
@pytest.mark.compat  # generate calls the forward its own way on each release (DESIGN.md §3.1)
def test_a_prompt_forward_is_reused_only_for_the_same_inputs_and_aggregation():
    model = tiny_model("llama", layers=2)
    ids, mask = _prompts()
    cfg = H2OConfig(heavy=4, recent=4)
    other_ids = ids.clone()
    other_ids[0, -1] = (other_ids[0, -1] + 1) % 250 + 3
    shorter = _prompts((19, 11, 14))
    cases = {
        "another token": (cfg, other_ids, mask),
        "another padding": (cfg, *shorter),
        "another aggregation": (H2OConfig(heavy=4, recent=4, gqa="max"), ids, mask),
        "one row fewer": (cfg, ids[:2], mask[:2]),
    }
    own = {what: _generate(model, *args) for what, args in cases.items()}
    with reuse_prompts(model, keep=8) as scope:
        _generate(model, cfg, ids, mask)
        for what, args in cases.items():
            before = scope.misses
            got = _generate(model, *args)
            assert scope.misses == before + 1 and scope.hits == 0 and got[2] == 9, what
            _assert_same(own[what], got, what)
        with inject("prefix_without_copy"):  # another layer class (a diagnosis fault): nothing is reused
            _generate(model, H2OConfig(policy="local", heavy=0, recent=8), ids, mask)
        assert scope.hits == 0
        reused = _generate(model, H2OConfig(policy="local", heavy=0, recent=8), ids, mask)
        assert scope.hits == 1 and reused[2] == 8
    assert "forward" not in vars(model)


def test_a_different_dtype_is_a_different_prompt_forward():
    model = tiny_model("llama", layers=2)
    ids, mask = _prompts()
    with reuse_prompts(model) as scope:
        _generate(model, H2OConfig(heavy=4, recent=4), ids, mask)
        model.to(torch.bfloat16)
        got = _generate(model, H2OConfig(policy="local", heavy=0, recent=8), ids, mask)
        assert (scope.hits, scope.misses) == (0, 2)
    _assert_same(_generate(model, H2OConfig(policy="local", heavy=0, recent=8), ids, mask), got, "bf16")


@pytest.mark.slow
def test_the_oldest_prompt_forward_goes_first_and_the_scope_restores_the_model():
    model = tiny_model("llama", layers=2)
    a, b = _prompts(seed=1), _prompts(seed=2)
    cfg = H2OConfig(heavy=4, recent=4)
    with reuse_prompts(model, keep=1) as scope:
        _generate(model, cfg, *a)
        _generate(model, cfg, *b)  # a goes
        _generate(model, cfg, *a)
        assert (scope.hits, scope.misses) == (0, 3)
        _generate(model, cfg, *a)
        assert scope.hits == 1
        scope.clear()
        _generate(model, cfg, *a)
        assert scope.hits == 1
    assert "forward" not in vars(model)
    with pytest.raises(RuntimeError, match="boom"), reuse_prompts(model):
        raise RuntimeError("boom")
    assert "forward" not in vars(model)
    with pytest.raises(ValueError, match="keep=0"):
        PromptReuse(model, keep=0)


@pytest.mark.slow
@pytest.mark.compat
def test_a_recording_from_a_reused_prompt_forward_is_the_recording_of_its_own(tmp_path):
    """The recorder hears the same prefill (events, prompt pass for the replay, the batch a replay
    forwards again) and the replay tables are the same."""
    import pandas as pd

    from recorders.replay import replay
    from runlog.manifest import read_manifest
    from runlog.store import load_run

    model = tiny_model("llama", layers=3)
    ids, mask = _prompts()
    cfg = H2OConfig(policy="tova", heavy=4, recent=4)

    def record(out, reuse: bool):
        scope = PromptReuse(model) if reuse else None
        if scope is not None:
            scope.__enter__()
            with recorders.record(model, H2OConfig(heavy=3, recent=3), out=out / "primer", fsync=False):
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        try:
            with recorders.record(model, cfg, out=out, fsync=False, keep_prompt_pass=True) as rec:
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        finally:
            if scope is not None:
                assert (scope.hits, scope.misses) == (1, 1)
                scope.__exit__(None, None, None)
        return rec

    own, reused = record(tmp_path / "own", False), record(tmp_path / "reused", True)
    assert sorted(reused.prompt_passes) == sorted(own.prompt_passes) == [0, 1, 2]
    for r, p in own.prompt_passes.items():
        q = reused.prompt_passes[r]
        assert p.ids == q.ids and torch.equal(p.first, q.first)
        assert all(torch.equal(x, y) for x, y in zip(p.keys + p.values + p.cols, q.keys + q.values + q.cols))
    mine, theirs = read_manifest(own.run_dir), read_manifest(reused.run_dir)
    assert mine["prefill_batches"] == theirs["prefill_batches"]
    # no prefill ran: no prefill time, and the manifest says the forward was reused
    assert mine["prefill_seconds"] > 0 and "prompt_forward_reused" not in mine
    assert theirs["prefill_seconds"] is None and theirs["prompt_forward_reused"] == 1
    tables = ("evictions", "tokens", "steps", "run_logits", "requests")
    a, b = load_run(own.run_dir, tables=tables), load_run(reused.run_dir, tables=tables)
    for t in tables:
        fa, fb = a[t].to_pandas(), b[t].to_pandas()
        drop = [c for c in fa.columns if c in ("run_id", "seconds", "step_seconds")]
        pd.testing.assert_frame_equal(fa.drop(columns=drop), fb.drop(columns=drop), check_exact=True, obj=t)
    for run in (own, reused):
        replay(run.run_dir, model=model, progress=False, prompt_passes=run.prompt_passes)
    replayed = [load_run(r.run_dir, tables=("replay", "replay_steps", "oracle")) for r in (own, reused)]
    for t in ("replay", "replay_steps", "oracle"):
        pd.testing.assert_frame_equal(
            replayed[0][t].to_pandas().drop(columns=["run_id"], errors="ignore"),
            replayed[1][t].to_pandas().drop(columns=["run_id"], errors="ignore"),
            check_exact=True,
            obj=t,
        )


def test_a_batch_of_one_prompt_repeated_costs_one_prompt_forward_and_keeps_each_rows_bits():
    """b copies of one prompt (the culprit search's probes, one set of pins per row, DESIGN.md §19):
    with ``repeated`` the scope runs that prompt's forward once, at one row, and every row starts
    from it; each row equals the same config run alone, before and after the one-row forward is
    held. Without it the batch runs its own prompt forward."""
    model = tiny_model("llama", layers=2)
    ids = left_padded((21,), 3)[0]
    cfg = H2OConfig(heavy=5, recent=3)
    pins = [(), (2,), (2, 9), (4, 11, 15)]

    def run(row_pins):
        batch = ids.expand(len(row_pins), -1)
        with torch.no_grad(), h2o_lens.h2o(model, cfg) as session:
            out = model.generate(
                input_ids=batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
                cache=session.new_cache(row_pins=row_pins),
            )
        return out[:, ids.shape[1] :].tolist(), session.last_cache

    alone = [run([p])[0][0] for p in pins]
    widths = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda _m, a: widths.append(a[0].shape[:2]))
    try:
        with reuse_prompts(model) as scope:  # without repeated: the batch's own prompt forward
            assert run(pins)[0] == alone and (scope.hits, scope.misses) == (0, 1)
        assert widths == [torch.Size([len(pins), ids.shape[1]])] + [torch.Size([len(pins), 1])] * 7
        widths.clear()
        with reuse_prompts(model, repeated=True) as scope:
            first, cache = run(pins)  # nothing held: the one row's forward runs, once
            assert (scope.hits, scope.misses) == (0, 1) and cache.prompt_reused
            again, _ = run(pins[1:])  # held: served to three rows
            one, _ = run(pins[2:3])  # and to one row
            assert (scope.hits, scope.misses) == (2, 1)
    finally:
        hook.remove()
    assert first == alone and again == alone[1:] and one == alone[2:3]
    prompts = [w for w in widths if w[1] == ids.shape[1]]
    assert prompts == [torch.Size([1, ids.shape[1]])]  # one prompt forward, of one row
