"""``h2o-lens record --guard recall:WINDOW``: the guard opens a recall window on the evicted entries
of a request whose risk reaches the threshold; the action and what the window held are in the
run's log (DESIGN.md §18.2, §18.5, §2.13), and a malformed spec is one line before anything loads."""

from __future__ import annotations

import json

import pytest
import test_commands_record_guard as guard_tests

from analyses.guard import guard_actions
from commands.cli import main
from runlog.store import check_run, load_run

folder = guard_tests.folder  # the tiny model folder
_record = guard_tests._record  # one record run of it


def test_a_recall_at_threshold_0_opens_the_window_at_the_prefill_and_is_logged(folder, tmp_path, monkeypatch, capsys):
    """Threshold 0: the window of 8 slots opens at the prefill (step P - 1, 8 -> 16 slots); from the
    first decode step on the ``recalls`` table holds up to 8 entries per layer and KV set, each a
    position its request evicted before (the strict check holds the run to it), with the bytes read;
    the manifest's ``cold`` says the tier was the guard's. The event reads back from DuckDB, and the
    replay, which puts the window's entries back, reproduces the run's logits."""
    code, out = _record(folder, tmp_path, monkeypatch, "--guard", "recall:8@0", "--replay")
    assert code == 0
    (run_dir,) = out.iterdir()
    check_run(run_dir)
    run = load_run(run_dir)
    p = int(run["requests"].to_pandas()["prompt_len"].iloc[0])
    actions = guard_actions(out, run_dir.name).fetchall()
    assert [(a[0], a[1], a[3], a[4], a[5], a[6]) for a in actions] == [(0, p - 1, "recall", 8, 16, 0.0)]
    recalls = run["recalls"].to_pandas()
    assert sorted(recalls["step"].unique()) == list(range(p, p + 5))  # each decode step refilled
    per = recalls.groupby(["step", "layer", "kv_head"]).size()
    assert per.max() == 8 and (recalls["bytes_read"] >= 0).all() and recalls["bytes_read"].sum() > 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    cold = manifest["cold"]
    assert cold["gated"] is True and cold["recall"] == 8 and cold["store"] == "cpu" and cold["recalled"] > 0
    assert "cold" not in manifest["config"]  # the budget is plain H2O's: the window came on top
    said = capsys.readouterr()
    assert f"recall at step {p - 1} (8 -> 16 slots, 0 positions already evicted)" in said.err
    replayed = said.out + said.err
    assert "max |logit diff|" in replayed and "(ok)" in replayed


def test_a_recall_that_never_acts_recalls_nothing(folder, tmp_path, monkeypatch):
    """At threshold 1 no request is flagged: every window stays closed, nothing is recalled or read,
    and the run is plain H2O's (the same evictions as a run without the guard)."""
    code, out = _record(folder, tmp_path, monkeypatch, "--guard", "recall:8@1")
    assert code == 0
    code, plain = _record(folder, tmp_path / "plain", monkeypatch)
    assert code == 0
    (run_dir,) = out.iterdir()
    check_run(run_dir)
    run = load_run(run_dir)
    assert run["guard_events"].num_rows == 0 and run["recalls"].num_rows == 0
    cold = json.loads((run_dir / "manifest.json").read_text())["cold"]
    assert (cold["recall"], cold["recalled"], cold["bytes_read"]) == (0, 0, 0) and cold["evicted"] > 0
    (plain_dir,) = plain.iterdir()
    columns = ["step", "layer", "kv_head", "position"]
    ours = run["evictions"].to_pandas()[columns].sort_values(columns).values.tolist()
    theirs = load_run(plain_dir)["evictions"].to_pandas()[columns].sort_values(columns).values.tolist()
    assert ours == theirs


@pytest.mark.parametrize(
    "spec, says",
    [
        ("recall:0", "the recall window must be a whole number of slots >= 1"),
        ("recall:1.5", "or a share of the prompt in (0, 1]"),
        ("recall:8:0.1", "expected recall:WINDOW[@THRESHOLD]"),
        ("recall:eight", "expected recall:WINDOW[@THRESHOLD]"),
        ("recall:8@", "expected recall:WINDOW[@THRESHOLD]"),
        ("recall:8@2", "the threshold after @ must be in [0, 1]"),
    ],
)
def test_a_bad_recall_spec_is_one_line_before_the_model_loads(tmp_path, capsys, spec, says):
    args = ["record", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "runs"), "--prompt", "hi"]
    assert main([*args, "--guard", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("h2o-lens: error: ") and err.count("\n") == 1 and says in err
    assert f"--guard '{spec}'" in err and not (tmp_path / "runs").exists()


def test_recall_beside_a_cold_tier_is_refused(tmp_path, capsys):
    args = ["record", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "runs"), "--prompt", "hi"]
    assert main([*args, "--heavy", "8", "--recent", "8", "--guard", "recall:4", "--cold", "cpu:4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--guard recall brings its own cold tier" in err
