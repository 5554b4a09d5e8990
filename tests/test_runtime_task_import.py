"""Importers of the field's data (DESIGN.md §20.2): RULER, LongBench, kvpress and needle files.

Each file is written here in the upstream layout; the imported answer spec is compared, answer by
answer, with the benchmark's own scoring rule written out again below from its definition.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from commands.cli import main
from h2o_lens.tasks.importers import import_tasks
from h2o_lens.tasks.taskfile import TaskFileError, load_tasks, write_tasks

HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 4


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _round_trip(tasks, tmp_path):
    out = write_tasks(tasks, tmp_path / "tasks.jsonl")
    assert load_tasks(out) == tasks


# --------------------------------------------------------------------- the upstream rules, by hand


def ruler_all(pred: str, refs: list[str]) -> float:
    return sum(1.0 if r.lower() in pred.lower() else 0.0 for r in refs) / len(refs)


def ruler_part(pred: str, refs: list[str]) -> float:
    return max(1.0 if r.lower() in pred.lower() else 0.0 for r in refs)


def _squad_norm(s: str) -> list[str]:
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split()).split()


def qa_f1(pred: str, truth: str) -> float:
    p, t = _squad_norm(pred), _squad_norm(truth)
    same = sum((Counter(p) & Counter(t)).values())
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(t)
    return 2 * prec * rec / (prec + rec)


def classification(pred: str, truth: str, classes: list[str]) -> float:
    found = [c for c in classes if c in pred]
    found = [c for c in found if not (c in truth and c != truth)]
    return 1.0 / len(found) if truth in found else 0.0


def numbers_score(pred: str, value: str) -> float:
    nums = re.findall(r"\d+", pred)
    return sum(n == value for n in nums) / len(nums) if nums else 0.0


def first_line(pred: str) -> str:
    return pred.lstrip("\n").split("\n")[0]


# ------------------------------------------------------------------------------------------ RULER


def _ruler_line(i: int, values: list[str]) -> dict:
    needles = " ".join(f"One of the special magic numbers for lucky-{i} is: {v}." for v in values)
    cut = HAYSTACK.index(". ", 110) + 2  # at a sentence end, as RULER inserts
    text = HAYSTACK[:cut] + needles + " " + HAYSTACK[cut:] + f"\nWhat are all the special magic numbers for lucky-{i}?"
    return {"index": i, "input": text, "outputs": values, "length": 2048, "length_w_model_temp": 2080,
            "answer_prefix": " Answer: The special magic numbers for lucky are"}  # fmt: skip


PREDICTIONS = [
    "7391 and 1122", "The numbers are 7391, 1122.", "7391", "73911122", "none", "", "1122\n7391",
    "ANSWER 7391-1122", "lucky 7391 1122 extra", "739 1122",
]  # fmt: skip


def test_ruler_round_trip_scores_as_string_match_all_and_labels_its_needles(tmp_path):
    path = _jsonl(tmp_path / "validation.jsonl", [_ruler_line(0, ["7391", "1122"]), _ruler_line(1, ["5"])])
    tasks = import_tasks(path, "ruler")
    assert [t.name for t in tasks] == ["ruler_0", "ruler_1"] and {t.kind for t in tasks} == {"ruler"}
    first = tasks[0]
    assert first.prompt.endswith("lucky are") and first.max_new_tokens == 128
    assert first.meta["length"] == 2048 and first.meta["outputs"] == ["7391", "1122"]
    spans = [first.prompt[a:b] for a, b in first.evidence.values()]
    assert spans == [f"One of the special magic numbers for lucky-0 is: {v}." for v in ("7391", "1122")]
    for pred in PREDICTIONS:
        assert first.check(pred) == (ruler_all(pred, ["7391", "1122"]) == 1.0), pred
    part = import_tasks(path, "ruler", match="part")[0]
    for pred in PREDICTIONS:
        assert part.check(pred) == (ruler_part(pred, ["7391", "1122"]) == 1.0), pred
    _round_trip(tasks, tmp_path)


def test_ruler_outputs_with_regex_characters_match_literally(tmp_path):
    path = _jsonl(tmp_path / "r.jsonl", [{"index": 3, "input": "Key a.b*(c) here.", "outputs": ["a.b*(c)"]}])
    (task,) = import_tasks(path, "ruler")
    assert task.check("it is A.B*(C)!") and not task.check("it is axb*(c)")


# --------------------------------------------------------------------------------------- LongBench


def _longbench(dataset: str, answers: list[str], classes=None, **extra) -> dict:
    return {"input": "Which one?", "context": "Passage one. Passage two.", "answers": answers, "length": 5,
            "dataset": dataset, "language": "en", "all_classes": classes, "_id": f"id-{dataset}", **extra}  # fmt: skip


def test_longbench_round_trip_scores_each_data_set_by_its_metric(tmp_path):
    classes = ["Location", "City", "Description", "Abbreviation", "Definition"]
    rows = [
        _longbench("hotpotqa", ["Miller v. California", "Miller"]),
        _longbench("triviaqa", ["The Eiffel Tower"]),
        _longbench("trec", ["City"], classes),
        _longbench("passage_retrieval_en", ["Paragraph 12"]),
        _longbench("passage_count", ["7"]),
        _longbench("gov_report", ["A long summary."]),
    ]
    tasks = import_tasks(_jsonl(tmp_path / "lb.jsonl", rows), "longbench")
    by = {t.meta["dataset"]: t for t in tasks}
    assert [t.max_new_tokens for t in tasks] == [32, 32, 64, 32, 32, 512]
    assert by["gov_report"].answer is None and by["gov_report"].meta["score"] == "unchecked"
    qa = ["Miller", "miller v california", "It was Miller v. California, 1973, a case", "California", "no idea", ""]
    for pred in qa:
        assert by["hotpotqa"].check(pred) == (max(qa_f1(pred, t) for t in ["Miller v. California", "Miller"]) >= 0.5)
    trivia = ["Eiffel tower\nmore text about paris", "\n\nthe eiffel tower", "it is in paris\nEiffel Tower", "Tower"]
    for pred in trivia:
        assert by["triviaqa"].check(pred) == (qa_f1(first_line(pred), "The Eiffel Tower") >= 0.5), pred
    trec = ["City", "Location City", "City\nLocation", "\nCity is it", "Description", "city", "CityDefinition"]
    for pred in trec:
        assert by["trec"].check(pred) == (classification(first_line(pred), "City", classes) == 1.0), pred
    for pred in ["Paragraph 12", "12", "Paragraph 12 and 12", "Paragraph 1", "Paragraph 12, not 3", "112", "none"]:
        assert by["passage_retrieval_en"].check(pred) == (numbers_score(pred, "12") == 1.0), pred
    for pred in ["7", "There are 7 passages", "17", "7 or 8", "seven"]:
        assert by["passage_count"].check(pred) == (numbers_score(pred, "7") == 1.0), pred
    _round_trip(tasks, tmp_path)


def test_longbench_f1_threshold_and_dataset_option(tmp_path):
    row = _longbench("hotpotqa", ["alpha beta gamma delta"])
    del row["dataset"]
    path = _jsonl(tmp_path / "hotpotqa.jsonl", [row])
    (loose,) = import_tasks(path, "longbench", dataset="hotpotqa", f1_min=0.3)
    (strict,) = import_tasks(path, "longbench", dataset="hotpotqa", f1_min=0.9)
    pred = "alpha beta"  # F1 = 2 * 1 * 0.5 / 1.5 = 0.667
    assert qa_f1(pred, "alpha beta gamma delta") == pytest.approx(2 / 3)
    assert loose.check(pred) and not strict.check(pred)


# ----------------------------------------------------------------------------------------- kvpress


def test_kvpress_parquet_round_trip(tmp_path):
    rows = {
        "context": ["Some text. The special magic number for cat is: 4242. More text.", "Q context."],
        "question": ["\nWhat is the special magic number for cat?", "\nWho?"],
        "answer_prefix": [" Answer:", " Answer:"],
        "answer": [["4242"], ["Alice", "Bob"]],
        "task": ["niah_single_1", "qa_1"],
        "max_new_tokens": [128, 32],
    }
    path = tmp_path / "ruler.parquet"
    pq.write_table(pa.table(rows), path)
    first, second = import_tasks(path, "kvpress")
    assert first.prompt == rows["context"][0] + rows["question"][0] + " Answer:"
    assert (first.max_new_tokens, second.max_new_tokens) == (128, 32) and first.name == "niah_single_1_1"
    for pred in ["4242", "it is 42424", "no"]:
        assert first.check(pred) == (ruler_all(pred, ["4242"]) == 1.0)
    for pred in ["bob", "Alice and Bob", "Carol"]:  # a QA task: any one answer (RULER's string_match_part)
        assert second.check(pred) == (ruler_part(pred, ["Alice", "Bob"]) == 1.0)
    assert not first.evidence
    _round_trip([first, second], tmp_path)


# -------------------------------------------------------------------------------------------- niah


def test_niah_inserts_the_needle_at_its_depth_and_labels_it(tmp_path):
    needle = "The best thing to do in San Francisco is eat a sandwich in Dolores Park."
    question = "What is the best thing to do in San Francisco?"
    row = {"context": HAYSTACK, "needle": needle, "depth_percent": 50, "retrieval_question": question,
           "answer": "Dolores Park"}  # fmt: skip
    inside = dict(row, context=HAYSTACK[:100] + needle + " " + HAYSTACK[100:], depth_percent=25)
    inserted, given = import_tasks(_jsonl(tmp_path / "niah.jsonl", [row, inside]), "niah")
    (a, b), (c, d) = inserted.evidence["needle"], given.evidence["needle"]
    assert inserted.prompt[a:b] == needle and given.prompt[c:d] == needle and c == 100
    assert inserted.prompt[: a - 1] == HAYSTACK[: a - 1] and inserted.prompt[a - 2] == "."  # after a full stop
    assert abs(a - len(HAYSTACK) / 2) < 40
    assert inserted.meta["needle_inserted"] and not given.meta["needle_inserted"]
    assert inserted.check("Eat a sandwich in Dolores Park.") and not inserted.check("Golden Gate")
    _round_trip([inserted, given], tmp_path)


# --------------------------------------------------------------------------------------- malformed


@pytest.mark.parametrize(
    "fmt, rows, needle",
    [
        ("ruler", [_ruler_line(0, ["1"]), {"index": 1, "input": "x"}], "line 2, field 'outputs': missing"),
        ("ruler", [_ruler_line(0, ["1"]), {"index": 1, "input": 5, "outputs": ["1"]}], "line 2, field 'input': is"),
        ("ruler", ['{"index": 0, "input": '], "line 1: not valid JSON"),
        ("longbench", [_longbench("nosuch", ["a"])], "line 1, field 'dataset': 'nosuch' is not a LongBench data set"),
        ("longbench", [_longbench("trec", ["City"])], "line 1, field 'all_classes': missing"),
        ("longbench", [_longbench("hotpotqa", [])], "line 1, field 'answers'"),
        ("kvpress", [{"context": "c", "question": "q", "answer": "a"}], "line 1, field 'max_new_tokens': missing"),
        ("niah", [{"context": "c", "needle": "n", "depth_percent": 150}], "line 1, field 'depth_percent': 150"),
        ("niah", [{"context": "c", "needle": "n", "depth_percent": 5, "retrieval_question": "q", "answer": "?!"}],
         "line 1: the imported request is not a valid task"),
    ],
)  # fmt: skip
def test_malformed_files_name_the_line_and_field(tmp_path, capsys, fmt, rows, needle):
    path = _jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(TaskFileError) as info:
        import_tasks(path, fmt)
    assert needle in str(info.value)
    code = main(["tasks", "import", str(path), "--from", fmt, "-o", str(tmp_path / "out.jsonl")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and not (tmp_path / "out.jsonl").exists()
    assert err.startswith("h2o-lens: error: ") and needle in err and len(err.strip().splitlines()) == 1


def test_parquet_missing_column_names_the_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"context": ["c"], "answer": ["a"], "max_new_tokens": [8]}), path)
    with pytest.raises(TaskFileError, match=r"row 1, field 'question': missing"):
        import_tasks(path, "kvpress")


def test_cli_import_writes_a_task_file_tasks_check_accepts(tmp_path, capsys):
    path = _jsonl(tmp_path / "validation.jsonl", [_ruler_line(i, [str(1000 + i)]) for i in range(3)])
    out = tmp_path / "tasks.jsonl"
    assert main(["tasks", "import", str(path), "--from", "ruler", "-o", str(out), "--max-new-tokens", "16"]) == 0
    text, _ = capsys.readouterr()
    assert text.startswith(f"wrote 3 requests to {out}\n  ruler: 3 requests | prompt 3 | answer regex 3")
    assert [t.max_new_tokens for t in load_tasks(out)] == [16, 16, 16]
    assert main(["tasks", "check", str(out)]) == 0


@pytest.mark.parametrize(
    "answer, needle",
    [
        ({"f1": ["a b"]}, "an F1 answer has keys f1, min and optionally first_line"),
        ({"f1": ["a b"], "min": 0}, "'min' is 0; expected a number in (0, 1]"),
        ({"f1": [], "min": 0.5}, "'f1' is []"),
        ({"f1": ["a"], "min": 0.5, "first_line": "yes"}, "'first_line' is"),
    ],
)
def test_f1_answers_are_checked_in_task_files(tmp_path, answer, needle):
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": answer}])
    with pytest.raises(TaskFileError, match=re.escape(needle)):
        load_tasks(path)
