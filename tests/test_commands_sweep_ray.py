"""Sweeps on a Ray cluster (DESIGN.md §13): the same tables as in-process, a killed worker, Ray missing.

A local Ray cluster of 2 CPUs on 127.0.0.1 is started once for the module (and
shut down at its end); the sweeps run 2 worker actors on it, each loading a
tiny random llama saved with a byte-level tokenizer.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runlog import open_runs
from tests.test_commands_sweep_grid import REQUESTS, _byte_tokenizer, _per_request
from tests.tiny import tiny_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
#: columns of the runs table that differ between two sweeps of one grid: timings and the root's path
TIMINGS = {"created_at", "finished_at", "seconds_per_token", "prefill_seconds", "path"}
#: long enough (new tokens) that a cell is still being recorded when the test finds it running
SLOW = [
    {"name": "slow_a", "prompt": "Count from one onwards and do not stop: one, two, three,", "max_new_tokens": 96},
    {"name": "slow_b", "prompt": "List colours, one per line, for a long time: red, green,", "max_new_tokens": 96},
]


@pytest.fixture(scope="module")
def ray_cluster():
    """The address of a local Ray cluster with 2 CPUs, bound to 127.0.0.1, without dashboard."""
    ray = pytest.importorskip(
        "ray", reason="the ray extra is not installed (`make compat` has it on the newest release)"
    )

    saved = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
        else:
            os.environ["RAY_USAGE_STATS_ENABLED"] = saved


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_model")
    tok = _byte_tokenizer()
    model = tiny_model("llama", vocab=len(tok))
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 0, 1, 2
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _task_file(path: Path, requests: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests), encoding="utf-8")
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}


def _runs_rows(root: Path) -> set[tuple]:
    con = open_runs(root)
    columns = [c for (c, *_) in con.sql("DESCRIBE runs").fetchall() if c not in TIMINGS]
    return set(con.sql(f"SELECT {', '.join(columns)} FROM runs").fetchall())


def _sweep_csv(root: Path) -> list[dict[str, str]]:
    with open(root / "sweep.csv", encoding="utf-8") as fh:
        return [{k: v for k, v in row.items() if k != "ms_per_token"} for row in csv.DictReader(fh)]


@pytest.mark.compat  # the Ray executor on the newest transformers release (DESIGN.md §3.1)
def test_a_ray_sweep_writes_the_same_runs_as_the_in_process_one(ray_cluster, tiny_dir, tmp_path, capsys):
    from commands.grid import LOCK_DIR, _flock
    from commands.jobs import sweep
    from commands.ray_sweep import RayOptions, RaySweep
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    task_file = _task_file(tmp_path / "tasks.jsonl", REQUESTS)
    model, tok = load_model(tiny_dir, dtype=torch.float64, progress=False)
    grid = dict(
        tasks=resolve_tasks(str(task_file)),
        tasks_spec=str(task_file),
        tokenizer=tok,
        ratios=(1.0, 0.5),
        policies=(("h2o", "sum"), ("local", "sum")),
        batch_size=2,
        progress=False,
    )
    sweep(tmp_path / "inprocess", model=model, **grid)
    (plan,) = json.loads((tmp_path / "inprocess" / "sweep_plan.json").read_text())["grids"].values()
    held = plan["cells"][4]["run_id"]
    capsys.readouterr()
    with RaySweep(str(tiny_dir), "float64", RayOptions(workers=2)) as pool:
        # a cell whose lock another process holds is left to it by the workers, as in-process
        with _flock(tmp_path / "ray" / LOCK_DIR / f"{held}.lock", wait=False) as mine:
            assert mine
            sweep(tmp_path / "ray", executor=pool, **grid)
        assert "8 run, 0 already done, 0 failed, 1 taken by another sweep" in capsys.readouterr().out
        assert not (tmp_path / "ray" / held).exists()
        sweep(tmp_path / "ray", executor=pool, **grid)  # the same command again: only that cell runs
        assert "1 run, 8 already done, 0 failed, 0 taken" in capsys.readouterr().out
        workers = [(w.info["pid"], w.cells) for w in pool.workers]
    # two worker processes (not this one), each of which ran cells: 3 batches x (full + 2 policies)
    assert len({pid for pid, _ in workers}) == 2 and os.getpid() not in {pid for pid, _ in workers}
    assert sum(n for _, n in workers) == 9 and all(n > 0 for _, n in workers), workers
    local, ray = _per_request(tmp_path / "inprocess"), _per_request(tmp_path / "ray")
    assert local["evictions"] and local["tokens"]
    for table in ("evictions", "tokens", "verdicts"):  # kept sets, tokens and verdicts
        assert ray[table] == local[table], table
    assert _runs_rows(tmp_path / "ray") == _runs_rows(tmp_path / "inprocess")  # same cells, run ids included
    assert {s for *_, s in open_runs(tmp_path / "ray").sql("SELECT run_id, status FROM runs").fetchall()} == {
        "complete"
    }
    assert _sweep_csv(tmp_path / "ray") == _sweep_csv(tmp_path / "inprocess")
    plans = [json.loads((tmp_path / r / "sweep_plan.json").read_text())["grids"] for r in ("inprocess", "ray")]
    assert plans[0].keys() == plans[1].keys()


def test_a_worker_killed_mid_cell_loses_only_its_cell_which_is_retried_once(ray_cluster, tiny_dir, tmp_path):
    root = tmp_path / "grid"
    task_file = _task_file(tmp_path / "slow.jsonl", SLOW)
    args = ["sweep", "--model", str(tiny_dir), "--tasks", str(task_file), "--ratios", "1,0.5", "--policies", "h2o"]
    args += ["--batch-size", "1", "--no-replay", "--out", str(root)]
    args += ["--executor", "ray", "--address", ray_cluster, "--workers", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "commands.cli", *args],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = None
    deadline = time.monotonic() + 240
    try:
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            for path in root.glob("cell-*/manifest.json"):
                try:
                    manifest = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if manifest.get("status") == "running":  # a cell in flight: kill the worker writing it
                    pid = manifest["writer"]["pid"]
                    assert pid != proc.pid
                    os.kill(pid, signal.SIGKILL)
                    killed = (path.parent.name, pid)
                    break
            time.sleep(0.01)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "no cell was seen running"
    assert proc.returncode == 0, err[-3000:]
    run_id, pid = killed
    assert err.count(f"worker lost on cell {run_id}; retrying it") == 1, err[-3000:]
    assert "worker lost" not in err.replace(f"worker lost on cell {run_id}; retrying it", "")
    assert "1 retried after a worker died" in out, out
    (grid,) = json.loads((root / "sweep_plan.json").read_text())["grids"].values()
    cells = sorted(c["run_id"] for c in grid["cells"])
    assert len(cells) == 2 * 2  # two requests alone x (full cache, h2o at 50 %)
    assert sorted(p.name for p in root.glob("cell-*")) == cells  # one folder per cell, nothing else
    con = open_runs(root)
    assert sorted(con.sql("SELECT run_id, status FROM runs").fetchall()) == [(c, "complete") for c in cells]
    assert con.sql("SELECT count(*) FROM requests").fetchall() == [(len(cells),)]
    dup = "SELECT run_id, request, position FROM tokens GROUP BY ALL HAVING count(*) > 1"
    assert con.sql(dup).fetchall() == []
    redone = json.loads((root / run_id / "manifest.json").read_text())
    assert redone["writer"]["pid"] != pid and redone["status"] == "complete"
    status = subprocess.run(
        [sys.executable, "-m", "commands.cli", "sweep", "--status", str(root)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"total: {len(cells)} cells: {len(cells)} done, 0 failed, 0 running, 0 to do" in status.stdout


def test_without_ray_the_executor_gives_one_line_naming_the_extra(tmp_path):
    # `import ray` fails in this interpreter, as where Ray is not installed; the rest still imports
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import commands.cli, commands.jobs, commands.grid, commands.ray_sweep\n"
        "sys.exit(commands.cli.main(sys.argv[1:]))"
    )
    out = tmp_path / "root"
    proc = subprocess.run(
        [sys.executable, "-c", code, "sweep", "--executor", "ray", "--out", str(out)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "h2o-lens: error: --executor ray needs Ray, which is not installed; install the extra: "
        "pip install 'h2o-lens[ray]'"
    ]
    assert not out.exists()


def test_ray_options_without_the_ray_executor_are_refused(capsys):
    from commands.cli import main

    assert main(["sweep", "--address", "auto", "--workers", "2"]) == 2
    assert "--address, --workers only apply to a Ray sweep; add --executor ray" in capsys.readouterr().err


def test_bench_sweep_on_ray_prints_both_executors_the_ratio_and_the_overhead(ray_cluster, tiny_dir, tmp_path, capsys):
    from commands.benchmarks.sweep import bench_sweep
    from h2o_lens.models import load_model

    task_file = _task_file(tmp_path / "tasks.jsonl", REQUESTS[:4])
    model, tok = load_model(tiny_dir, progress=False)
    common = dict(tasks=str(task_file), count=4, batch_size=1, new_tokens=2, replay=False)
    assert bench_sweep(str(tiny_dir), model=model, tokenizer=tok, executor="ray", workers=2, **common) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("in-process", "ray x2"))}
    assert rows["in-process"][1] == rows["ray"][2] == "4", out  # 4 cells each way
    ratio = float(out.split("ray / in-process: ")[1].split("x")[0])
    assert ratio > 0
    assert "ms (worker time outside cells)" in out and "ms (no-op round trip)" in out


def test_a_cell_whose_worker_was_lost_is_left_failed_with_the_error(tmp_path):
    from commands.grid import LOCK_DIR, _flock, cell_state, fail_cell, grid_status, plan_grid, write_plan
    from h2o_lens.tasks.builtins import resolve_tasks
    from runlog.manifest import process_identity, read_manifest, write_manifest

    tasks = resolve_tasks(str(_task_file(tmp_path / "tasks.jsonl", REQUESTS)))
    tok = _byte_tokenizer()
    grid = plan_grid(tasks, tok, model="tiny", tasks_spec="t", policies=[("h2o", "sum")], ratios=[0.5], batch_size=1)
    root = tmp_path / "root"
    write_plan(root, grid)
    lost, done = grid.cells[0], grid.cells[1]
    for cell, status in ((lost, "running"), (done, "complete")):
        (root / cell.run_id).mkdir()
        write_manifest(root / cell.run_id, {"run_id": cell.run_id, "status": status, "writer": process_identity()})
    with _flock(root / LOCK_DIR / f"{lost.run_id}.lock", wait=False):  # its writer still holds it
        assert not fail_cell(root, lost, "worker lost 2 times: ActorDiedError")
    assert fail_cell(root, lost, "worker lost 2 times: ActorDiedError")
    assert cell_state(root, lost.run_id, False) == ("failed", "WorkerLost: worker lost 2 times: ActorDiedError")
    assert f"failed {lost.run_id}: WorkerLost: worker lost 2 times" in grid_status(root)
    assert not fail_cell(root, done, "late") and read_manifest(root / done.run_id)["status"] == "complete"
    assert not fail_cell(root, grid.cells[2], "never started") and not (root / grid.cells[2].run_id).exists()


def test_a_free_worker_gets_the_next_cell_of_its_batch_else_a_batch_nobody_runs():
    """Batch affinity (DESIGN.md §13): the cells of a batch go to the worker that holds its prompt forward."""
    from commands.grid import plan_grid
    from commands.ray_sweep import _next_cell
    from h2o_lens.tasks.builtins import resolve_tasks

    tasks = resolve_tasks("builtin:full", count=6)
    grid = plan_grid(
        tasks,
        _byte_tokenizer(),
        model="tiny",
        tasks_spec="t",
        policies=[("h2o", "sum"), ("local", "sum")],
        ratios=[0.5, 0.3],
        batch_size=2,
    )
    by_batch = {}
    for i, cell in enumerate(grid.cells):
        by_batch.setdefault(cell.batch, []).append(i)
    assert len(by_batch) == 3 and all(len(v) == 4 for v in by_batch.values())
    queue = list(range(len(grid.cells)))
    assert _next_cell(grid, queue, None, set()) == 0  # nothing run yet: the first in line
    assert _next_cell(grid, queue, None, {0}) == by_batch[1][0]  # batch 0 is taken: the next batch
    queue = [i for i in queue if i not in (0, by_batch[1][0])]
    assert _next_cell(grid, queue, 1, {0}) == by_batch[1][1]  # its own batch first
    assert _next_cell(grid, queue, 0, {1}) == by_batch[0][1]
    assert _next_cell(grid, queue, 5, {0, 1, 2}) == queue[0]  # every batch is running: the first in line
