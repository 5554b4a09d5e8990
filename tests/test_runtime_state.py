"""Saved, shared and cancelled state (DESIGN.md §15): exact continuation and the lifecycle check."""

from __future__ import annotations

import contextlib

import pytest
import torch
from faulty import inject
from runtime_utils import KeptRecorder
from tiny import tiny_model

import recorders
import runlog
from h2o_lens import H2OConfig, h2o
from h2o_lens.errors import ConfigError
from recorders.lifecycle import check_lifecycle
from runlog import read_manifest

FAMILIES = ["llama", "qwen2"]
KW = dict(do_sample=False, pad_token_id=0)


def _batch(rows=2, width=20, seed=1):
    ids = torch.randint(3, 256, (rows, width), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for r in range(1, rows):
        mask[r, : 3 * r + 2] = 0  # left padding of different widths
    return ids, mask


def _extend(mask, seq):
    """The attention mask of ``seq`` (the prompt's mask, then ones for the generated columns)."""
    return torch.cat([mask, torch.ones(mask.shape[0], seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)


def _generate(model, ids, mask, new, cache):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, cache=cache, **KW)


def _row_state(cache, row):
    return [
        getattr(layer, name)[row].clone()
        for layer in cache.layers
        for name in ("keys", "values", "scores", "positions", "next_pos", "budget")
    ]


# -- save and restore -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_restored_generation_equals_the_uninterrupted_one(tmp_path, family):
    model = tiny_model(family)
    cfg = H2OConfig(heavy=4, recent=3)
    ids, mask = _batch()
    whole, parts = KeptRecorder(), KeptRecorder()
    with h2o(model, cfg) as session:
        full = _generate(model, ids, mask, 12, session.new_cache(listener=whole))
        part = _generate(model, ids, mask, 5, session.new_cache(listener=parts))
        session.save(tmp_path / "state.pt")
    blob = torch.load(tmp_path / "state.pt", weights_only=True)  # plain tensors and a JSON header
    assert set(blob) == {"format", "header", "tensors"}
    with h2o(model, cfg) as session:
        cache = session.restore(tmp_path / "state.pt", listener=parts)
        assert cache.layers[0].next_pos.tolist() == [24, 24 - 5]  # prompt + 4 fed tokens, padding excluded
        rest = _generate(model, part, _extend(mask, part), 7, cache)
    assert rest.tolist() == full.tolist()
    assert {k: v for k, v in parts.kept.items()} == {k: v for k, v in whole.kept.items()}


def test_a_restored_pinned_generation_keeps_its_pins(tmp_path):
    """Pins survive a save and restore: the restored cache gets its Pins extension back from the
    saved budgets, and the continued run equals the uninterrupted one with every pin kept."""
    from h2o_lens.config import pin
    from h2o_lens.pins import Pins

    model = tiny_model("llama")
    cfg = pin(H2OConfig(policy="local", heavy=4, recent=3), (0, 2))
    ids, mask = _batch(rows=1)
    whole, parts = KeptRecorder(), KeptRecorder()
    with h2o(model, cfg) as session:
        full = _generate(model, ids, mask, 10, session.new_cache(listener=whole))
        part = _generate(model, ids, mask, 4, session.new_cache(listener=parts))
        session.save(tmp_path / "state.pt")
    with h2o(model, cfg) as session:
        cache = session.restore(tmp_path / "state.pt", listener=parts)
        assert any(isinstance(e, Pins) for e in cache.extensions)
        rest = _generate(model, part, _extend(mask, part), 6, cache)
    assert rest.tolist() == full.tolist() and parts.kept == whole.kept
    assert all({0, 2} <= set(kv) for layer in whole.kept.values() for step in layer for row in step for kv in row)


def test_restore_refuses_another_model_another_config_and_other_files(tmp_path):
    model = tiny_model("llama")
    cfg = H2OConfig(heavy=4, recent=3)
    ids, mask = _batch()
    with h2o(model, cfg) as session:
        _generate(model, ids, mask, 3, session.new_cache())
        path = session.save(tmp_path / "state.pt")
    with h2o(tiny_model("llama", seed=1), cfg) as session, pytest.raises(ConfigError, match="another model.*weights"):
        session.restore(path)
    with h2o(tiny_model("qwen2"), cfg) as session, pytest.raises(ConfigError, match="architecture"):
        session.restore(path)
    with h2o(model, H2OConfig(heavy=4, recent=4)) as session, pytest.raises(ConfigError, match="recent=3"):
        session.restore(path)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with h2o(model, cfg) as session:
        with pytest.raises(ConfigError, match="not a saved H2O state"):
            session.restore(tmp_path / "other.pt")
        (tmp_path / "junk.pt").write_bytes(b"not a torch file")
        with pytest.raises(ConfigError, match="cannot read"):
            session.restore(tmp_path / "junk.pt")
        with pytest.raises(ConfigError, match="no cache to save"):
            session.save(tmp_path / "empty.pt")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_recorded_across_save_and_restore_is_analysable(tmp_path, family):
    model = tiny_model(family)
    cfg = H2OConfig(heavy=4, recent=3)
    ids, mask = _batch(rows=3)
    with h2o(model, cfg) as session:
        full = _generate(model, ids, mask, 10, session.new_cache())
    with recorders.record(model, cfg, out=tmp_path, fsync=False) as run:
        part = _generate(model, ids, mask, 4, None)
        run.session.save(tmp_path / "state.pt")
        cache = run.session.restore(tmp_path / "state.pt")
        rest = _generate(model, part, _extend(mask, part), 6, cache)
    assert rest.tolist() == full.tolist()
    loaded = runlog.load_run(run.run_dir, tables=("tokens", "requests", "run_logits"))
    assert loaded["requests"]["new_tokens"].to_pylist() == [10, 10, 10]
    tok = loaded["tokens"].to_pydict()
    row1 = [t for r, t in zip(tok["request"], tok["token_id"]) if r == 1]
    assert row1 == full[1][mask[1].bool().tolist() + [True] * 10].tolist()
    logits = loaded["run_logits"].to_pydict()
    assert sorted(s for r, s in zip(logits["request"], logits["step"]) if r == 0) == list(range(19, 29))
    events = read_manifest(run.run_dir)["state_events"]
    assert [e["event"] for e in events] == ["save", "restore"] and events[1]["requests"] == [0, 1, 2]
    result = check_lifecycle(run.run_dir, model, tolerance=0.0)
    assert result.ok, [r.describe() for r in result.failed]
    assert all(r.steps == 10 for r in result.requests)


def test_a_continued_generation_must_feed_the_recorded_tokens(tmp_path):
    model = tiny_model("llama")
    ids, mask = _batch()
    with recorders.record(model, H2OConfig(heavy=4, recent=3), out=tmp_path, fsync=False) as run:
        part = _generate(model, ids, mask, 3, None)
        cache = run.session.last_cache
        other = part.clone()
        other[0, -2] = (other[0, -2] + 1) % 256
        with pytest.raises(runlog.RecorderError, match="do not start with the .* tokens recorded so far"):
            _generate(model, other, _extend(mask, other), 3, cache)


# -- cancellation ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_cancel_frees_the_rows_and_leaves_the_others_byte_identical(tmp_path, family):
    model = tiny_model(family)
    cfg = H2OConfig(heavy=4, recent=3)
    ids, mask = _batch(rows=3)
    with h2o(model, cfg) as session:
        full = _generate(model, ids, mask, 10, session.new_cache())
    with recorders.record(model, cfg, out=tmp_path, fsync=False) as run:
        part = _generate(model, ids, mask, 4, None)
        cache = run.session.last_cache
        before = {r: _row_state(cache, r) for r in (0, 2)}
        kv_before = cache.nbytes()["kv"]
        keep = cache.cancel(1)
        assert keep == [0, 2] and cache.request_ids == [0, 2]
        assert cache.nbytes()["kv"] * 3 == kv_before * 2  # its slots are gone
        for new_row, old_row in enumerate(keep):
            for a, b in zip(_row_state(cache, new_row), before[old_row]):
                assert torch.equal(a, b)
        rest = _generate(model, part[keep], _extend(mask, part)[keep], 6, cache)
        with pytest.raises(ConfigError, match="not rows of this batch"):
            cache.cancel(5)
    assert rest.tolist() == full[keep].tolist()
    loaded = runlog.load_run(run.run_dir, tables=("requests",))
    assert loaded["requests"]["new_tokens"].to_pylist() == [10, 4, 10]  # request 1 ended when cancelled
    events = read_manifest(run.run_dir)["state_events"]
    assert events == [{"seq": 0, "event": "cancel", "rows": [1], "requests": [1]}]
    result = check_lifecycle(run.run_dir, model, tolerance=0.0)
    assert result.ok, [r.describe() for r in result.failed]


# -- beam reorder and its fault -------------------------------------------------------------------


def _faulty(fault: str | None):
    """The caches of the block have the known bug ``fault`` (tests/faulty.py), or none."""
    return inject(fault) if fault else contextlib.nullcontext()


def _record_reordered(model, out, fault: str | None):
    """Generate, swap the two rows as a beam step would, continue: the log must follow the rows."""
    ids, mask = _batch()
    with _faulty(fault), recorders.record(model, H2OConfig(heavy=4, recent=3), out=out, fsync=False) as run:
        part = _generate(model, ids, mask, 4, None)
        cache = run.session.last_cache
        order = [1, 0]
        cache.reorder_cache(torch.tensor(order))
        assert cache.request_ids == [1, 0]
        rest = _generate(model, part[order], _extend(mask, part)[order], 6, cache)
    return run, rest


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_lifecycle_check_catches_kv_reordered_without_scores(tmp_path, family):
    import analyses

    model = tiny_model(family)
    good, rest = _record_reordered(model, tmp_path / "good", None)
    with h2o(model, H2OConfig(heavy=4, recent=3)) as session:
        ids, mask = _batch()
        full = _generate(model, ids, mask, 10, session.new_cache())
    assert rest.tolist() == full[[1, 0]].tolist()
    assert check_lifecycle(good.run_dir, model, tolerance=0.0).ok
    bad, _ = _record_reordered(model, tmp_path / "bad", "kv_reorder_without_scores")
    result = check_lifecycle(bad.run_dir, model)
    assert not result.ok
    # both requests go wrong from the first step after the reorder: the rows kept each other's
    # positions and counters, so request 0 (prompt 20) is logged from request 1's step 18 on
    assert {r.request: r.first_bad_step for r in result.failed} == {0: 18, 1: 18}
    data = analyses.report_data(tmp_path / "bad", bad.run_id)
    assert data["lifecycle"]["ok"] is False and data["lifecycle"]["state_events"] == {"reorder": 1}
    assert "State events logged: reorder 1" in analyses.build_report(tmp_path / "bad", bad.run_id, fmt="md")
    assert {c["name"]: c["status"] for c in data["verdict"]["checks"]}["lifecycle_errors"] == "fail"


# -- shared prefixes ------------------------------------------------------------------------------

PREFIX = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(7)).tolist()
_G = torch.Generator().manual_seed(3)
SUFFIXES = [torch.randint(3, 256, (n,), generator=_G).tolist() for n in (6, 9, 7, 8, 10)]
SHARED_CFG = H2OConfig(heavy=6, recent=2)  # the prefill evicts prefix and suffix positions alike


def _record_shared(model, cfg, out, fault: str | None, new=6):
    with _faulty(fault), recorders.record(model, cfg, out=out, fsync=False) as run:
        cache, ids, mask, logits = run.session.prefill_shared(PREFIX, SUFFIXES)
        first = logits.argmax(-1, keepdim=True)
        seq = torch.cat([ids, first], 1)
        out_ids = _generate(model, seq, _extend(mask, seq), new - 1, cache)
    return run, out_ids, mask


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_shared_prefix_batch_equals_each_request_alone(tmp_path, family):
    model = tiny_model(family)
    cfg = SHARED_CFG
    run, out_ids, mask = _record_shared(model, cfg, tmp_path, None)
    alone = []
    with h2o(model, cfg) as session:
        for suffix in SUFFIXES:
            prompt = torch.tensor([PREFIX + suffix])
            alone.append(_generate(model, prompt, None, 6, session.new_cache())[0, prompt.shape[1] :].tolist())
    assert [row[-6:] for row in out_ids.tolist()] == alone
    result = check_lifecycle(run.run_dir, model, tolerance=0.0)
    assert result.ok, [r.describe() for r in result.failed]
    events = read_manifest(run.run_dir)["state_events"]
    assert [e["event"] for e in events] == ["prefix_share", "prefix_copy"]
    assert events[1]["requests"] == [0, 1, 2, 3, 4] and events[1]["prefix_len"] == 12
    loaded = runlog.load_run(run.run_dir, tables=("requests",))
    assert loaded["requests"]["prompt_len"].to_pylist() == [18, 21, 19, 20, 22]
    assert loaded["requests"]["new_tokens"].to_pylist() == [6] * 5


@pytest.mark.parametrize("family", FAMILIES)
def test_the_lifecycle_check_catches_a_prefix_shared_without_copy(tmp_path, family):
    import analyses

    model = tiny_model(family)
    run, _, _ = _record_shared(model, SHARED_CFG, tmp_path, "prefix_without_copy")
    result = check_lifecycle(run.run_dir, model)
    # each request adds its share to the prefix's own column sums; every later one ranks with them
    assert result.requests[0].ok and not result.ok
    assert not result.requests[3].ok and not result.requests[4].ok
    prompt = {r: 12 + len(x) for r, x in enumerate(SUFFIXES)}
    assert all(r.first_bad_step == prompt[r.request] - 1 for r in result.failed)  # at their prefill
    md = analyses.build_report(tmp_path, run.run_id, fmt="md")
    assert "## State lifecycle" in md and f"FAIL ({len(result.failed)} request(s))" in md


def test_a_shared_prefix_refuses_what_it_cannot_share():
    model = tiny_model("llama")
    with h2o(model, H2OConfig(policy="tova", heavy=4, recent=3)) as session:
        with pytest.raises(ConfigError, match="last rows"):
            session.prefill_shared(PREFIX, SUFFIXES)
    with h2o(model, H2OConfig(heavy=4, recent=3)) as session:
        with pytest.raises(ConfigError, match="at least one token per suffix"):
            session.prefill_shared(PREFIX, [[1], []])


# -- the default model ----------------------------------------------------------------------------


@pytest.mark.model
def test_default_model_restored_generation_equals_uninterrupted_and_passes_the_check(tmp_path):
    import h2o_lens

    model, tok = h2o_lens.load_model(progress=False)
    prompts = ["The capital of France is Paris. The capital of Italy is", "List three colours:"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    cfg = H2OConfig(heavy=6, recent=4)
    with h2o(model, cfg) as session:
        full = _generate(model, ids, mask, 12, session.new_cache())
    with recorders.record(model, cfg, out=tmp_path, tokenizer=tok, fsync=False) as run:
        part = _generate(model, ids, mask, 5, None)
        run.session.save(tmp_path / "state.pt")
        cache = run.session.restore(tmp_path / "state.pt")
        rest = _generate(model, part, _extend(mask, part), 7, cache)
    assert rest.tolist() == full.tolist()
    result = check_lifecycle(run.run_dir, model)
    assert result.ok, [r.describe() for r in result.failed]
    assert [e["event"] for e in read_manifest(run.run_dir)["state_events"]] == ["save", "restore"]
