"""The sweep grid: keyed cells of (batch of requests, policy, budget, gqa), resumable (DESIGN.md §12).

A sweep resolves its requests (a task file or ``builtin:NAME``), groups them
into batches of requests of the same ``max_new_tokens`` and similar prompt
length, and crosses the batches with policy × budget × gqa. Each cell is one
recorded run of one batched ``generate`` (left padding), each request with its
own checker verdict in the ``requests`` table.

A cell's key hashes everything its run depends on (model, tasks spec and the
content digest of the resolved requests, the batch, policy, budget, gqa, dtype,
seed, max_new_tokens, replay); its run folder is ``cell-<key>``, so the same
command on the same root finds its finished cells and only runs the rest:

* a folder whose manifest is ``complete`` (and replayed, when replay is on) is done;
* a folder left ``failed``, ``running`` (its writer was killed) or damaged is
  removed and the cell redone;
* each cell is run under an exclusive ``fcntl`` lock on
  ``<root>/.sweep_locks/<run_id>.lock``, so two invocations on one root never
  write the same cell (the second skips it); the kernel drops the lock when a
  process dies, SIGKILL included;
* the plan, every grid run on the root with its cells, is ``<root>/sweep_plan.json``
  (rewritten atomically under ``<root>/.sweep_locks/plan.lock``); another grid on
  the same root adds its cells, and a cell two grids share (the full cache of a
  batch) is run once.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from h2o_lens import policies as registry
from h2o_lens import presses
from h2o_lens.config import H2OConfig
from h2o_lens.errors import ConfigError

__all__ = [
    "PLAN_NAME",
    "LOCK_DIR",
    "Cell",
    "Grid",
    "GridReport",
    "make_batches",
    "plan_grid",
    "run_grid",
    "run_cell",
    "fail_cell",
    "CellOutcome",
    "cell_state",
    "grid_status",
    "tasks_digest",
]

PLAN_NAME = "sweep_plan.json"
LOCK_DIR = ".sweep_locks"
#: bump when the meaning of a key changes (old cells are then simply not found)
KEY_VERSION = 1


@dataclass(frozen=True)
class Cell:
    """One run of the grid: a batch of requests under one policy, budget and gqa.

    ``budget`` is a keep ratio (``budget_kind == "ratio"``) or a slot count
    (``"slots"``); ``None`` for the full cache.
    """

    key: str
    run_id: str
    batch: int
    requests: tuple[int, ...]  # indices into the resolved requests
    policy: str
    gqa: str
    budget: float | int | None
    budget_kind: str
    max_new_tokens: int
    #: a budget plan's shares per layer (and KV set) at a mean of 1, scaled to the cell's keep ratio
    #: (``--plan``, DESIGN.md §2.14); None: one budget for every layer and set
    plan: Any = None
    #: a cold tier, ``STORE:RECALL:SELECTION`` (``--cold``, DESIGN.md §2.13); None: none
    cold: str | None = None

    @property
    def label(self) -> str:
        """The curve this cell belongs to, e.g. ``h2o-sum``, ``h2o-sum+plan``, ``h2o-sum+cold`` or ``local``."""
        extra = ("+plan" if self.plan is not None else "") + ("+cold" if self.cold is not None else "")
        return sweep_label(self.policy, self.gqa) + extra

    @property
    def budget_text(self) -> str:
        if self.budget is None:
            return "100%"
        return f"{self.budget:.0%}" if self.budget_kind == "ratio" else f"{self.budget} slots"

    @property
    def is_press(self) -> bool:
        """A kvpress press's cell (``kvpress:NAME``, DESIGN.md §17)."""
        return presses.is_press_policy(self.policy)

    def config(self, seed: int = 0) -> H2OConfig | presses.PressSpec:
        """The policy configuration the cell records with: an H2OConfig (with the cell's cold tier),
        or for a press its :class:`~h2o_lens.presses.PressSpec` at ``compression_ratio = 1 - keep ratio``."""
        if self.cold is not None:
            from h2o_lens.cold_config import parse_cold

            return replace(replace(self, cold=None).config(seed), cold=parse_cold(self.cold))
        if self.is_press and self.budget is not None:
            return presses.sweep_spec(self.policy, float(self.budget))
        if self.budget is None:
            return H2OConfig(policy=registry.FULL_CACHE, gqa=self.gqa, seed=seed)
        if self.plan is not None:
            from h2o_lens.plan import scaled

            return H2OConfig(policy=self.policy, plan=scaled(self.plan, float(self.budget)), gqa=self.gqa, seed=seed)
        if self.budget_kind == "slots":
            heavy, recent = registry.half_split(int(self.budget))
            return H2OConfig(policy=self.policy, heavy=heavy, recent=recent, gqa=self.gqa, seed=seed)
        return H2OConfig(policy=self.policy, ratio=float(self.budget), gqa=self.gqa, seed=seed)


@dataclass
class Grid:
    """A planned sweep: its identity, requests and cells."""

    grid_id: str
    model: str
    tasks_spec: str
    digest: str
    names: list[str]
    batches: list[tuple[int, ...]]
    cells: list[Cell]
    dtype: str
    seed: int
    replay: bool
    command: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "grid_id": self.grid_id,
            "model": self.model,
            "tasks": self.tasks_spec,
            "digest": self.digest,
            "requests": self.names,
            "batches": [list(b) for b in self.batches],
            "dtype": self.dtype,
            "seed": self.seed,
            "replay": self.replay,
            "command": self.command,
            "cells": [_cell_json(c) for c in self.cells],
        }


@dataclass
class GridReport:
    """What one invocation did: cells run, skipped as done, failed, or left to another process."""

    ran: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    busy: list[str] = field(default_factory=list)
    redone: list[str] = field(default_factory=list)  # cells found failed or interrupted, removed and redone
    retried: dict[str, int] = field(default_factory=dict)  # run again after their worker died (DESIGN.md §13)
    seconds: float = 0.0
    record_seconds: float = 0.0  # recording (generate with the recorder, the run written)
    replay_seconds: float = 0.0
    prompts_reused: int = 0  # cells that started from another cell's prompt forward (DESIGN.md §12.5)
    unmarked: list[str] = field(default_factory=list)  # failed cells whose failure could not be written

    def add(self, cell: CellOutcome) -> None:
        """Count one cell's outcome."""
        self.prompts_reused += cell.prompt_reused
        if cell.outcome == "failed":
            self.failed[cell.key] = cell.error or "failed"
            if not cell.marked:
                self.unmarked.append(cell.key)
        else:
            {"ran": self.ran, "done": self.done, "busy": self.busy}[cell.outcome].append(cell.key)
        if cell.redone:
            self.redone.append(cell.key)
        self.record_seconds += cell.record_seconds
        self.replay_seconds += cell.replay_seconds


def sweep_label(policy: str, gqa: str) -> str:
    """The curve of a policy: its name, with the aggregation for the method (both are swept)
    and for any other policy not run with the default ``sum``; a press by its grid name."""
    if presses.is_press_policy(policy):
        return policy
    if not registry.get(policy).evicts:
        return policy
    return f"{policy}-{gqa}" if policy == registry.DEFAULT or gqa != "sum" else policy


def _cell_json(cell: Cell) -> dict[str, Any]:
    """A cell in the sweep plan file; a cell without a budget plan is written as before plans existed."""
    out = asdict(cell) | {"requests": list(cell.requests)}
    for name in ("plan", "cold"):
        if out[name] is None:
            del out[name]
    return out


def kind_of(ratios: Any, slots: Any) -> str:
    """``ratio`` or ``slots``: how a grid's budgets are given."""
    return "ratio" if ratios is not None else "slots"


def _tuples(plan: Any) -> Any:
    """A cell's plan read back from JSON: lists to tuples (a cell is hashable)."""
    if plan is None:
        return None
    return tuple(tuple(row) if isinstance(row, list) else row for row in plan)


def tasks_digest(tasks: Sequence[Any]) -> str:
    """SHA-256 of the resolved requests (their task-file lines), in order."""
    text = json.dumps([t.to_json() for t in tasks], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def encode(tokenizer: Any, texts: Sequence[str]) -> Any:
    """The batch ``generate`` is fed: left padding, special tokens only without a chat template."""
    return tokenizer(
        list(texts),
        return_tensors="pt",
        padding=True,
        padding_side="left",
        add_special_tokens=not getattr(tokenizer, "chat_template", None),
        return_token_type_ids=False,  # a model that takes none refuses them in generate
    )


def prompt_lengths(tasks: Sequence[Any], tokenizer: Any) -> list[int]:
    """Each request's prompt length in tokens, as :func:`encode` feeds it to ``generate``."""
    return [len(encode(tokenizer, [t.chat_text(tokenizer)])["input_ids"][0]) for t in tasks]


def make_batches(
    tasks: Sequence[Any], tokenizer: Any, batch_size: int, lengths: Sequence[int] | None = None
) -> list[tuple[int, ...]]:
    """Request indices in batches of at most ``batch_size``, deterministically.

    Requests are grouped by ``max_new_tokens`` (one generate call has one), then
    ordered by prompt length in tokens (ties by file order) and cut in runs of
    ``batch_size``, so that a batch pads its prompts as little as the lengths allow.
    ``lengths``: the :func:`prompt_lengths`, when the caller has them.
    """
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
    if lengths is None:
        lengths = prompt_lengths(tasks, tokenizer)
    order = sorted(range(len(tasks)), key=lambda i: (tasks[i].max_new_tokens, lengths[i], i))
    batches: list[tuple[int, ...]] = []
    for _, group in itertools.groupby(order, key=lambda i: tasks[i].max_new_tokens):
        members = list(group)
        batches += [tuple(members[j : j + batch_size]) for j in range(0, len(members), batch_size)]
    return batches


def _key(payload: dict[str, Any]) -> str:
    text = json.dumps({"v": KEY_VERSION, **payload}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def plan_grid(
    tasks: Sequence[Any],
    tokenizer: Any,
    *,
    model: str,
    tasks_spec: str,
    policies: Sequence[tuple[str, str]],
    ratios: Sequence[float] | None = None,
    slots: Sequence[int] | None = None,
    batch_size: int = 8,
    dtype: str = "float32",
    seed: int = 0,
    replay: bool = True,
    command: Sequence[str] = (),
    lengths: Sequence[int] | None = None,
    plan: Any = None,
    cold: Any = None,
) -> Grid:
    """The cells of a sweep, in run order (batch by batch: full cache first, then policy × budget × gqa).

    The full cache runs once per batch (not per policy or gqa), when a ratio of
    1.0 or the ``full`` policy is asked for; a ratio of 1.0 gives no evicting cell.
    ``lengths``: the requests' :func:`prompt_lengths`, when the caller has them. ``plan``: a
    :class:`~h2o_lens.plan.BudgetPlan` in shares; every ``h2o`` cell then has a twin
    under the plan scaled to the cell's keep ratio (label ``+plan``, DESIGN.md §2.14). ``cold``: a
    :class:`~h2o_lens.cold_config.ColdTier`; every cell of an evicting policy (not a press, not a
    teacher) then has a twin with it (label ``+cold``, DESIGN.md §2.13), checked against every
    request's slot count before any cell runs.
    """
    weights = None
    if plan is not None:
        from h2o_lens.plan import relative

        if kind_of(ratios, slots) != "ratio":
            raise ConfigError("--plan takes keep ratios (--ratios): the plan is scaled to each ratio")
        weights = relative(plan)
    if not tasks:
        raise ConfigError(f"--tasks {tasks_spec!r} resolved to no requests; give a file with at least one line")
    kind, budgets = _budgets(ratios, slots)
    for name, gqa in policies:
        if presses.is_press_policy(name):
            if kind != "ratio":
                raise ConfigError(
                    f"{name}: a press takes a keep ratio (compression_ratio = 1 - ratio), not a slot count; "
                    "give --ratios for a grid with presses"
                )
            presses.parse_sweep_policy(name)
            continue
        H2OConfig(policy=name, gqa=gqa, heavy=32, recent=32)  # a ConfigError naming what is known
    evicts = {p: presses.is_press_policy(p) or registry.get(p).evicts for p, _ in policies}
    cold_text = None if cold is None else f"{cold.store}:{cold.recall}:{cold.select}"
    full = (kind == "ratio" and 1.0 in budgets) or not all(evicts.values())
    evicting = list(dict.fromkeys((p, g) for p, g in policies if evicts[p]))
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"--tasks {tasks_spec!r}: request names repeat ({', '.join(dup[:5])}); names must be unique")
    digest = tasks_digest(tasks)
    batches = make_batches(tasks, tokenizer, batch_size, lengths)
    base = {"model": model, "tasks": tasks_spec, "digest": digest, "dtype": dtype, "seed": seed, "replay": replay}
    cells = []
    for b, members in enumerate(batches):
        mnt = int(tasks[members[0]].max_new_tokens)
        combos: list[tuple[str, str, float | int | None, Any, str | None]] = (
            [(registry.FULL_CACHE, "sum", None, None, None)] if full else []
        )
        for x in budgets:
            if kind == "ratio" and x >= 1.0:
                continue
            combos += [(p, g, x, None, None) for p, g in evicting]
            if weights is not None:  # the method under the plan, beside it
                combos += [(p, g, x, weights, None) for p, g in evicting if p == registry.DEFAULT]
            if cold is not None:  # each evicting policy with the cold tier, beside it
                combos += [(p, g, x, None, cold_text) for p, g in evicting if cold_takes(p)]
        for policy, gqa, budget, shares, tier in combos:
            key = _key(
                {
                    **base,
                    "batch": b,
                    "requests": [names[i] for i in members],
                    "policy": policy,
                    "gqa": gqa,
                    "budget": budget,
                    "budget_kind": kind if budget is not None else None,
                    "max_new_tokens": mnt,
                    **({"plan": shares} if shares is not None else {}),  # keys without a plan as before
                    **({"cold": tier} if tier is not None else {}),  # and without a cold tier
                }
            )
            cells.append(Cell(key, f"cell-{key[:20]}", b, members, policy, gqa, budget, kind, mnt, shares, tier))
    per_batch = sum(1 for c in cells if c.batch == 0)
    for cell in cells[:per_batch]:  # the cells of one batch hold every configuration
        try:
            cell.config(seed)
        except ConfigError as exc:
            raise ConfigError(f"{cell.label} at {cell.budget_text}: {exc}") from None
    if cold is not None:
        _check_cold(cells, tasks, tokenizer, lengths, seed)
    grid_id = hashlib.sha256("".join(c.key for c in cells).encode()).hexdigest()[:12]
    return Grid(grid_id, model, tasks_spec, digest, names, batches, cells, dtype, seed, replay, list(command))


def _budgets(ratios: Sequence[float] | None, slots: Sequence[int] | None) -> tuple[str, list[float | int]]:
    """How a grid's budgets are given (``ratio`` or ``slots``) and the budgets, checked, without repeats."""
    if (ratios is None) == (slots is None):
        raise ConfigError("give the budgets either as keep ratios (--ratios) or as slot counts (--slots), not both")
    kind = "ratio" if ratios is not None else "slots"
    budgets: list[float | int] = []
    for b in ratios if ratios is not None else slots:
        if kind == "ratio" and not (isinstance(b, int | float) and 0 < b <= 1):
            raise ConfigError(f"--ratios: {b!r} is not a keep ratio in (0, 1]; e.g. --ratios 1.0 0.2 0.1")
        if kind == "slots" and not (isinstance(b, int) and b >= 2):
            raise ConfigError(f"--slots: {b!r} is not a slot count of at least 2; e.g. --slots 64 128")
        if b not in budgets:
            budgets.append(b)
    return kind, budgets


def cold_takes(policy: str) -> bool:
    """Whether a sweep's ``--cold`` gives ``policy``'s cells a twin with the cold tier: an evicting
    policy that is neither a kvpress press nor a teacher's plan (DESIGN.md §2.13)."""
    if presses.is_press_policy(policy):
        return False
    spec = registry.get(policy)
    return spec.evicts and not spec.teacher


def _check_cold(cells: Sequence[Cell], tasks: Sequence[Any], tokenizer: Any, lengths: Any, seed: int) -> None:
    """Every cold-tier cell's window fits every one of its requests' slot counts (a keep ratio
    resolves per prompt), or one ConfigError naming the cell and the request, before any cell runs."""
    lengths = lengths if lengths is not None else prompt_lengths(tasks, tokenizer)
    for cell in cells:
        if cell.cold is None:
            continue
        config = cell.config(seed)
        for i in cell.requests:
            try:
                config.resolve(int(lengths[i]))
            except ConfigError as exc:
                raise ConfigError(
                    f"{cell.label} at {cell.budget_text}, request {tasks[i].name} ({lengths[i]} prompt tokens): {exc}"
                ) from None


# -- the plan file and the locks ----------------------------------------------------------------


@contextlib.contextmanager
def _flock(path: Path, *, wait: bool) -> Iterator[bool]:
    """An exclusive ``fcntl`` lock on ``path`` (created if missing); yields whether it was taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_plan(root: str | os.PathLike) -> dict[str, Any]:
    """``<root>/sweep_plan.json`` (``{"grids": {}}`` when there is none)."""
    path = Path(root) / PLAN_NAME
    if not path.exists():
        return {"version": KEY_VERSION, "grids": {}}
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable sweep plan ({exc}); move it away to start a new plan") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("grids"), dict):
        raise ConfigError(f"{path} is not a sweep plan (no 'grids' object); move it away to start a new plan")
    return plan


def write_plan(root: str | os.PathLike, grid: Grid) -> Path:
    """Add (or refresh) ``grid`` in the root's plan: atomic rewrite under the plan lock."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / PLAN_NAME
    with _flock(root / LOCK_DIR / "plan.lock", wait=True):
        plan = read_plan(root)
        entry = grid.to_json()
        old = plan["grids"].get(grid.grid_id)
        entry["created"] = (old or {}).get("created") or dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        plan["grids"][grid.grid_id] = entry
        tmp = path.with_name(f"{PLAN_NAME}.{os.getpid()}.tmp")
        text = json.dumps(plan, indent=1)
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            from runlog.errors import storage_error

            with contextlib.suppress(OSError):
                tmp.unlink()
            raise storage_error(path, exc, len(text.encode())) from exc
    return path


def cell_state(root: str | os.PathLike, run_id: str, replay: bool) -> tuple[str, str | None]:
    """``(state, error)`` of a cell's run folder: ``todo``, ``done``, ``unreplayed`` (recorded,
    the replay missing or partial: :func:`runlog.replay_complete`), ``failed``, ``running``
    (its writer lives) or ``interrupted``."""
    from runlog import replay_complete
    from runlog.manifest import MANIFEST_NAME, effective_status, read_manifest

    run_dir = Path(root) / run_id
    if not run_dir.exists():
        return "todo", None
    if not (run_dir / MANIFEST_NAME).exists():
        return "interrupted", "run folder without a manifest"
    try:
        manifest = read_manifest(run_dir)
    except Exception as exc:  # a damaged manifest is a cell to redo
        return "interrupted", f"unreadable manifest: {exc}"
    status = effective_status(manifest)
    if status == "complete":
        return ("unreplayed", None) if replay and not replay_complete(run_dir, manifest) else ("done", None)
    if status == "failed":
        return "failed", f"{manifest.get('error_type', 'Error')}: {manifest.get('error', '')}"
    return status if status in ("running", "interrupted") else "interrupted", None


# -- running -----------------------------------------------------------------------------------


def _record_cell(
    root: Path, cell: Cell, tasks: Sequence[Any], model: Any, tokenizer: Any, grid: Grid, progress: bool = False
) -> dict:
    """Record one cell's batch; returns its requests' prompt passes when the grid replays
    (handed to the replay so that it does not forward the prompts again, DESIGN.md §6.1).
    ``progress``: a bar of the batch's new tokens while it generates (gone when done)."""
    import torch

    from h2o_lens.progress import GenerationProgress
    from recorders.recorder import record

    batch = [tasks[i] for i in cell.requests]
    enc = encode(tokenizer, [t.chat_text(tokenizer) for t in batch])

    def annotate(request: int, answer: str | None) -> dict[str, Any]:
        task = batch[request]
        return {
            "task": task.name,
            "expected": task.expected,
            "correct": bool(task.check(answer or "")) if task.checked else None,
        }

    info = {
        "task": batch[0].name if len(batch) == 1 else f"{batch[0].name} +{len(batch) - 1}",
        "sweep_cell": cell.key,
        "sweep_grid": grid.grid_id,
        "sweep_batch": cell.batch,
        "tasks_spec": grid.tasks_spec,
        # each request's task-file line and the decoding: what a counterfactual re-run needs
        "task_specs": [t.to_json() for t in batch],
        "decoding": {"do_sample": False, "max_new_tokens": cell.max_new_tokens},
    }
    with (
        torch.no_grad(),
        record(
            model,
            cell.config(grid.seed),
            out=str(root),
            tokenizer=tokenizer,
            evidence=[dict(t.evidence) for t in batch],
            prompts=[t.prompt for t in batch],
            name=f"{cell.label} {cell.budget_text} batch {cell.batch}",
            info=info,
            annotate=annotate,
            run_id=cell.run_id,
            keep_prompt_pass=grid.replay,
        ) as rec,
    ):
        # a press generates its requests one at a time: kvpress's compressed cache no longer lines up
        # with a padded batch's mask at decode steps (DESIGN.md §17); H2O runs the batch at once
        texts = [t.chat_text(tokenizer) for t in batch]
        for feed in [encode(tokenizer, [text]) for text in texts] if cell.is_press else [enc]:
            model.generate(
                **feed,
                max_new_tokens=cell.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                streamer=GenerationProgress(
                    cell.max_new_tokens, f"{cell.label} {cell.budget_text} batch {cell.batch}", disable=not progress
                ),
            )
    return rec.prompt_passes or {}


@dataclass
class CellOutcome:
    """What :func:`run_cell` did with one cell: ``ran``, ``done`` (found complete), ``busy``
    (locked by another process) or ``failed`` (with the error); timings in seconds."""

    key: str
    outcome: str
    error: str | None = None
    redone: bool = False
    record_seconds: float = 0.0
    replay_seconds: float = 0.0
    seconds: float = 0.0
    prompt_reused: bool = False  # it started from another cell's prompt forward (DESIGN.md §12.5)
    marked: bool = True  # a failed cell's folder says failed (False: even that could not be written)


def run_cell(
    root: str | os.PathLike,
    cell: Cell,
    grid: Grid,
    tasks: Sequence[Any],
    model: Any,
    tokenizer: Any,
    progress: bool = False,
    reuse: Any = None,
) -> CellOutcome:
    """Run one cell under its lock (DESIGN.md §12.3): skip it when done or taken, redo it when
    failed or interrupted, replay it when only the replay is missing. ``progress``: bars of the
    cell's new tokens and replay forwards (a long-context cell takes minutes). ``reuse``: the
    open :class:`~h2o_lens.prompt_reuse.PromptReuse` scope of the caller, or None: it drops the
    prompt forwards of another batch before the cell runs (DESIGN.md §12.5).

    The one function every executor runs per cell, in-process or on a Ray worker
    (DESIGN.md §13). A cell that raises is left ``failed`` with its error.
    """
    t0 = time.perf_counter()
    from recorders.replay import replay as replay_run
    from runlog.ownership import remove_run

    root = Path(root)
    out = CellOutcome(cell.key, "ran")
    with _flock(root / LOCK_DIR / f"{cell.run_id}.lock", wait=False) as mine:
        state = cell_state(root, cell.run_id, grid.replay)[0] if mine else "busy"
        if state in ("busy", "done"):
            out.outcome = state
            out.seconds = time.perf_counter() - t0
            return out
        try:
            passes = None
            if state != "unreplayed":
                if state != "todo":  # failed, or left by a killed writer: start the cell afresh
                    remove_run(root / cell.run_id)  # its own run folder only (DESIGN.md §5.1)
                    out.redone = True
                t1 = time.perf_counter()
                hits = 0
                if reuse is not None:
                    if reuse.batch != (grid.grid_id, cell.batch):
                        reuse.clear()
                        reuse.batch = (grid.grid_id, cell.batch)
                    hits = reuse.hits
                passes = _record_cell(root, cell, tasks, model, tokenizer, grid, progress)
                out.prompt_reused = reuse is not None and reuse.hits > hits
                out.record_seconds = time.perf_counter() - t1
            if grid.replay:
                t1 = time.perf_counter()
                replay_run(root / cell.run_id, model=model, progress=progress, prompt_passes=passes)
                out.replay_seconds = time.perf_counter() - t1
        except Exception as exc:
            out.outcome, out.error = "failed", f"{type(exc).__name__}: {exc}"
            print(f"h2o-lens: cell {cell.run_id} failed: {exc}", file=sys.stderr)
            if os.environ.get("H2O_LENS_DEBUG"):
                traceback.print_exc()
            out.marked = _mark_failed(root / cell.run_id, exc)
    out.seconds = time.perf_counter() - t0
    return out


def run_grid(
    root: str | os.PathLike,
    grid: Grid,
    tasks: Sequence[Any],
    model: Any,
    tokenizer: Any,
    *,
    progress: bool = True,
    share_prompts: bool = True,
) -> GridReport:
    """Run every cell of ``grid`` not yet done under ``root`` (see the module docstring).

    A cell that raises is left ``failed`` with its error (shown by ``--status``)
    and the next cell runs; ``KeyboardInterrupt`` stops the sweep. ``share_prompts``: the
    cells of a batch start from one prompt forward (DESIGN.md §12.5); False
    forwards the prompts in every cell (the same runs, bit for bit, in more time).
    """
    from tqdm.auto import tqdm

    from h2o_lens.prompt_reuse import reuse_prompts

    root = Path(root)
    write_plan(root, grid)
    report = GridReport()
    t0 = time.perf_counter()
    # the configurations of a batch run one after another: one prompt forward per batch serves
    # them all, whatever their aggregation (DESIGN.md §12.5); run_cell drops it when the batch changes
    aggregations = len({c.gqa for c in grid.cells if c.budget is not None})
    scope = reuse_prompts(model, keep=max(1, aggregations), any_gqa=aggregations > 1)
    with scope if share_prompts else contextlib.nullcontext() as reuse:
        for cell in tqdm(grid.cells, desc="sweep", unit="cell", disable=not progress):
            report.add(run_cell(root, cell, grid, tasks, model, tokenizer, progress, reuse))
    report.seconds = time.perf_counter() - t0
    return report


def _mark_failed(run_dir: Path, exc: BaseException) -> bool:
    """Leave a cell that raised ``failed`` with its error, whatever stage it reached (redone next time).

    A run recorded but whose replay raised becomes ``failed`` (``replay: ...``); one left
    ``running`` (its manifest could not be closed, on a full disk say) gets its error; a cell
    that failed before its run folder was written (a request the tokenizer refuses) gets a
    folder with a ``failed`` manifest, so ``--status`` shows the error the sweep reported.
    Returns whether the folder now says ``failed``. A folder in the way that is not the cell's
    run (no manifest, and not empty) is left as it is: False.
    """
    from runlog import RunWriter
    from runlog.errors import RecorderError
    from runlog.manifest import MANIFEST_NAME, read_manifest, write_manifest
    from runlog.ownership import remove_run

    try:
        if not (run_dir / MANIFEST_NAME).exists():
            remove_run(run_dir)  # a folder a killed writer left empty; anything else raises
            writer = RunWriter(run_dir.parent, run_dir.name, fsync=False, name=run_dir.name)
            writer.start()
            writer.close("failed", exc)
            return True
        manifest = read_manifest(run_dir)
        status = manifest.get("status")
        if status == "failed":
            return True
        manifest["status"] = "failed"
        manifest["error"] = f"replay: {exc}" if status == "complete" else str(exc) or repr(exc)
        manifest["error_type"] = type(exc).__name__
        write_manifest(run_dir, manifest, in_place_if_full=True)
        return True
    except (OSError, RecorderError):  # a full disk may refuse even this: --status then says "to do"
        return False


def fail_cell(root: str | os.PathLike, cell: Cell, error: str, error_type: str = "WorkerLost") -> bool:
    """Leave a cell whose writer was lost ``failed`` with ``error`` (redone by the next sweep).

    Under the cell's lock: a run folder left ``running`` or ``interrupted`` gets a
    ``failed`` manifest; a complete or missing one is left as it is. Returns
    whether a manifest was rewritten (False also when another process holds the cell).
    """
    from runlog.manifest import MANIFEST_NAME, read_manifest, write_manifest

    run_dir = Path(root) / cell.run_id
    with _flock(Path(root) / LOCK_DIR / f"{cell.run_id}.lock", wait=False) as mine:
        if not mine or not (run_dir / MANIFEST_NAME).exists():
            return False
        try:
            manifest = read_manifest(run_dir)
        except Exception:  # a damaged manifest: the next sweep redoes the cell anyway
            return False
        if manifest.get("status") not in ("running", "interrupted"):
            return False
        manifest.update(status="failed", error=error, error_type=error_type)
        write_manifest(run_dir, manifest)
        return True


# -- status ------------------------------------------------------------------------------------


def grid_status(root: str | os.PathLike) -> str:
    """Done / failed (with the error) / to do per cell group of every grid of the root, and totals."""
    root = Path(root)
    if not (root / PLAN_NAME).exists():
        raise ConfigError(
            f"{root} has no {PLAN_NAME}: no sweep was started there; start one with h2o-lens sweep --out {root} ..."
        )
    plan = read_plan(root)
    grids = plan["grids"]
    lines = []
    seen: dict[str, str] = {}
    for gid, g in sorted(grids.items(), key=lambda kv: kv[1].get("created", "")):
        lines.append(
            f"grid {gid} ({g.get('created', '?')}): model {g['model']}, tasks {g['tasks']} "
            f"({len(g['requests'])} requests in {len(g['batches'])} batches), dtype {g['dtype']}, "
            f"{'replayed' if g['replay'] else 'not replayed'}"
        )
        groups: dict[tuple[str, str], dict[str, list[str]]] = {}
        for c in g["cells"]:
            cell = Cell(**{**c, "requests": tuple(c["requests"]), "plan": _tuples(c.get("plan"))})
            state, error = cell_state(root, cell.run_id, g["replay"])
            seen[cell.run_id] = state
            state = {"unreplayed": "todo", "interrupted": "todo"}.get(state, state)
            bucket = groups.setdefault((cell.label, cell.budget_text), {})
            bucket.setdefault(state, []).append(f"{cell.run_id}: {error}" if error else cell.run_id)
        header = f"  {'policy':<14} {'budget':<10} {'done':>5} {'failed':>7} {'running':>8} {'to do':>6}"
        lines.append(header)
        for (label, budget), bucket in groups.items():
            n = {s: len(bucket.get(s, ())) for s in ("done", "failed", "running", "todo")}
            lines.append(f"  {label:<14} {budget:<10} {n['done']:>5} {n['failed']:>7} {n['running']:>8} {n['todo']:>6}")
            for failed in bucket.get("failed", ()):
                lines.append(f"      failed {failed}")
    counts = {s: sum(1 for v in seen.values() if v == s) for s in ("done", "failed", "running")}
    todo = len(seen) - sum(counts.values())
    lines.append(
        f"total: {len(seen)} cells: {counts['done']} done, {counts['failed']} failed, "
        f"{counts['running']} running, {todo} to do"
    )
    if len(grids) > 1:
        lines.append(
            f"{len(grids)} grids on this root: cells are keyed, so another grid adds its cells "
            "(a cell two grids share, such as the full cache of a batch, is run and counted once)"
        )
    return "\n".join(lines)
