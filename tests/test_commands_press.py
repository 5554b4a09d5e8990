"""kvpress presses in sweeps (DESIGN.md §17): ``kvpress:NAME`` policies beside H2O, ``--press-args``,
keep ratio -> ``compression_ratio = 1 - ratio``, and resume after SIGKILL.

A tiny random llama with a byte-level tokenizer (the sweep tests' model), loaded by the command
line. kvpress needs transformers < 5.3: these run in the 5.2 compatibility venv and skip where
kvpress is absent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from h2o_lens.errors import ConfigError
from runlog import open_runs
from tests.test_commands_sweep_grid import REPO, _cells_done, _cli, task_file, tiny_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.compat


@pytest.fixture(scope="module", autouse=True)
def kv():
    return pytest.importorskip("kvpress")


def test_press_policies_take_short_names_inline_arguments_and_press_args():
    from commands.sweep import sweep_grid

    assert sweep_grid(["h2o,kvpress:snapkv,kvpress:streaming_llm"]) == (
        ("h2o", "sum"),
        ("kvpress:snapkv", "sum"),
        ("kvpress:streaming_llm", "sum"),
    )
    # --press-args goes to every press that takes it; inline arguments win; a comma inside
    # parentheses stays with its press
    grid = sweep_grid(
        ["kvpress:snapkv(kernel_size=3,window_size=8),kvpress:tova", "kvpress:knorm"], None, ["window_size=4"]
    )
    assert grid == (
        ("kvpress:snapkv(kernel_size=3, window_size=8)", "sum"),
        ("kvpress:tova", "sum"),
        ("kvpress:knorm", "sum"),
    )
    assert sweep_grid(["kvpress:SnapKVPress"], None, ["window_size=4"]) == (("kvpress:snapkv(window_size=4)", "sum"),)


def test_a_wrapper_press_takes_its_scorer_and_the_scorer_takes_press_args():
    from commands.sweep import sweep_grid

    grid = sweep_grid(["kvpress:adakv,kvpress:block(press=knorm),kvpress:chunkkv"], None, ["window_size=4"])
    assert grid == (
        ("kvpress:adakv(window_size=4)", "sum"),  # its SnapKV takes the window
        ("kvpress:block(press='knorm')", "sum"),  # KnormPress takes no window: left out
        ("kvpress:chunkkv(window_size=4)", "sum"),
    )
    assert sweep_grid(["kvpress:criticaladakv"], None, ["press=knorm"]) == (
        ("kvpress:criticaladakv(press='knorm')", "sum"),
    )


@pytest.mark.parametrize(
    ("policies", "press_args", "message"),
    [
        (["kvpress:nosuch"], None, "unknown press 'nosuch'"),
        (["kvpress:snapkv(compression_ratio=0.5)"], None, "sets compression_ratio from each keep ratio"),
        (["kvpress:snapkv"], ["window=4"], "window: no press of --policies takes it"),
        (["h2o"], ["window_size=4"], "add one to --policies"),
        (["kvpress:thin_k"], None, "ThinKPress is not supported: it zeroes key channels"),
        (["kvpress:kvzip"], None, "KVzipPress is not supported: it compresses when its `with press(model):` block"),
        (["kvpress:adakv"], ["press=decoding"], "expected the short name of a scorer press"),
        (["kvpress:dms"], None, "wraps another press"),
        (["kvpress:snapkv(windowsize=4)"], None, "SnapKVPress takes no windowsize; its parameters are"),
        (["kvpress:decoding"], None, "wraps another press"),
    ],
)
def test_bad_press_policies_are_refused_in_one_line(policies, press_args, message):
    from commands.sweep import sweep_grid

    with pytest.raises(ConfigError) as err:
        sweep_grid(policies, None, press_args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_cli_refuses_a_press_with_slot_budgets_before_loading_a_model(tiny_dir, task_file, tmp_path):  # noqa: F811
    res = _cli(
        "sweep", "--model", str(tiny_dir), "--tasks", str(task_file), "--policies", "kvpress:snapkv",
        "--slots", "16", "--out", str(tmp_path / "out"), timeout=120,
    )  # fmt: skip
    assert res.returncode == 2 and "a press takes a keep ratio" in res.stderr, res.stderr[-2000:]
    assert res.stderr.count("\n") == 1


def test_a_sweep_with_two_presses_and_h2o_resumes_after_sigkill(tiny_dir, task_file, tmp_path):  # noqa: F811
    root = tmp_path / "grid"
    args = [
        "sweep", "--model", str(tiny_dir), "--tasks", str(task_file),
        "--policies", "h2o,kvpress:snapkv,kvpress:streaming_llm", "--press-args", "window_size=4",
        "--ratios", "1,0.5", "--batch-size", "2", "--out", str(root),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "commands.cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while len(_cells_done(root)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
    (grid,) = json.loads((root / "sweep_plan.json").read_text())["grids"].values()
    cells = grid["cells"]
    assert len(cells) == 3 * (1 + 3)  # 3 batches x (the full cache + h2o and two presses at 0.5)
    before = {n: json.loads((root / n / "manifest.json").read_text()) for n in _cells_done(root)}
    assert 3 <= len(before) < len(cells)

    again = _cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(cells) - len(before)} run, {len(before)} already done" in again.stdout
    for name, manifest in before.items():  # not done again
        assert json.loads((root / name / "manifest.json").read_text())["finished_at"] == manifest["finished_at"]
    con = open_runs(root)
    rows = con.sql(
        "SELECT policy, keep_ratio, status, max_logit_diff <= logit_tolerance, backend FROM runs ORDER BY policy"
    ).fetchall()
    assert {r[2] for r in rows} == {"complete"} and all(r[3] for r in rows), rows  # replays pass the check
    presses = {r[0] for r in rows if r[0].startswith("kvpress:")}
    assert presses == {
        "kvpress:SnapKVPress(compression_ratio=0.5, window_size=4, kernel_size=5)",
        "kvpress:StreamingLLMPress(compression_ratio=0.5, n_sink=4)",
    }
    assert {r[1] for r in rows if r[0] in presses} == {0.5} and {r[4] for r in rows if r[0] in presses} == {"kvpress"}
    # the same budget: at keep ratio 0.5 a press holds int(P * 0.5) of a P-token prompt (kvpress
    # floors), H2O max(2, round(0.5 * P)) (DESIGN.md §2.7): equal, or one apart for an odd P
    kept = con.sql(
        "SELECT r.policy LIKE 'kvpress:%', q.prompt_len, max(s.kept), min(s.kept) FROM steps s "
        "JOIN runs r USING (run_id) JOIN requests q USING (run_id, request) "
        "WHERE r.keep_ratio = 0.5 AND s.step = q.prompt_len - 1 GROUP BY ALL"
    ).fetchall()
    assert {p for p, *_ in kept} == {True, False}
    for press, prompt_len, most, least in kept:
        assert most == least == (int(prompt_len * 0.5) if press else max(2, round(0.5 * prompt_len)))
    csv = (root / "sweep.csv").read_text()
    assert "kvpress:snapkv(window_size=4)" in csv and "kvpress:streaming_llm" in csv
    assert "#d62728" in (root / "sweep.html").read_text()  # SnapKV's colour in the curves


def test_a_sweep_of_per_head_and_chunk_presses_records_and_replays(tiny_dir, task_file, tmp_path):  # noqa: F811
    root = tmp_path / "grid"
    res = _cli(
        "sweep", "--model", str(tiny_dir), "--tasks", str(task_file),
        "--policies", "kvpress:adakv,kvpress:chunkkv(chunk_length=4),kvpress:block(press=knorm)",
        "--press-args", "window_size=4", "--ratios", "0.5", "--batch-size", "2", "--out", str(root), timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    con = open_runs(root)
    rows = con.sql(
        "SELECT policy, keep_ratio, status, max_logit_diff <= logit_tolerance FROM runs WHERE policy LIKE 'kvpress:%'"
    ).fetchall()
    assert {r[2] for r in rows} == {"complete"} and all(r[3] for r in rows), rows
    assert {r[1] for r in rows} == {0.5}
    assert {r[0] for r in rows} == {
        "kvpress:AdaKVPress(press=SnapKVPress(compression_ratio=0.5, window_size=4, kernel_size=5), "
        "alpha_safeguard=0.2)",
        "kvpress:ChunkKVPress(press=SnapKVPress(compression_ratio=0.5, window_size=4, kernel_size=5), chunk_length=4)",
        "kvpress:BlockPress(press=KnormPress(compression_ratio=0.5), block_size=128)",
    }
    # AdaKV's budgets differ by head and sum, per layer, to the press's count over its KV heads
    per_layer = con.sql(
        "SELECT count(DISTINCT s.kept) > 1, sum(s.kept), any_value(q.prompt_len) FROM steps s "
        "JOIN runs r USING (run_id) JOIN requests q USING (run_id, request) "
        "WHERE r.policy LIKE 'kvpress:AdaKV%' GROUP BY s.run_id, s.request, s.layer"
    ).fetchall()
    assert any(d for d, *_ in per_layer)
    heads = con.sql("SELECT max(kv_head) + 1 FROM steps").fetchall()[0][0]
    assert all(total == heads * int(n * 0.5) for _, total, n in per_layer)
    assert "kvpress:adakv(window_size=4)" in (root / "sweep.csv").read_text()
