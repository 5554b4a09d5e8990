"""Task files: one request per JSON line, the one way tasks reach a sweep.

A line is an object with these fields::

    {"name": "needle_0",                      # optional, unique in the file (default: line_<n>)
     "prompt": "... text ...",                 # or "messages": [{"role": ..., "content": ...}, ...]
     "answer": "Lisbon",                       # or ["Lisbon", "lisboa"] (any of them)
                                               # or {"regex": "\\b6604\\b"}
                                               # or {"all": ["Oslo", "Lima"], "none": ["Cairo"]}
     "evidence": {"city": "moved to Lisbon"},  # label -> substring, or label -> [start, end]
     "max_new_tokens": 16,
     "meta": {...}}                            # free, carried to the run's info

:class:`FileTask` is the in-memory form; the built-in families produce it too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .real import check_answer

__all__ = ["FileTask", "Answer", "load_tasks", "resolve_tasks", "from_builtin"]

#: an answer spec: str | tuple of str | {"regex": str} | {"all": [...], "none": [...]}
Answer = Any


@dataclass(frozen=True)
class FileTask:
    """One request of a task file.

    Attributes
    ----------
    name : str
    prompt : str
        The user message. For a ``messages`` task, the content of its last user turn.
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
    """

    name: str
    prompt: str
    turns: tuple[Mapping[str, str], ...] | None = None
    answer: Answer = None
    evidence: Mapping[str, Any] = field(default_factory=dict, hash=False)
    max_new_tokens: int = 32
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)
    kind: str = "file"

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
        tokenizer has one, else the prompt as is (a ``messages`` task needs a template)."""
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(self.messages(), tokenize=False, add_generation_prompt=True)
        if self.turns is not None:
            return "\n\n".join(m["content"] for m in self.turns)
        return self.prompt

    def to_json(self) -> dict[str, Any]:
        """The task as one task-file line (a JSON object)."""
        out: dict[str, Any] = {"name": self.name}
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
        meta = dict(self.meta)
        if self.kind != "file":
            meta.setdefault("kind", self.kind)
        if meta:
            out["meta"] = meta
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


def _dumps(tasks: Sequence[FileTask]) -> str:
    return "".join(json.dumps(t.to_json(), ensure_ascii=False) + "\n" for t in tasks)


def load_tasks(path: str | os.PathLike[str]) -> list[FileTask]:
    """The requests of a JSONL task file, in file order (blank lines skipped)."""
    tasks = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            turns = obj.get("messages")
            prompt = obj.get("prompt")
            if turns is not None:
                turns = tuple(dict(m) for m in turns)
                prompt = [m["content"] for m in turns if m.get("role") == "user"][-1]
            answer = obj.get("answer")
            tasks.append(
                FileTask(
                    name=obj.get("name", f"line_{n}"),
                    prompt=prompt,
                    turns=turns,
                    answer=tuple(answer) if isinstance(answer, list) else answer,
                    evidence={k: v if isinstance(v, str) else tuple(v) for k, v in obj.get("evidence", {}).items()},
                    max_new_tokens=obj.get("max_new_tokens", 32),
                    meta=obj.get("meta", {}),
                    kind=obj.get("meta", {}).get("kind", "file"),
                )
            )
    return tasks


def resolve_tasks(
    spec: str, *, seed: int = 0, length: int | None = None, count: int | None = None, tokenizer: Any = None
) -> list[FileTask]:
    """``builtin:NAME`` (a family of :mod:`h2o_lens.tasks.builtins`) or the path of a task file."""
    if spec.startswith("builtin:"):
        from .builtins import family

        return family(spec.removeprefix("builtin:"))(seed=seed, length=length, count=count, tokenizer=tokenizer)
    tasks = load_tasks(spec)
    return tasks[:count] if count is not None else tasks
