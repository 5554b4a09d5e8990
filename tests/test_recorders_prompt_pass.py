"""A replay started from the recording's prompt pass equals one that forwards the prompt (DESIGN.md §6.1).

The recording keeps each request's prompt K/V, column sums and first logits; the replay then
skips its prompt forward. Every replay table and the implementation check must come out with the
same bits either way, for a single request and for a left-padded batch of unequal prompts (the
tiny model computes a row of these batches as it computes it alone; DESIGN.md §6.1 says where a
larger model's rows may differ in the last places).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from tiny import left_padded, tiny_model

import recorders
from h2o_lens import H2OConfig
from recorders.prompt_pass import PromptPass
from recorders.replay import replay
from runlog.manifest import read_manifest
from runlog.store import load_run

TABLES = ("replay", "replay_steps", "oracle")


def _prompts(batch: str) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded([21] if batch == "single" else [21, 13, 17], seed=3)


def _replayed(run_dir, model, passes) -> tuple[dict[str, pd.DataFrame], int, object]:
    """The replay tables, the model forwards the replay ran and its summary."""
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        summary = replay(run_dir, model=model, progress=False, prompt_passes=passes)
    finally:
        hook.remove()
    run = load_run(run_dir, tables=TABLES)
    tables = {t: run[t].to_pandas().sort_values(list(run[t].column_names)).reset_index(drop=True) for t in TABLES}
    written = read_manifest(run_dir)["replay"]
    assert (written["prompts_from_run"], written["prompts_as_batch"]) == (
        summary.prompts_from_run,
        summary.prompts_as_batch,
    )
    return tables, len(calls), summary


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gqa", ["sum", "max", "none"])
@pytest.mark.parametrize("batch", ["single", "padded"])
def test_replay_from_the_prompt_pass_has_the_bits_of_the_forwarded_prompt(tmp_path, batch, gqa, dtype):
    model = tiny_model("llama", layers=3).to(dtype)
    ids, mask = _prompts(batch)
    cfg = H2OConfig(heavy=4, recent=4, gqa=gqa)
    with recorders.record(model, cfg, out=tmp_path, fsync=False, keep_prompt_pass=True) as rec:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    passes = rec.prompt_passes
    assert sorted(passes) == list(range(len(ids)))
    for r, prompt_pass in passes.items():
        assert prompt_pass.ids == tuple(ids[r][mask[r].bool()].tolist())
        assert prompt_pass.keys[0].shape == (1, 2, int(mask[r].sum()), 16)

    # from the folder alone: a request recorded alone forwards its prompt alone, a batch forwards
    # its prompts again as the same padded batch (one forward), then two per request
    forwarded, calls_forwarded, alone = _replayed(rec.run_dir, model, None)
    handed, calls_handed, from_run = _replayed(rec.run_dir, model, passes)
    n = len(ids)
    assert calls_forwarded == (3 * n if n == 1 else 1 + 2 * n) and calls_handed == 2 * n
    assert (alone.prompts_from_run, alone.prompts_as_batch) == (0, 0 if n == 1 else n)
    assert (from_run.prompts_from_run, from_run.prompts_as_batch) == (n, 0)
    assert from_run.max_logit_diff == alone.max_logit_diff and from_run.implementation_ok
    for t in TABLES:
        assert len(forwarded[t]), t
        pd.testing.assert_frame_equal(handed[t], forwarded[t], check_exact=True, obj=t)


def test_a_prompt_pass_of_another_prompt_is_not_used(tmp_path):
    """A pass whose tokens, layers or dtype do not match its request is ignored (the prompt is forwarded)."""
    model = tiny_model("llama", layers=2)
    ids, mask = _prompts("single")
    with recorders.record(model, H2OConfig(heavy=4, recent=4), out=tmp_path, fsync=False, keep_prompt_pass=True) as rec:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    good = rec.prompt_passes[0]
    forwarded, _, _ = _replayed(rec.run_dir, model, None)
    wrong = {
        "tokens": PromptPass((7, *good.ids[1:]), good.keys, good.values, good.cols, good.first),
        "layers": PromptPass(good.ids, good.keys[:1], good.values[:1], good.cols[:1], good.first),
        "dtype": PromptPass(good.ids, [k.double() for k in good.keys], good.values, good.cols, good.first),
    }
    for name, bad in wrong.items():
        tables, calls, summary = _replayed(rec.run_dir, model, {0: bad})
        assert calls == 3 and summary.prompts_from_run == 0, name
        for t in TABLES:
            pd.testing.assert_frame_equal(tables[t], forwarded[t], check_exact=True, obj=f"{name}: {t}")


def test_no_prompt_pass_is_kept_unless_asked(tmp_path):
    model = tiny_model("llama", layers=2)
    ids, mask = _prompts("single")
    with recorders.record(model, H2OConfig(heavy=4, recent=4), out=tmp_path, fsync=False) as rec:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert rec.prompt_passes is None
    assert rec.session.last_cache.prompt_sink is None
