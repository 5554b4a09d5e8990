"""Every command that writes output into a folder leaves what it did not write alone (DESIGN.md §5.1).

Each command is pointed at a user's project folder (a ``.git``, a source folder, a file of
theirs): it refuses in one line before any model loads, and with ``--force`` writes beside them
without removing anything. Re-running into its own demo or sweep root still resumes and
replaces as before. The runs are made on a tiny random llama saved as a user's model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_runlog_ownership import project, tree
from tiny import save_tiny

from commands.cli import main

REPO = Path(__file__).resolve().parent.parent
REQUEST = {
    "name": "code",
    "prompt": "Notes: the lab code is 4419. The cable goes to port 7. Lunch is at noon. What is the code?",
    "answer": "4419",
    "evidence": {"code": "code is 4419"},
    "max_new_tokens": 4,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model folder, the model and tokenizer loaded from it, and its one request."""
    from h2o_lens.models import load_model
    from h2o_lens.tasks.builtins import resolve_tasks

    base = tmp_path_factory.mktemp("tiny")
    save_tiny(base / "m")
    (base / "tasks.jsonl").write_text(json.dumps(REQUEST) + "\n", encoding="utf-8")
    model, tok = load_model(str(base / "m"), dtype=torch.float64, progress=False)
    return base, model, tok, resolve_tasks(str(base / "tasks.jsonl"))


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("h2o-lens: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["samples", "--out", "{out}"],
        ["demo", "--out", "{out}", "--count", "1"],
        ["sweep", "--out", "{out}", "--count", "1", "--ratios", "0.5", "--policies", "h2o"],
        ["eval", "--out", "{out}", "--tasks", "any_task", "--policies", "h2o", "--ratios", "1,0.2"],
    ],
    ids=["samples", "demo", "sweep", "eval"],
)
def test_a_project_folder_is_refused_in_one_line_before_any_model_loads(tmp_path, capsys, argv):
    out = project(tmp_path / "project")
    before = tree(out)
    code = main([a.format(out=out) for a in argv])
    line = _one_error(capsys.readouterr().err)
    assert code == 2 and "3 entries h2o-lens did not write (.git, notes.txt, src)" in line and "--force" in line
    assert tree(out) == before


@pytest.mark.slow
def test_the_demo_writes_beside_a_project_with_force_and_reruns_into_its_own_root(tmp_path, tiny, capsys):
    from commands.jobs import demo

    _, model, tok, tasks = tiny
    out = project(tmp_path / "project")
    before = tree(out)
    args = dict(tasks=tasks, model=model, tokenizer=tok, explain=False, baselines=(), budgets=(0.5,), progress=False)
    demo(out, **args, reports=False, force=True)
    assert {k: v for k, v in tree(out).items() if k in before} == before  # nothing of theirs touched
    assert (out / "demo_summary.json").exists()
    own = tmp_path / "demo"
    for reports in (True, False):  # its own root (runs, reports, summary): no refusal the second time
        demo(own, **args, reports=reports)
    assert (own / "reports").is_dir() and len(json.loads((own / "demo_summary.json").read_text())) == 2


def test_a_sweep_redoes_a_cell_only_in_its_own_run_folder(tmp_path, tiny, capsys):
    from commands.grid import cell_state
    from commands.jobs import sweep

    _, model, tok, tasks = tiny
    root = tmp_path / "sweep"
    args = dict(tasks=tasks, model=model, tokenizer=tok, ratios=(1.0, 0.5), policies=(("h2o", "sum"),), progress=False)
    sweep(root, **args)
    cells = sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists())
    sweep(root, **args)  # its own root: resumed, every cell already done
    assert "2 already done" in capsys.readouterr().out
    # a cell's folder replaced by one of the user's (no manifest): refused as it stands ...
    victim = root / cells[0]
    for p in sorted(victim.iterdir()):
        p.unlink()
    (victim / "mine.txt").write_text("keep me\n")
    assert cell_state(root, cells[0], True)[0] == "interrupted"
    with pytest.raises(Exception, match="h2o-lens did not write"):
        sweep(root, **args)
    # ... and with force the cell fails with the reason instead of removing the folder
    sweep(root, **args, force=True)
    assert (victim / "mine.txt").read_text() == "keep me\n"
    assert "not a run folder h2o-lens wrote" in capsys.readouterr().err


def test_explain_refuses_to_remove_a_folder_in_the_way_of_a_re_run(tmp_path, tiny, capsys):
    base, *_ = tiny
    runs = tmp_path / "runs"
    argv = ["record", "--model", str(base / "m"), "--out", str(runs), "--max-new-tokens", "5", "--replay"]
    assert main([*argv, "--heavy", "4", "--recent", "4"]) == 0
    (run_dir,) = runs.iterdir()
    from recorders.counterfactual import counterfactual_id

    in_the_way = project(runs / counterfactual_id(run_dir.name, 0, "full"))
    before = tree(runs)
    capsys.readouterr()
    assert main(["explain", str(run_dir), "--request", "0", "--no-bisect"]) == 2
    assert "not a run folder h2o-lens wrote" in _one_error(capsys.readouterr().err)
    assert tree(in_the_way) == {k.split("/", 1)[1]: v for k, v in before.items() if k.startswith(in_the_way.name + "/")}


def test_report_replaces_its_own_file_but_not_one_of_the_users(tmp_path, capsys):
    run = str(REPO / "sample_runs" / "delayed-recall-0-h2o-10")
    mine = tmp_path / "notes.md"
    mine.write_text("# my notes\n")
    assert main(["report", run, "--format", "md", "-o", str(mine)]) == 2
    assert "not a file h2o-lens wrote" in _one_error(capsys.readouterr().err)
    assert mine.read_text() == "# my notes\n"
    out = tmp_path / "r.json"
    for _ in range(2):  # a new file, then its own report again
        assert main(["report", run, "--format", "json", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["run"]["run_id"] == "delayed-recall-0-h2o-10"
    assert main(["report", run, "--format", "md", "-o", str(mine), "--force"]) == 0
    assert mine.read_text().startswith("# H2O Lens report")
    (tmp_path / ".git").mkdir()
    assert main(["report", run, "-o", str(tmp_path / ".git" / "r.html"), "--force"]) == 2
    assert "version-control" in _one_error(capsys.readouterr().err)
    assert not (tmp_path / ".git" / "r.html").exists()


def test_bench_explain_removes_its_earlier_re_runs_but_not_a_folder_in_their_way(tmp_path):
    from test_runlog_ownership import run

    from commands.benchmarks.explain import clear_reruns
    from runlog.ownership import OutputFolderError

    mine = run(tmp_path, "parent-r0-full")  # a re-run an earlier round wrote
    assert clear_reruns(str(tmp_path), "parent") == ["parent-r0-full"] and not mine.exists()
    theirs = project(tmp_path / "parent-r0-notes")
    before = tree(theirs)
    with pytest.raises(OutputFolderError, match="not a run folder h2o-lens wrote"):
        clear_reruns(str(tmp_path), "parent")
    assert tree(theirs) == before


def test_tasks_export_replaces_its_own_file_but_not_one_of_the_users(tmp_path, capsys):
    spec = ["tasks", "export", "builtin:demo", "--count", "2", "-o"]
    mine = tmp_path / "notes.txt"
    mine.write_text("mine\n")
    hand = tmp_path / "hand.jsonl"  # a task file written by hand: it loads, but the export did not write it
    hand.write_text(json.dumps(REQUEST, indent=None, separators=(",", ":")) + "\n")
    for path in (mine, hand):
        before = path.read_text()
        assert main([*spec, str(path)]) == 2
        assert "is not a file h2o-lens wrote" in _one_error(capsys.readouterr().err)
        assert path.read_text() == before
    for name in ("t.jsonl", "t.json"):  # a new file, then its own export again
        for count in ("2", "3"):
            assert main([*spec[:-3], "--count", count, "-o", str(tmp_path / name)]) == 0
    assert (
        len((tmp_path / "t.jsonl").read_text().splitlines()) == 3
        and len(json.loads((tmp_path / "t.json").read_text())) == 3
    )
    assert main([*spec, str(mine), "--force"]) == 0
    assert mine.read_text().startswith('{"name": ')
