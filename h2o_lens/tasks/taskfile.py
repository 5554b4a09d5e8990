"""Task files: one request per JSON line, the one way tasks reach a sweep (DESIGN.md §10).

A line is an object with these fields::

    {"name": "needle_0",                      # optional, unique in the file (default: line_<n>)
     "kind": "needle",                         # optional, the family (default: "file")
     "prompt": "... text ...",                 # or "messages": [{"role": ..., "content": ...}, ...]
     "answer": "Lisbon",                       # or ["Lisbon", "lisboa"] (any of them)
                                               # or {"regex": "\\b6604\\b"}
                                               # or {"all": ["Oslo", "Lima"], "none": ["Cairo"]}
     "evidence": {"city": "moved to Lisbon"},  # label -> substring, or label -> [start, end]
     "max_new_tokens": 16,                     # optional (default 32)
     "meta": {...}}                            # free, carried to the run's info

:func:`load_tasks` checks every line (:func:`parse_task`) and raises :class:`TaskFileError`
naming the file, the line and the field; :func:`write_tasks` writes a file that loads back
to equal :class:`FileTask` objects. :class:`FileTask` is the in-memory form; the built-in
families produce it too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from ..errors import ConfigError, H2OLensError
from .real import check_answer, normalise

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
    "resolve_tasks",
    "from_builtin",
    "summarise_tasks",
]

#: an answer spec: str | tuple of str | {"regex": str} | {"all": [...], "none": [...]}
Answer = Any

#: the fields of a task-file line, in the order :meth:`FileTask.to_json` writes them
FIELDS = ("name", "kind", "prompt", "messages", "answer", "evidence", "max_new_tokens", "meta")
#: the roles a ``messages`` turn may have
ROLES = ("system", "user", "assistant")
DEFAULT_MAX_NEW_TOKENS = 32


class TaskFileError(H2OLensError, ValueError):
    """A task file (or one of its lines) is not valid.

    Attributes
    ----------
    source : str
        The file (or what was being written).
    line : int or None
        The line (1-based; the item for a ``.json`` list) at fault, ``None`` for the whole file.
    field : str or None
        The field at fault, ``None`` when the line as a whole is.
    """

    def __init__(self, message: str, *, source: str, line: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.source, self.line, self.field = source, line, field


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
            a = {k: v if isinstance(v, str) else list(v) for k, v in a.items()}
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


# ------------------------------------------------------------------------------ validation


def _show(value: Any, limit: int = 60) -> str:
    """A value as received, in JSON, cut to ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type(value: Any) -> str:
    """The JSON type name of ``value``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


_ANSWER_FORMS = 'a string, a list of strings, {"regex": PATTERN} or {"all": [...], "none": [...]}'

Fail = Callable[[str | None, str], NoReturn]


def _answer_item(item: Any, where: str, fail: Fail) -> str:
    if not isinstance(item, str):
        fail("answer", f"{where} is {_type(item)} ({_show(item)}); expected a string")
    if not normalise(item):
        fail(
            "answer",
            f"{where} {_show(item)} has no letters or digits, so it can never match "
            "(answers match as whole words after lower-casing and dropping punctuation)",
        )
    return item


def _answer(value: Any, fail: Fail) -> Answer:
    if isinstance(value, str):
        return _answer_item(value, "the answer", fail)
    if isinstance(value, list):
        if not value:
            fail("answer", "is an empty list; give at least one accepted answer, or leave the field out (no checker)")
        return tuple(_answer_item(v, f"item {i} of the list", fail) for i, v in enumerate(value))
    if isinstance(value, Mapping):
        keys = set(value)
        if "regex" in keys:
            if keys != {"regex"}:
                fail("answer", f"a regex answer has the one key 'regex'; got keys {sorted(keys)}")
            pattern = value["regex"]
            if not isinstance(pattern, str) or not pattern:
                fail("answer", f"'regex' is {_show(pattern)}; expected a non-empty pattern string")
            try:
                re.compile(pattern)
            except re.error as exc:
                fail("answer", f"'regex' {_show(pattern)} does not compile: {exc}")
            return {"regex": pattern}
        if keys - {"all", "none"} or "all" not in keys:
            fail(
                "answer",
                f"an answer object with keys {sorted(keys)}: expected {{\"regex\": PATTERN}} or "
                '{"all": [every required item], "none": [items that make the answer wrong]} ("none" optional)',
            )
        out: dict[str, list[str]] = {}
        for key in ("all", "none"):
            if key not in value:
                continue
            items = value[key]
            if not isinstance(items, list):
                fail("answer", f"'{key}' is {_type(items)} ({_show(items)}); expected a list of strings")
            if key == "all" and not items:
                fail("answer", "'all' is an empty list; give at least one required item")
            out[key] = [_answer_item(v, f"item {i} of '{key}'", fail) for i, v in enumerate(items)]
        return out
    fail("answer", f"is {_type(value)} ({_show(value)}); expected {_ANSWER_FORMS}")


def _turns(value: Any, fail: Fail) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        fail(
            "messages",
            f"is {_show(value)}; expected a non-empty list of turns "
            '[{"role": "system" | "user" | "assistant", "content": TEXT}, ...]',
        )
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, Mapping):
            fail("messages", f"turn {i} is {_type(turn)} ({_show(turn)}); expected an object with role and content")
        missing = [k for k in ("role", "content") if k not in turn]
        extra = sorted(set(turn) - {"role", "content"})
        if missing or extra:
            what = f"lacks {' and '.join(missing)}" if missing else f"has unknown keys {extra}"
            fail("messages", f'turn {i} {what} ({_show(turn)}); a turn is {{"role": ..., "content": ...}}')
        role, content = turn["role"], turn["content"]
        if role not in ROLES:
            fail("messages", f"turn {i} has role {_show(role)}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str) or not content.strip():
            fail("messages", f"turn {i} has content {_show(content)}; expected a non-empty string")
        turns.append({"role": role, "content": content})
    if not any(t["role"] == "user" for t in turns):
        fail("messages", "has no user turn; the model answers the last turn, which must be a user turn")
    if turns[-1]["role"] != "user":
        fail(
            "messages",
            f"ends with a {turns[-1]['role']!r} turn; the last turn must be the user turn the model answers",
        )
    return tuple(turns)


def _evidence(value: Any, prompt: str, texts: Sequence[str], fail: Fail) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        fail(
            "evidence",
            f"is {_type(value)} ({_show(value)}); expected an object {{label: substring or [start, end]}}",
        )
    out: dict[str, Any] = {}
    for label, span in value.items():
        if not label.strip():
            fail("evidence", 'has an empty label; give each span a name, e.g. {"code": "code is 4419"}')
        if isinstance(span, str):
            if not span:
                fail("evidence", f"{label!r} is an empty string; give a substring of the prompt")
            if not any(span in t for t in texts):
                fail(
                    "evidence",
                    f"{label!r} = {_show(span)} does not occur in the prompt text; give a substring of the "
                    "prompt (exact, case and spaces included) or a [start, end] character range",
                )
            out[label] = span
            continue
        pair = isinstance(span, list) and len(span) == 2
        if not pair or not all(isinstance(x, int) and not isinstance(x, bool) for x in span):
            fail(
                "evidence",
                f"{label!r} is {_show(span)}; expected a substring of the prompt or a [start, end] "
                "pair of integers (a character range of the prompt)",
            )
        start, end = span
        if not 0 <= start < end <= len(prompt):
            of = "the prompt's length in characters" + ("; of a messages task, its last user turn" * (len(texts) > 1))
            fail(
                "evidence",
                f"{label!r} = [{start}, {end}] is not a range of the prompt: expected "
                f"0 <= start < end <= {len(prompt)} ({of})",
            )
        out[label] = (start, end)
    return out


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
        Naming ``source``, ``line`` and the field, what was received and what is expected.
    """
    where = f"{source}, {unit} {line}"

    def fail(name: str | None, problem: str) -> NoReturn:
        at = f", field {name!r}" if name else ""
        raise TaskFileError(f"{where}{at}: {problem}", source=source, line=line, field=name)

    if not isinstance(obj, Mapping):
        fail(None, f'expected a JSON object {{"prompt": ..., "answer": ...}}, got {_type(obj)} ({_show(obj)})')
    for key in obj:
        if key not in FIELDS:
            fail(
                key,
                f'unknown field; the fields are {", ".join(FIELDS)}. Put free fields in "meta", '
                f'e.g. "meta": {{{json.dumps(key)}: {_show(obj[key], 30)}}}',
            )
    name = obj.get("name", f"{unit}_{line}")
    if not isinstance(name, str) or not name.strip():
        fail("name", f"is {_show(name)}; expected a non-empty string, unique in the file")
    kind = obj.get("kind", "file")
    if not isinstance(kind, str) or not kind.strip():
        fail("kind", f'is {_show(kind)}; expected a non-empty string (the family, e.g. "needle")')
    if ("prompt" in obj) == ("messages" in obj):
        problem = 'has "messages" too; give one of them' if "prompt" in obj else "missing"
        fail(
            "prompt",
            f'{problem}: a request has either "prompt" (the user message) or "messages" '
            "(chat turns ending with a user turn)",
        )
    turns = None
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            fail("prompt", f"is {_type(prompt)} ({_show(prompt)}); expected the user message as a string")
        if not prompt.strip():
            fail("prompt", f"is empty ({_show(prompt)}); expected the user message")
        texts: Sequence[str] = (prompt,)
    else:
        turns = _turns(obj["messages"], fail)
        prompt = turns[-1]["content"]
        texts = [prompt] + [t["content"] for t in turns[:-1]]
    answer = _answer(obj["answer"], fail) if "answer" in obj else None
    evidence = _evidence(obj["evidence"], prompt, texts, fail) if "evidence" in obj else {}
    max_new = obj.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        fail("max_new_tokens", f"is {_show(max_new)}; expected a positive integer, e.g. 32")
    meta = obj.get("meta", {})
    if not isinstance(meta, Mapping):
        fail("meta", f'is {_type(meta)} ({_show(meta)}); expected an object of free fields, e.g. {{"source": "x"}}')
    return FileTask(
        name=name,
        prompt=prompt,
        turns=turns,
        answer=answer,
        evidence=evidence,
        max_new_tokens=max_new,
        meta=dict(meta),
        kind=kind,
    )


# ------------------------------------------------------------------------------ reading


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _decode(text: str, *, source: str, line: int) -> Any:
    """One JSONL line decoded; invalid JSON and repeated keys name the line."""
    where = f"{source}, line {line}"
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        key = exc.args[0]
        raise TaskFileError(
            f"{where}, field {key!r}: appears twice in one object; keep one", source=source, line=line, field=key
        ) from None
    except json.JSONDecodeError as exc:
        raise TaskFileError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one "
            'complete JSON object, e.g. {"prompt": "...", "answer": "..."}',
            source=source,
            line=line,
        ) from None


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
    try:
        items = json.loads(text, object_pairs_hook=_no_duplicates) if text.strip() else []
    except _DuplicateKey as exc:
        key = exc.args[0]
        raise TaskFileError(
            f"{source}, field {key!r}: appears twice in one object; keep one", source=source, field=key
        ) from None
    except json.JSONDecodeError as exc:
        raise TaskFileError(
            f"{source}, line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})",
            source=source,
            line=exc.lineno,
        ) from None
    if not isinstance(items, list):
        raise TaskFileError(
            f"{source}: a .json task file holds one list of request objects, got {_type(items)}; "
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

    :func:`load_tasks` of the file gives back equal tasks. Returns the path.
    """
    target = Path(path)
    text = dumps_tasks(tasks, source=str(target))
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


def resolve_tasks(
    spec: str, *, seed: int = 0, length: int | None = None, count: int | None = None, tokenizer: Any = None
) -> list[FileTask]:
    """``builtin:NAME`` (a family of :mod:`h2o_lens.tasks.builtins`) or the path of a task file.

    Raises :class:`ConfigError` (a :class:`TaskFileError` for a bad file) for an unknown
    family, a ``count`` below 1 or a ``length`` given with a task file.
    """
    if count is not None and count < 1:
        raise ConfigError(f"count must be at least 1, got {count}")
    if spec.startswith("builtin:"):
        from .builtins import family

        try:
            return family(spec.removeprefix("builtin:"))(seed=seed, length=length, count=count, tokenizer=tokenizer)
        except H2OLensError:
            raise
        except ValueError as exc:  # an unknown family, a length it does not take
            raise ConfigError(str(exc)) from None
    if length is not None:
        raise ConfigError(
            f"length {length} applies to the built-in families (builtin:NAME); the prompts of task file "
            f"{spec!r} are used as written"
        )
    tasks = load_tasks(spec)
    return tasks[:count] if count is not None else tasks


def _answer_form(a: Answer) -> str:
    if a is None:
        return "no answer"
    if isinstance(a, str):
        return "answer text"
    if isinstance(a, Mapping):
        return "answer regex" if "regex" in a else "answer all/none"
    return "answer any-of"


def summarise_tasks(tasks: Sequence[FileTask]) -> list[tuple[str, str]]:
    """One ``(kind, summary)`` per kind of ``tasks``, in order of first appearance: the number of
    requests and the fields they carry (for ``h2o-lens tasks check``)."""
    groups: dict[str, list[FileTask]] = {}
    for t in tasks:
        groups.setdefault(t.kind, []).append(t)
    order = ("prompt", "messages", "answer text", "answer any-of", "answer regex", "answer all/none", "no answer")
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
