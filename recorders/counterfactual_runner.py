"""Re-running one request of a parent run under another configuration (DESIGN.md §6.10).

:class:`Runner` records a free generation (full cache, pinned evidence, the policy at another
slot count), copies a full-cache run already under the root, and runs the oracle from the
full-cache teacher; each re-run is judged by the request's pass test and recorded as a run folder.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from h2o_lens.config import H2OConfig
from h2o_lens.presses import PressSpec
from runlog.catalog import replay_complete
from runlog.counterfactual_reuse import copy_request
from runlog.errors import RecorderError
from runlog.store import load_run

from .counterfactual_outcomes import (
    FULL,
    PINNED,
    Outcome,
    _decode,
    _failed_run,
    _fresh,
    _link,
    _note,
    counterfactual_id,
)
from .counterfactual_parent import ParentRequest, checker_from_spec
from .counterfactual_search import press_ratio, split_slots

__all__ = ["Runner"]


class Runner:
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

        run_id = counterfactual_id(
            self.parent.run_id, self.parent.request, kind, slots, window=extra.get("window"), plan=extra.get("plan")
        )
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
            kind,
            slots,
            run_id,
            True,
            seen.get("passed"),
            seen.get("answer"),
            seconds=time.perf_counter() - t0,
            plan=extra.get("plan"),
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
            return press.with_ratio(ratio)
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
