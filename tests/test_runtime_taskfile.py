"""Task files (DESIGN.md §10): strict line-by-line validation, exact round trips of the built-in
families, and a file with every field recorded on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h2o_lens.tasks.builtins import FAMILIES, resolve_tasks
from h2o_lens.tasks.taskfile import (
    FileTask,
    TaskFileError,
    dumps_tasks,
    from_builtin,
    load_tasks,
    parse_task,
    write_tasks,
)

GOOD = {"prompt": "The code is 4419. What is the code?", "answer": "4419"}
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]

# (the bad line 3, the field the error names (None: the line as a whole), a piece of the message)
BAD_LINES = [
    ('{"prompt": "x",', None, "not valid JSON"),
    ('{"prompt": "x"} {"prompt": "y"}', None, "not valid JSON"),
    ('["The code is 4419."]', None, "expected a JSON object"),
    ('"just a prompt"', None, "got a string"),
    ('{"answer": "4419"}', "prompt", "missing"),
    (json.dumps({"prompt": "hi there", "messages": TURNS}), "prompt", '"messages" too'),
    ('{"prompt": "   "}', "prompt", "is empty"),
    ('{"prompt": 17}', "prompt", "is a number"),
    ('{"prompt": "a", "prompt": "b"}', "prompt", "appears twice"),
    ('{"messages": "Say hi."}', "messages", "non-empty list of turns"),
    ('{"messages": []}', "messages", "non-empty list of turns"),
    ('{"messages": ["Say hi."]}', "messages", "messages[0] is a string"),
    ('{"messages": [{"content": "Say hi."}]}', "messages", "messages[0] lacks role"),
    ('{"messages": [{"role": "user"}]}', "messages", "messages[0] lacks content"),
    ('{"messages": [{"role": "user", "content": "x", "name": "bob"}]}', "messages", "unknown keys ['name']"),
    ('{"messages": [{"role": "robot", "content": "Say hi."}]}', "messages", 'role "robot"'),
    ('{"messages": [{"role": "user", "content": " "}]}', "messages", "messages[0] has content"),
    ('{"messages": [{"role": "system", "content": "Be brief."}]}', "messages", "no user turn"),
    (json.dumps({"messages": [*TURNS, {"role": "assistant", "content": "Hi"}]}), "messages", "ends with a 'assistant'"),
    ('{"prompt": "p q", "answer": 4419}', "answer", "is a number"),
    ('{"prompt": "p q", "answer": null}', "answer", "is null"),
    ('{"prompt": "p q", "answer": []}', "answer", "empty list"),
    ('{"prompt": "p q", "answer": ""}', "answer", "has no letters or digits"),
    ('{"prompt": "p q", "answer": "?!"}', "answer", "has no letters or digits"),
    ('{"prompt": "p q", "answer": ["Oslo", 3]}', "answer", "answer[1] is a number"),
    ('{"prompt": "p q", "answer": {"regex": "(4419"}}', "answer", "does not compile"),
    ('{"prompt": "p q", "answer": {"regex": ""}}', "answer", "non-empty pattern"),
    ('{"prompt": "p q", "answer": {"regex": "a", "all": ["b"]}}', "answer", "the one key 'regex'"),
    ('{"prompt": "p q", "answer": {"any": ["Oslo"]}}', "answer", "keys ['any']"),
    ('{"prompt": "p q", "answer": {"all": ["Oslo"], "but": ["x"]}}', "answer", "keys ['all', 'but']"),
    ('{"prompt": "p q", "answer": {"none": ["Oslo"]}}', "answer", "keys ['none']"),
    ('{"prompt": "p q", "answer": {"all": []}}', "answer", "'all' is an empty list"),
    ('{"prompt": "p q", "answer": {"all": "Oslo"}}', "answer", "'all' is a string"),
    ('{"prompt": "p q", "answer": {"all": ["Oslo"], "none": ["-"]}}', "answer", 'answer.none[0] "-" has no letters'),
    ('{"prompt": "p q", "evidence": ["p"]}', "evidence", "is a list"),
    ('{"prompt": "p q", "evidence": {"x": "Lisbon"}}', "evidence", "'x' = \"Lisbon\" does not occur"),
    ('{"prompt": "p q", "evidence": {"x": ""}}', "evidence", "empty string"),
    ('{"prompt": "p q", "evidence": {"": "p"}}', "evidence", "empty label"),
    ('{"prompt": "p q", "evidence": {"x": [0, 4]}}', "evidence", "0 <= start < end <= 3"),
    ('{"prompt": "p q", "evidence": {"x": [-1, 2]}}', "evidence", "[-1, 2] is not a range"),
    ('{"prompt": "p q", "evidence": {"x": [2, 1]}}', "evidence", "[2, 1] is not a range"),
    ('{"prompt": "p q", "evidence": {"x": [1, 1]}}', "evidence", "[1, 1] is not a range"),
    ('{"prompt": "p q", "evidence": {"x": [1]}}', "evidence", "[start, end] pair of integers"),
    ('{"prompt": "p q", "evidence": {"x": [0, 1, 2]}}', "evidence", "[start, end] pair of integers"),
    ('{"prompt": "p q", "evidence": {"x": [0.0, 2]}}', "evidence", "[start, end] pair of integers"),
    ('{"prompt": "p q", "evidence": {"x": [false, 2]}}', "evidence", "[start, end] pair of integers"),
    ('{"prompt": "p q", "evidence": {"x": 2}}', "evidence", "[start, end] pair of integers"),
    ('{"prompt": "p q", "max_new_tokens": 0}', "max_new_tokens", "positive integer"),
    ('{"prompt": "p q", "max_new_tokens": -4}', "max_new_tokens", "positive integer"),
    ('{"prompt": "p q", "max_new_tokens": true}', "max_new_tokens", "is true"),
    ('{"prompt": "p q", "max_new_tokens": 8.0}', "max_new_tokens", "is 8.0"),
    ('{"prompt": "p q", "max_new_tokens": "8"}', "max_new_tokens", 'is "8"'),
    ('{"prompt": "p q", "name": 7}', "name", "non-empty string"),
    ('{"prompt": "p q", "name": ""}', "name", "non-empty string"),
    ('{"prompt": "p q", "name": "first"}', "name", "already the name of line 1"),
    ('{"prompt": "p q", "kind": ["needle"]}', "kind", "non-empty string"),
    ('{"prompt": "p q", "meta": [1, 2]}', "meta", "is a list"),
    ('{"prompt": "p q", "meta": "note"}', "meta", "expected an object of free fields"),
    ('{"prompt": "p q", "question": "Where?"}', "question", 'Put free fields in "meta"'),
]


def _file(tmp_path: Path, bad: str, name: str = "tasks.jsonl") -> Path:
    path = tmp_path / name
    first = json.dumps({"name": "first", **GOOD})
    path.write_text(f"{first}\n\n{bad}\n{json.dumps(GOOD)}\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(("bad", "field", "says"), BAD_LINES)
def test_a_bad_line_names_its_file_line_and_field(tmp_path, bad, field, says):
    path = _file(tmp_path, bad)
    with pytest.raises(TaskFileError) as caught:
        load_tasks(path)
    err = caught.value
    assert (err.line, err.field, err.source) == (3, field, str(path)), str(err)
    message = str(err)
    assert message.startswith(f"{path}, line 3"), message
    assert (f"field {field!r}" in message) == (field is not None), message
    assert says in message, message


def test_the_same_lines_are_fine_when_corrected(tmp_path):
    """The file around the bad lines is valid: blank lines skipped, default names per line."""
    tasks = load_tasks(_file(tmp_path, json.dumps({"prompt": "p q", "evidence": {"x": [0, 3]}})))
    assert [t.name for t in tasks] == ["first", "line_3", "line_4"]
    assert tasks[1].evidence == {"x": (0, 3)} and tasks[2].answer == "4419" and tasks[2].max_new_tokens == 32


def test_a_range_of_a_messages_task_indexes_its_last_user_turn(tmp_path):
    """`Say hi.` has 7 characters: [0, 7] is fine, [0, 8] is out even though the turns are longer."""
    ok = parse_task({"messages": TURNS, "evidence": {"x": [0, 7]}}, line=1)
    assert ok.prompt == "Say hi." and ok.evidence == {"x": (0, 7)}
    with pytest.raises(TaskFileError, match=r"0 <= start < end <= 7 .*last user turn"):
        parse_task({"messages": TURNS, "evidence": {"x": [0, 8]}}, line=1)
    # a substring may come from any turn (it is found in the text the model is fed)
    assert parse_task({"messages": TURNS, "evidence": {"rule": "brief"}}, line=1).evidence == {"rule": "brief"}


def test_unknown_field_suggests_meta():
    with pytest.raises(TaskFileError) as caught:
        parse_task({"prompt": "p", "source": "wiki"}, line=9, source="mine.jsonl")
    assert str(caught.value) == (
        "mine.jsonl, line 9, field 'source': unknown field; the fields are name, kind, prompt, messages, "
        'answer, evidence, max_new_tokens, meta. Put free fields in "meta", e.g. "meta": {"source": "wiki"}'
    )


def test_file_level_errors(tmp_path):
    with pytest.raises(TaskFileError, match="does not exist"):
        load_tasks(tmp_path / "missing.jsonl")
    with pytest.raises(TaskFileError, match="is not a file"):
        load_tasks(tmp_path)
    for text in ("", "\n\n  \n"):
        (tmp_path / "empty.jsonl").write_text(text)
        with pytest.raises(TaskFileError, match="holds no requests") as caught:
            load_tasks(tmp_path / "empty.jsonl")
        assert caught.value.line is None
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps(GOOD).encode() + b"\n\n" + '{"prompt": "café"}'.encode("latin-1") + b"\n")
    with pytest.raises(TaskFileError, match=r"line 3: not valid UTF-8 \(byte 16 of the line is b'\\xe9'\)") as caught:
        load_tasks(bad)
    assert caught.value.line == 3
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\r\n")
    assert load_tasks(bom) == [FileTask(name="line_1", prompt=GOOD["prompt"], answer="4419")]


def test_a_json_list_file_loads_and_errors_name_the_item(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([GOOD, {"prompt": "p q", "answer": ["Oslo", "Lima"]}], indent=2))
    tasks = load_tasks(path)
    assert [t.name for t in tasks] == ["item_1", "item_2"] and tasks[1].answer == ("Oslo", "Lima")
    path.write_text(json.dumps([GOOD, {"prompt": "p q", "max_new_tokens": 0}], indent=2))
    with pytest.raises(TaskFileError, match=r"item 2, field 'max_new_tokens'"):
        load_tasks(path)
    path.write_text(json.dumps(GOOD))
    with pytest.raises(TaskFileError, match="holds one list of request objects, got an object"):
        load_tasks(path)
    path.write_text('[\n{"prompt": "x"},\n{"prompt": }\n]')
    with pytest.raises(TaskFileError, match=r"line 3: not valid JSON") as caught:
        load_tasks(path)
    assert caught.value.line == 3


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_builtin_family_round_trips_exactly(tmp_path, name):
    """write_tasks then load_tasks gives equal tasks, kind and meta included."""
    tasks = resolve_tasks(f"builtin:{name}", count=3)
    assert tasks
    path = write_tasks(tasks, tmp_path / "t.jsonl")
    back = load_tasks(path)
    assert back == tasks
    assert [(t.kind, t.meta) for t in back] == [(t.kind, t.meta) for t in tasks]
    assert [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]  # no temporary file left


def test_builtin_demo_keeps_kind_and_meta_apart():
    """The family goes to the top-level "kind", never into the user's "meta"."""
    (task,) = resolve_tasks("builtin:demo", count=1)
    line = json.loads(dumps_tasks([task]))
    assert line["kind"] == task.kind == "delayed_recall" and line["meta"] == {"seed": 0}
    back = parse_task(line, line=1)
    assert back.kind == "delayed_recall" and back.meta == {"seed": 0} and back == task


def test_builtin_checkers_survive_the_round_trip(tmp_path):
    """The exported multi-fact answer ({"all", "none"}) checks like the built-in task."""
    from h2o_lens.tasks import suite

    originals = suite(size="demo")
    back = load_tasks(write_tasks([from_builtin(t) for t in originals], tmp_path / "demo.jsonl"))
    for task, loaded in zip(originals, back, strict=True):
        right = " and ".join(task.required)
        wrong = f"{right} or {task.distractors[0]}" if task.distractors else "nothing"
        assert loaded.check(right) and task.check(right)
        assert loaded.check(wrong) == task.check(wrong) is False
        assert loaded.evidence == task.evidence and loaded.max_new_tokens == task.max_new_tokens


def test_write_tasks_refuses_what_would_not_load_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "t.jsonl"
    write_tasks([FileTask(name="a", prompt="p q")], path)
    before = path.read_text()
    with pytest.raises(TaskFileError, match="field 'evidence'"):
        write_tasks([FileTask(name="a", prompt="p q", evidence={"x": "Lisbon"})], path)
    with pytest.raises(TaskFileError, match="line 2, field 'name'"):
        write_tasks([FileTask(name="a", prompt="p q"), FileTask(name="a", prompt="r s")], path)
    with pytest.raises(TaskFileError, match="field 'meta'.*cannot be written as JSON"):
        write_tasks([FileTask(name="a", prompt="p q", meta={"when": {1, 2}})], path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]


def test_file_task_normalises_answers_and_ranges():
    a = FileTask(name="a", prompt="p q", answer=["x", "y"], evidence={"r": [0, 1]})
    b = FileTask(name="a", prompt="p q", answer=("x", "y"), evidence={"r": (0, 1)})
    assert a == b and a.answer == ("x", "y") and a.evidence == {"r": (0, 1)}


def test_answer_kinds_check_as_documented():
    def task(answer):
        return parse_task({"prompt": "p q", "answer": answer}, line=1)

    assert task("Lisbon").check("She moved to lisbon!") and not task("Lisbon").check("Lisbonne")
    assert task("6604").check("The code is 6,604.") and not task("6604").check("66045")
    assert task(["Lisbon", "Lisboa"]).check("Lisboa.") and not task(["Lisbon", "Lisboa"]).check("Porto")
    assert task({"regex": r"\bA-\d{3}\b"}).check("id A-123") and not task({"regex": r"\bA-\d{3}\b"}).check("a-123")
    both = task({"all": ["Oslo", "Lima"], "none": ["Cairo"]})
    assert both.check("Oslo and Lima") and not both.check("Oslo") and not both.check("Oslo, Lima, Cairo")
    assert task({"all": ["Oslo"]}).check("Oslo") and not parse_task({"prompt": "p"}, line=1).checked


def test_resolve_tasks_errors(tmp_path):
    from h2o_lens.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown built-in task family 'nope'"):
        resolve_tasks("builtin:nope")
    with pytest.raises(ConfigError, match="takes no --length"):
        resolve_tasks("builtin:demo", length=1000)
    path = write_tasks(resolve_tasks("builtin:demo", count=2), tmp_path / "t.jsonl")
    with pytest.raises(ConfigError, match="are used as written"):
        resolve_tasks(str(path), length=1000)
    with pytest.raises(ConfigError, match="count must be at least 1"):
        resolve_tasks(str(path), count=0)
    assert len(resolve_tasks(str(path), count=1)) == 1


# ------------------------------------------------------------------ recorded on a tiny model


def _char_tokenizer():
    """A byte-level tokenizer without merges (one token per ASCII character) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|eos|>"] = len(vocab)
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|eos|>", pad_token="<|eos|>")
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


EVERY_FIELD = [
    {
        "name": "code",
        "kind": "recall",
        "prompt": "The lab code is 4419. The cafe opens at nine. What is the lab code?",
        "answer": "4419",
        "evidence": {"code": "code is 4419", "cafe": [22, 45]},
        "max_new_tokens": 6,
        "meta": {"source": "hand-written", "depth": 0.1},
    },
    {"name": "city", "prompt": "Maria moved to Lisbon. Where did Maria move?", "answer": ["Lisbon", "Lisboa"]},
    {"name": "any", "prompt": "Write anything at all.", "answer": {"regex": "(?s)."}, "max_new_tokens": 4},
    {
        "name": "pair",
        "prompt": "Ann lives in Oslo. Bo lives in Lima. Where do Ann and Bo live?",
        "answer": {"all": ["Oslo", "Lima"], "none": ["Cairo"]},
        "evidence": {"ann": "Ann lives in Oslo", "bo": "Bo lives in Lima"},
    },
    {
        "name": "chat",
        "messages": [
            {"role": "system", "content": "The password is heron."},
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Tell me the password, please."},
        ],
        "evidence": {"password": "password is heron", "ask": [8, 20]},
        "max_new_tokens": 5,
    },
]


def test_a_file_with_every_field_loads(tmp_path):
    path = tmp_path / "every.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in EVERY_FIELD))
    code, city, any_, pair, chat = load_tasks(path)
    assert (code.kind, code.meta, code.max_new_tokens) == ("recall", {"source": "hand-written", "depth": 0.1}, 6)
    assert code.evidence == {"code": "code is 4419", "cafe": (22, 45)}
    assert code.prompt[22:45] == "The cafe opens at nine."
    assert city.kind == "file" and city.answer == ("Lisbon", "Lisboa") and city.max_new_tokens == 32
    assert any_.answer == {"regex": "(?s)."} and pair.answer == {"all": ["Oslo", "Lima"], "none": ["Cairo"]}
    assert chat.prompt == "Tell me the password, please." and chat.prompt[8:20] == "the password"
    assert chat.answer is None and not chat.checked and len(chat.turns) == 4
    assert load_tasks(write_tasks([code, city, any_, pair, chat], tmp_path / "again.jsonl")) == [
        code,
        city,
        any_,
        pair,
        chat,
    ]


@pytest.mark.slow
def test_a_file_with_every_field_records_labels_and_verdicts(tmp_path):
    """Each request recorded on a tiny model: tokens carry the evidence labels at the stated
    characters, requests carry the checker's verdict (null without an answer)."""
    import torch
    from tiny import tiny_model

    import recorders
    import runlog
    from h2o_lens.config import H2OConfig

    path = tmp_path / "every.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in EVERY_FIELD))
    tasks = load_tasks(path)
    tok = _char_tokenizer()
    model = tiny_model("llama", vocab=len(tok), seed=3)
    out = tmp_path / "runs"
    run_ids = {}
    for task in tasks:
        text = task.chat_text(tok)
        enc = tok(text, return_tensors="pt", add_special_tokens=False)

        def annotate(request, answer, task=task):
            return {
                "task": task.name,
                "expected": task.expected,
                "correct": task.check(answer) if task.checked else None,
            }

        with (
            torch.no_grad(),
            recorders.record(
                model,
                H2OConfig(heavy=8, recent=8),
                out=str(out),
                tokenizer=tok,
                evidence=task.evidence,
                prompts=[task.prompt],
                annotate=annotate,
                name=task.name,
                fsync=False,
            ) as run,
        ):
            model.generate(**enc, max_new_tokens=task.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        run_ids[task.name] = run.run_id
    con = runlog.open_runs(out)
    verdicts = []
    for task in tasks:
        rid = run_ids[task.name]
        ((name, expected, answer, correct, new),) = con.execute(
            "SELECT task, expected, answer, correct, new_tokens FROM requests WHERE run_id = ?", [rid]
        ).fetchall()
        assert (name, expected) == (task.name, task.expected) and 0 < new <= task.max_new_tokens
        assert correct == (task.check(answer) if task.checked else None), (task.name, answer)
        verdicts.append(correct)
        labelled = con.execute(
            "SELECT evidence, string_agg(text, '' ORDER BY position) FROM tokens "
            "WHERE run_id = ? AND is_prompt AND evidence IS NOT NULL GROUP BY evidence",
            [rid],
        ).fetchall()
        spans = {k: v if isinstance(v, str) else task.prompt[v[0] : v[1]] for k, v in task.evidence.items()}
        assert dict(labelled) == spans
    # the random model gets the words wrong and the any-character regex right
    assert verdicts == [False, False, True, False, None]


@pytest.mark.parametrize("doc", ["README.md", "docs/DESIGN.md"])
def test_the_documented_example_lines_load(tmp_path, doc):
    import re

    text = (Path(__file__).resolve().parent.parent / doc).read_text(encoding="utf-8")
    section = text[text.index("Task files") :]
    block = re.search(r"```json\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "example.jsonl"
    path.write_text(block.replace("\n ", " "))  # DESIGN.md wraps its one line
    (task,) = load_tasks(path)
    assert task.name == "code_0" and task.check("It is 4419.") and task.evidence == {"code": "code is 4419"}


def test_write_tasks_to_a_json_name_writes_a_list_that_loads_back(tmp_path):
    tasks = resolve_tasks("builtin:demo", count=3)
    path = write_tasks(tasks, tmp_path / "demo.json")
    assert [row["name"] for row in json.loads(path.read_text())] == [t.name for t in tasks]
    assert load_tasks(path) == tasks
    with pytest.raises(TaskFileError, match="is a folder"):
        write_tasks(tasks, tmp_path)
