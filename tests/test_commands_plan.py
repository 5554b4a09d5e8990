"""``h2o-lens plan`` and ``record --plan`` (DESIGN.md §2.14, §2.15) on a tiny model in a folder."""

from __future__ import annotations

import json

import pytest
from test_commands_sweep_grid import tiny_dir  # noqa: F401  (a module fixture)

from commands.cli import main
from h2o_lens import plan as budget_plan
from runlog import open_runs, read_manifest


@pytest.fixture
def no_model(monkeypatch):
    import h2o_lens.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(h2o_lens.models, "load_model", refuse)


def _tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    lines = [
        {"name": f"t{i}", "prompt": f"Remember {i * 7919}. " * 6 + "What number?", "answer": str(i * 7919)}
        for i in range(2)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_plan_writes_a_plan_record_runs_it(tmp_path, capsys, tiny_dir):  # noqa: F811
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", str(tiny_dir), "--tasks", str(_tasks(tmp_path)), "--total", "0.3", "--by", "head"]
    assert main([*argv, "--steps", "2", "-o", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.count("layer ") == 2 and f"wrote {out}" in printed.err
    assert "plan: calibration sweeps" in printed.err  # 2 prompts x (1 + 4 sets) sweeps, on a bar
    plan = budget_plan.load(out)
    doc = json.loads(out.read_text())
    assert len(plan.ratios) == 2 and all(len(row) == 2 for row in plan.ratios)
    assert set(doc["evidence"]) >= {"k90", "k95", "p1_coverage", "p5_coverage", "sensitivity", "shares"}
    assert main([*argv, "--steps", "1", "-o", str(out), "--quiet"]) == 0  # its own file: replaced
    assert "calibration sweeps" not in capsys.readouterr().err
    assert main([*argv, "--steps", "0", "-o", str(out)]) == 0
    runs = tmp_path / "runs"
    rc = main(["record", "--model", str(tiny_dir), "--prompt", "one two three " * 8, "--plan", str(out),
               "--max-new-tokens", "4", "--raw", "--out", str(runs)])  # fmt: skip
    assert rc == 0
    con = open_runs(runs)
    (run_id,) = con.execute("SELECT run_id FROM runs").fetchall()[0]
    logged = read_manifest(runs / run_id)["config"]["plan"]  # one request: resolved to its slots
    (prompt_len,) = con.execute("SELECT prompt_len FROM requests").fetchall()[0]
    ratios = budget_plan.load(out).ratios
    assert logged == {"slots": [[max(2, round(r * prompt_len)) for r in row] for row in ratios]}
    assert con.execute("SELECT count(*) FROM set_budgets").fetchall()[0][0] == 4


@pytest.mark.parametrize(
    "case, needle",
    [
        ("foreign", "is not a file h2o-lens wrote"),
        ("no_folder", "its folder does not exist"),
        ("total", "--total"),
        ("by", "--by"),
        ("record_both", "--plan gives the budget; drop --ratio"),
        ("record_missing", "cannot read the budget plan"),
        ("record_full", "--policy full keeps every token"),
    ],
)
def test_plan_options_are_refused_before_the_model_loads(tmp_path, capsys, no_model, case, needle):
    foreign = tmp_path / "mine.json"
    foreign.write_text('{"mine": 1}')
    plan = tmp_path / "plan.json"
    budget_plan.BudgetPlan(ratios=[0.2, 0.2]).save(plan)
    base = ["plan", "--tasks", "builtin:small", "--total", "0.2"]
    argv = {
        "foreign": [*base, "-o", str(foreign)],
        "no_folder": [*base, "-o", str(tmp_path / "nope" / "p.json")],
        "total": ["plan", "--total", "1.5", "-o", str(tmp_path / "p.json")],
        "by": [*base, "--by", "set", "-o", str(tmp_path / "p.json")],
        "record_both": ["record", "--plan", str(plan), "--ratio", "0.2", "--out", str(tmp_path / "r")],
        "record_missing": ["record", "--plan", str(tmp_path / "none.json"), "--out", str(tmp_path / "r")],
        "record_full": ["record", "--plan", str(plan), "--policy", "full", "--out", str(tmp_path / "r")],
    }[case]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h2o-lens: error: ") and needle in lines[0], lines
    assert foreign.read_text() == '{"mine": 1}'


def test_sweep_runs_each_h2o_cell_under_the_plan_too(tmp_path, capsys, tiny_dir):  # noqa: F811
    """``sweep --plan``: every H2O cell has a twin under the plan scaled to its keep ratio, on its own
    curve (``h2o-sum+plan``); the twins' runs hold the scaled plan; --slots is refused with it."""
    plan = tmp_path / "plan.json"
    budget_plan.BudgetPlan(ratios=[(0.1, 0.3), 0.2]).save(plan)  # a mean of 0.2 over the layers and sets
    out = tmp_path / "sweep"
    argv = ["sweep", "--model", str(tiny_dir), "--tasks", str(_tasks(tmp_path)), "--policies", "h2o,local"]
    assert main([*argv, "--ratios", "0.35", "--plan", str(plan), "--out", str(out), "--no-replay"]) == 0
    printed = capsys.readouterr().out
    assert "h2o-sum+plan" in printed and "local+plan" not in printed
    con = open_runs(out)
    plans = [read_manifest(out / r)["config"].get("plan") for (r,) in con.execute("SELECT run_id FROM runs").fetchall()]
    planned = [p for p in plans if p is not None]
    assert len(planned) == 1 and len(plans) == 3  # h2o, local and h2o+plan: one batch of two requests
    assert planned[0] == {"ratios": [[0.175, 0.525], [0.35]]}  # the plan's shape at a mean of 0.35
    assert main([*argv, "--slots", "8", "--plan", str(plan), "--out", str(tmp_path / "s2")]) == 2
    assert "--plan takes keep ratios" in capsys.readouterr().err
