"""The main jobs: the demo (the task suite under H2O and its baselines) and the budget sweep.

Both record real runs on the default model, replay them against the full-cache
teacher and read the results back through :mod:`analyses`. They sit at the top
of the stack, so ``recorders`` and ``analyses`` are imported inside functions.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from h2o_lens import policies as registry
from h2o_lens import presses
from h2o_lens.config import H2OConfig
from h2o_lens.models import ContextWarning, context_message, context_window
from h2o_lens.presses import PressSpec

from .options import guard_scope, guard_summary

__all__ = [
    "Task",
    "run_task",
    "demo",
    "demo_verdicts",
    "explain_failures",
    "sweep",
    "DEMO_BUDGETS",
    "BASELINES",
    "SWEEP_RATIOS",
    "SWEEP_POLICIES",
]

DEMO_BUDGETS = (0.2, 0.1)
#: the method's baselines in the registry (its ablations at the same slot count), at the demo's first budget
BASELINES = registry.baselines()
SWEEP_RATIOS = (1.0, 0.4, 0.2, 0.1, 0.05)
#: the method with both GQA aggregations, then every baseline of the registry (alternatives such as
#: TOVA join with ``policies=``)
SWEEP_POLICIES = ((registry.DEFAULT, "sum"), (registry.DEFAULT, "max"), *((p, "sum") for p in BASELINES))


class Task(Protocol):
    """What the suite needs of a task instance."""

    name: str
    prompt: str
    evidence: dict[str, str]
    expected: str
    max_new_tokens: int

    def check(self, answer: str) -> bool: ...


@dataclass
class TaskRun:
    """One recorded (and replayed) task run."""

    task: str
    policy: str
    gqa: str | None  # None for a kvpress press
    ratio: float | None
    run_id: str
    run_dir: Path
    answer: str
    correct: bool
    seconds: float
    guard: str = ""  # a guarded run's one-line summary (its highest risk and actions)


def _config(policy: str, ratio: float | None, gqa: str = "sum") -> H2OConfig:
    if not registry.get(policy).evicts or ratio is None or ratio >= 1.0:
        return H2OConfig(policy=registry.FULL_CACHE, gqa=gqa)
    return H2OConfig(policy=policy, ratio=ratio, gqa=gqa)


def run_task(
    model: Any,
    tok: Any,
    task: Task,
    config: H2OConfig | PressSpec,
    out: str | os.PathLike,
    *,
    ratio: float | None = None,
    replay: bool = True,
    name: str | None = None,
    run_id: str | None = None,
    guard: Any = None,
) -> TaskRun:
    """Record ``task`` under ``config`` (an H2O policy or a kvpress press, DESIGN.md §17; and replay
    it); the requests table carries the checker's verdict. ``guard`` (a ``GuardConfig``) runs the
    request guarded, its risk and actions logged (DESIGN.md §18)."""
    from recorders.recorder import record
    from recorders.replay import replay as replay_run

    if hasattr(task, "chat_text"):  # a task-file request (prompt or messages)
        text = task.chat_text(tok)
    elif getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            [{"role": "user", "content": task.prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = task.prompt
    enc = tok(
        text,
        return_tensors="pt",
        add_special_tokens=not getattr(tok, "chat_template", None),
        return_token_type_ids=False,  # a model that takes none refuses them in generate
    )
    verdict: dict[str, Any] = {}

    def annotate(request: int, answer: str | None) -> dict[str, Any]:
        verdict["answer"] = answer or ""
        verdict["correct"] = bool(task.check(answer or ""))
        return {"task": task.name, "expected": task.expected, "correct": verdict["correct"]}

    t0 = time.perf_counter()
    info = {
        "task": task.name,
        "task_spec": _task_spec(task),  # the checker, rebuilt by counterfactual re-runs
        "decoding": {"do_sample": False, "max_new_tokens": task.max_new_tokens},
    }
    with (
        torch.no_grad(),
        guard_scope(guard, model, tok, enc["input_ids"]) as (processors, watch),
        record(
            model,
            config,
            out=str(out),
            tokenizer=tok,
            evidence=task.evidence,
            prompts=[task.prompt],
            name=name or task.name,
            info=info,
            annotate=annotate,
            run_id=run_id,
            keep_prompt_pass=replay and not isinstance(config, PressSpec),
        ) as run,
    ):
        model.generate(
            **enc,
            max_new_tokens=task.max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            logits_processor=processors,
        )
    if replay:
        replay_run(run.run_dir, model=model, progress=False, prompt_passes=run.prompt_passes)
    pressed = isinstance(config, PressSpec)
    return TaskRun(
        task.name,
        presses.policy_text(config.press, config.kwargs) if pressed else config.policy,
        None if pressed else config.gqa,
        ratio,
        run.run_id,
        Path(run.run_dir),
        verdict.get("answer", ""),
        verdict.get("correct", False),
        time.perf_counter() - t0,
        guard_summary(watch.last) if watch is not None and watch.last is not None else "",
    )


def _task_spec(task: Task) -> dict[str, Any] | None:
    """The task as a task-file line (prompt, answer spec, evidence), or None when it has no such form."""
    from h2o_lens.tasks.taskfile import from_builtin

    if hasattr(task, "to_json"):
        return task.to_json()
    if hasattr(task, "required"):
        return from_builtin(task).to_json()
    return None


def demo_verdicts(root: str | os.PathLike, runs: Iterable[TaskRun]) -> dict[str, tuple[str, str | None]]:
    """The demo table's verdict of each run, and where it comes from (DESIGN.md §6.10).

    An explained run (counterfactual re-runs under ``root``) shows the causal verdict
    with its sub-label, e.g. ``scoring (delayed_reference)``, source ``re-runs``. Any
    other failed run shows the threshold rules' fast estimate, labelled as one:
    ``budget (estimate)``, source ``estimate``. A right answer never shows a failure
    cause: ``ok``, or ``ok (drifts from teacher)`` when the teacher's measures (top-1
    agreement, KL) fail it all the same (source None in both).
    """
    from analyses import attribute, causal_verdicts, connect

    con = connect(str(root))
    out: dict[str, tuple[str, str | None]] = {}
    for r in runs:
        if not registry.get(r.policy).evicts:
            out[r.run_id] = ("ok (teacher)" if r.correct else "full cache fails", None)
            continue
        if r.correct:  # a right answer has no failure to explain, whatever the measures say
            out[r.run_id] = ("ok (drifts from teacher)" if attribute(con, r.run_id) else "ok", None)
            continue
        causal = causal_verdicts(con, r.run_id)
        if causal:
            v = causal[0]
            out[r.run_id] = (v.verdict + (f" ({v.sub_label})" if v.sub_label else ""), "re-runs")
            continue
        found = attribute(con, r.run_id)
        if not found:
            out[r.run_id] = ("ok", None)
        else:
            said = "unknown (run explain)" if found[0].verdict == "unknown" else f"{found[0].verdict} (estimate)"
            out[r.run_id] = (said, "estimate")
    return out


def explain_failures(
    runs: Sequence[TaskRun], kinds: dict[str, str], model: Any, tokenizer: Any, *, progress: bool = True
) -> list[TaskRun]:
    """Counterfactual re-runs (``h2o-lens explain`` without the budget searches) of one wrong
    H2O answer per task family: the one at the largest budget, the first task of the family
    first. ``kinds`` maps a task name to its family. A run whose explanation raises a
    one-line error keeps its estimate; the error is printed as a note. Returns the runs explained."""
    from h2o_lens.errors import H2OLensError

    from .explain import explain_run

    failed = [r for r in runs if r.policy == registry.DEFAULT and not r.correct]
    picked: dict[str, TaskRun] = {}
    for r in sorted(failed, key=lambda r: -(r.ratio if r.ratio is not None else 1.0)):
        picked.setdefault(kinds.get(r.task, r.task), r)
    done = []
    for r in sorted(picked.values(), key=runs.index):
        try:
            explain_run(str(r.run_dir), model=model, tokenizer=tokenizer, bisect=False, progress=progress)
        except H2OLensError as exc:
            print(f"h2o-lens: note: {r.run_id} not explained: {exc}", file=sys.stderr)
            continue
        done.append(r)
    return done


def _headline(root: str | os.PathLike) -> dict[str, dict[str, float]]:
    """Mean KL and mean dropped mass per run (:func:`analyses.runs_table`)."""
    from analyses import runs_table

    rows = runs_table(str(root)).select("run_id, kl_mean, dropped_mass_mean").fetchall()
    return {run_id: {"kl": kl, "dropped": dropped} for run_id, kl, dropped in rows}


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line, sep, *("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells)])


def demo(
    out: str | os.PathLike = "demo_runs",
    *,
    tasks: Sequence[Task] | None = None,
    model: Any = None,
    tokenizer: Any = None,
    budgets: Sequence[float] = DEMO_BUDGETS,
    baselines: Sequence[str] = BASELINES,
    reports: bool = True,
    explain: bool = True,
    progress: bool = True,
    force: bool = False,
) -> list[TaskRun]:
    """Run the task suite with H2O at ``budgets`` and the baselines at the first budget.

    Every run is replayed. With ``explain``, one wrong H2O answer per task family
    is explained by counterfactual re-runs (:func:`explain_failures`). Each H2O run
    gets an HTML, Markdown and JSON report in ``<out>/reports``. Prints the summary
    table (task × policy × budget: correct, KL, dropped mass, verdict: the causal one
    where re-runs exist, else the labelled estimate, :func:`demo_verdicts`) and the
    command that opens the dashboard. An ``out`` holding anything h2o-lens did not write is
    refused in one line, before the model loads, unless ``force`` (DESIGN.md §5.1).
    """
    from tqdm.auto import tqdm

    from h2o_lens.models import load_model
    from h2o_lens.tasks import suite

    from .paths import check_out_root

    check_out_root(out, force=force)
    if model is None:
        model, tokenizer = load_model(progress=progress)
    tasks = list(tasks) if tasks is not None else suite(size="demo")
    check_requests([t for t in tasks if hasattr(t, "to_json")], None, None, past_context=True)
    plan: list[tuple[Task, str, float | None]] = []
    for task in tasks:
        plan.append((task, registry.FULL_CACHE, None))
        plan += [(task, registry.DEFAULT, b) for b in budgets]
        plan += [(task, p, budgets[0]) for p in baselines]
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    runs = []
    t0 = time.perf_counter()
    for task, policy, ratio in tqdm(plan, desc="demo", unit="run", disable=not progress):
        runs.append(run_task(model, tokenizer, task, _config(policy, ratio), root, ratio=ratio))
    if explain:
        explain_failures(runs, {t.name: getattr(t, "kind", t.name) for t in tasks}, model, tokenizer, progress=progress)
    verdicts = demo_verdicts(root, runs)
    if reports:
        _demo_reports(root, runs)
    rows = _demo_table(root, runs, verdicts)
    print(f"{len(runs)} runs in {time.perf_counter() - t0:.0f} s under {root}/ (reports in {root}/reports/)")
    print(f"open the dashboard: h2o-lens app {root}")
    write_text_atomic(
        root / "demo_summary.json",
        json.dumps(
            [
                {
                    **dict(zip(["task", "policy", "budget", "correct", "kl", "dropped", "verdict", "run_id"], row)),
                    "verdict_source": verdicts[r.run_id][1],
                }
                for row, r in zip(rows, runs)
            ],
            indent=1,
        ),
    )
    sys.stdout.flush()
    return runs


def _demo_reports(root: Path, runs: Sequence[TaskRun]) -> None:
    """An HTML, Markdown and JSON report of each of the method's runs in ``<root>/reports``."""
    from analyses import write_report

    rep = root / "reports"
    rep.mkdir(exist_ok=True)
    for r in runs:
        if r.policy == registry.DEFAULT:  # the method's runs
            for fmt in ("html", "md", "json"):
                write_report(root, r.run_id, rep / f"{r.task}-{r.policy}-{int(r.ratio * 100)}.{fmt}")


def _demo_table(root: Path, runs: Sequence[TaskRun], verdicts: dict[str, tuple[str, str | None]]) -> list[list[Any]]:
    """Print the demo's table (task × policy × budget) and its accuracy line; return the rows."""
    head = _headline(root)
    rows = []
    for r in runs:
        h = head.get(r.run_id, {})
        rows.append(
            [
                r.task,
                r.policy,
                "100%" if r.ratio is None else f"{r.ratio:.0%}",
                "yes" if r.correct else "NO",
                f"{h.get('kl', 0):.3f}",
                f"{h.get('dropped', 0):.3f}",
                verdicts[r.run_id][0],
                r.run_id,
            ]
        )
    print(_table(rows, ["task", "policy", "budget", "correct", "KL", "dropped", "verdict", "run"]))
    if any(source == "estimate" for _, source in verdicts.values()):
        print(
            "verdict: decided by counterfactual re-runs where a run was explained; '(estimate)': the threshold "
            f"rules' fast estimate, nothing re-run (h2o-lens explain RUN --root {root} decides it)"
        )
    acc: dict[tuple[str, float | None], list[bool]] = {}
    for r in runs:
        acc.setdefault((r.policy, r.ratio), []).append(r.correct)
    print()
    print(
        "accuracy: "
        + ", ".join(f"{p}@{'100%' if q is None else f'{q:.0%}'} {sum(v)}/{len(v)}" for (p, q), v in acc.items())
    )
    return rows


def sweep(
    out: str | os.PathLike = "sweep_runs",
    *,
    tasks: Sequence[Any] | None = None,
    tasks_spec: str | None = None,
    model: Any = None,
    tokenizer: Any = None,
    ratios: Sequence[float] | None = SWEEP_RATIOS,
    slots: Sequence[int] | None = None,
    policies: Sequence[tuple[str, str]] = SWEEP_POLICIES,
    batch_size: int = 1,
    replay: bool = True,
    seed: int = 0,
    page_size: int = 16,
    command: Sequence[str] = (),
    progress: bool = True,
    executor: Any = None,
    past_context: bool = False,
    force: bool = False,
    plan: Any = None,
    cold: Any = None,
) -> Any:
    """Keep ratio (or slots) × policy over the requests → the three curves (quality, physical KV, latency).

    The sweep is a grid of keyed cells (:mod:`commands.grid`, DESIGN.md §12): each batch of
    ``batch_size`` requests is one run per (policy, budget, gqa, and the ``cold`` tier's twin,
    DESIGN.md §2.13), the full cache one run per batch; cells complete under ``out`` are skipped,
    failed or interrupted ones redone. Writes ``sweep.csv``, ``sweep.md`` and ``sweep.html``
    (the curves) into ``out`` and returns the per-configuration table (pandas).

    ``tasks``: :class:`~h2o_lens.tasks.taskfile.FileTask` (or suite tasks) in
    memory; default the ``builtin:small`` family. ``tasks_spec`` names them in
    the cell keys (default: ``builtin:small``, or ``inline`` for given tasks).

    Every request is checked first (:func:`check_requests`): a request with text the tokenizer
    cannot take, or whose ``max_new_tokens`` exceeds the model's context less its prompt, is
    refused in one line before any cell runs, unless ``past_context`` allows the latter (the
    sweep then says once how many requests go past the window).

    ``executor``: ``None`` runs the cells in this process; a started or new
    :class:`~commands.ray_sweep.RaySweep` runs them on its Ray workers, which
    hold the model (``model`` is then not needed, only the tokenizer; DESIGN.md §13).

    An ``out`` holding anything h2o-lens did not write is refused in one line, before the model
    loads, unless ``force``; a cell is redone only in its own run folder (DESIGN.md §5.1).
    """
    from h2o_lens.tasks.builtins import resolve_tasks
    from h2o_lens.tasks.taskfile import FileTask, from_builtin

    from .grid import plan_grid, prompt_lengths, run_grid
    from .paths import check_out_root

    check_out_root(out, force=force)
    model, tokenizer, (name, dtype, kv_per_token) = _sweep_model(model, tokenizer, executor, progress)
    if tasks is None:
        tasks_spec = tasks_spec or "builtin:small"
        tasks = resolve_tasks(tasks_spec, tokenizer=tokenizer)
    tasks = [t if isinstance(t, FileTask) else from_builtin(t) for t in tasks]
    check_requests(tasks, None, None, past_context=True)  # before the tokenizer sees them
    lengths = prompt_lengths(tasks, tokenizer)  # tokenized once: the batches and the context check
    if executor is None:
        check_requests(tasks, lengths, context_window(model), past_context=past_context)
    grid = plan_grid(
        tasks,
        tokenizer,
        model=name,
        tasks_spec=tasks_spec or "inline",
        policies=policies,
        ratios=None if slots is not None else ratios,
        slots=slots,
        batch_size=batch_size,
        dtype=dtype,
        seed=seed,
        replay=replay,
        command=command,
        lengths=lengths,
        plan=plan,
        cold=cold,
    )
    root = Path(out)
    if executor is not None:
        report = executor.run(root, grid, tasks, progress=progress)
        print(executor.summary(report))
    else:
        _warn_past_context(model, tasks, lengths)
        with warnings.catch_warnings():  # said once above, not once per cell
            warnings.simplefilter("ignore", ContextWarning)
            report = run_grid(root, grid, tasks, model, tokenizer, progress=progress)
    _say_cells(grid, report, batch_size)
    done = [c for c in grid.cells if c.key in set(report.ran) | set(report.done)]
    if not done:
        print(f"no complete cell under {root}/ yet; no curves written")
        _say_failed(root, report)
        return None
    table = sweep_table(root, done, model, page_size=page_size, replayed=replay, kv_bytes_per_token=kv_per_token)
    write_sweep_outputs(root, table, page_size)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"\n{len(done)} runs under {root}/; curves in {root}/sweep.html, table in {root}/sweep.csv")
    _say_failed(root, report)
    return table


def _sweep_model(model: Any, tokenizer: Any, executor: Any, progress: bool) -> tuple[Any, Any, tuple]:
    """The sweep's model and tokenizer (the default model when none is given), and the model's
    ``(name, dtype, kv_bytes_per_token)`` for the plan: a Ray executor's workers load the model,
    which then says them (``kv_bytes_per_token`` None: read from the model here)."""
    from h2o_lens.models import load_model, load_tokenizer, model_info

    if executor is not None:  # the workers load the model; the plan needs its name and dtype
        info = executor.info or executor.start()
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(executor.model)
        return model, tokenizer, (info["name"], info["dtype"], info["kv_bytes_per_token"])
    if model is None:
        model, tokenizer = load_model(progress=progress)
    return model, tokenizer, (str(model_info(model)["name"]), str(model.dtype).removeprefix("torch."), None)


def _say_cells(grid: Any, report: Any, batch_size: int) -> None:
    """The sweep's one line of cells run, done before, failed and taken."""
    print(
        f"{len(grid.cells)} cells ({len(grid.batches)} batches of up to {batch_size} requests): "
        f"{len(report.ran)} run, {len(report.done)} already done, {len(report.failed)} failed, "
        f"{len(report.busy)} taken by another sweep, in {report.seconds:.0f} s"
        + (f"; {report.prompts_reused} started from another cell's prompt forward" if report.prompts_reused else "")
    )


def _say_failed(root: Path, report: Any) -> None:
    """The failed cells, as ``--status`` counts them (each with its error there)."""
    if not report.failed:
        return
    print(f"{len(report.failed)} cells failed; see h2o-lens sweep --status {root}, rerun the command to redo them")
    if report.unmarked:
        print(
            f"{len(report.unmarked)} of them could not even be marked failed (the disk is full?): --status counts "
            "them as to do",
            file=sys.stderr,
        )


def check_requests(
    tasks: Sequence[Any], lengths: Sequence[int] | None, window: int | None, *, past_context: bool
) -> None:
    """Refuse, in one line, a request a sweep could not run or should not: one whose fields fail the
    task-file checks (a lone surrogate in its text, say: the tokenizer would fail on it mid-sweep)
    and, unless ``past_context``, one whose ``max_new_tokens`` exceeds the model's context window
    less its prompt (``lengths``: prompt tokens; ``window``: the context, None when unknown)."""
    from h2o_lens.errors import ConfigError
    from h2o_lens.tasks.taskfile import parse_task

    for i, task in enumerate(tasks, 1):
        parse_task(task.to_json(), line=i, source="the requests of the sweep", unit="request")
    if window is None or past_context or lengths is None:
        return
    for i, (task, n) in enumerate(zip(tasks, lengths), 1):
        room = window - n
        if task.max_new_tokens > room:
            raise ConfigError(
                f"request {i} ({task.name}): max_new_tokens {task.max_new_tokens:,} is more than the model's context "
                f"window of {window:,} positions less its prompt of {n:,} tokens ({max(room, 0):,}); lower "
                "max_new_tokens, or add --past-context to run past the window on purpose"
            )


def _warn_past_context(model: Any, tasks: Sequence[Any], lengths: Sequence[int]) -> None:
    """One line on stderr when requests (prompts of ``lengths`` tokens) reach past the model's
    context window."""
    window = context_window(model)
    if window is None:
        return
    ends = [n + t.max_new_tokens for n, t in zip(lengths, tasks)]
    past = [e for e in ends if e > window]
    if past:
        print(
            f"h2o-lens: warning: {len(past)} of {len(ends)} requests go past the context window; "
            f"{context_message(window, max(past), 'the longest')}",
            file=sys.stderr,
        )


def sweep_table(
    root: Path,
    cells: Sequence[Any],
    model: Any,
    *,
    page_size: int = 16,
    replayed: bool = True,
    kv_bytes_per_token: int | None = None,
) -> Any:
    """One row per (curve, budget): accuracy over the checked requests, mean KL, dropped mass,
    KV and page shares, bytes per token and median latency, from the cells' runs.

    ``kv_bytes_per_token``: a full cache's K and V bytes of one position, when
    ``model`` is not loaded here (a Ray sweep); else read from ``model``."""
    from analyses import connect, run_curve_points
    from analyses.tiers import cold_bytes_per_token
    from h2o_lens.runtime import full_kv_bytes

    con = connect(str(root))
    ids = [c.run_id for c in cells]
    points = run_curve_points(con, ids, page_size=page_size).df()
    verdicts = dict(
        (run_id, (right, checked))
        for run_id, right, checked in con.execute(
            "SELECT run_id, sum(correct::INT), count(correct) FROM requests WHERE list_contains($ids, run_id) "
            "GROUP BY run_id",
            {"ids": ids},
        ).fetchall()
    )
    slots = cells[0].budget_kind == "slots"
    x = "slots" if slots else "keep_ratio"
    points[x] = [c.budget if c.budget is not None else (None if slots else 1.0) for c in cells]
    points["policy"] = [c.label for c in cells]
    points["right"] = [verdicts.get(c.run_id, (0, 0))[0] or 0 for c in cells]
    points["checked"] = [verdicts.get(c.run_id, (0, 0))[1] or 0 for c in cells]
    points["requests"] = [len(c.requests) for c in cells]
    points["policy_name"] = [c.policy for c in cells]
    if slots:  # the full cache keeps every slot: drawn at the largest budget's right
        points[x] = points[x].fillna(max(c.budget for c in cells if c.budget is not None) * 2)
    cold = cold_bytes_per_token(con, ids)  # only where the sweep has cold cells (DESIGN.md §7.5)
    if cold:
        points["cold_bytes_per_token"] = [cold.get(c.run_id) for c in cells]
    if not replayed:
        points["kl_mean"] = float("nan")
        points["dropped_mass"] = float("nan")
    # K and V bytes of one position in a full cache, all layers
    per_token = kv_bytes_per_token if kv_bytes_per_token is not None else full_kv_bytes(model, 1)
    table = points.groupby(["policy", x], as_index=False).agg(
        right=("right", "sum"),
        checked=("checked", "sum"),
        kl_mean=("kl_mean", "mean"),
        dropped_mass=("dropped_mass", "mean"),
        kv_share=("kept_share", "mean"),
        page_share=("page_share", "mean"),
        ms_per_token=("seconds_per_token", lambda s: 1e3 * s.median()),
        runs=("run_id", "count"),
        requests=("requests", "sum"),
        **({"cold_bytes_per_token": ("cold_bytes_per_token", "mean")} if "cold_bytes_per_token" in points else {}),
    )
    table.insert(2, "accuracy", table["right"] / table["checked"].where(table["checked"] > 0))
    table = table.drop(columns=["right"])
    table["kv_bytes_per_token"] = table["kv_share"] * per_token
    table["paged_bytes_per_token"] = table["page_share"] * per_token
    table = table.sort_values(["policy", x], ascending=[True, False]).reset_index(drop=True)
    table.attrs["policy_of"] = dict(zip(points["policy"], points["policy_name"]))
    table.attrs["x"] = x
    return table


def write_text_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through ``<path>.tmp`` and a rename: a reader sees the old file or
    the new one. A write that fails (a full disk) removes the temporary file and raises
    :class:`~runlog.errors.StorageError` naming the file and the space it needed."""
    from runlog.errors import storage_error

    data = text.encode("utf-8")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise storage_error(path, exc, len(data)) from exc
    return path


def write_sweep_outputs(root: Path, table: Any, page_size: int) -> None:
    """``sweep.csv``, ``sweep.md`` and ``sweep.html`` of a sweep table (each rewritten atomically;
    a failed write leaves no temporary file and raises a one-line
    :class:`~runlog.errors.StorageError`)."""
    policy_of, x = table.attrs["policy_of"], table.attrs["x"]
    for name, text in (
        ("sweep.csv", table.to_csv(index=False)),
        ("sweep.md", _markdown_table(table)),
    ):
        write_text_atomic(root / name, text)
    from analyses import sweep_html

    write_text_atomic(root / "sweep.html", sweep_html(table, page_size, policy_of, x=x))


def _markdown_table(table: Any) -> str:
    """The sweep table as a Markdown pipe table, numbers to 4 significant digits (written here, not
    by an optional formatter, so the file reads the same on every install)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "" if v != v else f"{v:.4g}"
        return str(v)

    head = [str(c) for c in table.columns]
    rows = [[cell(v) for v in row] for row in table.itertuples(index=False)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


#: real tasks shipped in sample_runs/ (first instance of each kind)
SAMPLE_TASKS = ("delayed_recall_0", "multi_fact_0", "long_passage_0")
#: failed sample runs explained by counterfactual re-runs (budget searches included): the Why
#: section has its re-runs and the budget curves two requests
SAMPLE_EXPLAINED = ("delayed-recall-0-h2o-10", "multi-fact-0-h2o-20")
#: a guarded sample run (DESIGN.md §18): the task, H2O's keep ratio, the guard's raise target and rescue
SAMPLE_GUARDED = ("delayed_recall_0", 0.2, 0.35, 0.15)


def make_guarded_sample(root: str | os.PathLike, model: Any, tokenizer: Any) -> TaskRun:
    """The guarded sample run (:data:`SAMPLE_GUARDED`): H2O at its keep ratio under a guard that
    raises to the target, with the rescue, when the risk reaches the default threshold; replayed."""
    from h2o_lens.guard import GuardConfig
    from h2o_lens.tasks import get_task

    name, ratio, target, rescue = SAMPLE_GUARDED
    pct = round(ratio * 100)
    return run_task(
        model,
        tokenizer,
        get_task(name),
        _config("h2o", ratio),
        root,
        ratio=ratio,
        name=f"{name} h2o {pct}% guarded (raise to {round(target * 100)}%)",
        run_id=f"{name}-h2o-{pct}-guard".replace("_", "-"),
        guard=GuardConfig(action="raise", raise_ratio=target, rescue=rescue),
    )


def make_sample_runs(
    out: str | os.PathLike = "sample_runs",
    *,
    model: Any = None,
    tokenizer: Any = None,
    progress: bool = True,
    force: bool = False,
) -> list[str]:
    """Regenerate the shipped sample runs (≤ 20 MB): policy cases and a few real tasks.

    The run folders under ``out`` are replaced, nothing else; a folder holding anything
    h2o-lens did not write is refused in one line unless ``force`` (DESIGN.md §5.1).

    * every synthetic policy case under H2O, plus the baselines that show its
      signature (local on the far hotspot, gqa max/none on the GQA split);
    * the first task of three kinds on the default model: full cache, H2O at
      20 % and 10 %, local at 20 %, and teacher-forced gqa ``max`` and
      ``none`` re-records of the H2O 20 % run (the paired runs behind the
      GQA overlap and Compare views). Every run is replayed;
    * one guarded run (:func:`make_guarded_sample`), behind the Overview's Guard section;
    * the counterfactual re-runs of the failures in :data:`SAMPLE_EXPLAINED`
      (``h2o-lens explain``, budget searches at the default resolution), behind
      the Report page's Why section and budget curves.
    """
    from h2o_lens.models import load_model
    from h2o_lens.tasks import get_task, policy_cases
    from recorders.policy_cases import write_policy_case
    from recorders.recorder import record_teacher_forced
    from recorders.replay import replay as replay_run
    from runlog.ownership import replace_runs

    from .paths import check_out_root

    root = Path(out)
    check_out_root(root, force=force)
    replace_runs(root)  # the runs only: whatever else --force wrote beside stays
    root.mkdir(parents=True, exist_ok=True)
    made = []
    for case in policy_cases():
        made.append(write_policy_case(root, case).name)
        extra = {
            "far_hotspot": [("local", "sum")],
            "gqa_split": [("h2o", "max"), ("h2o", "none")],
            "delayed_reference": [("local", "sum")],
        }.get(case.name, [])
        for policy, gqa in extra:
            made.append(write_policy_case(root, case, policy=policy, gqa=gqa).name)
    if model is None:
        model, tokenizer = load_model(progress=progress)
    for name in SAMPLE_TASKS:
        task = get_task(name)
        runs = {}
        for policy, ratio in (("full", None), ("h2o", 0.2), ("h2o", 0.1), ("local", 0.2)):
            pct = "100" if ratio is None else f"{round(ratio * 100)}"
            runs[(policy, ratio)] = run_task(
                model,
                tokenizer,
                task,
                _config(policy, ratio),
                root,
                ratio=ratio,
                name=f"{name} {policy} {pct}%",
                run_id=f"{name}-{policy}-{pct}".replace("_", "-"),
            )
            made.append(runs[(policy, ratio)].run_id)
        base = runs[("h2o", 0.2)]
        resolved = json.loads((base.run_dir / "manifest.json").read_text())["config"]
        for gqa in ("max", "none"):
            cfg = H2OConfig(heavy=resolved["heavy"], recent=resolved["recent"], gqa=gqa)
            rec = record_teacher_forced(
                model,
                base.run_dir,
                cfg,
                out=root,
                tokenizer=tokenizer,
                name=f"{name} h2o 20% gqa={gqa} (same tokens)",
                run_id=f"{name}-h2o-20-{gqa}-paired".replace("_", "-"),
            )
            replay_run(rec.run_dir, model=model, progress=False)
            made.append(rec.run_id)
    made.append(make_guarded_sample(root, model, tokenizer).run_id)
    from analyses import counterfactual_runs

    from .explain import explain_run

    for run_id in SAMPLE_EXPLAINED:
        explain_run(str(root / run_id), model=model, tokenizer=tokenizer, progress=progress)
        made += sorted(set(counterfactual_runs(str(root), run_id).df()["run_id"]))
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    print(f"{len(made)} sample runs in {root}/ ({size / 2**20:.1f} MiB)")
    return made
