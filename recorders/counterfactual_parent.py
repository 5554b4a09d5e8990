"""The failed request a counterfactual re-runs (DESIGN.md §6.10): read from its run, checked, judged.

:func:`load_parent` reads one request of a recorded run (its prompt, answer, resolved policy, a
kvpress press and the positions it keeps), :func:`check_parent` refuses a parent whose verdicts
could not be trusted, :func:`checker_from_spec` rebuilds the request's answer checker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from h2o_lens.config import H2OConfig
from h2o_lens.presses import PressSpec
from runlog.catalog import replay_complete
from runlog.errors import RecorderError
from runlog.manifest import effective_status, read_manifest
from runlog.store import load_run, request_order

__all__ = ["ParentRequest", "load_parent", "check_parent", "checker_from_spec"]


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
    # a guarded run's request row holds the slots after a raise: its first slot count is the config's
    guarded = isinstance(manifest.get("guard"), dict)
    if press is None and config.spec.evicts and row.get("heavy") is not None and not guarded:
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
    guard = manifest.get("guard")
    if isinstance(guard, dict):
        raise RecorderError(
            f"run {name} was recorded under the guard (action {guard.get('action', '?')}): explain re-runs a "
            "request without it, so its variants would not be counterfactuals of this run. Explain the same "
            "request recorded without --guard, or pass --force to explain it as unguarded H2O at the run's "
            "first slot count"
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
