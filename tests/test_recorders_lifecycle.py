"""The state lifecycle check (DESIGN.md §15.1): logged kept sets against the tokens run alone."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny import tiny_model

import analyses
import recorders
import runlog
from h2o_lens import H2OConfig
from recorders.lifecycle import check_lifecycle
from runlog import list_segments, read_manifest
from runlog.manifest import write_manifest

ROOT = Path(__file__).resolve().parents[1]


def _batch(seed=1):
    ids = torch.randint(3, 256, (3, 24), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding of different widths: the batch differs from each request alone
    mask[2, :9] = 0
    return ids, mask


def _record(model, cfg, out, new=14):
    ids, mask = _batch()
    with recorders.record(model, cfg, out=out, fsync=False) as run:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return run


def _rewrite_evictions(run_dir: Path, change) -> None:
    """Apply ``change(columns) -> columns`` to the run's evictions segment in place (same rows)."""
    (seg,) = list_segments(run_dir)["evictions"]
    table = pq.read_table(seg)
    names = ("request", "step", "layer", "kv_head", "position", "margin", "phase")
    cols = change({n: table[n].to_numpy(zero_copy_only=False).copy() for n in names})
    for n in ("position", "margin"):
        i = table.schema.get_field_index(n)
        table = table.set_column(i, table.schema.field(i), pa.array(cols[n], type=table.schema.field(i).type))
    pq.write_table(table, seg)


def _swap_victim(cols, *, margin=None):
    """Move one decode eviction of request 1 to another position that was still cached then."""
    ev = cols
    sel = np.flatnonzero((ev["request"] == 1) & (ev["phase"] == "decode") & (ev["layer"] == 1))
    i = sel[len(sel) // 2]
    t, head, victim = ev["step"][i], ev["kv_head"][i], ev["position"][i]
    same = (ev["request"] == 1) & (ev["layer"] == 1) & (ev["kv_head"] == head)
    gone = set(ev["position"][same & (ev["step"] <= t)].tolist())
    other = next(p for p in range(t, -1, -1) if p not in gone and p != victim)
    ev["position"][i] = other
    if margin is not None:
        ev["margin"][i] = margin
    return ev, (int(t), int(head), int(victim), int(other))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "cfg",
    [H2OConfig(heavy=4, recent=3), H2OConfig(ratio=0.4), H2OConfig(heavy=4, recent=4, gqa="none")],
    ids=["slots", "ratio", "gqa-none"],
)
@pytest.mark.slow
def test_a_correct_batched_run_passes_exactly(tmp_path, family, cfg):
    model = tiny_model(family)
    run = _record(model, cfg, tmp_path)
    result = check_lifecycle(run.run_dir, model, tolerance=0.0)
    assert result.ok, [r.describe() for r in result.failed]
    assert [r.request for r in result.requests] == [0, 1, 2]
    assert all(r.steps == 14 and r.tie_flips == 0 for r in result.requests)
    stored = read_manifest(run.run_dir)["lifecycle"]
    assert stored["ok"] is True and len(stored["requests"]) == 3


@pytest.mark.slow
def test_a_wrong_victim_is_caught_at_its_step_layer_and_set(tmp_path):
    model = tiny_model("llama")
    run = _record(model, H2OConfig(heavy=4, recent=3), tmp_path)
    found = {}

    def change(cols):
        cols, found["where"] = _swap_victim(cols)
        return cols

    _rewrite_evictions(Path(run.run_dir), change)
    t, head, victim, other = found["where"]
    result = check_lifecycle(run.run_dir, model)
    assert not result.ok
    assert [r.ok for r in result.requests] == [True, False, True]
    bad = result.requests[1]
    assert (bad.first_bad_step, bad.layer, bad.kv_set) == (t, 1, head)
    assert bad.logged_only == [victim] and bad.reference_only == [other]
    assert f"step {t}" in bad.describe()


@pytest.mark.slow
def test_a_near_tie_flip_is_tolerated_and_a_clear_margin_is_not(tmp_path):
    model = tiny_model("llama")
    run = _record(model, H2OConfig(heavy=4, recent=3), tmp_path / "a")
    copy = tmp_path / "b" / Path(run.run_dir).name
    shutil.copytree(run.run_dir, copy)

    def near(cols):
        return _swap_victim(cols, margin=np.float32(1e-7))[0]

    def clear(cols):
        return _swap_victim(cols, margin=np.float32(0.05))[0]

    _rewrite_evictions(Path(run.run_dir), near)
    _rewrite_evictions(copy, clear)
    tied = check_lifecycle(run.run_dir, model)
    assert tied.ok and tied.requests[1].tie_flips == 1
    assert not check_lifecycle(run.run_dir, model, tolerance=0.0).ok  # 0: only exact ties pass
    assert not check_lifecycle(copy, model).ok
    assert check_lifecycle(copy, model, tolerance=1.0).ok  # a loose bound tolerates it


@pytest.mark.slow
def test_the_report_shows_the_stored_result(tmp_path):
    model = tiny_model("qwen2")
    run = _record(model, H2OConfig(heavy=4, recent=3), tmp_path)
    unchecked = analyses.report_data(tmp_path, run.run_id)
    assert unchecked["lifecycle"]["checked"] is False
    gate = {c["name"]: c for c in unchecked["verdict"]["checks"]}["lifecycle_errors"]
    assert gate["status"] == "no data"
    check_lifecycle(run.run_dir, model)
    data = json.loads(analyses.build_report(tmp_path, run.run_id, fmt="json"))
    jsonschema.validate(data, analyses.report_schema())
    assert data["lifecycle"]["ok"] is True and data["lifecycle"]["failed"] == 0
    gate = {c["name"]: c for c in data["verdict"]["checks"]}["lifecycle_errors"]
    assert gate["status"] == "pass"
    _rewrite_evictions(Path(run.run_dir), lambda c: _swap_victim(c)[0])
    bad = check_lifecycle(run.run_dir, model)
    data = analyses.report_data(tmp_path, run.run_id)
    assert data["lifecycle"]["ok"] is False and data["verdict"]["status"] == "fail"
    row = data["lifecycle"]["requests"][1]
    assert row["first_bad_step"] == bad.requests[1].first_bad_step and row["ok"] is False
    md = analyses.build_report(tmp_path, run.run_id, fmt="md")
    assert "## State lifecycle" in md and "FAIL (1 request(s))" in md
    html = analyses.build_report(tmp_path, run.run_id, fmt="html")
    assert 'id="lifecycle"' in html


def test_the_check_refuses_to_run_where_caches_get_another_layer_class(tmp_path):
    """Inside a fault's block (tests/faulty.py) the check's own re-run would build the broken
    layers too; it refuses instead of comparing the run with a broken reference."""
    from faulty import inject

    model = tiny_model("llama")
    run = _record(model, H2OConfig(heavy=4, recent=3), tmp_path, new=4)
    with inject("prefix_without_copy"), pytest.raises(runlog.RecorderError, match="FaultyLayer"):
        check_lifecycle(run.run_dir, model)
    assert check_lifecycle(run.run_dir, model, tolerance=0.0).ok  # outside the block it runs


def _byte_tokenizer():
    """A byte-level tokenizer without merges (3 special tokens, then 256 bytes), so load_model finds one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(specials)} | {c: len(specials) + i for i, c in enumerate(alphabet)}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="</s>")


@pytest.mark.slow
def test_cli_check_exit_codes(tmp_path):
    model = tiny_model("llama", vocab=259)
    model.save_pretrained(tmp_path / "model")
    _byte_tokenizer().save_pretrained(tmp_path / "model")
    run = _record(model, H2OConfig(heavy=4, recent=3), tmp_path / "runs", new=8)
    manifest = read_manifest(run.run_dir)
    manifest["model"]["name"] = str(tmp_path / "model")
    write_manifest(run.run_dir, manifest)
    cmd = [sys.executable, "-m", "commands.cli", "check", run.run_id, "--root", str(tmp_path / "runs")]
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    ok = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "(ok)" in ok.stdout
    _rewrite_evictions(Path(run.run_dir), lambda c: _swap_victim(c)[0])
    bad = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 3, bad.stderr
    assert "LIFECYCLE ERROR in 1 request(s)" in bad.stdout and "request 1:" in bad.stdout


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_negative_or_infinite_tolerance_is_refused_before_anything_is_read(tmp_path, bad):
    from recorders.lifecycle import check_lifecycle
    from runlog.errors import RecorderError

    with pytest.raises(RecorderError, match="near-tie bound"):
        check_lifecycle(tmp_path / "no-such-run", tolerance=bad)
