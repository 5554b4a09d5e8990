"""The dashboard's cold-tier and budget-plan data (:mod:`analyses.tiers`, DESIGN.md §7.5) on real runs:
a ``record --cold cpu:4`` run and a ``record --plan`` run of a tiny model, read back through
DuckDB and checked against the run's own Parquet files and manifest."""

from __future__ import annotations

import json

import pytest
from test_commands_sweep_grid import tiny_dir  # noqa: F401  (a module fixture)

from analyses import tiers
from app import textview
from commands.cli import main
from h2o_lens import plan as budget_plan
from runlog import load_run, open_runs

PROMPT = "The code is 4711. " + "filler words here. " * 6 + "What is the code?"
EVIDENCE = {
    "k90": [[0.1, 0.5], [0.3, 0.05]],
    "k95": [[0.2, 0.6], [0.4, 0.1]],
    "shares": [[0.2, 0.4], [0.3, 0.1]],
}


@pytest.fixture(scope="module")
def tier_root(tmp_path_factory, tiny_dir):  # noqa: F811
    """A runs root with a cold-tier run (cpu store, a 4-slot recall window, replayed) and a run
    under a per-KV-set budget plan whose file carries planted evidence."""
    root = tmp_path_factory.mktemp("tiers")
    runs = root / "runs"
    base = ["record", "--model", str(tiny_dir), "--prompt", PROMPT, "--raw", "--out", str(runs)]
    assert main([*base, "--cold", "cpu:4", "--heavy", "8", "--recent", "8", "--max-new-tokens", "12", "--replay"]) == 0
    plan_file = root / "plan.json"
    budget_plan.BudgetPlan(ratios=[[0.2, 0.4], [0.3, 0.1]]).save(plan_file, evidence=EVIDENCE)
    assert main([*base, "--plan", str(plan_file), "--max-new-tokens", "4"]) == 0
    # two runs recorded within one second sort by their random suffix: tell them apart by manifest
    names = [p.name for p in runs.iterdir() if p.is_dir()]
    (cold,) = [n for n in names if json.loads((runs / n / "manifest.json").read_text()).get("cold")]
    (plan,) = [n for n in names if n != cold]
    return root, {"cold": cold, "plan": plan, "plan_file": plan_file}


def test_recalled_tokens_are_the_recalls_table_per_position(tier_root):
    root, runs = tier_root
    rows = load_run(root / "runs" / runs["cold"], ["recalls"])["recalls"].to_pylist()
    assert rows, "the cold run recalled nothing: the test needs recalls"
    got = tiers.recalled_tokens(open_runs(root / "runs"), runs["cold"]).df()
    assert sorted(got["position"]) == sorted({r["position"] for r in rows})
    for r in got.itertuples():
        mine = [x for x in rows if x["position"] == r.position]
        assert r.first_step == min(x["step"] for x in mine) and r.last_step == max(x["step"] for x in mine)
        assert r.steps == len({x["step"] for x in mine})
        assert r.sets == len({(x["layer"], x["kv_head"]) for x in mine})
        assert r.bytes_read == sum(x["bytes_read"] for x in mine) and r.tier == "cpu"
    window = tiers.recalled_tokens(open_runs(root / "runs"), runs["cold"], first=0, last=int(got["position"].iloc[0]))
    assert len(window.df()) == 1
    assert tiers.recalled_tokens(open_runs(root / "runs"), runs["plan"]).df().empty


def test_cold_overview_reads_the_manifest_counters_and_recall_counts(tier_root):
    root, runs = tier_root
    loaded = load_run(root / "runs" / runs["cold"], ["recalls", "requests"])
    cold = loaded.manifest["cold"]
    got = tiers.cold_overview(open_runs(root / "runs"), runs["cold"])
    assert got["store"] == "cpu" and got["recall"] == 4 and got["hot_slots"] == 16
    assert (got["bytes_written"], got["bytes_read"]) == (cold["bytes_written"], cold["bytes_read"])
    assert got["bytes_written"] > 0 and got["bytes_read"] > 0
    rec = loaded["recalls"].to_pylist()
    assert got["recall_rows"] == len(rec)
    assert got["recalled_positions"] == len({(r["request"], r["position"]) for r in rec})
    generated = sum(loaded["requests"].column("new_tokens").to_pylist())
    assert got["bytes_read_per_token"] == pytest.approx(cold["bytes_read"] / generated)
    assert tiers.cold_overview(open_runs(root / "runs"), runs["plan"]) is None


def test_set_slots_of_a_plan_and_of_kept_sets(tier_root):
    root, runs = tier_root
    con = open_runs(root / "runs")
    slots, source = tiers.set_slots(con, runs["plan"])
    logged = load_run(root / "runs" / runs["plan"], ["requests"]).manifest["config"]["plan"]["slots"]
    assert source == "plan"
    assert [[int(v) for v in g["slots"]] for _, g in slots.groupby("layer")] == logged
    assert len({int(v) for v in slots["slots"]}) == 4  # four unequal sets
    kept, source = tiers.set_slots(con, runs["cold"])
    assert source == "kept" and len(kept) == 4
    steps = load_run(root / "runs" / runs["cold"], ["steps"])["steps"].to_pylist()
    assert set(kept["slots"]) == {max(s["kept"] for s in steps if s["kept"] is not None)}


def test_plan_evidence_long_per_layer_and_set(tier_root, tmp_path):
    _, runs = tier_root
    ev = tiers.plan_evidence(runs["plan_file"])
    assert list(ev.columns) == ["layer", "kv_set", "k90", "k95", "share"]
    assert ev.set_index(["layer", "kv_set"])["k90"].to_dict() == {(0, 0): 0.1, (0, 1): 0.5, (1, 0): 0.3, (1, 1): 0.05}
    bare = tmp_path / "bare.json"
    budget_plan.BudgetPlan(ratios=[0.2, 0.2]).save(bare)
    with pytest.raises(ValueError, match="no planner evidence"):
        tiers.plan_evidence(bare)
    (tmp_path / "x.json").write_text(json.dumps([1]))
    with pytest.raises(ValueError):
        tiers.plan_evidence(tmp_path / "x.json")


def test_token_text_marks_recalled_positions_up_to_the_step(tier_root):
    root, runs = tier_root
    con = open_runs(root / "runs")
    rec = tiers.recalled_tokens(con, runs["cold"]).df()
    notes = textview.recall_notes(rec)
    assert set(notes) == set(rec["position"]) and all("recalled from cpu at step" in n for n in notes.values())
    early = int(rec["first_step"].min())
    assert set(textview.recall_notes(rec, early)) == set(rec.loc[rec["first_step"] <= early, "position"])
    from analyses import views

    df = views.token_evictions(con, runs["cold"], layer=0, kv_head=0).df()
    html = textview.token_html(df, mode="step", step_range=(0, 50), at_step=None, selected=None, recalled=notes)
    assert html.count("recalled from cpu") == len([p for p in notes if p in set(df["position"])])
