"""Task files from the field's long-context data (DESIGN.md §20.2): RULER, LongBench, kvpress's
evaluation data sets and needle-in-a-haystack files, read from local files only.

Each reader takes the upstream layout as it is written on disk and gives :class:`FileTask`
requests whose answer spec scores an answer the way that benchmark scores it:

``ruler``
    JSONL lines ``{"index", "input", "outputs", "length", "answer_prefix"?}``. Correct when every
    item of ``outputs`` occurs in the answer, case-insensitively, as a substring (RULER's
    ``string_match_all`` at 100 %); ``match="part"`` (RULER's QA tasks) accepts any one.
    Evidence: the sentence of the input holding each output (its needles).
``longbench``
    JSONL lines ``{"input", "context", "answers", "length", "dataset", "language",
    "all_classes", "_id"}``. Correct when LongBench's metric of the data set gives full marks
    (classification, passage count, passage retrieval) or, for its token-F1 QA data sets, an F1
    of at least ``f1_min`` (default 0.5). Data sets scored with ROUGE, code similarity or
    Chinese word segmentation get no checker (:data:`LONGBENCH_UNCHECKED`). No evidence.
``kvpress``
    rows with the columns ``context``, ``question``, ``answer_prefix``, ``answer``,
    ``max_new_tokens`` (and ``task`` where the data set has one), as Parquet or JSONL. Scored
    as RULER scores (``answer`` a string or a list; ``task`` starting with ``qa`` matches any
    item). No evidence.
``niah``
    JSONL lines ``{"context", "needle", "depth_percent", "retrieval_question", "answer"}``: the
    needle is inserted into the context at ``depth_percent`` % of its characters (at the end of
    the sentence before that point) unless the context already holds it. Evidence: the needle.

Every malformed line raises :class:`TaskFileError` naming the file, the line (``row`` for a
Parquet file) and the field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .taskcheck import MAX_NEW_TOKENS, TaskFileError, json_type, shown
from .taskfile import FileTask, _decode, _lines, parse_task

__all__ = [
    "FORMATS",
    "LONGBENCH_F1",
    "LONGBENCH_UNCHECKED",
    "LONGBENCH_MAX_NEW_TOKENS",
    "import_tasks",
    "substring_regex",
]

#: the formats ``h2o-lens tasks import --from`` reads
FORMATS = ("ruler", "longbench", "kvpress", "niah")

#: LongBench data sets scored with token F1 (those whose answer LongBench cuts at the first line: ``first_line``)
LONGBENCH_F1 = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa")
_FIRST_LINE = ("trec", "triviaqa", "samsum", "lsht")
_CLASSIFICATION = ("trec", "lsht")
_RETRIEVAL = {"passage_retrieval_en": r"Paragraph (\d+)", "passage_retrieval_zh": r"段落(\d+)"}
_COUNT = ("passage_count",)
#: LongBench data sets whose metric is neither a string match nor an English token F1: no checker
LONGBENCH_UNCHECKED = (
    "gov_report", "qmsum", "multi_news", "vcsum", "samsum", "lcc", "repobench-p",
    "multifieldqa_zh", "dureader",
)  # fmt: skip
#: tokens LongBench generates per data set (its published generation lengths)
LONGBENCH_MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}  # fmt: skip
_DEFAULT_MAX_NEW_TOKENS = {"ruler": 128, "niah": 32}
_LONGBENCH_PROMPT = "{context}\n\nQuestion: {input}\nAnswer:"
_NIAH_PROMPT = "{context}\n\n{question}"

Row = Mapping[str, Any]
Fail = Callable[[str | None, str], Exception]


def substring_regex(items: Sequence[str], *, every: bool = True) -> str:
    """A regex that holds when every item (``every``) or any item occurs in a text as a
    case-insensitive substring: ``r.lower() in text.lower()`` for each ``r``."""
    escaped = [re.escape(item) for item in items]
    if every:
        return r"(?is)\A" + "".join(f"(?=.*?{e})" for e in escaped)
    return "(?is)" + "|".join(escaped)


def _read_rows(path: str, parquet: bool) -> Iterator[tuple[int, Any]]:
    """The (number, decoded value) of each line of a JSONL file, or each row of a Parquet file."""
    if not os.path.isfile(path):
        raise TaskFileError(f"{path!r} is not a file; give the path of a local data file", source=path)
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise TaskFileError(f"{path}: not a readable Parquet file ({exc})", source=path) from None
        yield from enumerate(table.to_pylist(), 1)
        return
    with open(path, "rb") as fh:
        data = fh.read()
    for n, text in _lines(data, path):
        yield n, _decode(text, source=path, line=n)


def _field(row: Any, name: str, where: str, source: str, n: int, kind: type | tuple = str, required: bool = True):
    """``row[name]``, checked to be of ``kind`` (a missing optional field is ``None``)."""
    if not isinstance(row, Mapping):
        raise TaskFileError(f"{where}: is {json_type(row)}; expected an object", source=source, line=n)
    if name not in row or row[name] is None:
        if not required:
            return None
        raise TaskFileError(
            f"{where}, field {name!r}: missing; the line has {sorted(row)}", source=source, line=n, field=name
        )
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TaskFileError(
            f"{where}, field {name!r}: is {json_type(value)} ({shown(value)}); expected {want}",
            source=source,
            line=n,
            field=name,
        )
    return value


def _strings(row: Row, name: str, where: str, source: str, n: int) -> list[str]:
    """A field holding a string or a non-empty list of non-empty strings, as a list."""
    value = _field(row, name, where, source, n, (str, list, tuple))
    items = [value] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise TaskFileError(
            f"{where}, field {name!r}: is {shown(value)}; expected a non-empty string or list of non-empty strings",
            source=source,
            line=n,
            field=name,
        )
    return items


def _sentence(text: str, start: int, end: int) -> tuple[int, int]:
    """The sentence of ``text`` around ``text[start:end]``: from after the previous full stop or
    line end to the next one (included)."""
    stop = text.rfind(". ", 0, start)
    left = max(stop + 2 if stop != -1 else 0, text.rfind("\n", 0, start) + 1)
    stops = [i for i in (text.find(". ", end), text.find(".\n", end), text.find("\n", end)) if i != -1]
    right = min(stops) + 1 if stops else len(text)
    if text[right - 1 : right] == "\n":
        right -= 1
    return left, max(right, end)


def _ruler(row: Row, n: int, source: str, match: str) -> FileTask:
    where = f"{source}, line {n}"
    text = _field(row, "input", where, source, n)
    outputs = _strings(row, "outputs", where, source, n)
    prefix = _field(row, "answer_prefix", where, source, n, required=False) or ""
    evidence = {}
    for i, out in enumerate(outputs):
        at = text.find(out)
        if at != -1:
            evidence[f"needle_{i}"] = _sentence(text, at, at + len(out))
    index = _field(row, "index", where, source, n, int, required=False)
    meta = {"source": "ruler", "score": f"string_match_{match}", "outputs": outputs}
    meta |= {k: row[k] for k in ("index", "length") if row.get(k) is not None}
    return FileTask(
        name=f"ruler_{index if index is not None else n}",
        prompt=text + prefix,
        answer={"regex": substring_regex(outputs, every=match == "all")},
        evidence=evidence,
        max_new_tokens=_DEFAULT_MAX_NEW_TOKENS["ruler"],
        meta=meta,
        kind="ruler",
    )


def _classification_regex(truths: Sequence[str], classes: Sequence[str]) -> str:
    """Full marks of LongBench's classification score, on the answer's first non-empty line: a
    ground truth occurs in it and no other class does, but classes inside that ground truth."""
    parts = []
    for truth in truths:
        others = [c for c in classes if c != truth and c not in truth]
        parts.append(r"\A\n*(?=[^\n]*" + re.escape(truth) + ")" + "".join(rf"(?![^\n]*{re.escape(c)})" for c in others))
    return "|".join(f"(?:{p})" for p in parts)


def _numbers_regex(values: Sequence[str]) -> str:
    """Full marks of LongBench's count and retrieval scores: the answer has at least one number
    and every number in it (each run of digits) is the expected one."""
    return "|".join(rf"(?:\A\D*{re.escape(v)}(?:\D+{re.escape(v)})*\D*\Z)" for v in values)


def _longbench_answer(dataset: str, answers: list[str], row: Row, where: str, source: str, n: int, f1_min: float):
    """The answer spec of a LongBench line (``None``: the data set's metric is not a string match or F1)."""
    if dataset in LONGBENCH_F1:
        return {"f1": answers, "min": f1_min, "first_line": dataset in _FIRST_LINE}, "qa_f1_score"
    if dataset in _CLASSIFICATION:
        classes = _strings(row, "all_classes", where, source, n)
        return {"regex": _classification_regex(answers, classes)}, "classification_score"
    if dataset in _RETRIEVAL:
        ids = [m for a in answers for m in re.findall(_RETRIEVAL[dataset], a)[:1]]
        if not ids:
            raise TaskFileError(
                f"{where}, field 'answers': {shown(answers)} names no paragraph ({_RETRIEVAL[dataset]})",
                source=source,
                line=n,
                field="answers",
            )
        return {"regex": _numbers_regex(ids)}, "retrieval_score"
    if dataset in _COUNT:
        return {"regex": _numbers_regex(answers)}, "count_score"
    return None, "unchecked"


def _longbench(row: Row, n: int, source: str, dataset: str | None, f1_min: float) -> FileTask:
    where = f"{source}, line {n}"
    context = _field(row, "context", where, source, n)
    question = _field(row, "input", where, source, n)
    answers = _strings(row, "answers", where, source, n)
    name = _field(row, "dataset", where, source, n, required=dataset is None) or dataset
    if name not in LONGBENCH_MAX_NEW_TOKENS:
        raise TaskFileError(
            f"{where}, field 'dataset': {name!r} is not a LongBench data set; expected one of "
            f"{', '.join(LONGBENCH_MAX_NEW_TOKENS)}",
            source=source,
            line=n,
            field="dataset",
        )
    answer, metric = _longbench_answer(name, answers, row, where, source, n, f1_min)
    meta = {"source": "longbench", "dataset": name, "score": metric, "answers": answers}
    meta |= {k: row[k] for k in ("length", "language", "_id") if row.get(k) is not None}
    return FileTask(
        name=f"{name}_{n}",
        prompt=_LONGBENCH_PROMPT.format(context=context, input=question),
        answer=answer,
        max_new_tokens=LONGBENCH_MAX_NEW_TOKENS[name],
        meta=meta,
        kind=f"longbench_{name}",
    )


def _kvpress(row: Row, n: int, source: str, unit: str) -> FileTask:
    where = f"{source}, {unit} {n}"
    context = _field(row, "context", where, source, n)
    question = _field(row, "question", where, source, n)
    prefix = _field(row, "answer_prefix", where, source, n, required=False) or ""
    answers = _strings(row, "answer", where, source, n)
    budget = _field(row, "max_new_tokens", where, source, n, int)
    if not 0 < budget <= MAX_NEW_TOKENS:
        raise TaskFileError(
            f"{where}, field 'max_new_tokens': {budget}; expected 1 to {MAX_NEW_TOKENS:,}",
            source=source,
            line=n,
            field="max_new_tokens",
        )
    task = _field(row, "task", where, source, n, required=False)
    every = not (task or "").startswith("qa")
    meta = {"source": "kvpress", "score": f"string_match_{'all' if every else 'part'}", "answers": answers}
    meta |= {"task": task} if task else {}
    return FileTask(
        name=f"{task or 'kvpress'}_{n}",
        prompt=context + question + prefix,
        answer={"regex": substring_regex(answers, every=every)},
        max_new_tokens=budget,
        meta=meta,
        kind="kvpress",
    )


def _insert_needle(context: str, needle: str, depth: float) -> tuple[str, int]:
    """``context`` with ``needle`` at ``depth`` % of its characters, moved back to the end of the
    sentence before that point; and where the needle starts."""
    at = len(context) if depth >= 100 else int(len(context) * depth / 100)
    if 0 < at < len(context):
        stop = context.rfind(".", 0, at)
        at = stop + 1 if stop != -1 else 0
    before, after = context[:at], context[at:]
    sep = " " if before and not before.endswith((" ", "\n")) else ""
    text = before + sep + needle + ("" if after.startswith((" ", "\n")) or not after else " ") + after
    return text, len(before) + len(sep)


def _niah(row: Row, n: int, source: str) -> FileTask:
    where = f"{source}, line {n}"
    context = _field(row, "context", where, source, n)
    needle = _field(row, "needle", where, source, n)
    depth = _field(row, "depth_percent", where, source, n, (int, float))
    if not 0 <= depth <= 100:
        raise TaskFileError(
            f"{where}, field 'depth_percent': {depth}; expected 0 to 100", source=source, line=n, field="depth_percent"
        )
    question = _field(row, "retrieval_question", where, source, n)
    answer = _strings(row, "answer", where, source, n)
    if not needle.strip():
        raise TaskFileError(f"{where}, field 'needle': is empty", source=source, line=n, field="needle")
    at = context.find(needle)
    text = context if at != -1 else None
    if text is None:
        text, at = _insert_needle(context, needle, float(depth))
    prompt = _NIAH_PROMPT.format(context=text, question=question)
    return FileTask(
        name=f"niah_{n}",
        prompt=prompt,
        answer=answer[0] if len(answer) == 1 else tuple(answer),
        evidence={"needle": (at, at + len(needle))},
        max_new_tokens=_DEFAULT_MAX_NEW_TOKENS["niah"],
        meta={"source": "niah", "depth_percent": depth, "needle_inserted": context.find(needle) == -1},
        kind="niah",
    )


def import_tasks(
    path: str | os.PathLike[str],
    fmt: str,
    *,
    match: str = "all",
    dataset: str | None = None,
    f1_min: float = 0.5,
    max_new_tokens: int | None = None,
) -> list[FileTask]:
    """The requests of a local data file in the layout ``fmt`` (one of :data:`FORMATS`).

    Parameters
    ----------
    path : a JSONL file (``kvpress``: also ``.parquet``)
    match : RULER's string match, ``"all"`` (every output) or ``"part"`` (any, its QA tasks)
    dataset : LongBench's data set for lines without a ``dataset`` field (e.g. ``hotpotqa``)
    f1_min : the token F1 from which a LongBench F1 answer counts as correct
    max_new_tokens : overrides each format's generation length

    Raises
    ------
    TaskFileError
        Naming the file, the line (or Parquet row) and the field; a request that would not
        load back from a task file names its line too.
    """
    source = os.fspath(path)
    if fmt not in FORMATS:
        raise TaskFileError(f"--from {fmt!r}: unknown format; expected one of {', '.join(FORMATS)}", source=source)
    if match not in ("all", "part"):
        raise TaskFileError(f"match {match!r}: expected all or part", source=source)
    if not 0 < f1_min <= 1:
        raise TaskFileError(f"F1 threshold {f1_min}: expected a number in (0, 1]", source=source)
    parquet = fmt == "kvpress" and source.endswith((".parquet", ".pq"))
    unit = "row" if parquet else "line"
    tasks: list[FileTask] = []
    for n, row in _read_rows(source, parquet):
        if fmt == "ruler":
            task = _ruler(row, n, source, match)
        elif fmt == "longbench":
            task = _longbench(row, n, source, dataset, f1_min)
        elif fmt == "kvpress":
            task = _kvpress(row, n, source, unit)
        else:
            task = _niah(row, n, source)
        if max_new_tokens is not None:
            task = FileTask(**{**_fields(task), "max_new_tokens": max_new_tokens})
        try:  # the request as its task-file line would load
            task = parse_task(task.to_json(), line=n, source=source)
        except TaskFileError as exc:
            raise TaskFileError(
                f"{source}, {unit} {n}: the imported request is not a valid task ({exc})", source=source, line=n
            ) from None
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{source!r} holds no {unit}s to import", source=source)
    return tasks


def _fields(task: FileTask) -> dict[str, Any]:
    return {k: getattr(task, k) for k in ("name", "prompt", "turns", "answer", "evidence", "meta", "kind")}
