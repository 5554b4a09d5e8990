"""What a counterfactual leaves (DESIGN.md §6.10): its outcome, and its run folder linked to the parent.

:class:`Outcome` is one re-run, :class:`Explanation` every re-run of one request; the rest names a
counterfactual's run folder (:func:`counterfactual_id`), writes the manifest fields that tie it to
its parent (:func:`_link`, :func:`_note`), reuses one an earlier explain left (:func:`_fresh`) and
records one that could not start (:func:`_failed_run`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runlog.counterfactual_reuse import judged_teacher_forced
from runlog.errors import RecorderError
from runlog.manifest import read_manifest, sanitize_run_id
from runlog.ownership import remove_run
from runlog.run import RunWriter
from runlog.schema import COUNTERFACTUAL_KINDS
from runlog.store import load_run

from .counterfactual_parent import ParentRequest
from .counterfactual_search import Bisection, bisection_from

__all__ = ["KINDS", "Outcome", "Explanation", "counterfactual_id"]

#: the counterfactual kinds, in the order they are run
KINDS = COUNTERFACTUAL_KINDS
FULL, PINNED, ORACLE, POLICY_BUDGET, ORACLE_BUDGET, RECALL, PLAN = KINDS


@dataclasses.dataclass
class Outcome:
    """One counterfactual: ran or not, passed or not, and its run folder."""

    kind: str
    slots: int | None
    run_id: str | None
    ran: bool
    passed: bool | None = None
    answer: str | None = None
    error: str | None = None
    seconds: float = 0.0
    bisection: Bisection | None = None
    #: the oracle's teacher-forced top-1 agreement: ``[k, n]``, k of the teacher's n tokens
    teacher_agreement: list[int] | None = None
    #: the ``recall`` variant's window: slots of ``slots`` given to recalled entries
    window: int | None = None
    #: the ``plan`` variant's plan digest (DESIGN.md §6.12)
    plan: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "bisection"}
        out["bisection"] = self.bisection.to_dict() if self.bisection else None
        return out


@dataclasses.dataclass
class Explanation:
    """Every counterfactual of one request (the verdict is :func:`analyses.causal_verdicts`)."""

    parent_run: str
    request: int
    slots: int | None
    prompt_len: int
    outcomes: dict[str, Outcome]
    seconds: float = 0.0
    probe_seconds: list[float] = dataclasses.field(default_factory=list)
    #: model forwards of the oracle's teacher (its full-cache pass, masked forwards, re-planned tokens)
    oracle_forwards: int | None = None
    #: seconds of each recorded free generation (full, pinned, the policy's probes), replays excluded
    generation_seconds: list[float] = dataclasses.field(default_factory=list)
    #: generations that started from an earlier variant's prompt forward (DESIGN.md §12.5)
    prompts_reused: int = 0
    #: the full-cache run copied as ``full`` instead of generated (None: it was generated)
    full_copied_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "parent_run": self.parent_run,
            "request": self.request,
            "slots": self.slots,
            "prompt_len": self.prompt_len,
            "outcomes": {k: o.to_dict() for k, o in self.outcomes.items()},
            "seconds": self.seconds,
        }


def counterfactual_id(
    parent: str,
    request: int,
    kind: str,
    slots: int | None = None,
    *,
    window: int | None = None,
    plan: str | None = None,
) -> str:
    """The run id of a counterfactual: ``<parent>-r<request>-<kind>`` (``-b<slots>`` for budgets,
    ``-w<window>`` for a recall window, ``-p<digest>`` for a budget plan)."""
    tail = f"-b{slots}" if kind.endswith("_budget") and slots is not None else ""
    tail += f"-w{window}" if window is not None else ""
    tail += f"-p{plan}" if plan is not None else ""
    return sanitize_run_id(f"{parent}-r{request}-{kind.replace('_', '-')}{tail}")


def _link(parent: ParentRequest, kind: str, slots: int | None, override: Any = None, **extra: Any) -> dict[str, Any]:
    """The manifest fields that tie a counterfactual to its parent (and the model override, if any)."""
    return {
        **({"model_overrides": [override]} if override else {}),
        "parent_run": parent.run_id,
        "counterfactual_kind": kind,
        "counterfactual_request": parent.request,
        "counterfactual_slots": slots,
        "counterfactual": {"kind": kind, "slots": slots, "request": parent.request, **extra},
        "task": parent.manifest.get("task"),
        "task_spec": parent.task_spec,
        "decoding": {"do_sample": False, "max_new_tokens": parent.max_new_tokens},
    }


def _fresh(out: Path, run_id: str, finish: Callable[[Path, dict], None] | None = None) -> Outcome | None:
    """A complete earlier counterfactual of this id (reused), else None (a failed one is removed).

    ``finish(run_dir, counterfactual)`` completes a reused run that an earlier explain left half
    done (killed during its replay, or before its pass result was noted): its replay is redone
    and its result read back from its tables, never shown as a run without KL.
    """
    run_dir = out / run_id
    if not run_dir.exists():
        return None
    try:
        manifest = read_manifest(run_dir)
    except RecorderError:
        manifest = {}
    if (
        manifest.get("status") == "complete"
        and isinstance(manifest.get("counterfactual"), dict)
        and not judged_teacher_forced(manifest)
    ):
        if finish is not None:
            finish(run_dir, manifest)
            manifest = read_manifest(run_dir)
        cf = manifest["counterfactual"]
        bis = cf.get("bisection")
        return Outcome(
            cf.get("kind", ""),
            cf.get("slots"),
            run_id,
            True,
            cf.get("passed"),
            cf.get("answer"),
            bisection=bisection_from(bis) if isinstance(bis, dict) else None,
            teacher_agreement=cf.get("teacher_agreement"),
            window=cf.get("window"),
            plan=cf.get("plan"),
        )
    remove_run(run_dir)  # a run of its own only: anything else in the way is refused (DESIGN.md §5.1)
    return None


def _failed_run(out: Path, run_id: str, parent: ParentRequest, config: Any, link: dict[str, Any], exc: Exception):
    """A ``failed`` run folder for a counterfactual that could not even start (e.g. pins that do not fit)."""
    writer = RunWriter(out, run_id, config=config, model=parent.manifest.get("model"), fsync=False, name=run_id, **link)
    writer.start()
    writer.close("failed", exc)


def _decode(tokenizer: Any, tokens: Any) -> str:
    """The answer text of generated tokens, as the recorder writes it."""
    ids = [int(t) for t in tokens]
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


def _existing(out: Path, parent: ParentRequest, kind: str) -> Outcome | None:
    """A complete budget counterfactual recorded earlier for this request (its bisection reused)."""
    prefix = counterfactual_id(parent.run_id, parent.request, kind, 0).removesuffix("0")
    for run_dir in sorted(out.glob(prefix + "*")):
        got = _fresh(out, run_dir.name)
        if got is not None:
            return got
    return None


def _note(run_dir: Path, **fields: Any) -> None:
    """Add the pass result to the counterfactual's manifest (``counterfactual.passed``)."""
    from runlog.manifest import write_manifest

    manifest = read_manifest(run_dir)
    cf = dict(manifest.get("counterfactual") or {})
    cf.update({k: v for k, v in fields.items() if v is not None})
    manifest["counterfactual"] = cf
    write_manifest(run_dir, manifest)


def _answer_of(run_dir: Path) -> str | None:
    rows = load_run(run_dir, tables=("requests",))["requests"].to_pylist()
    return rows[0]["answer"] if rows else None
