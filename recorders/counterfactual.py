"""Counterfactual re-runs of one failed request (DESIGN.md §6.10).

A verdict from thresholds on logged measures is a correlation; an
intervention decides. :func:`explain_request` re-runs the request of a
recorded run with one thing changed, on the same prompt tokens, the same
model and the same (greedy) decoding, and records each re-run as a normal
run folder linked to its parent (manifest ``parent_run``,
``counterfactual_kind``, ``counterfactual_request``, ``counterfactual_slots``
and a ``counterfactual`` object; the ``counterfactuals`` view joins them):

``full``
    the full cache: does the model answer right at all?
``pinned``
    the run's policy and slot count, with the evidence tokens pinned
    (:func:`h2o_lens.config.pin`): they can never be evicted.
``oracle``
    the future-aware oracle at the same slot count, generating its own
    answer with hindsight from the full-cache teacher, re-planned where its
    tokens depart from the teacher's (:class:`recorders.oracle_runs.OracleTeacher`);
    its teacher-forced top-1 agreement with the teacher's tokens is noted
    next to it.
``policy_budget`` / ``oracle_budget``
    the smallest slot count at which the run's policy (free generation, the
    heavy:recent split of the run kept) and the oracle pass, found by
    :func:`bisect_budget`; the run recorded is the one at that count, its
    ``counterfactual.bisection`` holds every probe.

Every variant has one pass test: the request's answer checker (rebuilt
from the task spec the run's manifest carries: ``task_spec``, a task-file
line), else agreement with the full-cache run's answer. A full-cache run of
the same prompt already under the root is copied instead of generated again
(:mod:`runlog.counterfactual_reuse`), and the variants share one prompt
forward (:func:`h2o_lens.prompt_reuse.reuse_prompts`, DESIGN.md §12.5) and
its prompt pass (the teacher's keys and values, the replays). A
counterfactual that raises is recorded as a ``failed`` run folder with its
error ("could not run"); the parent run is only ever read.

A kvpress press run is explained the same way (DESIGN.md §17.3): its slot count is the positions
the press keeps, ``pinned`` raises the evidence positions' scores so that the press keeps them,
and ``policy_budget`` searches the press's compression ratio (:func:`press_ratio`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from h2o_lens.config import H2OConfig
from h2o_lens.errors import ConfigError
from h2o_lens.presses import PressSpec
from runlog.catalog import replay_complete
from runlog.counterfactual_reuse import copy_request, find_full_run, judged_teacher_forced
from runlog.errors import RecorderError
from runlog.manifest import effective_status, read_manifest, sanitize_run_id
from runlog.ownership import remove_run
from runlog.recorded_model import check_model
from runlog.run import RunWriter
from runlog.schema import COUNTERFACTUAL_KINDS
from runlog.store import load_run, request_order

__all__ = [
    "KINDS",
    "Bisection",
    "bisect_budget",
    "Outcome",
    "Explanation",
    "ParentRequest",
    "load_parent",
    "check_parent",
    "explain_request",
    "split_slots",
    "press_ratio",
]

#: the counterfactual kinds, in the order they are run
KINDS = COUNTERFACTUAL_KINDS
FULL, PINNED, ORACLE, POLICY_BUDGET, ORACLE_BUDGET = KINDS


# ----------------------------------------------------------------------------- bisection


@dataclasses.dataclass(frozen=True)
class Bisection:
    """The smallest passing slot count in ``[lo, hi]``, and whether the pass test looked monotone.

    Attributes
    ----------
    min_slots : int or None
        The smallest passing slot count; ``None`` when nothing in the range
        passes or when the test is not monotone (then ``smallest_pass`` is
        the smallest count seen passing, and ``violations`` the evidence).
    monotone : bool
        False when a probe passed at a count below one that failed.
    probes : dict slots -> passed, every count tested (with the known ones)
    violations : tuple of (passing slots, failing slots) pairs with passing < failing
    """

    lo: int
    hi: int
    min_slots: int | None
    monotone: bool
    probes: Mapping[int, bool]
    violations: tuple[tuple[int, int], ...] = ()
    smallest_pass: int | None = None
    resolution: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "lo": self.lo,
            "hi": self.hi,
            "resolution": self.resolution,
            "min_slots": self.min_slots,
            "monotone": self.monotone,
            "probes": [[int(s), bool(p)] for s, p in sorted(self.probes.items())],
            "violations": [list(v) for v in self.violations],
            "smallest_pass": self.smallest_pass,
        }


def _violations(probes: Mapping[int, bool]) -> tuple[tuple[int, int], ...]:
    """(pass, fail) pairs with the passing count below the failing one (at most one per pass)."""
    items = sorted(probes.items())
    out = []
    for i, (s, ok) in enumerate(items):
        if ok:
            worse = [t for t, ok2 in items[i + 1 :] if not ok2]
            if worse:
                out.append((s, worse[-1]))
    return tuple(out)


def _widest_gap(probes: Mapping[int, bool], lo: int, hi: int) -> int | None:
    """The middle of the widest run of untested counts strictly inside ``(lo, hi)``."""
    tested = sorted(s for s in probes if lo <= s <= hi)
    edges = [lo, *tested, hi] if tested else [lo, hi]
    best = None
    for a, b in zip(edges, edges[1:]):
        if b - a > 1 and (best is None or b - a > best[1] - best[0]):
            best = (a, b)
    return None if best is None else (best[0] + best[1]) // 2


def bisect_budget(
    pass_fn: Callable[[int], bool],
    lo: int,
    hi: int,
    *,
    known: Mapping[int, bool] | None = None,
    checks: int = 2,
    resolution: int = 1,
) -> Bisection:
    """The smallest slot count in ``[lo, hi]`` at which ``pass_fn`` passes.

    Bisection assumes the pass test is monotone in the slot count. It is
    checked, not trusted: after the search, ``checks`` more counts are
    tested (alternately below and above the result, in the widest untested
    gaps); together with every probe of the search, any count that passes
    below one that fails makes the result ``monotone=False`` with
    ``min_slots=None`` and the offending pairs, instead of a wrong number.

    Parameters
    ----------
    pass_fn : slot count -> bool (called at most once per count)
    lo, hi : the range searched, ``1 <= lo <= hi``
    known : results already known (e.g. the parent run's own count), not re-tested
    checks : extra counts tested to check monotonicity
    resolution : stop when the failing and passing counts are this close: the
        result is then the smallest count seen passing, at most ``resolution - 1``
        above the true minimum (1: exact)
    """
    if not 1 <= lo <= hi:
        raise RecorderError(f"bisect_budget: need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    probes: dict[int, bool] = {int(k): bool(v) for k, v in (known or {}).items()}

    def test(s: int) -> bool:
        if s not in probes:
            probes[s] = bool(pass_fn(s))
        return probes[s]

    found: int | None = None
    if test(hi):
        if lo in probes and probes[lo]:
            found = lo
        else:
            # a count below lo is taken to fail (0 slots attend to nothing) unless lo is tested
            a, b = (lo if lo in probes else lo - 1), hi
            while b - a > max(1, int(resolution)):
                m = (a + b) // 2
                a, b = (a, m) if test(m) else (m, b)
            found = b
        for k in range(checks):
            below = k % 2 == 0
            point = _widest_gap(probes, lo, found) if below else _widest_gap(probes, found, hi)
            if point is None:
                point = _widest_gap(probes, found, hi) if below else _widest_gap(probes, lo, found)
            if point is None:
                break
            test(point)
    bad = _violations({s: p for s, p in probes.items() if lo <= s <= hi})
    passing = [s for s, p in probes.items() if p and lo <= s <= hi]
    if found is not None and passing:
        found = min(passing)  # a check below the search's result may have passed (still monotone)
    return Bisection(
        lo,
        hi,
        None if bad else found,
        not bad,
        dict(sorted(probes.items())),
        bad,
        min(passing) if passing else None,
        max(1, int(resolution)),
    )


def split_slots(heavy: int, recent: int, slots: int) -> tuple[int, int]:
    """``slots`` split as ``heavy:recent`` (at least one recent slot when the run had one)."""
    total = heavy + recent
    h = int(math.floor(slots * heavy / total + 0.5)) if total else 0
    h = min(max(h, 0), slots)
    r = slots - h
    if recent and r == 0 and slots > 1:
        h, r = h - 1, 1
    if heavy and h == 0 and slots > 1 and recent:
        h, r = 1, r - 1
    return h, r


# ----------------------------------------------------------------------------- the parent


@dataclasses.dataclass
class ParentRequest:
    """What a counterfactual needs of the failed request of a recorded run."""

    run_id: str
    run_dir: Path
    request: int
    manifest: dict[str, Any]
    config: H2OConfig  # the run's policy with the request's resolved slot counts
    prompt_ids: list[int]
    new_ids: list[int]
    labels: list[str | None]  # evidence label of each prompt token
    answer: str | None
    correct: bool | None
    task_spec: dict[str, Any] | None
    max_new_tokens: int
    #: the run's kvpress press (DESIGN.md §17.3); then ``config`` is the full cache it runs on
    press: PressSpec | None = None
    #: a press run's slot count per layer: the prompt positions the press keeps
    press_slots: int | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def slots(self) -> int | None:
        return self.press_slots if self.press is not None else self.config.capacity

    @property
    def evidence_positions(self) -> list[int]:
        return [i for i, label in enumerate(self.labels) if label is not None]


def _config_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(H2OConfig)}
    return {k: v for k, v in raw.items() if k in names}


def load_parent(run_dir: str | Path, request: int = 0) -> ParentRequest:
    """Read one request of a recorded run (strictly: a damaged run raises)."""
    run_dir = Path(run_dir)
    run = load_run(run_dir, tables=("tokens", "requests"))
    tok = run["tokens"].to_pydict()
    order = request_order(tok, request)
    if not len(order):
        known = sorted(set(tok["request"]))
        raise RecorderError(f"{run_dir}: run {run.run_id!r} has no request {request}; its requests are {known}")
    ids = np.asarray(tok["token_id"])[order]
    prompt = np.asarray(tok["is_prompt"])[order]
    labels = [tok["evidence"][i] for i in order[prompt]]
    rows = [r for r in run["requests"].to_pylist() if r["request"] == request]
    row = rows[0] if rows else {}
    manifest = run.manifest
    raw = manifest.get("config") or {}
    if not isinstance(raw, dict):
        raise RecorderError(f"{run_dir}: the manifest has no config object; cannot re-run the request")
    press = PressSpec.from_dict(raw["press"]) if isinstance(raw.get("press"), dict) else None
    config = H2OConfig(policy="full") if press is not None else H2OConfig(**_config_fields(raw))
    if press is None and config.spec.evicts and row.get("heavy") is not None:
        config = dataclasses.replace(config, ratio=None, heavy=int(row["heavy"]), recent=int(row["recent"]))
    elif press is None and config.spec.evicts and not config.resolved:
        config = config.resolve(int(prompt.sum()))
    spec = manifest.get("task_spec")
    specs = manifest.get("task_specs")
    if isinstance(specs, list) and request < len(specs) and isinstance(specs[request], dict):
        spec = specs[request]
    decoding = manifest.get("decoding") if isinstance(manifest.get("decoding"), dict) else {}
    new = ids[~prompt].tolist()
    max_new = decoding.get("max_new_tokens") or (spec or {}).get("max_new_tokens") or max(len(new), 1)
    return ParentRequest(
        run.run_id,
        run_dir,
        request,
        manifest,
        config,
        ids[prompt].tolist(),
        new,
        labels,
        row.get("answer"),
        row.get("correct"),
        spec if isinstance(spec, dict) else None,
        int(max_new),
        press,
        None if press is None else _press_slots(run, press, request, int(prompt.sum())),
    )


def _press_slots(run: Any, press: PressSpec, request: int, prompt_len: int) -> int:
    """The prompt positions a press keeps per layer: ``int(P · (1 - compression_ratio))``, kvpress's
    count, for a press with a compression ratio; else the most its first compression of the
    request kept in any layer and KV head (the ``steps`` table)."""
    if press.compression_ratio is not None:
        return int(prompt_len * (1.0 - press.compression_ratio))
    steps = load_run(run.run_dir, tables=("steps",))["steps"].to_pandas()
    steps = steps[steps.request == request]
    if steps.empty:
        raise RecorderError(
            f"run {run.run_id!r}: the press {press.press} compressed nothing in request {request}; there is no "
            "eviction to explain"
        )
    return int(steps[steps.step == steps.step.min()].kept.max())


def press_ratio(slots: int, prompt_len: int) -> float:
    """The compression ratio at which kvpress keeps ``slots`` of ``prompt_len`` positions
    (``int(P · (1 - c)) == slots``; 0 from ``P`` slots on: nothing pruned)."""
    if slots >= prompt_len:
        return 0.0
    return (prompt_len - slots - 0.5) / prompt_len


def check_parent(run_dir: str | Path) -> None:
    """Refuse a parent whose verdicts could not be trusted: one not ``complete`` (failed, still
    running, interrupted: its log ends early) or without a complete replay (its KL and dropped
    mass are unknown). :class:`RecorderError` in one line; ``explain --force`` skips this."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    status = effective_status(manifest)
    name = run_dir.name
    if status != "complete":
        why = f" ({manifest.get('error')})" if status == "failed" and manifest.get("error") else ""
        raise RecorderError(
            f"run {name} is {status}{why}: its log is not a finished run, so re-runs against it cannot say why "
            "it failed. Explain a complete run, or pass --force to explain this one anyway"
        )
    if not replay_complete(run_dir, manifest):
        raise RecorderError(
            f"run {name} has no complete replay: its KL and dropped mass are unknown, so its failures cannot "
            f"be judged. Replay it first (h2o-lens replay {run_dir}), or pass --force to explain it anyway"
        )


def checker_from_spec(spec: Mapping[str, Any] | None) -> Callable[[str], bool] | None:
    """The answer checker of a task-file line (``None``: no answer spec)."""
    if not spec or spec.get("answer") is None:
        return None
    from h2o_lens.tasks.taskfile import FileTask

    answer = spec["answer"]
    task = FileTask(
        name=str(spec.get("name", "task")),
        prompt=str(spec.get("prompt", "")),
        answer=tuple(answer) if isinstance(answer, list) else answer,
    )
    return task.check


# ----------------------------------------------------------------------------- outcomes


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


def counterfactual_id(parent: str, request: int, kind: str, slots: int | None = None) -> str:
    """The run id of a counterfactual: ``<parent>-r<request>-<kind>`` (``-b<slots>`` for budgets)."""
    tail = f"-b{slots}" if kind.endswith("_budget") and slots is not None else ""
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
            bisection=_bisection_from(bis) if isinstance(bis, dict) else None,
            teacher_agreement=cf.get("teacher_agreement"),
        )
    remove_run(run_dir)  # a run of its own only: anything else in the way is refused (DESIGN.md §5.1)
    return None


def _bisection_from(d: Mapping[str, Any]) -> Bisection:
    return Bisection(
        int(d["lo"]),
        int(d["hi"]),
        d.get("min_slots"),
        bool(d.get("monotone", True)),
        {int(s): bool(p) for s, p in d.get("probes", [])},
        tuple(tuple(v) for v in d.get("violations", [])),
        d.get("smallest_pass"),
        int(d.get("resolution", 1)),
    )


def _failed_run(out: Path, run_id: str, parent: ParentRequest, config: Any, link: dict[str, Any], exc: Exception):
    """A ``failed`` run folder for a counterfactual that could not even start (e.g. pins that do not fit)."""
    writer = RunWriter(out, run_id, config=config, model=parent.manifest.get("model"), fsync=False, name=run_id, **link)
    writer.start()
    writer.close("failed", exc)


# ----------------------------------------------------------------------------- running


class _Runner:
    """Re-runs one request of a parent run under other configurations."""

    def __init__(
        self, model: Any, tokenizer: Any, parent: ParentRequest, out: Path, *, replay: bool, override: Any = None
    ):
        self.override = override  # a model other than the parent's, allowed explicitly: logged in each re-run
        self.model = model
        self.tok = tokenizer
        self.parent = parent
        self.out = out
        self.replay = replay
        self.check = checker_from_spec(parent.task_spec)
        self.teacher_text: str | None = None  # the full-cache answer, the pass test without a checker
        self.teacher: Any = None
        self.prompt_pass: Any = None  # the prompt pass of the first recorded variant, shared by the others
        self.probe_seconds: list[float] = []
        self.generation_seconds: list[float] = []

    # -- the pass test
    def passes(self, answer: str) -> bool:
        if self.check is not None:
            return bool(self.check(answer))
        if self.teacher_text is None:
            raise RecorderError("no answer checker and no full-cache answer to compare with")
        return answer.strip() == self.teacher_text.strip()

    def judge(self, answer: str | None) -> bool | None:
        """The pass test of an answer, None when there is nothing to judge it by."""
        return self.passes(answer or "") if (self.check or self.teacher_text is not None) else None

    def annotate(self, seen: dict[str, Any]) -> Callable[[int, str | None], dict[str, Any]]:
        """The recorder's ``annotate``: the pass test in the ``requests`` table, noted in ``seen``."""

        def annotate(request: int, answer: str | None) -> dict[str, Any]:
            seen["answer"] = answer or ""
            seen["passed"] = self.judge(answer)
            return {"task": self.parent.manifest.get("task"), "correct": seen["passed"]}

        return annotate

    def _prompt_passes(self, rec: Any) -> dict[int, Any] | None:
        """The recording's prompt pass (kept as the shared one when it is the first), else the shared one."""
        own = (getattr(rec, "prompt_passes", None) or {}).get(0)
        if own is not None and self.prompt_pass is None:
            self.prompt_pass = own
        got = own if own is not None else self.prompt_pass
        return {0: got} if got is not None else None

    def _generate(self) -> None:
        ids = torch.tensor([self.parent.prompt_ids], dtype=torch.long)
        pad = getattr(self.tok, "pad_token_id", None)
        self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=self.parent.max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )

    def record_free(
        self,
        kind: str,
        config_fn: Callable[[], H2OConfig],
        slots: int | None,
        *,
        replay: bool | None = None,
        **extra: Any,
    ) -> Outcome:
        """Record a free-generation counterfactual (``config_fn`` may raise: then it could not run)."""
        from .recorder import record
        from .replay import replay as replay_run

        run_id = counterfactual_id(self.parent.run_id, self.parent.request, kind, slots)
        wants_replay = (self.replay if replay is None else replay) and kind != FULL
        reused = _fresh(self.out, run_id, lambda d, m: self._finish(d, m, wants_replay))
        if reused is not None:
            return reused
        link = _link(self.parent, kind, slots, override=self.override, **extra)
        t0 = time.perf_counter()
        try:
            config = config_fn()
        except Exception as exc:  # e.g. pins that do not fit in the slots
            cfg = self.parent.manifest.get("config") if self.parent.press else self.parent.config.to_dict()
            _failed_run(self.out, run_id, self.parent, cfg, link, exc)
            return Outcome(kind, slots, run_id, False, error=f"{type(exc).__name__}: {exc}")
        seen: dict[str, Any] = {}
        replays = (self.replay if replay is None else replay) and kind != FULL
        pressed = isinstance(config, PressSpec)
        evicts = pressed or config.spec.evicts
        pins = {"pinned": extra["pinned"]} if pressed and kind == PINNED else {}
        try:
            with (
                torch.no_grad(),
                record(
                    self.model,
                    config,
                    out=str(self.out),
                    tokenizer=self.tok,
                    name=f"{self.parent.run_id} request {self.parent.request}: {kind}",
                    run_id=run_id,
                    info=link,
                    annotate=self.annotate(seen),
                    fsync=False,
                    keep_prompt_pass=not pressed and evicts and (replays or self.prompt_pass is None),
                    **pins,
                ) as rec,
            ):
                rec._labels_override = self.parent.labels
                t1 = time.perf_counter()
                self._generate()
                self.generation_seconds.append(time.perf_counter() - t1)
            passes = self._prompt_passes(rec) if evicts and not pressed else None
            if replays:
                replay_run(rec.run_dir, model=self.model, progress=False, prompt_passes=passes)
        except Exception as exc:
            return Outcome(kind, slots, run_id, False, error=f"{type(exc).__name__}: {exc}")
        _note(self.out / run_id, passed=seen.get("passed"), answer=seen.get("answer"))
        return Outcome(
            kind, slots, run_id, True, seen.get("passed"), seen.get("answer"), seconds=time.perf_counter() - t0
        )

    def _finish(self, run_dir: Path, manifest: dict, replay: bool) -> None:
        """Complete a reused counterfactual an earlier explain left half done (see :func:`_fresh`)."""
        from .replay import replay as replay_run

        if replay and not replay_complete(run_dir, manifest):
            replay_run(run_dir, model=self.model, progress=False)
        cf = manifest.get("counterfactual") or {}
        if "passed" in cf or "answer" in cf:
            return
        rows = load_run(run_dir, tables=("requests",))["requests"].to_pylist()
        answer = rows[0]["answer"] if rows else None
        passed = rows[0]["correct"] if rows else None
        if passed is None and answer is not None:
            passed = self.judge(answer)
        _note(run_dir, passed=passed, answer=answer)

    def copy_full(self, src: Path, request: int) -> Outcome:
        """The ``full`` counterfactual as a copy of a full-cache run of the same prompt under the root."""
        run_id = counterfactual_id(self.parent.run_id, self.parent.request, FULL)
        reused = _fresh(self.out, run_id)
        if reused is not None:
            return reused
        t0 = time.perf_counter()
        rows = [r for r in load_run(src, tables=("requests",))["requests"].to_pylist() if r["request"] == request]
        answer = rows[0]["answer"] if rows else None
        passed = self.judge(answer)
        link = _link(self.parent, FULL, None, copied_from={"run": src.name, "request": request})
        name = f"{self.parent.run_id} request {self.parent.request}: {FULL}"
        copy_request(src, request, self.out, run_id, info={"name": name, **link}, correct=passed)
        _note(self.out / run_id, passed=passed, answer=answer)
        return Outcome(FULL, None, run_id, True, passed, answer, seconds=time.perf_counter() - t0)

    def budget_config(self, slots: int) -> H2OConfig | PressSpec:
        """The run's policy at ``slots`` with its heavy:recent split (a press: at the compression
        ratio that keeps ``slots``)."""
        press = self.parent.press
        if press is not None:
            ratio = press_ratio(slots, self.parent.prompt_len)
            return PressSpec(press.press, tuple({**press.kwargs, "compression_ratio": ratio}.items()))
        cfg = self.parent.config
        h, r = split_slots(int(cfg.heavy), int(cfg.recent), slots)
        return dataclasses.replace(cfg, heavy=h, recent=r, ratio=None)

    def oracle_teacher(self, full_run: str) -> Any:
        if self.teacher is None:
            from .oracle_runs import OracleTeacher

            self.teacher = OracleTeacher(
                self.model,
                self.out / full_run,
                gqa=self.parent.config.gqa,
                request=0,
                prompt_pass=self.prompt_pass,
                max_new_tokens=self.parent.max_new_tokens,
            )
        return self.teacher

    def oracle_answer(self, full_run: str, slots: int) -> tuple[Any, str]:
        """The oracle's own answer at ``slots`` and its text."""
        got = self.oracle_teacher(full_run).generate(slots)
        return got, _decode(self.tok, got.tokens)

    def oracle_passes(self, full_run: str, slots: int) -> bool:
        t0 = time.perf_counter()
        try:
            return bool(self.judge(self.oracle_answer(full_run, slots)[1]))
        finally:
            self.probe_seconds.append(time.perf_counter() - t0)

    def record_oracle(
        self, kind: str, full_run: str, slots: int, *, replay: bool | None = None, **extra: Any
    ) -> Outcome:
        from .replay import replay as replay_run

        run_id = counterfactual_id(self.parent.run_id, self.parent.request, kind, slots)
        wants_replay = self.replay if replay is None else replay
        reused = _fresh(self.out, run_id, lambda d, m: self._finish(d, m, wants_replay))
        if reused is not None:
            return reused
        t0 = time.perf_counter()
        seen: dict[str, Any] = {}
        link = _link(self.parent, kind, slots, override=self.override, **extra)
        try:
            teacher = self.oracle_teacher(full_run)
            got, text = self.oracle_answer(full_run, slots)
            agreement = [got.agree, got.steps]
            link["counterfactual"]["teacher_agreement"] = agreement
            replays = self.replay if replay is None else replay
            rec = teacher.record(
                slots,
                answer=got,
                out=str(self.out),
                tokenizer=self.tok,
                name=f"{self.parent.run_id} request {self.parent.request}: {kind}",
                run_id=run_id,
                info=link,
                annotate=self.annotate(seen),
                fsync=False,
                keep_prompt_pass=replays,
            )
            run_dir = Path(getattr(rec, "run_dir", self.out / run_id))
            if replays:
                replay_run(run_dir, model=self.model, progress=False, prompt_passes=self._prompt_passes(rec))
        except Exception as exc:
            if not (self.out / run_id).exists():
                _failed_run(self.out, run_id, self.parent, {"policy": "oracle"}, link, exc)
            return Outcome(kind, slots, run_id, False, error=f"{type(exc).__name__}: {exc}")
        passed = seen.get("passed", self.judge(text))
        answer = seen.get("answer", text)
        _note(self.out / run_id, passed=passed, answer=answer)
        return Outcome(
            kind, slots, run_id, True, passed, answer, seconds=time.perf_counter() - t0, teacher_agreement=agreement
        )


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


def explain_request(
    model: Any,
    tokenizer: Any,
    run_dir: str | Path,
    request: int = 0,
    *,
    out: str | Path | None = None,
    bisect: bool = True,
    replay: bool = True,
    checks: int = 1,
    resolution: float = 0.05,
    progress: Callable[[str], None] | None = None,
    allow_other_model: bool = False,
    reuse_full: bool = True,
) -> Explanation:
    """Run and record the counterfactuals of one request of a recorded run.

    Parameters
    ----------
    model, tokenizer : the run's model (same weights and dtype) and its tokenizer
    run_dir : the parent run folder (only read)
    request : the request to explain
    out : runs root of the counterfactuals (default: the parent's root, so views and the
        dashboard find them next to it)
    bisect : also search the minimal passing budgets (policy and oracle)
    replay : replay the recorded counterfactuals against the teacher (KL in the tables)
    checks : extra counts tested by each bisection to check monotonicity
    resolution : the budget searches stop within this share of the prompt
        (``max(1, round(resolution · P))`` slots; 0: to the slot)
    progress : called with a short label before each re-run (a progress bar)
    allow_other_model : re-run with a model whose fingerprint differs from the parent's (logged in
        each re-run's ``model_overrides``); without it such a model is refused before anything runs
    reuse_full : copy a full-cache run of the same prompt found under ``out``
        (:func:`~runlog.counterfactual_reuse.find_full_run`) instead of generating one

    Returns
    -------
    Explanation with one :class:`Outcome` per kind; counterfactuals that could
    not run carry the error, and their kinds depend on them (pinned, oracle and
    bisections need the full-cache run) are reported as not run.
    """
    from h2o_lens.prompt_reuse import reuse_prompts

    t0 = time.perf_counter()
    parent = load_parent(run_dir, request)
    override = check_model(parent.manifest, model, run=parent.run_id, command="explain", allow_other=allow_other_model)
    if parent.press is None and not parent.config.spec.evicts:
        raise RecorderError(
            f"run {parent.run_id!r} keeps the full cache: there is no eviction to explain; "
            "explain a run of an evicting policy"
        )
    out = Path(out) if out is not None else Path(run_dir).resolve().parent
    runner = _Runner(model, tokenizer, parent, out, replay=replay, override=override)
    say = progress or (lambda label: None)
    with reuse_prompts(model) as shared:
        outcomes, copied = _run_variants(runner, bisect, checks, resolution, say, reuse_full)
    return Explanation(
        parent.run_id,
        request,
        int(parent.slots),
        parent.prompt_len,
        {k: outcomes[k] for k in KINDS if k in outcomes},
        time.perf_counter() - t0,
        list(runner.probe_seconds),
        runner.teacher.forwards if runner.teacher is not None else None,
        list(runner.generation_seconds),
        shared.hits,
        copied,
    )


def _run_variants(
    runner: _Runner, bisect: bool, checks: int, resolution: float, say: Callable[[str], None], reuse_full: bool
) -> tuple[dict[str, Outcome], str | None]:
    """Every variant of :func:`explain_request`, the policy's bisection before the oracle (its
    first probe's prompt pass spares the teacher a prompt forward when nothing is pinned)."""
    parent, out = runner.parent, runner.out
    slots = int(parent.slots)
    outcomes: dict[str, Outcome] = {}

    say("full cache")
    found = None
    if reuse_full and _fresh(out, counterfactual_id(parent.run_id, parent.request, FULL)) is None:
        found = find_full_run(
            out,
            parent.prompt_ids,
            model=parent.manifest.get("model"),
            max_new_tokens=parent.max_new_tokens,
            skip=(parent.run_id,),
        )
    if found is not None:
        full = runner.copy_full(*found)
    else:
        full = runner.record_free(FULL, lambda: H2OConfig(policy="full", gqa=parent.config.gqa), None)
    outcomes[FULL] = full
    if full.ran:
        runner.teacher_text = full.answer if full.answer is not None else _answer_of(out / full.run_id)
        if full.passed is None and runner.check is None:
            full.passed = True  # the teacher agrees with itself

    def skipped(kind: str, s: int | None, why: str) -> Outcome:
        return Outcome(kind, s, None, False, error=why)

    say("pinned evidence")
    if not parent.evidence_positions:
        outcomes[PINNED] = skipped(PINNED, slots, "the run labels no evidence tokens to pin")
    else:
        outcomes[PINNED] = runner.record_free(PINNED, lambda: _pinned(parent), slots, pinned=parent.evidence_positions)

    hi = parent.prompt_len + parent.max_new_tokens  # nothing is ever evicted at this count
    step = max(1, round(resolution * parent.prompt_len))
    if bisect:
        if not full.ran or not full.passed:
            why = "the full cache does not pass: no budget does" if full.ran else "the full-cache run could not run"
            outcomes[POLICY_BUDGET] = skipped(POLICY_BUDGET, None, why)
            outcomes[ORACLE_BUDGET] = skipped(ORACLE_BUDGET, None, why)
        elif parent.press is not None and parent.press.compression_ratio is None:
            why = f"the press {parent.press.press} has no compression_ratio to search"
            outcomes[POLICY_BUDGET] = skipped(POLICY_BUDGET, None, why)
        else:
            say("policy budget (bisection)")
            # a press prunes the prompt only: from P slots on it keeps everything
            top = parent.prompt_len if parent.press is not None else hi
            outcomes[POLICY_BUDGET] = _policy_budget(runner, slots, top, checks, step, say)

    say("oracle, same slots")
    if not full.ran:
        outcomes[ORACLE] = skipped(ORACLE, slots, f"needs the full-cache run, which could not run: {full.error}")
    else:
        outcomes[ORACLE] = runner.record_oracle(ORACLE, full.run_id, slots)

    if bisect and ORACLE_BUDGET not in outcomes:
        say("oracle budget (bisection)")
        outcomes[ORACLE_BUDGET] = _oracle_budget(runner, full.run_id, slots, hi, outcomes[ORACLE], checks, step)
    copied = found[0].name if found is not None and full.ran else None
    return outcomes, copied


def _pinned(parent: ParentRequest) -> H2OConfig | PressSpec:
    """The run's policy and slot count with the evidence positions pinned (a press: the press
    itself, its pins raised by the recorder, DESIGN.md §17.3)."""
    from h2o_lens.config import pin

    if parent.press is not None:
        pins = parent.evidence_positions
        if len(pins) > int(parent.slots):
            raise ConfigError(
                f"{len(pins)} evidence positions do not fit in the {parent.slots} positions the press keeps; "
                "nothing to pin within its count"
            )
        return parent.press
    return pin(parent.config, parent.evidence_positions)


def _answer_of(run_dir: Path) -> str | None:
    rows = load_run(run_dir, tables=("requests",))["requests"].to_pylist()
    return rows[0]["answer"] if rows else None


def _policy_budget(runner: _Runner, slots: int, hi: int, checks: int, step: int, say: Callable[[str], None]) -> Outcome:
    parent = runner.parent
    known = {hi: True}
    if parent.answer is not None:
        known[slots] = runner.passes(parent.answer)
    reused = _existing(runner.out, parent, "policy_budget")
    if reused is not None:
        return reused

    probes: dict[int, Outcome] = {}

    def pass_fn(s: int) -> bool:
        # each probe is recorded (no replay) so that the one found needs no extra generation
        say(f"policy at {s} slots")
        got = runner.record_free(POLICY_BUDGET, lambda: runner.budget_config(s), s, replay=False, **_ratio(runner, s))
        runner.probe_seconds.append(got.seconds)
        if not got.ran:
            raise RecorderError(f"the policy at {s} slots could not run: {got.error}")
        probes[s] = got
        return bool(got.passed)

    try:
        bis = bisect_budget(pass_fn, min(slots, hi), hi, known=known, checks=checks, resolution=step)
    except Exception as exc:
        _drop(runner.out, probes.values())
        return Outcome(POLICY_BUDGET, None, None, False, error=f"{type(exc).__name__}: {exc}")
    at = bis.min_slots if bis.min_slots is not None else bis.smallest_pass
    _drop(runner.out, (o for s, o in probes.items() if s != at))
    if at is None:
        return Outcome(POLICY_BUDGET, None, None, True, False, bisection=bis)
    got = probes.get(at)
    if got is None:  # a known count (the search never ran it): record it now
        got = runner.record_free(
            POLICY_BUDGET, lambda: runner.budget_config(at), at, replay=False, **_ratio(runner, at)
        )
    if got.ran:
        _note(runner.out / got.run_id, bisection=bis.to_dict(), min_slots=bis.min_slots)
    got.bisection = bis
    return got


def _ratio(runner: _Runner, slots: int) -> dict[str, float]:
    """A press probe's compression ratio, noted in its ``counterfactual`` object."""
    if runner.parent.press is None:
        return {}
    return {"compression_ratio": press_ratio(slots, runner.parent.prompt_len)}


def _drop(out: Path, outcomes: Any) -> None:
    """Remove the run folders of bisection probes other than the one kept."""
    for o in list(outcomes):
        if o.run_id:
            remove_run(out / o.run_id)


def _same_as_oracle(same: Outcome, bis: Bisection) -> Outcome:
    """The oracle's minimal budget is the run's own count: the same-count oracle run stands for it."""
    return Outcome(
        ORACLE_BUDGET,
        same.slots,
        same.run_id,
        True,
        True,
        same.answer,
        bisection=bis,
        teacher_agreement=same.teacher_agreement,
    )


def _oracle_budget(
    runner: _Runner, full_run: str, slots: int, hi: int, same: Outcome, checks: int, step: int
) -> Outcome:
    if not same.ran:
        return Outcome("oracle_budget", None, None, False, error=f"the oracle could not run: {same.error}")
    reused = _existing(runner.out, runner.parent, ORACLE_BUDGET)
    if reused is not None:
        return reused
    if same.bisection is not None:  # found at the run's own count earlier: the oracle run holds it
        return _same_as_oracle(same, same.bisection)
    lo, top = (1, slots) if same.passed else (slots, hi)
    known = {slots: bool(same.passed), hi: True}
    try:
        bis = bisect_budget(
            lambda s: runner.oracle_passes(full_run, s), lo, top, known=known, checks=checks, resolution=step
        )
    except Exception as exc:
        return Outcome("oracle_budget", None, None, False, error=f"{type(exc).__name__}: {exc}")
    at = bis.min_slots if bis.min_slots is not None else bis.smallest_pass
    if at is None:
        return Outcome("oracle_budget", None, None, True, False, bisection=bis)
    if at == slots:  # the oracle run at the same count is that run: note the search there
        _note(runner.out / same.run_id, bisection=bis.to_dict(), min_slots=bis.min_slots)
        return _same_as_oracle(same, bis)
    got = runner.record_oracle(
        ORACLE_BUDGET, full_run, at, replay=False, bisection=bis.to_dict(), min_slots=bis.min_slots
    )
    got.bisection = bis
    return got
