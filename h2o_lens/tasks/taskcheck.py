"""The field checks of a task-file line (DESIGN.md §10): what each field may hold, and an error
naming the file, the line and the field, what was received and what is expected."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from ..errors import H2OLensError
from .real import normalise

__all__ = [
    "TaskFileError",
    "Answer",
    "FIELDS",
    "ROLES",
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_NEW_TOKENS",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "check_line",
    "shown",
    "json_type",
]

#: an answer spec: str | tuple of str | {"regex": str} | {"all": [...], "none": [...]}
#: | {"f1": [...], "min": float, "first_line": bool}
Answer = Any

#: the fields of a task-file line, in the order :meth:`~h2o_lens.tasks.taskfile.FileTask.to_json` writes them
FIELDS = ("name", "kind", "prompt", "messages", "answer", "evidence", "max_new_tokens", "meta")
#: the roles a ``messages`` turn may have
ROLES = ("system", "user", "assistant")
DEFAULT_MAX_NEW_TOKENS = 32
#: the largest ``max_new_tokens`` a line may ask for; a sweep also checks it against the model's
#: context less the prompt, which the file check cannot know (DESIGN.md §10.2)
MAX_NEW_TOKENS = 2**20
#: the deepest nesting of lists and objects a line may hold (``meta`` included)
MAX_DEPTH = 32
#: the most digits an integer of a line may have (a 64-bit integer has at most 19)
MAX_INT_DIGITS = 20


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


def shown(value: Any, limit: int = 60) -> str:
    """A value as received, in JSON, cut to ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_type(value: Any) -> str:
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


_ANSWER_FORMS = (
    'a string, a list of strings, {"regex": PATTERN}, {"all": [...], "none": [...]} or {"f1": [...], "min": 0.5}'
)

Fail = Callable[[str | None, str], NoReturn]


def _answer_item(item: Any, where: str, fail: Fail) -> str:
    if not isinstance(item, str):
        fail("answer", f"{where} is {json_type(item)} ({shown(item)}); expected a string")
    if not normalise(item):
        fail(
            "answer",
            f"{where} {shown(item)} has no letters or digits, so it can never match "
            "(answers match as whole words after lower-casing and dropping punctuation)",
        )
    return item


def _f1_answer(value: Mapping[str, Any], fail: Fail) -> dict[str, Any]:
    """``{"f1": [references], "min": threshold, "first_line": bool}``: correct when the token F1
    (:func:`~h2o_lens.tasks.real.token_f1`) against some reference reaches ``min``."""
    keys = set(value)
    if keys - {"f1", "min", "first_line"} or "min" not in keys:
        fail("answer", f'an F1 answer has keys f1, min and optionally first_line; got keys {sorted(keys)}')
    refs = value["f1"]
    if not isinstance(refs, list) or not refs:
        fail("answer", f"'f1' is {shown(refs)}; expected a non-empty list of reference strings")
    out: dict[str, Any] = {"f1": [_answer_item(v, f"answer.f1[{i}]", fail) for i, v in enumerate(refs)]}
    threshold = value["min"]
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold <= 1:
        fail("answer", f"'min' is {shown(threshold)}; expected a number in (0, 1], the F1 a correct answer reaches")
    out["min"] = float(threshold)
    if "first_line" in keys:
        if not isinstance(value["first_line"], bool):
            fail("answer", f"'first_line' is {shown(value['first_line'])}; expected true or false")
        out["first_line"] = value["first_line"]
    return out


def _answer(value: Any, fail: Fail) -> Answer:
    if isinstance(value, str):
        return _answer_item(value, "the answer", fail)
    if isinstance(value, list):
        if not value:
            fail("answer", "is an empty list; give at least one accepted answer, or leave the field out (no checker)")
        return tuple(_answer_item(v, f"answer[{i}]", fail) for i, v in enumerate(value))
    if isinstance(value, Mapping):
        keys = set(value)
        if "regex" in keys:
            if keys != {"regex"}:
                fail("answer", f"a regex answer has the one key 'regex'; got keys {sorted(keys)}")
            pattern = value["regex"]
            if not isinstance(pattern, str) or not pattern:
                fail("answer", f"'regex' is {shown(pattern)}; expected a non-empty pattern string")
            try:
                re.compile(pattern)
            except re.error as exc:
                fail("answer", f"'regex' {shown(pattern)} does not compile: {exc}")
            return {"regex": pattern}
        if "f1" in keys:
            return _f1_answer(value, fail)
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
                fail("answer", f"'{key}' is {json_type(items)} ({shown(items)}); expected a list of strings")
            if key == "all" and not items:
                fail("answer", "'all' is an empty list; give at least one required item")
            out[key] = [_answer_item(v, f"answer.{key}[{i}]", fail) for i, v in enumerate(items)]
        return out
    fail("answer", f"is {json_type(value)} ({shown(value)}); expected {_ANSWER_FORMS}")


def _turns(value: Any, fail: Fail) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        fail(
            "messages",
            f"is {shown(value)}; expected a non-empty list of turns "
            '[{"role": "system" | "user" | "assistant", "content": TEXT}, ...]',
        )
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, Mapping):
            got = f"{json_type(turn)} ({shown(turn)})"
            fail("messages", f"messages[{i}] is {got}; expected an object with role and content")
        missing = [k for k in ("role", "content") if k not in turn]
        extra = sorted(set(turn) - {"role", "content"})
        if missing or extra:
            what = f"lacks {' and '.join(missing)}" if missing else f"has unknown keys {extra}"
            fail("messages", f'messages[{i}] {what} ({shown(turn)}); a turn is {{"role": ..., "content": ...}}')
        role, content = turn["role"], turn["content"]
        if role not in ROLES:
            fail("messages", f"messages[{i}] has role {shown(role)}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str) or not content.strip():
            fail("messages", f"messages[{i}] has content {shown(content)}; expected a non-empty string")
        turns.append({"role": role, "content": content})
    if not any(t["role"] == "user" for t in turns):
        fail("messages", "has no user turn; the model answers the last turn, which must be a user turn")
    if turns[-1]["role"] != "user":
        fail(
            "messages",
            f"ends with a {turns[-1]['role']!r} turn; the last turn must be the user turn the model answers",
        )
    return tuple(turns)


def _evidence(value: Any, prompt: str, texts: Sequence[str], chat: bool, fail: Fail) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        fail(
            "evidence",
            f"is {json_type(value)} ({shown(value)}); expected an object {{label: substring or [start, end]}}",
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
                    f"{label!r} = {shown(span)} does not occur in the prompt text; give a substring of the "
                    "prompt (exact, case and spaces included) or a [start, end] character range",
                )
            out[label] = span
            continue
        pair = isinstance(span, list) and len(span) == 2
        if not pair or not all(isinstance(x, int) and not isinstance(x, bool) for x in span):
            fail(
                "evidence",
                f"{label!r} is {shown(span)}; expected a substring of the prompt or a [start, end] "
                "pair of integers (a character range of the prompt)",
            )
        start, end = span
        if not 0 <= start < end <= len(prompt):
            of = "the prompt's length in characters" + ("; of a messages task, its last user turn" * chat)
            fail(
                "evidence",
                f"{label!r} = [{start}, {end}] is not a range of the prompt: expected "
                f"0 <= start < end <= {len(prompt)} ({of})",
            )
        out[label] = (start, end)
    return out


def _lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate of ``text`` (text UTF-8 cannot encode), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _walk(obj: Mapping[str, Any], fail: Fail) -> None:
    """Every value of a line, iteratively: nesting deeper than :data:`MAX_DEPTH` and text with a
    lone surrogate (a ``\\ud800`` escape no tokenizer takes) fail, naming the top-level field."""
    stack: list[tuple[Any, int, str | None]] = [(v, 1, k) for k, v in obj.items()]
    for key in obj:
        if isinstance(key, str) and (at := _lone_surrogate(key)) is not None:
            fail(None, f"a field name holds a lone surrogate (an unpaired \\u{ord(key[at]):04x} escape); remove it")
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, str):
            if (at := _lone_surrogate(value)) is not None:
                fail(
                    field,
                    f"holds a lone surrogate at character {at} (an unpaired \\u{ord(value[at]):04x} escape): it is "
                    "not text, and no tokenizer can encode it; remove it or pair it into a real character",
                )
            continue
        if not isinstance(value, Mapping | list):
            continue
        if depth >= MAX_DEPTH:
            fail(field, f"nests lists or objects more than {MAX_DEPTH} levels deep; flatten it")
        items = list(value.items()) if isinstance(value, Mapping) else [(None, v) for v in value]
        for key, item in items:
            if isinstance(key, str) and (at := _lone_surrogate(key)) is not None:
                fail(field, f"holds a key with a lone surrogate (an unpaired \\u{ord(key[at]):04x} escape)")
            stack.append((item, depth + 1, field))


def check_line(obj: Any, *, line: int, source: str = "<tasks>", unit: str = "line") -> dict[str, Any]:
    """The fields of one task-file line (a decoded JSON value), checked one by one, as the
    keyword arguments of :class:`~h2o_lens.tasks.taskfile.FileTask`.

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
        fail(None, f'expected a JSON object {{"prompt": ..., "answer": ...}}, got {json_type(obj)} ({shown(obj)})')
    _walk(obj, fail)
    for key in obj:
        if key not in FIELDS:
            fail(
                key,
                f'unknown field; the fields are {", ".join(FIELDS)}. Put free fields in "meta", '
                f'e.g. "meta": {{{json.dumps(key)}: {shown(obj[key], 30)}}}',
            )
    name = obj.get("name", f"{unit}_{line}")
    if not isinstance(name, str) or not name.strip():
        fail("name", f"is {shown(name)}; expected a non-empty string, unique in the file")
    kind = obj.get("kind", "file")
    if not isinstance(kind, str) or not kind.strip():
        fail("kind", f'is {shown(kind)}; expected a non-empty string (the family, e.g. "needle")')
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
            fail("prompt", f"is {json_type(prompt)} ({shown(prompt)}); expected the user message as a string")
        if not prompt.strip():
            fail("prompt", f"is empty ({shown(prompt)}); expected the user message")
        texts: Sequence[str] = (prompt,)
    else:
        turns = _turns(obj["messages"], fail)
        prompt = turns[-1]["content"]
        texts = [prompt] + [t["content"] for t in turns[:-1]]
    answer = _answer(obj["answer"], fail) if "answer" in obj else None
    evidence = _evidence(obj["evidence"], prompt, texts, turns is not None, fail) if "evidence" in obj else {}
    max_new = obj.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        fail("max_new_tokens", f"is {shown(max_new)}; expected a positive integer, e.g. 32")
    if max_new > MAX_NEW_TOKENS:
        fail(
            "max_new_tokens",
            f"is {max_new:,}; at most {MAX_NEW_TOKENS:,} are accepted (a sweep also refuses more than the "
            "model's context window less the prompt)",
        )
    meta = obj.get("meta", {})
    if not isinstance(meta, Mapping):
        fail("meta", f'is {json_type(meta)} ({shown(meta)}); expected an object of free fields, e.g. {{"source": "x"}}')
    return dict(
        name=name,
        prompt=prompt,
        turns=turns,
        answer=answer,
        evidence=evidence,
        max_new_tokens=max_new,
        meta=dict(meta),
        kind=kind,
    )
