"""The sweep's fourth curve (DESIGN.md §7.5, §12): cold bytes read per generated token, only where a
sweep has cold cells (``sweep --cold`` makes ``POLICY+cold`` curves), from the runs' manifests."""

from __future__ import annotations

from test_commands_sweep_cold import _grid
from test_commands_sweep_grid import task_file, tiny_dir  # noqa: F401 (fixtures)

from analyses.sweep_page import sweep_figure
from h2o_lens.cold_config import parse_cold
from runlog import read_manifest


def _table(root, grid, tasks, model, tok):
    from commands.grid import run_grid, write_plan
    from commands.jobs import sweep_table

    write_plan(root, grid)
    assert not run_grid(root, grid, tasks, model, tok, progress=False).failed
    return sweep_table(root, grid.cells, model, replayed=False)


def test_cold_cells_add_the_bytes_read_curve(tiny_dir, task_file, tmp_path):  # noqa: F811
    model, tok, tasks, grid = _grid(
        tiny_dir, task_file, ratios=[0.5], policies=[("h2o", "sum")], cold=parse_cold("cpu:2"), batch_size=8
    )
    table = _table(tmp_path / "cold", grid, tasks, model, tok)
    cold = next(c for c in grid.cells if c.cold is not None)
    counters = read_manifest(tmp_path / "cold" / cold.run_id)["cold"]
    row = table[table["policy"] == "h2o-sum+cold"].iloc[0]
    assert row["cold_bytes_per_token"] > 0
    assert table.loc[table["policy"] == "h2o-sum", "cold_bytes_per_token"].isna().all()
    assert counters["bytes_read"] > 0
    fig = sweep_figure(table, 16, table.attrs["policy_of"], x=table.attrs["x"])
    traces = [t for t in fig.data if t.name and t.name.endswith("cold bytes")]
    assert [t.name for t in traces] == ["h2o-sum+cold cold bytes"] and list(traces[0].y) == [
        row["cold_bytes_per_token"]
    ]
    assert "bytes read per generated token" in fig.layout.annotations[-1].text

    model, tok, tasks, plain = _grid(tiny_dir, task_file, ratios=[0.5], policies=[("h2o", "sum")], batch_size=8)
    table = _table(tmp_path / "plain", plain, tasks, model, tok)
    assert "cold_bytes_per_token" not in table  # a sweep without cold cells keeps its four panels
    assert len(sweep_figure(table, 16, table.attrs["policy_of"], x=table.attrs["x"]).layout.annotations) == 4
