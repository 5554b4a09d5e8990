"""``sweep --cold`` (DESIGN.md §2.13, §12): every evicting policy's cell gets a twin with the cold
tier, a distinct cell (its own key, run and curve ``+cold``) that resumes like any other; the cells
without it keep their keys; a window a request's slot count cannot hold is refused before any cell."""

from __future__ import annotations

import pytest
from test_commands_sweep_grid import task_file, tiny_dir  # noqa: F401 (fixtures)

from h2o_lens.cold_config import parse_cold
from h2o_lens.errors import ConfigError


def _grid(tiny_dir, task_file, **kw):  # noqa: F811
    from commands.grid import plan_grid
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    model, tok = load_model(tiny_dir, progress=False)
    tasks = resolve_tasks(str(task_file))
    base = dict(model="tiny", tasks_spec=str(task_file), policies=[("h2o", "sum"), ("local", "sum")], batch_size=8)
    return model, tok, tasks, plan_grid(tasks, tok, **{**base, **kw})


def test_a_cold_cell_is_a_twin_with_its_own_key_and_the_others_keep_theirs(tiny_dir, task_file):  # noqa: F811
    _, _, _, plain = _grid(tiny_dir, task_file, ratios=[1.0, 0.5])
    _, _, _, cold = _grid(tiny_dir, task_file, ratios=[1.0, 0.5], cold=parse_cold("cpu:2"))
    assert [c.key for c in cold.cells if c.cold is None] == [c.key for c in plain.cells]
    twins = [c for c in cold.cells if c.cold is not None and c.batch == 0]
    assert [c.label for c in twins] == ["h2o-sum+cold", "local+cold"]
    assert len({c.key for c in cold.cells}) == len(cold.cells) and cold.grid_id != plain.grid_id
    config = twins[0].config()
    assert config.cold == parse_cold("cpu:2") and config.ratio == 0.5 and config.policy == "h2o"
    assert "cold" in cold.to_json()["cells"][-1] and "cold" not in cold.to_json()["cells"][0]


def test_a_window_a_short_prompt_cannot_hold_is_refused_before_any_cell(tiny_dir, task_file):  # noqa: F811
    # "free" is the shortest prompt: at 10 % its slot count is far below a window of 8
    with pytest.raises(ConfigError, match=r"h2o-sum\+cold at 10%, request free \(\d+ prompt tokens\): .*recall window"):
        _grid(tiny_dir, task_file, ratios=[0.1], cold=parse_cold("cpu:8"))


@pytest.mark.slow
def test_a_sweep_with_a_cold_tier_records_its_twins_and_resumes(tiny_dir, task_file, tmp_path):  # noqa: F811
    from commands.grid import grid_status, run_grid, write_plan
    from runlog import read_manifest

    model, tok, tasks, grid = _grid(
        tiny_dir, task_file, ratios=[0.5], policies=[("h2o", "sum")], cold=parse_cold("cpu:2"), batch_size=8
    )
    root = tmp_path / "root"
    write_plan(root, grid)
    first = run_grid(root, grid, tasks, model, tok, progress=False)
    assert sorted(first.ran) == sorted(c.key for c in grid.cells) and not first.failed
    cold = next(c for c in grid.cells if c.cold is not None)
    manifest = read_manifest(root / cold.run_id)
    assert manifest["config"]["cold"]["recall"] == 2 and manifest["cold"]["evicted"] > 0
    plain = next(c for c in grid.cells if c.cold is None)
    assert "cold" not in read_manifest(root / plain.run_id)["config"]
    again = run_grid(root, grid, tasks, model, tok, progress=False)
    assert not again.ran and sorted(again.done) == sorted(c.key for c in grid.cells)
    assert "h2o-sum+cold" in grid_status(root)
