"""What ``sweep --status`` says is what the cells hold (DESIGN.md §12.3): a cell whose replay is
missing is to do (and redone), a cell that failed anywhere is failed with its error, and an
untouched sweep root has no problem. A tiny random llama in a folder, as a user's model.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny import save_tiny

from commands import grid as grid_module
from commands.grid import cell_state, grid_status, plan_grid, run_grid
from h2o_lens.models import load_model
from h2o_lens.tasks.taskfile import FileTask
from runlog import open_runs, read_manifest, replay_complete

TASKS = [
    FileTask(name="code", prompt="Notes: the lab code is 4419. The cable goes to port 7. What is the code?",
             answer="4419", evidence={"code": "code is 4419"}, max_new_tokens=5),
    FileTask(name="city", prompt="Maria moved to Lisbon in May. Where did Maria move?", answer="Lisbon",
             max_new_tokens=5),
]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(save_tiny(tmp_path_factory.mktemp("model") / "m"), dtype=torch.float32, progress=False)


def _grid(model):
    kw = dict(model="tiny", tasks_spec="inline", policies=[("h2o", "sum")], ratios=[1.0, 0.5], slots=None)
    return plan_grid(TASKS, model[1], batch_size=2, dtype="float32", replay=True, **kw)


def _counts(status: str) -> str:
    return status.splitlines()[-1]


def test_an_untouched_sweep_root_has_no_problem(model, tmp_path):
    grid = _grid(model)
    report = run_grid(tmp_path, grid, TASKS, *model, progress=False)
    assert len(report.ran) == len(grid.cells) == 2 and not report.failed
    con = open_runs(tmp_path, warn=False)
    assert con.execute("SELECT count(*) FROM problems").fetchone() == (0,)
    assert {i for (i,) in con.execute("SELECT integrity FROM runs").fetchall()} == {"ok"}


def test_a_cell_whose_replay_is_missing_is_to_do_and_is_replayed(model, tmp_path):
    grid = _grid(model)
    run_grid(tmp_path, grid, TASKS, *model, progress=False)
    cell = next(c for c in grid.cells if c.budget is not None)
    run_dir = tmp_path / cell.run_id
    for path in run_dir.glob("replay_steps-*.parquet"):  # what a replay killed after its delete left
        path.unlink()
    assert read_manifest(run_dir).get("replay")  # the manifest still says it was replayed
    assert cell_state(tmp_path, cell.run_id, True)[0] == "unreplayed"
    assert _counts(grid_status(tmp_path)) == "total: 2 cells: 1 done, 0 failed, 0 running, 1 to do"
    report = run_grid(tmp_path, grid, TASKS, *model, progress=False)
    assert report.ran == [cell.key] and not report.failed
    assert replay_complete(run_dir)
    con = open_runs(tmp_path, warn=False)
    steps = con.execute("SELECT count(kl) FROM replay_steps WHERE run_id = ?", [cell.run_id]).fetchone()[0]
    assert steps == sum(t.max_new_tokens for t in TASKS)
    assert con.execute("SELECT integrity FROM runs WHERE run_id = ?", [cell.run_id]).fetchone() == ("ok",)


def test_a_cell_failing_before_its_run_folder_exists_is_failed_with_its_error(model, tmp_path, monkeypatch):
    grid = _grid(model)
    real = grid_module._record_cell

    def record_cell(root, cell, *args, **kwargs):
        if cell.budget is not None:
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")  # as a tokenizer would
        return real(root, cell, *args, **kwargs)

    monkeypatch.setattr(grid_module, "_record_cell", record_cell)
    report = run_grid(tmp_path, grid, TASKS, *model, progress=False)
    assert len(report.failed) == 1 and not report.unmarked
    status = grid_status(tmp_path)
    assert _counts(status) == "total: 2 cells: 1 done, 1 failed, 0 running, 0 to do"
    (line,) = [x for x in status.splitlines() if x.strip().startswith("failed cell-")]
    assert "UnicodeEncodeError" in line and "surrogates not allowed" in line
    failed = next(c for c in grid.cells if c.budget is not None)
    assert json.loads((tmp_path / failed.run_id / "manifest.json").read_text())["status"] == "failed"
    monkeypatch.undo()
    report = run_grid(tmp_path, grid, TASKS, *model, progress=False)  # the next sweep redoes it
    assert report.ran == [failed.key] and report.redone == [failed.key]
