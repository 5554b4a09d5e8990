"""End-to-end checks on the real packaged model (SmolLM2-135M-Instruct, 30 layers, GQA 9/3)."""

from __future__ import annotations

import pytest
import torch
from runtime_utils import KeptRecorder, assert_same_sets, capture_qk, reference_sets

import h2o_lens
import recorders
from h2o_lens import H2OConfig

pytestmark = pytest.mark.model

PROMPT = (
    "Notes: the orange cable goes to port 7. The backup server is called Heron. "
    "The access code for the lab is 4419. Maria moved to the Lisbon office in May. "
    "Question: what is the access code for the lab?"
)


@pytest.fixture(scope="module")
def smol(shared_default_model):
    model, tok = shared_default_model
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    enc = tok(text, return_tensors="pt", add_special_tokens=False)
    return model, tok, enc


def _gen(model, enc, tok, new=16, **kw):
    with torch.no_grad():
        return model.generate(
            **enc,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )


@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_real_model_runtime_equals_reference(smol, gqa):
    model, tok, enc = smol
    p = enc["input_ids"].shape[1]
    rec = KeptRecorder()
    with h2o_lens.h2o(model, H2OConfig(heavy=12, recent=12, gqa=gqa), listener=rec), capture_qk() as qk:
        _gen(model, enc, tok, new=12)
    assert p > 24
    for layer in range(model.config.num_hidden_layers):
        runtime = [step[0] for step in rec.kept[layer]]
        assert_same_sets(runtime, reference_sets(qk[layer], 0, p, 12, 12, gqa), f"layer {layer}")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_real_model_budget_covering_sequence_equals_full_cache(smol, attn):
    model, tok, enc = smol
    model.set_attn_implementation(attn)
    try:
        ref = _gen(model, enc, tok)
        with h2o_lens.h2o(model, heavy=128, recent=128):
            got = _gen(model, enc, tok)
        assert model.config._attn_implementation == attn
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(ref.sequences, got.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits)) < 1e-4


def test_real_model_record_replay_and_evidence(smol, tmp_path):
    from recorders.replay import replay
    from runlog import open_runs

    model, tok, enc = smol
    with recorders.record(
        model,
        H2OConfig(heavy=16, recent=16),
        out=tmp_path,
        tokenizer=tok,
        evidence={"code": "4419", "city": "Lisbon"},
        fsync=False,
    ) as run:
        _gen(model, enc, tok, new=12)
    summary = replay(tmp_path / run.run_id, model=model, progress=False)
    assert summary.implementation_ok, summary
    con = open_runs(tmp_path)
    labelled = dict(
        con.sql(
            "SELECT evidence, string_agg(text, '' ORDER BY position) FROM tokens "
            "WHERE evidence IS NOT NULL GROUP BY evidence"
        ).fetchall()
    )
    assert labelled["code"].strip() == "4419" and labelled["city"].strip() == "Lisbon"
    assert con.sql("SELECT count(*) FROM replay WHERE dropped_mass > 0").fetchall()[0][0] > 0


def test_real_model_padded_batch_replays_alike_from_its_prompt_pass_and_from_the_folder(smol, tmp_path):
    """A left-padded batch of a short and a long prompt (the short row's prompt states may differ
    in the last places from the prompt alone): the replay from the recording's prompt passes and
    the replay from the run folder alone, which forwards the prompts again as the same batch,
    write the same bits (DESIGN.md §6.1)."""
    from recorders.replay import replay
    from runlog.store import load_run

    model, tok, _ = smol
    side, tok.padding_side = tok.padding_side, "left"
    try:
        enc = tok(["Say hello.", PROMPT], return_tensors="pt", padding=True)
    finally:
        tok.padding_side = side
    with recorders.record(model, H2OConfig(heavy=8, recent=8), out=tmp_path, fsync=False, keep_prompt_pass=True) as run:
        _gen(model, enc, tok, new=12)
    assert sorted(run.prompt_passes) == [0, 1]
    tables = []
    for passes in (None, run.prompt_passes):
        summary = replay(run.run_dir, model=model, progress=False, prompt_passes=passes)
        assert summary.implementation_ok, summary
        assert (summary.prompts_from_run, summary.prompts_as_batch) == ((0, 2) if passes is None else (2, 0))
        data = load_run(run.run_dir, tables=("replay", "replay_steps", "oracle"))
        tables.append({t: data[t].to_pandas().sort_values(list(data[t].column_names)) for t in data.tables})
    for name in tables[0]:
        assert tables[0][name].reset_index(drop=True).equals(tables[1][name].reset_index(drop=True)), name


def test_cli_generate_prints_text_and_bytes(capsys):
    from commands.cli import main

    assert (
        main(["generate", "--prompt", "Name a colour.", "--heavy", "8", "--recent", "8", "--max-new-tokens", "8"]) == 0
    )
    out, err = capsys.readouterr()
    assert out.strip()
    assert "physical KV" in err and "of full" in err
