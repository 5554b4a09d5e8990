"""The value contract at scan time (DESIGN.md §5.5) and the manifest's segment list (DESIGN.md §5.1).

The tamper cases edit a copy of the shipped ``sample_runs/`` the way a user's copy could be
edited: each must mark its run in ``runs.integrity`` and in ``problems``, fail the report's gate,
and leave every other run ``ok``. Untouched roots (the samples, a generated root of many runs)
have no problem at all.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analyses import report_data
from runlog import ContractError, check_run, open_runs, read_manifest, scan_root, write_synthetic_run
from runlog.manifest import write_manifest
from runlog.synthetic_root import make_root

SAMPLES = Path(__file__).resolve().parents[1] / "sample_runs"
RUN = "delayed-recall-0-h2o-20"  # the default model (30 layers, 3 KV heads), replayed


@pytest.fixture
def root(tmp_path) -> Path:
    out = tmp_path / "runs"
    shutil.copytree(SAMPLES, out, ignore=shutil.ignore_patterns(".h2o-lens-catalog*"))
    return out


def _rewrite(path: Path, column: str, change) -> None:
    """Replace ``column`` of a segment with ``change(values)`` (same rows, the file's metadata kept)."""
    table = pq.read_table(path)
    i = table.schema.get_field_index(column)
    field = table.schema.field(i)
    values = change(table[column].to_numpy(zero_copy_only=False).copy())
    pq.write_table(table.set_column(i, field, pa.array(values, type=field.type)), path)


def _segment(run_dir: Path, table: str) -> Path:
    (path,) = sorted(run_dir.glob(f"{table}-*.parquet"))
    return path


def _kl_negative(run_dir: Path) -> str:
    _rewrite(_segment(run_dir, "replay_steps"), "kl", lambda v: np.full_like(v, -5.0))
    return "column replay_steps.kl holds -5"


def _mass_above_one(run_dir: Path) -> str:
    _rewrite(_segment(run_dir, "replay"), "dropped_mass", lambda v: np.where(np.arange(len(v)) == 3, 7.5, v))
    return "column replay.dropped_mass holds 7.5"


def _mass_below_zero(run_dir: Path) -> str:
    # coverage = 1 - dropped mass: 4.0 for these rows, and P5 coverage would pass any gate
    _rewrite(_segment(run_dir, "replay"), "dropped_mass", lambda v: np.full_like(v, -3.0))
    return "column replay.dropped_mass holds -3"


def _position_past_the_tokens(run_dir: Path) -> str:
    manifest = read_manifest(run_dir)
    end = manifest["prompt_len"] + manifest["new_tokens"]
    _rewrite(_segment(run_dir, "evictions"), "position", lambda v: np.where(np.arange(len(v)) < 5, end + 40, v))
    return f"has a evictions position of {end + 40}"


def _layer_99(run_dir: Path) -> str:
    _rewrite(_segment(run_dir, "evictions"), "layer", lambda v: np.where(np.arange(len(v)) == 0, 99, v))
    return "column evictions.layer reaches 99, but the run's model (SmolLM2-135M-Instruct) has 30 layers"


def _kv_head_past_the_heads(run_dir: Path) -> str:
    _rewrite(_segment(run_dir, "evictions"), "kv_head", lambda v: np.where(np.arange(len(v)) == 0, 3, v))
    return "column evictions.kv_head reaches 3, but the run's model (SmolLM2-135M-Instruct) has 3 kv heads"


def _repeated_key(run_dir: Path) -> str:
    # the second step's KL row carries the first step's key: one step counted twice, one missing
    _rewrite(_segment(run_dir, "replay_steps"), "step", lambda v: np.where(np.arange(len(v)) == 1, v[0], v))
    return "1 row(s) of replay_steps repeat the key (request, step)"


def _step_past_the_tokens(run_dir: Path) -> str:
    manifest = read_manifest(run_dir)
    end = manifest["prompt_len"] + manifest["new_tokens"]
    _rewrite(_segment(run_dir, "replay_steps"), "step", lambda v: np.where(np.arange(len(v)) == len(v) - 1, end, v))
    return f"has a replay_steps step of {end}"


def _manifest_of_another_model(run_dir: Path) -> str:
    manifest = read_manifest(run_dir)
    manifest["model"] = {
        "name": "Qwen2.5-0.5B-Instruct",
        "architecture": "Qwen2ForCausalLM",
        "num_layers": 24,
        "num_query_heads": 14,
        "num_kv_heads": 2,
        "head_dim": 64,
        "dtype": "float32",
    }
    write_manifest(run_dir, manifest)
    return "has 24 layers"


def _extra_replay_steps_segment(run_dir: Path) -> str:
    # a second copy of the steps with KL 0: the mean KL halves, the step count doubles
    table = pq.read_table(_segment(run_dir, "replay_steps"))
    i = table.schema.get_field_index("kl")
    zeros = pa.array(np.zeros(table.num_rows, np.float32))
    pq.write_table(table.set_column(i, table.schema.field(i), zeros), run_dir / "replay_steps-00001.parquet")
    return "replay_steps rows, more than its new_tokens"


TAMPERS = {
    "kl_negative": _kl_negative,
    "dropped_mass_7.5": _mass_above_one,
    "dropped_mass_-3": _mass_below_zero,
    "position_past_prompt_and_new_tokens": _position_past_the_tokens,
    "layer_99_of_30": _layer_99,
    "kv_head_3_of_3": _kv_head_past_the_heads,
    "repeated_key": _repeated_key,
    "step_past_prompt_and_new_tokens": _step_past_the_tokens,
    "manifest_names_another_model": _manifest_of_another_model,
    "extra_replay_steps_segment": _extra_replay_steps_segment,
}


def _integrity(con) -> dict[str, str]:
    return dict(con.execute("SELECT run_id, integrity FROM runs").fetchall())


def test_untouched_samples_and_a_generated_root_have_no_problem(tmp_path):
    for where in (SAMPLES, make_root(tmp_path / "many", 40, seed=3)):
        catalog = scan_root(where, cache=False)
        assert catalog.problems == [], where
        assert {r.integrity for r in catalog.runs} == {"ok"}, where


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_an_impossible_value_marks_its_run_problems_and_the_gate(root, case):
    said = TAMPERS[case](root / RUN)
    con = open_runs(root, warn=False)
    integrity = _integrity(con)
    assert integrity[RUN] != "ok", case
    assert all(v == "ok" for r, v in integrity.items() if r != RUN), integrity  # only the edited run
    reasons = [r for (r,) in con.execute("SELECT reason FROM problems WHERE run_id = ?", [RUN]).fetchall()]
    assert any(said in r for r in reasons), reasons
    gate = {c["name"]: c for c in report_data(con, RUN)["verdict"]["checks"]}
    assert gate["problems"]["status"] == "fail" and gate["problems"]["value"] >= 1
    with pytest.raises(ContractError):
        check_run(root / RUN)


def test_the_findings_are_kept_in_the_catalog_cache_and_checked_again_when_a_file_changes(root):
    _kl_negative(root / RUN)
    first = _integrity(open_runs(root, warn=False))
    assert (root / ".h2o-lens-catalog.json").is_file()
    again = _integrity(open_runs(root, warn=False))  # every file from the cache
    assert again == first and again[RUN] == "replay_steps.kl out of range"
    _mass_above_one(root / RUN)  # another file of the run changes: the run is checked again
    last = _integrity(open_runs(root, warn=False))
    assert last[RUN] == "replay.dropped_mass out of range; replay_steps.kl out of range"


def _closed_run(root: Path, run_id: str = "run-a") -> Path:
    return write_synthetic_run(root, run_id, layers=2, kv_heads=1, steps=6, prompt_len=24, fsync=False)


def test_a_closed_run_lists_its_segments_and_rows_of_every_table(tmp_path):
    run_dir = _closed_run(tmp_path)
    manifest = read_manifest(run_dir)
    files = {p.name: pq.read_metadata(p).num_rows for p in run_dir.glob("*.parquet")}
    assert manifest["segments"] == files
    assert set(manifest["rows"]) >= {"tokens", "evictions", "replay", "replay_steps", "oracle", "spec_undone"}
    assert manifest["rows"]["replay_steps"] == 6 and manifest["rows"]["spec_undone"] == 0


def test_a_segment_the_manifest_does_not_list_is_left_out_and_named(tmp_path):
    run_dir = _closed_run(tmp_path)
    before = open_runs(tmp_path, warn=False).execute("SELECT count(*), avg(kl) FROM replay_steps").fetchone()
    extra = run_dir / "replay_steps-00001.parquet"
    shutil.copy(run_dir / "replay_steps-00000.parquet", extra)
    con = open_runs(tmp_path, warn=False)
    assert con.execute("SELECT count(*), avg(kl) FROM replay_steps").fetchone() == before  # not counted
    assert "replay_steps-00001.parquet left out (not in the manifest)" in _integrity(con)["run-a"]
    (reason,) = con.execute("SELECT reason FROM problems WHERE path = ?", [str(extra)]).fetchone()
    assert "does not list this segment" in reason


def test_a_manifest_renamed_to_another_model_is_told_from_its_files(tmp_path):
    run_dir = _closed_run(tmp_path)
    manifest = read_manifest(run_dir)
    manifest["model"] = dict(manifest["model"], name="synthetic/other")
    write_manifest(run_dir, manifest)
    integrity = _integrity(open_runs(tmp_path, warn=False))
    assert "manifest names another model" in integrity["run-a"]


def test_a_listed_segment_replaced_by_other_rows_is_left_out(tmp_path):
    run_dir = _closed_run(tmp_path)
    path = run_dir / "replay_steps-00000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.slice(0, 2), path)
    integrity = _integrity(open_runs(tmp_path, warn=False))["run-a"]
    assert "rows differ from the manifest" in integrity and "replay_steps: 0 of 6 rows" in integrity


def test_manifest_segment_list_of_the_wrong_type_is_a_field_problem(tmp_path):
    run_dir = _closed_run(tmp_path)
    manifest = read_manifest(run_dir)
    manifest["segments"] = ["tokens-00000.parquet"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    integrity = _integrity(open_runs(tmp_path, warn=False))["run-a"]
    assert "manifest field segments invalid" in integrity


def test_file_facts_match_a_plain_computation_in_any_row_order():
    import pandas as pd

    from runlog import to_arrow
    from runlog.contract import file_facts

    rng = np.random.default_rng(0)
    n = 400
    cols = {
        "request": rng.integers(0, 4, n).astype(np.int32),
        "step": rng.integers(10, 60, n),
        "layer": rng.integers(0, 3, n).astype(np.int16),
        "kv_head": rng.integers(0, 2, n).astype(np.int16),
        "exiting_position": rng.integers(0, 50, n),
    }
    table = to_arrow("steps", cols, run_id="r")
    df = pd.DataFrame(cols)
    per = df.groupby("request").agg(rows=("step", "size"), step=("step", "max"), pos=("exiting_position", "max"))
    expected = [[r, int(x.rows), int(x.step), int(x.pos)] for r, x in per.iterrows()]
    repeated = n - len(df.drop_duplicates(["request", "step", "layer", "kv_head"]))
    assert repeated > 0
    for order in (np.argsort(cols["request"], kind="stable"), rng.permutation(n)):  # grouped, then shuffled
        facts = file_facts("steps", table.take(order))
        assert sorted(facts["requests"]) == expected
        assert facts["repeated"] == repeated
        assert facts["min"]["step"] == df["step"].min() and facts["max"]["layer"] == df["layer"].max()
