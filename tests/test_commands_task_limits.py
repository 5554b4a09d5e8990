"""Hostile task files end in one line, never a traceback (DESIGN.md §10.2, §12.2).

Integers of thousands of digits, nesting a hundred thousand levels deep, lone surrogates and
absurd ``max_new_tokens`` are refused by ``tasks check`` and by ``sweep``, which also refuses a
request whose ``max_new_tokens`` does not fit the model's context after its prompt.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny import save_tiny

from commands.cli import main
from h2o_lens.errors import ConfigError
from h2o_lens.tasks.taskfile import FileTask, TaskFileError

CASES = {
    "a 5,000-digit max_new_tokens": (
        '{"prompt": "What is 2 + 2?", "max_new_tokens": ' + "9" * 5000 + "}",
        "line 1: an integer of 5,000 digits",
    ),
    "meta nested 100,000 deep": (
        '{"prompt": "What is 2 + 2?", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "line 1: lists or objects nested too deep to read",
    ),
    "meta nested 40 deep": (
        json.dumps(
            {
                "prompt": "What is 2 + 2?",
                "meta": {"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
            }
        ),
        "field 'meta': nests lists or objects more than 32 levels deep",
    ),
    "a lone surrogate in the prompt": (
        '{"prompt": "What is \\ud800 2 + 2?"}',
        "field 'prompt': holds a lone surrogate at character 8 (an unpaired \\ud800 escape)",
    ),
    "a lone surrogate in a chat turn": (
        '{"messages": [{"role": "user", "content": "hi \\udfff"}]}',
        "field 'messages': holds a lone surrogate",
    ),
    "max_new_tokens 10**12": (
        '{"prompt": "What is 2 + 2?", "max_new_tokens": 1000000000000}',
        "field 'max_new_tokens': is 1,000,000,000,000; at most 1,048,576",
    ),
}


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err[-2000:]
    lines = [line.strip() for line in err.splitlines() if line.strip().startswith("h2o-lens: error: ")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_tasks_check_refuses_in_one_line(tmp_path, capsys, case):
    line, said = CASES[case]
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line.replace("line 1", "line 2") + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["tasks", "check", str(path)]) == 2
    assert said.replace("line 1", "line 2") in _one_error(capsys.readouterr().err)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model") / "m")


def test_sweep_refuses_a_lone_surrogate_before_any_cell(tiny, tmp_path, capsys):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "What is \\ud800 2 + 2?"}\n', encoding="utf-8")
    out = tmp_path / "sweep"
    capsys.readouterr()
    assert main(["sweep", "--tasks", str(path), "--model", str(tiny), "--out", str(out), "--ratios", "0.5"]) == 2
    assert "line 2, field 'prompt': holds a lone surrogate" in _one_error(capsys.readouterr().err)
    assert not out.exists()


def _sweep(tiny, tmp_path, tasks, **kw):
    from commands.jobs import sweep
    from h2o_lens.models import load_model

    model, tok = load_model(tiny, dtype=torch.float64, progress=False)
    return sweep(
        tmp_path / "sweep", tasks=tasks, model=model, tokenizer=tok, ratios=(0.5,), policies=(("h2o", "sum"),),
        replay=False, progress=False, **kw,
    )  # fmt: skip


def test_sweep_refuses_a_request_built_in_memory_with_a_lone_surrogate(tiny, tmp_path):
    tasks = [FileTask(name="ok", prompt="fine"), FileTask(name="bad", prompt="What is \ud800 2 + 2?")]
    with pytest.raises(TaskFileError, match="request 2, field 'prompt': holds a lone surrogate"):
        _sweep(tiny, tmp_path, tasks)
    assert not (tmp_path / "sweep").exists()


def test_sweep_refuses_max_new_tokens_past_the_context_less_the_prompt(tiny, tmp_path):
    tasks = [
        FileTask(name="ok", prompt="fine", max_new_tokens=4),
        FileTask(name="long", prompt="fine", max_new_tokens=1100),
    ]
    with pytest.raises(ConfigError, match=r"request 2 \(long\): max_new_tokens 1,100 is more than the model's context"):
        _sweep(tiny, tmp_path, tasks)  # 1,024 positions: 1,100 new tokens do not fit after the prompt
    assert not (tmp_path / "sweep").exists()
