"""Task files: one request per JSON line, the one way tasks reach a sweep (DESIGN.md §10).

A line is an object with these fields::

    {"name": "needle_0",                      # optional, unique in the file (default: line_<n>)
     "kind": "needle",                         # optional, the family (default: "file")
     "prompt": "... text ...",                 # or "messages": [{"role": ..., "content": ...}, ...]
     "answer": "Lisbon",                       # or ["Lisbon", "lisboa"] (any of them)
                                               # or {"regex": "\\b6604\\b"}
                                               # or {"all": ["Oslo", "Lima"], "none": ["Cairo"]}
                                               # or {"f1": ["in Lisbon"], "min": 0.5}
     "evidence": {"city": "moved to Lisbon"},  # label -> substring, or label -> [start, end]
     "max_new_tokens": 16,                     # optional (default 32)
     "meta": {...}}                            # free, carried to the run's info

:func:`load_tasks` checks every line (:func:`parse_task`, the field checks in
:mod:`~h2o_lens.tasks.taskcheck`) and raises :class:`TaskFileError` naming the file, the line
and the field; :func:`write_tasks` writes a file that loads back
to equal :class:`FileTask` objects. :class:`FileTask` is the in-memory form; the built-in
families produce it too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .real import check_answer, token_f1
from .taskcheck import (
    DEFAULT_MAX_NEW_TOKENS,
    FIELDS,
    MAX_DEPTH,
    MAX_INT_DIGITS,
    MAX_NEW_TOKENS,
    ROLES,
    Answer,
    TaskFileError,
    check_line,
    json_type,
)

__all__ = [
    "FileTask",
    "Answer",
    "TaskFileError",
    "FIELDS",
    "ROLES",
    "DEFAULT_MAX_NEW_TOKENS",
    "parse_task",
    "load_tasks",
    "dumps_tasks",
    "write_tasks",
    "from_builtin",
    "summarise_tasks",
]


@dataclass(frozen=True)
class FileTask:
    """One request of a task file.

    Attributes
    ----------
    name : str
    prompt : str
        The user message. For a ``messages`` task, the content of its last turn (a user turn).
    turns : tuple of dict or None
        The chat messages of a ``messages`` task (``None`` for a ``prompt`` task).
    answer : answer spec or None
        ``None``: no checker (the request gets no verdict).
    evidence : dict label -> substring or (start, end)
        Substrings occur in the prompt text; character ranges index ``prompt``.
    max_new_tokens : int
    meta : dict
        Free fields, carried to the run.
    kind : str
        The family that generated it (``"file"`` for a line of a user's file).

    A list answer is kept as a tuple, an answer object's items as lists, range evidence as
    ``(start, end)`` tuples, so that a task equals itself read back from its file line.
    """

    name: str
    prompt: str
    turns: tuple[Mapping[str, str], ...] | None = None
    answer: Answer = None
    evidence: Mapping[str, Any] = field(default_factory=dict, hash=False)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)
    kind: str = "file"

    def __post_init__(self) -> None:
        a = self.answer
        if isinstance(a, list | tuple):
            a = tuple(a)
        elif isinstance(a, Mapping):
            a = {k: list(v) if isinstance(v, list | tuple) else v for k, v in a.items()}
        object.__setattr__(self, "answer", a)
        evidence = {k: v if isinstance(v, str) else tuple(v) for k, v in self.evidence.items()}
        object.__setattr__(self, "evidence", evidence)
        object.__setattr__(self, "meta", dict(self.meta))
        if self.turns is not None:
            object.__setattr__(self, "turns", tuple(dict(m) for m in self.turns))

    @property
    def expected(self) -> str:
        """The expected answer in words, for humans and the ``requests`` table."""
        a = self.answer
        if a is None:
            return ""
        if isinstance(a, str):
            return a
        if isinstance(a, Mapping):
            if "regex" in a:
                return f"/{a['regex']}/"
            if "f1" in a:
                return f"F1 >= {a['min']:g} with " + " | ".join(a["f1"])
            return " and ".join(a.get("all", ()))
        return " | ".join(a)

    @property
    def checked(self) -> bool:
        """Whether the request has an answer checker."""
        return self.answer is not None

    def check(self, answer: str) -> bool:
        """True when ``answer`` satisfies the answer spec (whole words after :func:`normalise`;
        a regex is searched in the raw answer)."""
        a = self.answer
        if a is None:
            return False
        if isinstance(a, str):
            return check_answer(answer, (a,))
        if isinstance(a, Mapping):
            if "regex" in a:
                return re.search(a["regex"], answer) is not None
            if "f1" in a:
                text = answer.lstrip("\n").split("\n")[0] if a.get("first_line") else answer
                return max(token_f1(text, ref) for ref in a["f1"]) >= a["min"]
            return check_answer(answer, tuple(a.get("all", ())), tuple(a.get("none", ())))
        return any(check_answer(answer, (item,)) for item in a)

    def messages(self) -> list[dict[str, str]]:
        """The chat messages of the request."""
        if self.turns is not None:
            return [dict(m) for m in self.turns]
        return [{"role": "user", "content": self.prompt}]

    def chat_text(self, tokenizer: Any) -> str:
        """The text the model is fed: the chat template with the generation prompt when the
        tokenizer has one, else the prompt as is (a ``messages`` task: its turns joined by
        blank lines)."""
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(self.messages(), tokenize=False, add_generation_prompt=True)
        if self.turns is not None:
            return "\n\n".join(m["content"] for m in self.turns)
        return self.prompt

    def to_json(self) -> dict[str, Any]:
        """The task as one task-file line (a JSON object)."""
        out: dict[str, Any] = {"name": self.name}
        if self.kind != "file":
            out["kind"] = self.kind
        if self.turns is not None:
            out["messages"] = [dict(m) for m in self.turns]
        else:
            out["prompt"] = self.prompt
        if self.answer is not None:
            a = self.answer
            out["answer"] = list(a) if isinstance(a, tuple | list) else (dict(a) if isinstance(a, Mapping) else a)
        if self.evidence:
            out["evidence"] = {k: (list(v) if not isinstance(v, str) else v) for k, v in self.evidence.items()}
        out["max_new_tokens"] = self.max_new_tokens
        if self.meta:
            out["meta"] = dict(self.meta)
        return out


def from_builtin(task: Any) -> FileTask:
    """A :class:`h2o_lens.tasks.real.Task` as a :class:`FileTask` (same prompt, evidence and checker)."""
    required, distractors = tuple(task.required), tuple(task.distractors)
    if len(required) == 1 and not distractors:
        answer: Answer = required[0]
    else:
        answer = {"all": list(required), "none": list(distractors)}
    return FileTask(
        name=task.name,
        prompt=task.prompt,
        answer=answer,
        evidence=dict(task.evidence),
        max_new_tokens=task.max_new_tokens,
        meta={"seed": task.seed},
        kind=task.kind,
    )


def parse_task(obj: Any, *, line: int, source: str = "<tasks>", unit: str = "line") -> FileTask:
    """One task-file line (a decoded JSON value) as a :class:`FileTask`, checked field by field.

    Parameters
    ----------
    obj : the decoded JSON value of the line
    line : its line number (1-based), used in errors and as the default name ``line_<n>``
    source : the file name, for errors
    unit : ``"line"`` (JSONL) or ``"item"`` (a ``.json`` list)

    Raises
    ------
    TaskFileError
        Naming ``source``, ``line`` and the field, what was received and what is expected
        (the checks: :func:`h2o_lens.tasks.taskcheck.check_line`).
    """
    return FileTask(**check_line(obj, line=line, source=source, unit=unit))


# ------------------------------------------------------------------------------ reading


class _DuplicateKey(Exception):
    pass


class _TooManyDigits(Exception):
    pass


def _parse_int(text: str) -> int:
    """An integer of the file; one of more than :data:`MAX_INT_DIGITS` digits is refused before
    Python converts it (it would refuse past 4,300 digits with a traceback, or hold a number no
    field takes)."""
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise _TooManyDigits(text)
    return int(text)


def _loads(text: str, where: str, *, source: str, line: int | None) -> Any:
    """``json.loads`` of a line or a file, every failure one :class:`TaskFileError` naming ``where``."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_parse_int)
    except _DuplicateKey as exc:
        key = exc.args[0]
        raise TaskFileError(
            f"{where}, field {key!r}: appears twice in one object; keep one", source=source, line=line, field=key
        ) from None
    except _TooManyDigits as exc:
        digits = len(exc.args[0]) - exc.args[0].startswith("-")
        raise TaskFileError(
            f"{where}: an integer of {digits:,} digits ({exc.args[0][:12]}...); integers have at most "
            f"{MAX_INT_DIGITS} digits (max_new_tokens at most {MAX_NEW_TOKENS:,})",
            source=source,
            line=line,
        ) from None
    except RecursionError:
        raise TaskFileError(
            f"{where}: lists or objects nested too deep to read (at most {MAX_DEPTH} levels are accepted); flatten it",
            source=source,
            line=line,
        ) from None
    except json.JSONDecodeError as exc:
        if line is None:  # a .json list: the error names the line of the file
            raise TaskFileError(
                f"{where}, line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})",
                source=source,
                line=exc.lineno,
            ) from None
        raise TaskFileError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one complete JSON "
            'object, e.g. {"prompt": "...", "answer": "..."}',
            source=source,
            line=line,
        ) from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _decode(text: str, *, source: str, line: int) -> Any:
    """One JSONL line decoded; invalid JSON, repeated keys, over-long integers and nesting too deep
    to read name the line."""
    return _loads(text, f"{source}, line {line}", source=source, line=line)


def _lines(data: bytes, source: str) -> list[tuple[int, str]]:
    """The non-blank lines of a file with their numbers; invalid UTF-8 names its line."""
    out = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise TaskFileError(
                f"{source}, line {n}: not valid UTF-8 (byte {exc.start + 1} of the line is "
                f"{raw[exc.start : exc.start + 1]!r}); save the file as UTF-8",
                source=source,
                line=n,
            ) from None
        if text.strip():
            out.append((n, text))
    return out


def _json_list(data: bytes, source: str) -> list[Any]:
    """The items of a ``.json`` task file (one list of request objects)."""
    _lines(data, source)  # invalid UTF-8 names its line
    text = data.decode("utf-8-sig")
    items = _loads(text, source, source=source, line=None) if text.strip() else []
    if not isinstance(items, list):
        raise TaskFileError(
            f"{source}: a .json task file holds one list of request objects, got {json_type(items)}; "
            "or write JSONL (one object per line, in a file not named .json)",
            source=source,
        )
    return items


def load_tasks(path: str | os.PathLike[str]) -> list[FileTask]:
    """The requests of a task file, in file order, every line checked (DESIGN.md §10).

    A JSONL file holds one JSON object per line (blank lines skipped); a file whose name ends
    in ``.json`` may instead hold one JSON list of such objects (errors then name the item).

    Raises
    ------
    TaskFileError
        The file is missing, not UTF-8, empty, or a line is invalid (see :func:`parse_task`).
    """
    source = os.fspath(path)
    if not os.path.exists(source):
        raise TaskFileError(
            f"task file {source!r} does not exist; give the path of a JSONL file (one request per line) "
            "or builtin:NAME (see h2o-lens tasks list)",
            source=source,
        )
    if not os.path.isfile(source):
        raise TaskFileError(f"task file {source!r} is not a file; give the path of a JSONL file", source=source)
    with open(source, "rb") as fh:
        data = fh.read()
    if source.endswith(".json"):
        unit, numbered = "item", list(enumerate(_json_list(data, source), 1))
    else:
        unit = "line"
        numbered = [(n, _decode(text, source=source, line=n)) for n, text in _lines(data, source)]
    tasks: list[FileTask] = []
    seen: dict[str, int] = {}
    for n, obj in numbered:
        task = parse_task(obj, line=n, source=source, unit=unit)
        if task.name in seen:
            raise TaskFileError(
                f"{source}, {unit} {n}, field 'name': {task.name!r} is already the name of {unit} "
                f"{seen[task.name]}; names must be unique in the file",
                source=source,
                line=n,
                field="name",
            )
        seen[task.name] = n
        tasks.append(task)
    if not tasks:
        raise TaskFileError(
            f"task file {source!r} holds no requests (it is empty or only blank lines); "
            'write one JSON object per line, e.g. {"prompt": "...", "answer": "..."}',
            source=source,
        )
    return tasks


# ------------------------------------------------------------------------------ writing


def dumps_tasks(tasks: Sequence[FileTask], *, source: str = "<tasks>") -> str:
    """The task-file text of ``tasks`` (one JSON line each), every line checked to load back."""
    out = []
    seen: dict[str, int] = {}
    for n, task in enumerate(tasks, 1):
        try:
            text = json.dumps(task.to_json(), ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise TaskFileError(
                f"{source}, line {n}, field 'meta': task {task.name!r} cannot be written as JSON ({exc}); "
                "meta values must be strings, numbers, booleans, null, lists or objects",
                source=source,
                line=n,
                field="meta",
            ) from None
        parse_task(json.loads(text), line=n, source=source)
        if task.name in seen:
            raise TaskFileError(
                f"{source}, line {n}, field 'name': {task.name!r} is already the name of line {seen[task.name]}",
                source=source,
                line=n,
                field="name",
            )
        seen[task.name] = n
        out.append(text + "\n")
    return "".join(out)


def write_tasks(tasks: Sequence[FileTask], path: str | os.PathLike[str]) -> Path:
    """Write ``tasks`` as a JSONL task file, atomically (a temporary file, then a rename).

    A path ending in ``.json`` gets one JSON list instead, as :func:`load_tasks` reads it.
    :func:`load_tasks` of the file gives back equal tasks. Returns the path.
    """
    target = Path(path)
    if target.is_dir():
        raise TaskFileError(f"{target} is a folder; give the path of the task file to write", source=str(target))
    text = dumps_tasks(tasks, source=str(target))
    if target.suffix == ".json":
        rows = [json.loads(line) for line in text.splitlines()]
        text = json.dumps(rows, ensure_ascii=False, indent=1) + "\n"
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def _answer_form(a: Answer) -> str:
    if a is None:
        return "no answer"
    if isinstance(a, str):
        return "answer text"
    if isinstance(a, Mapping):
        if "f1" in a:
            return "answer f1"
        return "answer regex" if "regex" in a else "answer all/none"
    return "answer any-of"


def summarise_tasks(tasks: Sequence[FileTask]) -> list[tuple[str, str]]:
    """One ``(kind, summary)`` per kind of ``tasks``, in order of first appearance: the number of
    requests and the fields they carry (for ``h2o-lens tasks check``)."""
    groups: dict[str, list[FileTask]] = {}
    for t in tasks:
        groups.setdefault(t.kind, []).append(t)
    order = (
        "prompt",
        "messages",
        "answer text",
        "answer any-of",
        "answer regex",
        "answer all/none",
        "answer f1",
        "no answer",
    )
    order += ("evidence substring", "evidence range")
    out = []
    for kind, group in groups.items():
        counts = dict.fromkeys(order, 0)
        for t in group:
            counts["messages" if t.turns is not None else "prompt"] += 1
            counts[_answer_form(t.answer)] += 1
            counts["evidence substring"] += sum(isinstance(v, str) for v in t.evidence.values())
            counts["evidence range"] += sum(not isinstance(v, str) for v in t.evidence.values())
        parts = [f"{len(group)} request{'s' * (len(group) != 1)}"]
        parts += [f"{key} {n}" for key, n in counts.items() if n]
        lo, hi = min(t.max_new_tokens for t in group), max(t.max_new_tokens for t in group)
        parts.append(f"max_new_tokens {lo}" + (f"-{hi}" if hi != lo else ""))
        lo, hi = min(len(t.prompt) for t in group), max(len(t.prompt) for t in group)
        parts.append(f"prompt {lo}" + (f"-{hi}" if hi != lo else "") + " chars")
        keys = sorted({k for t in group for k in t.meta})
        if keys:
            parts.append("meta: " + ", ".join(keys))
        out.append((kind, " | ".join(parts)))
    return out
