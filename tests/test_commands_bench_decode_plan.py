"""``h2o-lens bench decode --plan FILE`` (DESIGN.md §2.14): planned H2O beside uniform H2O at the
same total slots on a tiny model folder, and the input it refuses before the model loads (no
timing asserted)."""

from __future__ import annotations

import re

import pytest
from test_commands_plan import no_model  # noqa: F401  (a fixture)
from test_commands_sweep_grid import tiny_dir  # noqa: F401  (a module fixture)

from commands.cli import main
from h2o_lens import plan as budget_plan

HEADER = ("batch", "uniform ms/step", "planned ms/step", "planned/uniform", "uniform tok/s", "planned tok/s")


@pytest.mark.parametrize("backend", ["auto", "cpp"])
def test_bench_decode_plan_times_planned_and_uniform_h2o_at_the_same_total(tmp_path, capsys, tiny_dir, backend):  # noqa: F811
    if backend == "cpp":
        from h2o_lens.kernels.cpu import cpu_step_problem

        if cpu_step_problem() is not None:
            pytest.skip(cpu_step_problem())
    plan = tmp_path / "plan.json"
    budget_plan.BudgetPlan(ratios=[(0.1, 0.3), 0.2]).save(plan)  # layer 0 ragged (by KV set), layer 1 one share
    argv = ["bench", "decode", "--model", str(tiny_dir), "--plan", str(plan), "--contexts", "48", "--backend", backend]
    assert main([*argv, "--batch", "1", "2", "--steps", "2", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "alternating uniform / planned" in out and "by KV set" in out, out
    assert f"backend {backend};" in out
    # at 48 tokens: 5 + 14 slots in layer 0, 10 + 10 in layer 1; the uniform B is 39 / 4 rounded
    totals = (
        r"context 48: planned (\d+) slots .*?(\d+) ragged layers\); uniform H2O B=(\d+) x 2 layers x 2 KV sets = (\d+)"
    )
    m = re.search(totals, out)
    assert m, out
    assert [int(x) for x in m.groups()] == [39, 1, 10, 40]
    assert "the same total: the plan's slots at this context over layers x KV sets" in out
    lines = out.split("context 48:")[1].splitlines()
    assert all(h in lines[1] for h in HEADER), lines[1]
    rows = {int(line.split()[0]): [float(x) for x in line.split()[1:]] for line in lines[2:] if line.strip()}
    assert sorted(rows) == [1, 2]
    for b, (tu, tp, ratio, tps_u, tps_p, mib_u, mib_p) in rows.items():
        assert tu > 0 and tp > 0
        assert ratio == pytest.approx(tp / tu, rel=0.02)
        assert tps_u == pytest.approx(b * 1e3 / tu, rel=0.02) and tps_p == pytest.approx(b * 1e3 / tp, rel=0.02)
        assert mib_p > mib_u > 0  # the ragged layer's storage is as wide as its widest set (14 > 10)


@pytest.mark.parametrize(
    "case, needle",
    [
        ("missing", "bench decode --plan"),
        ("layers", "the budget plan has 3 layers, the model 2"),
        ("sets", "the model has 2 KV sets per layer"),
        ("keep", "drop --keep"),
        ("cold", "drop --cold"),
        ("guard", "drop --guard"),
        ("assistant", "drop --assistant"),
    ],
)
def test_bench_decode_plan_refuses_bad_input_before_the_model_loads(
    tmp_path,
    capsys,
    tiny_dir,  # noqa: F811
    no_model,  # noqa: F811
    case,
    needle,
):
    plan = tmp_path / "plan.json"
    budget_plan.BudgetPlan(ratios=[0.2, 0.2]).save(plan)
    other = tmp_path / "three.json"
    budget_plan.BudgetPlan(ratios=[0.2, 0.2, 0.2]).save(other)
    wide = tmp_path / "wide.json"
    budget_plan.BudgetPlan(ratios=[(0.1, 0.2, 0.3), 0.2]).save(wide)
    base = ["bench", "decode", "--model", str(tiny_dir), "--contexts", "48", "--batch", "1"]
    argv = {
        "missing": [*base, "--plan", str(tmp_path / "none.json")],
        "layers": [*base, "--plan", str(other)],
        "sets": [*base, "--plan", str(wide)],
        "keep": [*base, "--plan", str(plan), "--keep", "0.3"],
        "cold": [*base, "--plan", str(plan), "--cold", "cpu:3"],
        "guard": [*base, "--plan", str(plan), "--guard"],
        "assistant": [*base, "--plan", str(plan), "--assistant"],
    }[case]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h2o-lens: error: ") and needle in lines[0], lines
