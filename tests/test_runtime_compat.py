"""The compatibility tier (DESIGN.md §3.1): what must hold on every supported transformers release.

``make compat`` runs these (``-m compat``) in a venv of each of 4.56, 5.2 and the newest
release; ``make test`` runs them on the project's own venv. Tiny random models for the runtime
against the FP64 reference, prompt lookup and a left-padded batch; the real default model for a
recording and its replay (the implementation check), ``explain`` on one demo failure and the
golden kept sets stored in ``tests/golden/``, which must be the same on every release. The Ray
executor is checked on the newest release only (``tests/test_commands_sweep_ray.py``, where
Ray is installed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from runtime_utils import KeptRecorder, assert_same_sets, capture_qk, reference_sets
from tiny import left_padded, local_attention, tiny_model

import h2o_lens
from h2o_lens import H2OConfig, compat

pytestmark = pytest.mark.compat

GOLDEN = Path(__file__).resolve().parent / "golden" / "kept_sets.json"
#: the golden run: one fixed prompt, the default model in float32, H2O with 16 + 16 slots
GOLDEN_PROMPT = (
    "Notes: the orange cable goes to port 7. The backup server is called Heron. The access code for "
    "the lab is 4419. Maria moved to the Lisbon office in May. Question: what is the access code for the lab?"
)
GOLDEN_CONFIG = dict(heavy=16, recent=16, gqa="sum")
GOLDEN_NEW = 16


def _greedy(model, ids, new, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **kw)


# -- tiny models: the runtime against the FP64 reference ----------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_runtime_equals_the_fp64_reference(family):
    """FP64 tiny models: every layer and KV head keeps what the FP64 reference keeps on the run's q/k."""
    model = local_attention(tiny_model(family, layers=2, q_heads=4, kv_heads=2).double())
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    rec = KeptRecorder()
    with h2o_lens.h2o(model, H2OConfig(heavy=5, recent=3), listener=rec), capture_qk() as qk:
        out = _greedy(model, ids, 16)
    assert out.shape[1] == 36
    for layer in range(2):
        expected = reference_sets(qk[layer], 0, 20, 5, 3, "sum")
        assert_same_sets([step[0] for step in rec.kept[layer]], expected, f"{family} layer {layer}")


def test_left_padded_batch_rows_equal_the_reference():
    """A left-padded batch: each row keeps what the reference keeps on that row alone (padding dropped)."""
    model = local_attention(tiny_model("qwen2", layers=2, q_heads=4, kv_heads=2).double())
    model.generation_config.eos_token_id = None
    lengths = (9, 16, 13)
    ids, mask = left_padded(lengths, seed=3)
    rec = KeptRecorder()
    with h2o_lens.h2o(model, H2OConfig(heavy=4, recent=3), listener=rec), capture_qk() as qk:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    width = ids.shape[1]
    for r, n in enumerate(lengths):
        for layer in range(2):
            expected = reference_sets(qk[layer], r, n, 4, 3, "sum", offset=width - n)
            assert_same_sets([step[r] for step in rec.kept[layer]], expected, f"row {r} layer {layer}")


def test_prompt_lookup_decoding_equals_plain_greedy():
    """Prompt lookup under H2O: the same tokens, kept sets and slot scores as plain greedy decoding."""
    model = local_attention(tiny_model("llama", layers=2, q_heads=4, kv_heads=2).double())
    # an end token that cannot end it early: prompt lookup up to 5.x needs one (it looks for it in drafts)
    model.generation_config.eos_token_id = 2
    base = torch.randint(3, 256, (8,), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([base, base, base])[None]  # prompt lookup finds its n-grams here
    runs = []
    for kw in ({}, {"prompt_lookup_num_tokens": 4}):
        rec = _Segments()
        with h2o_lens.h2o(model, H2OConfig(heavy=6, recent=2), listener=rec) as session:
            out = _greedy(model, ids, 24, min_new_tokens=24, **kw)
        runs.append((out, rec, session.last_cache))
    (plain, plain_rec, plain_cache), (looked, rec, cache) = runs
    assert torch.equal(looked, plain), "prompt lookup changed the tokens"
    assert rec.segments, "prompt lookup proposed no draft, so nothing was verified"
    for layer in range(2):
        assert rec.kept[layer] == plain_rec.kept[layer], f"layer {layer}"
        a, b = cache.layers[layer], plain_cache.layers[layer]
        assert torch.equal(a.positions, b.positions) and a.seen == b.seen
        torch.testing.assert_close(a.scores, b.scores, rtol=1e-12, atol=1e-12)


class _Segments(KeptRecorder):
    """Kept sets of the steps that stood (a rolled-back step is dropped) and the segments seen."""

    def __init__(self):
        super().__init__()
        self.segments = []

    def on_segment(self, layer, ev):
        if ev.mode == "rollback" and ev.rolled_back:
            del self.kept[layer][-ev.rolled_back :]
        if layer == 0:
            self.segments.append((ev.proposed, ev.accepted))


# -- the real default model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(shared_default_model):
    """The packaged default model in float32 (converted once per transformers release), shared."""
    return shared_default_model


@pytest.mark.model
def test_default_model_padded_batch_records_and_replays_within_the_implementation_check(smol, tmp_path):
    """A left-padded batch of two prompts recorded under H2O, then replayed against the full-cache teacher."""
    import recorders
    from recorders.replay import replay

    model, tok = smol
    enc = tok(["Say hello.", GOLDEN_PROMPT], return_tensors="pt", padding=True)
    assert (enc["attention_mask"][0] == 0).any(), "the short prompt should be left-padded"
    with recorders.record(model, H2OConfig(heavy=8, recent=8), out=tmp_path, tokenizer=tok, fsync=False) as run:
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    summary = replay(run.run_dir, model=model, progress=False)
    assert summary.implementation_ok, summary
    assert summary.requests == 2 and summary.max_logit_diff <= summary.tolerance


@pytest.mark.model
def test_explain_finds_the_scoring_failure_of_a_demo_task(smol, tmp_path):
    """``explain`` on the demo's delayed recall, which fails under H2O at 20 %: pinning the evidence
    brings the answer back (DESIGN.md §6.10)."""
    from commands.jobs import run_task
    from h2o_lens.tasks import get_task
    from recorders.counterfactual import explain_request

    model, tok = smol
    parent = run_task(model, tok, get_task("delayed_recall_1"), H2OConfig(ratio=0.2), tmp_path, ratio=0.2, replay=False)
    assert not parent.correct
    ex = explain_request(model, tok, parent.run_dir, 0, replay=False, bisect=False)  # the budget searches: make test
    assert ex.outcomes["full"].passed and ex.outcomes["pinned"].passed


class _Force:
    """A logits processor that makes ``generate`` emit ``tokens`` (teacher forcing through generate)."""

    def __init__(self, tokens: list[int], prompt: int):
        self.tokens, self.prompt = tokens, prompt

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.prompt]] = 0.0
        return forced


def _golden_run(model, tok, forced: list[int] | None = None) -> dict:
    """The golden run on this release: prompt ids, new tokens (greedy, or ``forced``), the logits
    of those tokens and every kept set."""
    from transformers import LogitsProcessorList

    chat = tok.apply_chat_template(
        [{"role": "user", "content": GOLDEN_PROMPT}], tokenize=False, add_generation_prompt=True
    )
    enc = tok(chat, return_tensors="pt", add_special_tokens=False)
    ids = enc["input_ids"]
    force = LogitsProcessorList([_Force(forced, ids.shape[1])] if forced else [])
    rec = KeptRecorder()
    with h2o_lens.h2o(model, H2OConfig(**GOLDEN_CONFIG), listener=rec), torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=enc["attention_mask"],  # else 4.56 to 5.2 take the prompt's end tokens for padding
            max_new_tokens=GOLDEN_NEW,
            min_new_tokens=GOLDEN_NEW,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            logits_processor=force,
        )
    new = out.sequences[0, ids.shape[1] :].tolist()
    return {
        "prompt_ids": ids[0].tolist(),
        "new_tokens": new,
        "logits": [round(float(step[0, t]), 5) for step, t in zip(out.logits, new)],  # of the chosen tokens
        "top2_gap": [round(float(step[0].topk(2).values.diff().abs()), 5) for step in out.logits],
        "layers": [_deltas([step[0] for step in rec.kept[layer]]) for layer in sorted(rec.kept)],
    }


def _deltas(steps: list) -> dict:
    """Kept sets of one layer, ``steps[t][head]``, as the prefill's sets and each step's (in, out)."""
    changes = []
    for prev, cur in zip(steps, steps[1:]):
        changes.append([[sorted(set(c) - set(p)), sorted(set(p) - set(c))] for p, c in zip(prev, cur)])
    return {"prefill": steps[0], "steps": changes}


@pytest.mark.model
@pytest.mark.golden
def test_golden_kept_sets_are_the_same_on_every_release(smol):
    """The default model in float32 under H2O on one fixed prompt keeps, at every layer, KV head and
    step, the sets stored in tests/golden/kept_sets.json (DESIGN.md §3.1). The new tokens are the
    golden ones, forced: greedy decoding on another release may take the other side of a near tie
    (a measured logit difference, DESIGN.md §3.1), after which nothing would be comparable.
    H2O_LENS_WRITE_GOLDEN=1 writes the file from a greedy run on this release."""
    model, tok = smol
    if os.environ.get("H2O_LENS_WRITE_GOLDEN") == "1":
        record = {"transformers": compat.version(), "prompt": GOLDEN_PROMPT, "config": GOLDEN_CONFIG}
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({**record, **_golden_run(model, tok)}, separators=(",", ":")) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert (golden["prompt"], golden["config"]) == (GOLDEN_PROMPT, GOLDEN_CONFIG)
    got = _golden_run(model, tok, forced=golden["new_tokens"])
    assert got["prompt_ids"] == golden["prompt_ids"], "the tokenizer gives other ids for the golden prompt"
    assert got["new_tokens"] == golden["new_tokens"]
    drift = max(abs(a - b) for a, b in zip(got["logits"], golden["logits"]))
    where = f"transformers {compat.version()} vs {golden['transformers']}, max |logit difference| {drift:.2e}"
    print(where)  # the figure DESIGN.md §3.1 quotes
    assert len(got["layers"]) == len(golden["layers"]) == model.config.num_hidden_layers
    for layer, (a, b) in enumerate(zip(got["layers"], golden["layers"])):
        assert a["prefill"] == b["prefill"], f"layer {layer}, prefill: {where}"
        for t, (x, y) in enumerate(zip(a["steps"], b["steps"])):
            assert x == y, f"layer {layer}, step {t + 1} (in, out per KV head) {x} != {y}: {where}"
        assert len(a["steps"]) == len(b["steps"]) == GOLDEN_NEW - 1
    assert drift < 1e-2, where


# -- the version gate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fake", ["4.55.4", "6.0.0"])
def test_a_release_outside_the_range_is_refused_in_one_line(fake, monkeypatch, tmp_path, capsys):
    """h2o(...), record and the CLI refuse transformers outside the range before hooking or writing."""
    import transformers

    import recorders
    from commands.cli import main

    model = tiny_model("llama")
    monkeypatch.setattr(transformers, "__version__", fake)
    expected = f"transformers {fake} is installed; H2O Lens supports transformers{compat.SUPPORTED}"
    with pytest.raises(h2o_lens.UnsupportedVersionError, match=expected.replace(".", r"\.")):
        with h2o_lens.h2o(model, heavy=4, recent=2):
            pass
    assert model.config._attn_implementation == "sdpa" and "generate" not in vars(model)
    with pytest.raises(h2o_lens.UnsupportedVersionError, match="is installed; H2O Lens supports"):
        with recorders.record(model, heavy=4, recent=2, out=tmp_path / "runs"):
            pass
    assert not (tmp_path / "runs").exists(), "a refused recording must write nothing"
    assert main(["generate", "--prompt", "Hi.", "--heavy", "4", "--recent", "4"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"h2o-lens: error: {expected} (4.56 or newer, before 6); install a supported release, "
        f"e.g. pip install 'transformers{compat.SUPPORTED}'"
    ]


@pytest.mark.parametrize(
    ("installed", "saved_by", "reads"),
    [("5.2.0", "5.2.0", True), ("5.24.0", "5.2.0", False), ("5.2.0", "5.24.0", False), ("4.56.0", None, False)],
)
def test_a_converted_model_is_read_only_by_the_release_that_saved_it(installed, saved_by, reads, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", installed)
    assert compat.checkpoint_folder() == f"transformers-{installed}"
    assert compat.reads_checkpoint_of(saved_by) is reads


def test_the_supported_range_is_the_one_pyproject_pins():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'"transformers{compat.SUPPORTED}"' in text
    compat.check_supported()  # the installed release is inside it


def test_only_the_compatibility_module_asks_for_the_transformers_version():
    """No module but h2o_lens/compat.py reads or compares the transformers version (DESIGN.md §3.1)."""
    import re

    root = Path(__file__).resolve().parents[1]
    asks = re.compile(
        r"transformers\.__version__|version\(\s*[\"']transformers|is_transformers_version|"
        r"transformers\s+import\s+__version__|compat\._(at_least|parsed)\("
    )
    found = [
        f"{path.relative_to(root)}:{n}"
        for package in ("h2o_lens", "runlog", "recorders", "analyses", "app", "commands")
        for path in sorted((root / package).rglob("*.py"))
        if path.name != "compat.py" or path.parent.name != "h2o_lens"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if asks.search(line)
    ]
    assert not found, f"ask h2o_lens.compat instead: {found}"
    assert asks.search("import transformers; transformers.__version__")  # the pattern does match
