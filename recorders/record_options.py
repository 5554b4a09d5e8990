"""The options of a recording, in one object (:func:`recorders.record` takes them as keywords)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RecordOptions", "EvidenceSpec"]

#: evidence: {label: "substring" | (start, end)} for every request, or one such mapping per request
EvidenceSpec = Mapping[str, "str | tuple[int, int]"] | Sequence[Mapping[str, "str | tuple[int, int]"]]


@dataclass(frozen=True)
class RecordOptions:
    """Where and how a run is written, and what its requests are checked against.

    ``out`` the runs root (the run goes to ``<out>/<run_id>/``); ``tokenizer`` decodes token
    texts and locates evidence; ``evidence`` ``{label: substring | (start, end)}`` for every
    request or one mapping per prompt; ``name`` a free-form run name and ``run_id`` its folder
    (default: generated); ``prompts`` the user prompts, for character-range evidence; ``info``
    extra manifest fields; ``flush_every`` decode steps buffered between conversions to rows;
    ``fsync`` every segment durable before it is visible; ``rows_per_segment`` rows of one table
    per closed segment; ``annotate`` ``(request, answer) -> columns`` of the ``requests`` table;
    ``speculative`` ``rollback`` or ``defer`` (DESIGN.md §14); ``keep_prompt_pass`` keep each
    request's prompt pass for the replay (DESIGN.md §6.1); ``graphs`` decode steps replayed from
    captured graphs (DESIGN.md §2.16); ``manifest`` fields that replace the
    run's own (a press recording's config, DESIGN.md §17). :func:`recorders.record` documents each.
    """

    out: str
    tokenizer: Any = None
    evidence: EvidenceSpec | None = None
    name: str | None = None
    run_id: str | None = None
    prompts: Sequence[str] | None = None
    info: Mapping[str, Any] | None = None
    flush_every: int = 32
    fsync: bool = True
    rows_per_segment: int | None = None
    annotate: Callable[[int, str | None], Mapping[str, Any]] | None = None
    speculative: str = "rollback"
    keep_prompt_pass: bool = False
    graphs: bool | str = False
    manifest: Mapping[str, Any] | None = None
