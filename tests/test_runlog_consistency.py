"""The tables of a run against each other and against its manifest (DESIGN.md §5.5).

Each case edits a copy of the shipped guarded sample (or a plain replayed one) the way a user's
copy could be edited, so that every table still reads and every column keeps its range: deleted
tables with their manifest keys, impossible guard events, manifest fields out of range or naming
another model. Each must mark its run in ``runs.integrity`` with a problem naming the run, the
table or field and the value. Untouched roots (the samples, a demo root, a sweep root, guarded
runs, a generated root) have no problem at all.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runlog import read_manifest, scan_root
from runlog.manifest import write_manifest

SAMPLES = Path(__file__).resolve().parents[1] / "sample_runs"
GUARDED = "delayed-recall-0-h2o-20-guard"  # 30 layers, 3 KV heads; one raise 35 -> 61 at step 175
PLAIN = "delayed-recall-0-h2o-20"  # replayed, unguarded, schema version 1


@pytest.fixture
def root(tmp_path) -> Path:
    out = tmp_path / "runs"
    for run in (GUARDED, PLAIN):
        shutil.copytree(SAMPLES / run, out / run)
    return out


def _segment(run_dir: Path, table: str) -> Path:
    (path,) = sorted(run_dir.glob(f"{table}-*.parquet"))
    return path


def _rewrite(path: Path, column: str, change) -> None:
    """Replace ``column`` of a segment with ``change(values)`` (same rows, the file's metadata kept)."""
    table = pq.read_table(path)
    i = table.schema.get_field_index(column)
    field = table.schema.field(i)
    values = change(table[column].to_numpy(zero_copy_only=False).copy())
    pq.write_table(table.set_column(i, field, pa.array(values, type=field.type)), path)


def _edit_manifest(run_dir: Path, change) -> None:
    manifest = read_manifest(run_dir)
    change(manifest)
    write_manifest(run_dir, manifest)


def _delete(run_dir: Path, *tables: str) -> None:
    """Remove the tables' segments and every trace of them in the manifest."""

    def drop(m):
        for table in tables:
            path = _segment(run_dir, table)
            path.unlink()
            m["segments"].pop(path.name)
            m["rows"].pop(table)

    _edit_manifest(run_dir, drop)


def _event(column: str, value):
    return lambda run_dir: _rewrite(_segment(run_dir, "guard_events"), column, lambda v: np.full_like(v, value))


def _recall(slots_after: int):
    """The sample's raise rewritten as a guard ``recall`` (DESIGN.md §18.2) to ``slots_after``."""

    def edit(run_dir):
        _event("action", "recall")(run_dir)
        _event("slots_after", slots_after)(run_dir)

    return edit


def _guard_field(key: str, value):
    return lambda run_dir: _edit_manifest(run_dir, lambda m: m["guard"].__setitem__(key, value))


def _field(key: str, value):
    return lambda run_dir: _edit_manifest(run_dir, lambda m: m.__setitem__(key, value))


def _other_model(m) -> None:
    m["model"] = dict(m["model"], num_layers=80, num_kv_heads=8, num_query_heads=64)


#: case -> (edit of the guarded sample, what its problem says)
CASES = {
    "evictions_and_guard_events_deleted": (
        lambda d: _delete(d, "evictions", "guard_events"),
        "table evictions is missing: policy 'h2o' evicts",
    ),
    "evictions_deleted_oracle_kept": (
        lambda d: _delete(d, "evictions"),
        "table oracle holds 12690 rows, one per eviction, but table evictions holds 0",
    ),
    "guard_events_deleted_raise_kept": (
        lambda d: _delete(d, "guard_events"),
        "state_events hold 1 raise(s) of request 0, table guard_events 0 raise(s)",
    ),
    "guard_steps_deleted": (lambda d: _delete(d, "guard_steps"), "table guard_steps is missing: the run is guarded"),
    "v4_manifest_without_segments": (
        lambda d: _edit_manifest(d, lambda m: m.pop("segments")),
        "a version-4 manifest of a complete run lacks its 'segments' list",
    ),
    "v4_manifest_without_rows": (
        lambda d: _edit_manifest(d, lambda m: m.pop("rows")),
        "a version-4 manifest of a complete run lacks its 'rows' list",
    ),
    "action_explode": (_event("action", "explode"), "has action 'explode', not one of raise, refill, canary"),
    "slots_after_2e9": (_event("slots_after", 2_000_000_000), "has slots_after 2000000000, more than"),
    "raise_shrinks": (_event("slots_after", 10), "is a raise that shrinks slots 35 -> 10"),
    "recall_shrinks": (_recall(10), "is a recall that shrinks slots 35 -> 10"),
    "recall_window_1000": (_recall(1035), "has a recall window of 1000 slots, more than the request's 185 tokens"),
    "risk_under_threshold": (_event("risk", 0.2), "acted (raise) at risk 0.2, below the run's guard.threshold 0.5"),
    "request_it_does_not_have": (_event("request", 7), "names request 7, which the run does not have"),
    "manifest_prompt_len_10": (_field("prompt_len", 10), "manifest field prompt_len is 10, but the longest"),
    "manifest_new_tokens_1000": (_field("new_tokens", 1000), "manifest field new_tokens is 1000, but the longest"),
    "requests_prompt_len_against_tokens": (
        lambda d: _rewrite(_segment(d, "requests"), "prompt_len", lambda v: v - 5),
        "request 0 has 185 tokens rows, but its requests row says prompt_len 170 + new_tokens 10 = 180",
    ),
    "heavy_-3": (_field("heavy", -3), "manifest field heavy is -3, below its range"),
    "recent_-1": (_field("recent", -1), "manifest field recent is -1, below its range"),
    "keep_ratio_7": (_field("keep_ratio", 7), "manifest field keep_ratio is 7, above its range (expected (0, 1])"),
    "keep_ratio_0": (_field("keep_ratio", 0), "manifest field keep_ratio is 0, below its range"),
    "guard_threshold_7": (_guard_field("threshold", 7), "manifest field guard.threshold is 7, above its range"),
    "guard_weights_nan": (_guard_field("weights", [math.nan] * 10), "manifest field guard.weights[0] is nan"),
    "guard_cost_negative": (
        lambda d: _edit_manifest(d, lambda m: m["guard_cost"].__setitem__("seconds", -2.0)),
        "manifest field guard_cost.seconds is -2.0, below its range",
    ),
    "manifest_of_another_model": (
        lambda d: _edit_manifest(d, _other_model),
        "manifest field model.num_layers is 80, but the steps of this evicting run use 30 layers",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_run_whose_tables_or_manifest_disagree_is_marked(root, case):
    edit, said = CASES[case]
    edit(root / GUARDED)
    catalog = scan_root(root, cache=False)
    integrity = {r.run_id: r.integrity for r in catalog.runs}
    assert integrity[GUARDED] != "ok" and integrity[PLAIN] == "ok", integrity
    reasons = [p.reason for p in catalog.problems if p.run_id == GUARDED]
    assert any(said in r and f"run {GUARDED}" in r for r in reasons), reasons


def test_the_model_s_kv_sets_are_checked_too(root):
    _edit_manifest(root / GUARDED, _other_model)
    reasons = " ".join(p.reason for p in scan_root(root, cache=False).problems)
    assert "manifest field model.num_kv_heads is 8, but the steps of this evicting run use 3 sets" in reasons


def test_a_refill_at_the_prefill_with_nothing_recomputed_is_a_known_action(root):
    """The guard logs a refill at the prefill as ``refill`` (its raise event in state_events, no recompute)."""
    _event("action", "refill")(root / GUARDED)
    _rewrite(_segment(root / GUARDED, "guard_events"), "step", lambda v: np.full_like(v, 174))  # prompt_len - 1
    catalog = scan_root(root, cache=False)
    assert catalog.problems == [] and {r.integrity for r in catalog.runs} == {"ok"}


def test_the_findings_survive_the_catalog_cache(root):
    _event("action", "explode")(root / GUARDED)
    first = {r.run_id: r.integrity for r in scan_root(root).runs}
    again = {r.run_id: r.integrity for r in scan_root(root).runs}  # every file from the cache
    assert again == first and again[GUARDED].startswith("guard_events value impossible; ")


@pytest.fixture(scope="module")
def tiny_roots(tmp_path_factory) -> Path:
    """A demo root, a sweep root and guarded runs recorded on a tiny model."""
    import torch
    from tiny import save_tiny

    from commands.cli import main
    from commands.jobs import demo, sweep
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    base = tmp_path_factory.mktemp("consistency")
    save_tiny(base / "model")
    task = {"name": "pair", "prompt": "Oslo is cold, Lima is warm. Name the cold city.", "answer": "Oslo"}
    (base / "tasks.jsonl").write_text(json.dumps({**task, "max_new_tokens": 4}) + "\n", encoding="utf-8")
    model, tok = load_model(str(base / "model"), dtype=torch.float64, progress=False)
    tasks = resolve_tasks(str(base / "tasks.jsonl"))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        demo(base / "demo", tasks=tasks, model=model, tokenizer=tok, progress=False)
        sweep(base / "sweep", tasks=tasks, model=model, tokenizer=tok, ratios=(1.0, 0.5), batch_size=2, progress=False)
        prompt = "Read the notes. The lab code is 4419. The printer is out of toner. What is the lab code?"
        for guard in ("raise:1.0@0", "log", "canary"):
            args = ["record", "--model", str(base / "model"), "--out", str(base / "guarded"), "--prompt", prompt]
            main([*args, "--raw", "--max-new-tokens", "5", "--heavy", "4", "--recent", "4", "--guard", guard])
    return base


@pytest.mark.slow  # more than a few seconds on an idle 2-core machine (docs/TESTING.md)
@pytest.mark.parametrize("where", ["demo", "sweep", "guarded"])
def test_untouched_demo_sweep_and_guarded_roots_have_no_problem(tiny_roots, where):
    catalog = scan_root(tiny_roots / where, cache=False)
    assert catalog.runs and catalog.problems == [], [str(p) for p in catalog.problems]
    assert {r.integrity for r in catalog.runs} == {"ok"}


def test_untouched_samples_have_no_problem():
    catalog = scan_root(SAMPLES, cache=False)
    assert catalog.problems == [] and {r.integrity for r in catalog.runs} == {"ok"}
