"""The sweep grid (DESIGN.md §12): batched cells equal one-at-a-time runs, resume after SIGKILL, --status.

Everything runs on a tiny random llama saved with a byte-level tokenizer, so the
command line loads it with ``--model PATH`` like a user's model.
"""

from __future__ import annotations

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
from tests.tiny import tiny_model

REPO = Path(__file__).resolve().parent.parent
SPECIALS = ("<pad>", "<s>", "</s>")

REQUESTS = [
    {
        "name": "code",
        "prompt": "Notes: the lab code is 4419. The cable goes to port 7. Lunch is at noon. What is the code?",
        "answer": "4419",
        "evidence": {"code": "code is 4419"},
        "max_new_tokens": 6,
    },
    {
        "name": "city",
        "prompt": "Maria moved to Lisbon in May. Where did Maria move?",
        "answer": ["Lisbon", "lisboa"],
        "evidence": {"city": [15, 21]},
        "max_new_tokens": 6,
    },
    {
        "name": "digits",
        "prompt": "Write four digits after reading this rather long line of filler text about nothing at all, "
        "and then some more filler so that this prompt is the longest of the file by far.",
        "answer": {"regex": "[0-9]{4}"},
        "max_new_tokens": 6,
    },
    {"name": "free", "prompt": "Say something short.", "max_new_tokens": 4},
    {
        "name": "pair",
        "prompt": "Oslo is cold, Lima is warm, Cairo is hot. Name the cold and the warm city.",
        "answer": {"all": ["Oslo", "Lima"], "none": ["Cairo"]},
        "evidence": {"cold": "Oslo is cold", "warm": "Lima is warm"},
        "max_new_tokens": 4,
    },
]


def _byte_tokenizer():
    """A byte-level BPE tokenizer without merges: 3 special tokens, then the 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(SPECIALS)} | {c: len(SPECIALS) + i for i, c in enumerate(sorted(alphabet))}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny llama and its tokenizer in a folder, loadable with ``load_model(path)``."""
    path = tmp_path_factory.mktemp("tiny_model")
    tok = _byte_tokenizer()
    model = tiny_model("llama", vocab=len(tok))
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 0, 1, 2
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS), encoding="utf-8")
    return path


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "commands.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )


def _per_request(root: Path) -> dict[str, set]:
    """Per (policy, gqa, budget, task): its evictions, tokens and verdict, whatever run and row it was in."""
    con = open_runs(root)
    budget = "coalesce(r.keep_ratio::VARCHAR, 'full')"
    out = {}
    out["evictions"] = set(
        con.sql(
            f"SELECT r.policy, r.gqa, {budget}, q.task, e.layer, e.kv_head, e.step, e.position "
            "FROM evictions e JOIN requests q USING (run_id, request) JOIN runs r USING (run_id)"
        ).fetchall()
    )
    out["tokens"] = set(
        con.sql(
            f"SELECT r.policy, r.gqa, {budget}, q.task, t.position, t.token_id, t.is_prompt, t.evidence "
            "FROM tokens t JOIN requests q USING (run_id, request) JOIN runs r USING (run_id)"
        ).fetchall()
    )
    out["verdicts"] = set(
        con.sql(
            f"SELECT r.policy, r.gqa, {budget}, q.task, q.answer, q.correct, q.heavy, q.recent, q.prompt_len "
            "FROM requests q JOIN runs r USING (run_id)"
        ).fetchall()
    )
    return out


@pytest.mark.slow
def test_a_batched_sweep_equals_the_same_requests_one_at_a_time(tiny_dir, task_file, tmp_path):
    from commands.grid import make_batches
    from commands.jobs import sweep
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    model, tok = load_model(tiny_dir, dtype=torch.float64, progress=False)
    tasks = resolve_tasks(str(task_file))
    batches = make_batches(tasks, tok, 4)
    # same max_new_tokens in a batch; by prompt length; every request once
    assert [[tasks[i].name for i in b] for b in batches] == [["free", "pair"], ["city", "code", "digits"]]
    grid = dict(
        tasks=tasks,
        tasks_spec=str(task_file),
        model=model,
        tokenizer=tok,
        ratios=(1.0, 0.5),
        policies=(("h2o", "sum"), ("local", "sum"), ("h2o", "max")),
        replay=False,
        progress=False,
    )
    sweep(tmp_path / "batched", batch_size=4, **grid)
    sweep(tmp_path / "single", batch_size=1, **grid)
    batched, single = _per_request(tmp_path / "batched"), _per_request(tmp_path / "single")
    con = open_runs(tmp_path / "batched")
    # two batches x (full once + 3 evicting combos): 8 runs, each request once per combo
    assert con.sql("SELECT count(*) FROM runs").fetchall()[0][0] == 2 * 4
    assert con.sql("SELECT count(*) FROM requests").fetchall()[0][0] == len(REQUESTS) * 4
    assert open_runs(tmp_path / "single").sql("SELECT count(*) FROM runs").fetchall()[0][0] == len(REQUESTS) * 4
    assert batched["evictions"] and any(row[2] == "full" for row in batched["verdicts"])
    # per-request budgets: each request resolves 0.5 on its own prompt, so budgets differ within a batch
    heavy = {row[7] for row in batched["verdicts"] if row[0] == "h2o"}
    assert len(heavy) > 1
    for table in ("evictions", "tokens", "verdicts"):
        assert batched[table] == single[table], table
    verdicts = {(row[0], row[2], row[3]): row[5] for row in batched["verdicts"]}
    assert verdicts[("full", "full", "free")] is None  # no answer spec: no verdict
    assert all(verdicts[(p, b, t)] is not None for p, b, t in verdicts if t != "free")
    # each request of a batched run carries its own task-file line, so a counterfactual re-run
    # of request r checks its answer with r's checker
    from recorders.counterfactual import load_parent

    by_name = {t.name: t.to_json() for t in tasks}
    rows = con.sql(
        "SELECT q.run_id, q.request, q.task FROM requests q JOIN runs r USING (run_id) WHERE r.policy = 'h2o'"
    ).fetchall()
    assert len({run for run, _, _ in rows}) < len(rows)  # some runs hold several requests
    for run_id, request, task in rows:
        parent = load_parent(tmp_path / "batched" / run_id, request)
        assert parent.task_spec == by_name[task], (run_id, request)


def _cells_done(root: Path) -> list[str]:
    done = []
    for d in root.glob("cell-*"):
        try:
            if json.loads((d / "manifest.json").read_text()).get("replay"):
                done.append(d.name)
        except (OSError, ValueError):
            pass
    return done


@pytest.mark.slow
def test_a_sigkilled_sweep_resumes_where_it_stopped(tiny_dir, task_file, tmp_path):
    root = tmp_path / "grid"
    args = [
        "sweep",
        "--model",
        str(tiny_dir),
        "--tasks",
        str(task_file),
        "--policies",
        "h2o,local",
        "--policies",
        "sink",
        "--ratios",
        "1",
        "0.5",
        "--gqa",
        "sum,max",
        "--batch-size",
        "2",
        "--out",
        str(root),
    ]
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
    plan = json.loads((root / "sweep_plan.json").read_text())
    (grid,) = plan["grids"].values()
    cells = grid["cells"]
    # 3 batches (2 + 2 + 1 requests) x (full once + 3 policies x 2 gqa at one ratio)
    assert len(cells) == 3 * (1 + 6)
    before = {}
    for name in _cells_done(root):
        before[name] = json.loads((root / name / "manifest.json").read_text())
    assert 3 <= len(before) < len(cells)
    status = _cli("sweep", "--status", str(root))
    assert status.returncode == 0, status.stderr
    last = status.stdout.strip().splitlines()[-1]
    assert f"total: {len(cells)} cells: {len(before)} done" in last and "0 failed" in last, status.stdout
    assert "h2o-sum" in status.stdout and "sink-max" in status.stdout and "full" in status.stdout

    again = _cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(cells) - len(before)} run, {len(before)} already done" in again.stdout
    con = open_runs(root)
    rows = con.sql("SELECT run_id, status FROM runs").fetchall()
    assert sorted(r for r, _ in rows) == sorted(c["run_id"] for c in cells)  # one run folder per cell, no other
    assert {s for _, s in rows} == {"complete"}  # none left running
    for name, manifest in before.items():  # the cells done before the kill were not done again
        now = json.loads((root / name / "manifest.json").read_text())
        assert (now["created_at"], now["finished_at"], now["replay"]) == (
            manifest["created_at"],
            manifest["finished_at"],
            manifest["replay"],
        )
    keys = con.sql("SELECT run_id FROM runs").fetchall()
    for (run_id,) in keys:
        manifest = json.loads((root / run_id / "manifest.json").read_text())
        assert run_id == "cell-" + manifest["sweep_cell"][:20]
    assert (root / "sweep.html").exists() and "sink-max" in (root / "sweep.csv").read_text()

    status = _cli("sweep", "--status", str(root))
    assert f"total: {len(cells)} cells: {len(cells)} done, 0 failed, 0 running, 0 to do" in status.stdout
    # the same command once more runs nothing
    third = _cli(*args)
    assert f"0 run, {len(cells)} already done" in third.stdout
    # another grid on the same root adds its cells; the full cache of each batch is shared
    other = _cli(
        *args[: args.index("--policies")],
        "--policies",
        "heavy",
        "--ratios",
        "1,0.5",
        "--batch-size",
        "2",
        "--out",
        str(root),
    )
    assert other.returncode == 0, other.stderr[-3000:]
    assert "3 run, 3 already done" in other.stdout
    status = _cli("sweep", "--status", str(root))
    assert "2 grids on this root" in status.stdout and "heavy" in status.stdout


@pytest.mark.slow
def test_a_cell_locked_by_another_sweep_is_left_to_it_and_a_failed_cell_is_redone(tiny_dir, task_file, tmp_path):
    from commands.grid import LOCK_DIR, _flock, cell_state, grid_status, plan_grid, run_grid
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    model, tok = load_model(tiny_dir, progress=False)
    tasks = resolve_tasks(str(task_file))
    grid = plan_grid(
        tasks, tok, model="tiny", tasks_spec=str(task_file), policies=[("h2o", "sum")], ratios=[0.5], batch_size=8
    )
    first, second = grid.cells
    root = tmp_path / "root"
    # a failed run of the second cell, as a crashed earlier attempt leaves it
    (root / second.run_id).mkdir(parents=True)
    manifest = {"run_id": second.run_id, "status": "failed", "error": "boom", "error_type": "RuntimeError"}
    from runlog.manifest import write_manifest

    write_manifest(root / second.run_id, manifest)
    with _flock(root / LOCK_DIR / f"{first.run_id}.lock", wait=False) as mine:
        assert mine
        report = run_grid(root, grid, tasks, model, tok, progress=False)
        assert report.busy == [first.key] and not (root / first.run_id).exists()
        assert report.redone == [second.key] and report.ran == [second.key]
        assert "to do" in grid_status(root)
    assert cell_state(root, second.run_id, True) == ("done", None)
    report = run_grid(root, grid, tasks, model, tok, progress=False)
    assert report.ran == [first.key] and report.done == [second.key]


def test_sweep_status_shows_a_failed_cell_with_its_error(tiny_dir, task_file, tmp_path):
    from commands.grid import grid_status, plan_grid, write_plan
    from h2o_lens.errors import ConfigError
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks
    from runlog.manifest import write_manifest

    _, tok = load_model(tiny_dir, progress=False)
    grid = plan_grid(
        resolve_tasks(str(task_file)),
        tok,
        model="tiny",
        tasks_spec=str(task_file),
        policies=[("local", "sum")],
        slots=[8],
        batch_size=2,
    )
    root = tmp_path / "root"
    write_plan(root, grid)
    bad = grid.cells[1]
    (root / bad.run_id).mkdir()
    write_manifest(root / bad.run_id, {"run_id": bad.run_id, "status": "failed", "error": "out of memory"})
    text = grid_status(root)
    assert f"failed {bad.run_id}: Error: out of memory" in text
    assert "local" in text and "8 slots" in text
    assert (
        text.splitlines()[-1]
        == f"total: {len(grid.cells)} cells: 0 done, 1 failed, 0 running, {len(grid.cells) - 1} to do"
    )
    with pytest.raises(Exception, match="no sweep_plan.json"):
        grid_status(tmp_path / "nothing")
    # a budget a policy cannot take is refused when the grid is planned, not cell by cell
    with pytest.raises(ConfigError, match="sink at 2 slots: sink=4 leaves no recent slot"):
        plan_grid(
            resolve_tasks(str(task_file)), tok, model="tiny", tasks_spec="t", policies=[("sink", "sum")], slots=[2]
        )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policies", "h2o,lru"], "unknown policy 'lru'"),
        (["--gqa", "mean"], "unknown aggregation"),
        (["--ratios", "1,0.2", "--slots", "64"], "not allowed with argument"),
        (["--dtype", "float8"], "invalid choice: 'float8'"),
        (["--ratios", "1,abc"], "'abc' is not a number"),
        (["--batch-size", "0"], "argument --batch-size: expected a whole number >= 1, got 0"),
        (["--tasks", "no/such/file.jsonl"], "neither builtin:NAME nor an existing task file"),
        (["--tasks", "builtin:nope"], "unknown built-in family"),
    ],
)
@pytest.mark.slow
def test_sweep_refuses_bad_input_before_loading_a_model(argv, message, tmp_path):
    res = _cli("sweep", "--out", str(tmp_path / "out"), *argv, timeout=120)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr
    assert not (tmp_path / "out").exists()


def test_policy_lists_take_commas_repeats_and_gqa_lists():
    from commands.jobs import SWEEP_POLICIES
    from commands.sweep import sweep_grid

    assert sweep_grid(None) == SWEEP_POLICIES  # the earlier default grid stays
    assert sweep_grid(["h2o,local", "sink"]) == (("h2o", "sum"), ("local", "sum"), ("sink", "sum"))
    assert sweep_grid(["h2o,local:max,full"], ["sum,max"]) == (
        ("h2o", "sum"),
        ("h2o", "max"),
        ("local", "max"),
        ("full", "sum"),
    )


def test_tasks_option_takes_a_spec_or_the_earlier_count(task_file):
    from commands.options import task_source as _task_source
    from h2o_lens.errors import ConfigError

    assert _task_source(None, None, "builtin:demo") == ("builtin:demo", None)
    assert _task_source("2", None, "builtin:small") == ("builtin:small", 2)  # `--tasks 2`, as README had it
    assert _task_source(str(task_file), 3, "builtin:small") == (str(task_file), 3)
    with pytest.raises(ConfigError, match="--count must be at least 1"):
        _task_source("0", None, "builtin:demo")
    with pytest.raises(ConfigError, match="keep one"):
        _task_source("2", 3, "builtin:demo")


@pytest.mark.slow
def test_a_sweeps_replay_starts_each_request_from_its_recordings_prompt_pass(tiny_dir, task_file, tmp_path):
    """Every request of an evicting cell is replayed from the prompt pass its recording handed on
    (DESIGN.md §6.1); the full-cache cell has no H2O prefill to take it from and forwards its prompts."""
    from commands.jobs import sweep
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    model, tok = load_model(tiny_dir, dtype=torch.float32, progress=False)
    tasks = resolve_tasks(str(task_file))
    sweep(
        tmp_path,
        batch_size=4,
        tasks=tasks,
        tasks_spec=str(task_file),
        model=model,
        tokenizer=tok,
        ratios=(1.0, 0.5),
        policies=(("h2o", "sum"),),
        replay=True,
        progress=False,
    )
    seen = {}
    for manifest_path in tmp_path.glob("cell-*/manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        seen.setdefault(manifest["policy"], []).append((manifest["replay"]["prompts_from_run"], manifest["requests"]))
    assert sorted(seen) == ["full", "h2o"] and len(seen["h2o"]) == 2
    assert all(handed == requests for handed, requests in seen["h2o"]), seen
    assert all(handed == 0 for handed, _ in seen["full"]), seen


@pytest.mark.slow
def test_a_sweep_shows_each_cells_tokens_and_replay_and_leaves_no_bar(tiny_dir, task_file, tmp_path, capfd):
    """A long-context cell takes minutes: the sweep shows its new tokens and its replay forwards
    as they go, then clears both bars; the runs are those of a sweep without bars."""
    from commands.grid import plan_grid, run_grid
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    model, tok = load_model(tiny_dir, dtype=torch.float64, progress=False)
    tasks = resolve_tasks(str(task_file))
    kw = dict(model="tiny", tasks_spec=str(task_file), policies=[("h2o", "sum")], ratios=[0.5], slots=None)
    grid = plan_grid(tasks, tok, batch_size=4, dtype="float64", replay=True, **kw)
    capfd.readouterr()
    report = run_grid(tmp_path / "shown", grid, tasks, model, tok, progress=True)
    err = capfd.readouterr().err
    assert not report.failed and len(report.ran) == len(grid.cells) == 2
    cell = grid.cells[0]
    # the token bar, then the replay's
    assert f"{cell.label} {cell.budget_text} batch {cell.batch}" in err and f"/{cell.max_new_tokens} [" in err
    assert f"replay {cell.run_id}" in err and "forward" in err
    run_grid(tmp_path / "quiet", grid, tasks, model, tok, progress=False)
    assert capfd.readouterr().err == ""
    assert _per_request(tmp_path / "shown") == _per_request(tmp_path / "quiet")


def test_a_sweep_past_the_context_window_on_purpose_says_so_once(tiny_dir, task_file, tmp_path, capsys):
    import warnings

    from commands.grid import encode
    from commands.jobs import sweep
    from h2o_lens.models import ContextWarning, load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    model, tok = load_model(tiny_dir, dtype=torch.float64, progress=False)
    tasks = resolve_tasks(str(task_file))
    ends = sorted(len(encode(tok, [t.chat_text(tok)])["input_ids"][0]) + t.max_new_tokens for t in tasks)
    model.config.max_position_embeddings = ends[2]  # the two longest requests go past it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sweep(tmp_path, tasks=tasks, model=model, tokenizer=tok, ratios=(0.5,), policies=(("h2o", "sum"),),
              batch_size=2, replay=False, progress=False, past_context=True)  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("go past the context window") == 1, err
    assert f"2 of {len(tasks)} requests" in err and f"spans {ends[-1]:,} positions" in err
    assert not [w for w in seen if issubclass(w.category, ContextWarning)]  # not once more per cell
    model.config.max_position_embeddings = ends[-1]
    sweep(tmp_path / "fits", tasks=tasks, model=model, tokenizer=tok, ratios=(0.5,), policies=(("h2o", "sum"),),
          batch_size=2, replay=False, progress=False)  # fmt: skip
    assert "context window" not in capsys.readouterr().err


@pytest.mark.slow
def test_the_cells_of_a_batch_share_one_prompt_forward_and_record_what_they_would_alone(tiny_dir, task_file, tmp_path):
    """One prompt forward per batch and aggregation serves every configuration (DESIGN.md §12.5):
    every table of every cell, replay included, is the same as when each cell forwards its prompts."""
    import pandas as pd

    from commands.grid import plan_grid, run_grid
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks
    from runlog.segments import list_segments

    model, tok = load_model(tiny_dir, dtype=torch.float32, progress=False)
    tasks = resolve_tasks(str(task_file))
    policies = [("h2o", "sum"), ("tova", "sum"), ("h2o", "max"), ("local", "sum")]
    kw = dict(model="tiny", tasks_spec=str(task_file), policies=policies, ratios=[1.0, 0.5, 0.3], slots=None)
    grid = plan_grid(tasks, tok, batch_size=4, dtype="float32", replay=True, **kw)
    shared = run_grid(tmp_path / "shared", grid, tasks, model, tok, progress=False)
    alone = run_grid(tmp_path / "alone", grid, tasks, model, tok, progress=False, share_prompts=False)
    assert not shared.failed and not alone.failed and len(shared.ran) == len(grid.cells)
    # per batch: the full cache (its own forward), then 4 combos x 2 budgets from one forward,
    # whatever their aggregation
    assert shared.prompts_reused == len(grid.batches) * (4 * 2 - 1) and alone.prompts_reused == 0
    for cell in grid.cells:
        a, b = list_segments(tmp_path / "shared" / cell.run_id), list_segments(tmp_path / "alone" / cell.run_id)
        assert sorted(a) == sorted(b) and {"tokens", "replay_steps"} <= set(a), cell.run_id
        for table in a:
            fa = pd.concat([pd.read_parquet(f) for f in a[table]]).reset_index(drop=True)
            fb = pd.concat([pd.read_parquet(f) for f in b[table]]).reset_index(drop=True)
            timing = [c for c in fa.columns if "second" in c]
            pd.testing.assert_frame_equal(fa.drop(columns=timing), fb.drop(columns=timing), check_exact=True)
        manifest = json.loads((tmp_path / "shared" / cell.run_id / "manifest.json").read_text())
        if cell.policy != "full":  # every request replayed from the prompt pass its recording handed on
            assert manifest["replay"]["prompts_from_run"] == len(cell.requests), cell.label


@pytest.mark.slow
def test_bench_sweep_prints_both_modes_and_with_sharing_the_prompt_forwards_shared(
    tiny_dir, task_file, capsys, monkeypatch
):
    from commands.cli import main

    common = ["bench", "sweep", "--model", str(tiny_dir), "--tasks", str(task_file), "--count", "4"]
    common += ["--new-tokens", "3", "--policies", "h2o,local", "--gqa", "sum,max", "--rounds", "1"]
    assert main([*common, "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    rows = {line[:22].strip(): line[22:].split() for line in out.splitlines() if line.startswith(("batch", "one at"))}
    # 4 requests in 2 batches of 2 or 4 of 1, under h2o and local, each with sum and max: 4 cells each
    assert rows["batch 2"][0] == "8" and rows["one at a time"][0] == "16", out
    # per batch: h2o sum forwards the prompts, h2o max, local sum and local max reuse them
    assert rows["batch 2"][-1] == "6" and rows["one at a time"][-1] == "12", out
    assert float(out.split("batched / one at a time: ")[1].split("x")[0]) > 0
    from h2o_lens import packed

    state = "on" if packed._kernel_present() else "off"  # a torch without MKL never packs
    assert f"packed decode products {state} (DESIGN.md §16)" in out.splitlines()[0], out
    monkeypatch.setenv("H2O_LENS_PACKED_LINEARS", "0")
    assert main([*common, "--batch-size", "2", "--rounds", "1"]) == 0
    assert "packed decode products off" in capsys.readouterr().out
    monkeypatch.delenv("H2O_LENS_PACKED_LINEARS")
    assert main([*common, "--batch-size", "2", "--sharing"]) == 0
    out = capsys.readouterr().out
    rows = {line[:22].strip(): line[22:].split() for line in out.splitlines() if line.startswith("batch")}
    assert rows["batch 2, shared"][-1] == "6" and rows["batch 2, each cell"][-1] == "0", out
    assert float(out.split("shared / each cell: ")[1].split("x")[0]) > 0
    # one H2O configuration per batch: nothing to share, said before any work
    lone = ["bench", "sweep", "--model", str(tiny_dir), "--tasks", str(task_file), "--sharing"]
    lone += ["--policies", "h2o", "--gqa", "max"]
    assert main(lone) == 2
    assert "no prompt forward to share" in capsys.readouterr().err
