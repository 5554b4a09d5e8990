"""explain's ``recall`` variant (DESIGN.md §6.10, §6.11): on a tiny model whose answer H2O at 8
slots loses, a recall window inside the same 8 slots brings it back, and the window the search
finds is the smallest (one slot less fails, re-run on its own)."""

from __future__ import annotations

import json

import pytest
import torch
from test_recorders_counterfactual import CharTokenizer
from tiny import tiny_model

import recorders
import runlog
from analyses import causal_verdicts, connect
from h2o_lens import H2OConfig
from recorders.counterfactual import explain_request, load_parent
from recorders.counterfactual_recall import largest_window, recall_config

NEW = 8


def _parent(root, config=None):
    """An H2O run (4 heavy + 4 recent slots, 24 prompt tokens) of a tiny model whose full-cache
    answer it gets wrong; the evidence label sits on early tokens the decode steps refer back to."""
    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2, seed=2)
    model.config._name_or_path = "tiny/llama-recall"
    tok = CharTokenizer()
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    text = tok.decode(ids[0].tolist())
    info = {"decoding": {"do_sample": False, "max_new_tokens": NEW}}
    config = config or H2OConfig(heavy=4, recent=4)
    ev = {"fact": text[2:5]}
    with recorders.record(model, config, out=root, tokenizer=tok, evidence=ev, info=info, fsync=False) as run:
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return model, tok, root / run.run_id


def _answer(model, tok, parent_dir, window):
    """The request's answer with a recall window of ``window`` slots, generated on its own."""
    import h2o_lens

    parent = load_parent(parent_dir, 0)
    ids = torch.tensor([parent.prompt_ids])
    with h2o_lens.h2o(model, recall_config(parent, window)), torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1] :].tolist())


@pytest.mark.slow  # about a dozen tiny generations
def test_the_recall_variant_fixes_the_answer_at_the_smallest_window(tmp_path):
    from commands.explain import format_verdicts

    model, tok, parent_dir = _parent(tmp_path)
    ex = explain_request(model, tok, parent_dir, 0, bisect=False, replay=False, resolution=0, recall=True)
    full, got = ex.outcomes["full"], ex.outcomes["recall"]
    assert full.passed and ex.outcomes["pinned"].ran
    parent = load_parent(parent_dir, 0)
    assert parent.answer != full.answer  # H2O at 8 slots loses the answer
    assert got.ran and got.passed and got.slots == 8
    bis = got.bisection
    assert (bis.lo, bis.hi) == (1, largest_window(parent)) == (1, 7) and bis.monotone
    w = got.window
    assert w == bis.min_slots and 1 < w < 8
    assert bis.probes[w] is True and bis.probes[w - 1] is False  # one slot less fails
    # checked again, generated on their own: the window found passes, one slot less does not
    assert _answer(model, tok, parent_dir, w) == full.answer != _answer(model, tok, parent_dir, w - 1)
    # the kept run is the one at the window found; the other probes are removed
    manifest = runlog.read_manifest(tmp_path / got.run_id)
    assert manifest["config"]["cold"]["recall"] == w and manifest["config"]["cold"]["store"] == "cpu"
    assert manifest["counterfactual"]["window"] == w and manifest["counterfactual"]["kind"] == "recall"
    assert [d.name for d in tmp_path.glob("*-recall-*")] == [got.run_id]
    # every re-run of the request started from one prompt forward
    assert ex.prompts_reused >= len(bis.probes)
    # the verdict, explain's table and its JSON say so
    (v,) = causal_verdicts(connect(tmp_path), ex.parent_run)
    assert v.recall["fixed"] is True and v.recall["window"] == w and v.recall["slots"] == 8
    assert v.recall["store"] == "cpu" and v.recall["select"] == "exact"
    shown = format_verdicts([v])
    assert f"recall: recall fixes it: a window of {w} of the 8 slots" in shown
    assert any(line.split()[:3] == ["recall", "8", "(window"] for line in (x.strip() for x in shown.splitlines()))
    (row,) = json.loads(format_verdicts([v], "json"))
    assert row["recall"]["fixed"] is True and row["recall"]["window"] == w
    # and the report's Why section
    from analyses._base import plain
    from analyses._markdown import why_section

    md = "\n".join(why_section({"why": [plain(v.to_dict())]})).replace("\\", "")  # Markdown escapes
    assert f"Recall window: recall fixes it: a window of {w} of the 8 slots" in md, md
    assert f"8 (window {w})" in md, md
    # explaining again reuses the search
    again = explain_request(model, tok, parent_dir, 0, bisect=False, replay=False, resolution=0, recall=True)
    assert again.outcomes["recall"].run_id == got.run_id and again.outcomes["recall"].window == w


@pytest.mark.slow  # about a dozen tiny generations
def test_a_cold_parents_variants_keep_its_tier_and_no_recall_leaves_the_variant_out(tmp_path):
    """A run recorded with a cold tier (``record --cold``) is explained with it: the pinned run and
    the policy's budget probes keep the tier (window and store), the recall search starts at the
    run's own window, which failed; ``recall=False`` leaves the variant out."""
    from h2o_lens.cold_config import ColdTier

    model, tok, parent_dir = _parent(tmp_path, H2OConfig(heavy=4, recent=4, cold=ColdTier(recall=2)))
    parent = load_parent(parent_dir, 0)
    assert parent.config.cold.recall == 2 and parent.slots == 8
    assert recall_config(parent, 5).cold == ColdTier(recall=5)
    ex = explain_request(model, tok, parent_dir, 0, replay=False, resolution=0.25)
    assert all(o.ran for o in ex.outcomes.values()), {k: o.error for k, o in ex.outcomes.items()}
    for kind in ("pinned", "policy_budget", "recall"):
        cold = runlog.read_manifest(tmp_path / ex.outcomes[kind].run_id)["config"]["cold"]
        assert cold["store"] == "cpu" and (kind == "recall" or cold["recall"] == 2), kind
    bis = ex.outcomes["recall"].bisection
    assert bis.lo == 2 and bis.probes[2] is False and bis.hi == 7
    assert min(ex.outcomes["policy_budget"].bisection.probes) == 8  # from the run's own count up
    again = explain_request(model, tok, parent_dir, 0, replay=False, resolution=0.25, recall=False)
    assert "recall" not in again.outcomes and again.outcomes["pinned"].run_id == ex.outcomes["pinned"].run_id
