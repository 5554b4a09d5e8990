"""`h2o-lens tasks export | check | list` (DESIGN.md §10): the built-in families as task files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from commands.cli import main
from h2o_lens.tasks.builtins import FAMILIES, resolve_tasks
from h2o_lens.tasks.taskfile import load_tasks

REPO = Path(__file__).resolve().parent.parent


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_export_check_load_round_trip_of_builtin_demo(tmp_path, capsys):
    path = tmp_path / "demo.jsonl"
    code, out, err = _run(capsys, "tasks", "export", "builtin:demo", "-o", str(path))
    assert (code, out) == (0, "") and err == f"wrote 8 requests to {path}\n"
    code, out, err = _run(capsys, "tasks", "check", str(path))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"{path}: 8 requests, valid"
    kinds = [line.split(":")[0].strip() for line in lines[1:]]
    assert kinds == ["delayed_recall", "multi_fact", "topic_switch", "long_passage"]
    for line in lines[1:]:
        assert "2 requests | prompt 2 | " in line and "evidence substring" in line and line.endswith("meta: seed")
    assert "answer text 1 | answer all/none 1" in lines[1]  # a code to recall; a city, the other cities wrong
    assert load_tasks(path) == resolve_tasks("builtin:demo")


def test_export_to_stdout_takes_seed_and_count(capsys):
    code, out, _ = _run(capsys, "tasks", "export", "builtin:full", "--seed", "1", "--count", "3")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows == [t.to_json() for t in resolve_tasks("builtin:full", seed=1, count=3)]
    assert rows != [t.to_json() for t in resolve_tasks("builtin:full", seed=0, count=3)]


def test_check_names_the_bad_line_and_field(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "The code is 4419.", "answer": "4419"}\n{"prompt": "p q", "answer": []}\n')
    code, out, err = _run(capsys, "tasks", "check", str(path))
    assert (code, out) == (2, "")
    assert err == (
        f"h2o-lens: error: {path}, line 2, field 'answer': is an empty list; give at least one accepted "
        "answer, or leave the field out (no checker)\n"
    )
    code, _, err = _run(capsys, "tasks", "check", str(tmp_path / "missing.jsonl"))
    assert code == 2 and err.startswith("h2o-lens: error: task file") and "does not exist" in err


def test_check_summarises_every_field_per_kind(tmp_path, capsys):
    rows = [
        {"name": "a", "kind": "k", "prompt": "The code is 4419.", "answer": "4419", "evidence": {"c": "4419"}},
        {"name": "b", "kind": "k", "prompt": "Oslo or Lima?", "answer": ["Oslo", "Lima"], "max_new_tokens": 8},
        {"prompt": "Say x.", "answer": {"regex": "x"}, "evidence": {"r": [4, 5]}, "meta": {"src": "me"}},
        {"prompt": "Oslo?", "answer": {"all": ["Oslo"], "none": ["Lima"]}, "meta": {"depth": 0.5}},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = _run(capsys, "tasks", "check", str(path))
    assert code == 0
    assert out.splitlines() == [
        f"{path}: 5 requests, valid",
        "  k: 2 requests | prompt 2 | answer text 1 | answer any-of 1 | evidence substring 1 | "
        "max_new_tokens 8-32 | prompt 13-17 chars",
        "  file: 3 requests | prompt 2 | messages 1 | answer regex 1 | answer all/none 1 | no answer 1 | "
        "evidence range 1 | max_new_tokens 32 | prompt 3-6 chars | meta: depth, src",
    ]


def test_export_errors_are_one_line(tmp_path, capsys):
    code, out, err = _run(capsys, "tasks", "export", "builtin:nope", "--length", "1000")
    assert (code, out) == (2, "")
    assert err == f"h2o-lens: error: unknown built-in task family 'nope'; known: {', '.join(FAMILIES)}\n"
    file = tmp_path / "one.jsonl"
    file.write_text('{"prompt": "p q"}\n')
    code, _, err = _run(capsys, "tasks", "export", str(file), "--length", "1000")  # no model is loaded for it
    assert code == 2 and err.startswith("h2o-lens: error: length 1000 applies to the built-in families")
    code, _, err = _run(capsys, "tasks", "export", "builtin:demo", "--count", "0")
    assert code == 2 and err.startswith("h2o-lens: error: tasks export: argument --count: expected a whole number >= 1")
    code, _, err = _run(capsys, "tasks", "export", "builtin:demo", "-o", str(tmp_path / "no" / "t.jsonl"))
    assert code == 2 and "its folder does not exist" in err and err.count("\n") == 1
    code, _, err = _run(capsys, "tasks", "export", "builtin:demo", "-o", str(tmp_path))
    assert code == 2 and err == f"h2o-lens: error: {tmp_path} is a folder; give the path of the task file to write\n"
    assert list(tmp_path.iterdir()) == [file]  # nothing written by the failed exports


def test_list_shows_every_family_with_its_docstring(capsys):
    code, out, _ = _run(capsys, "tasks", "list")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == len(FAMILIES)
    for line, (name, build) in zip(lines, FAMILIES.items(), strict=True):
        label, doc = line.split(maxsplit=1)
        assert label == f"builtin:{name}" and doc == build.__doc__.strip().splitlines()[0]


def test_the_installed_command_exits_2_with_one_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "p q", "question": "Where?"}\n')
    res = subprocess.run(
        [sys.executable, "-m", "commands.cli", "tasks", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and res.stderr.startswith(f"h2o-lens: error: {path}, line 1, field 'question'")
