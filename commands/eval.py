"""``h2o-lens eval``: lm-evaluation-harness tasks per policy and keep ratio, every generated
request a recorded, replayed run with lm-eval's metric as its verdict (DESIGN.md §20.1).

A cell is one policy at one keep ratio (a keep ratio of 1 is the full cache, run once as
``full``). Its runs live under the runs root as ``<cell>/<task>-<doc>``; lm-eval's aggregate
for the cell is written to ``<root>/eval_<cell>.json`` once the cell is done. Running the same
command again skips the cells whose file is there (for the same tasks, limit and model) and
reuses every complete run of a cell cut short, as ``sweep`` does (DESIGN.md §12.3).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .options import DTYPES, load_model_args, number, split_list
from .paths import add_force_arg

__all__ = ["add_parser", "run", "evaluate", "format_table", "INSTALL_HINT"]

INSTALL_HINT = "lm-eval is not installed; pip install 'h2o-lens[eval]'"


def add_parser(sub: Any) -> None:
    ev = sub.add_parser(
        "eval", help="lm-evaluation-harness tasks per policy and keep ratio, every request recorded and explainable"
    )
    ev.add_argument("--tasks", required=True, help="lm-eval task names, comma separated (e.g. my_task,gsm8k)")
    ev.add_argument("--include-path", default=None, help="folder of local lm-eval YAML tasks")
    ev.add_argument(
        "--policies",
        action="extend",
        nargs="+",
        default=None,
        metavar="NAME",
        help="policies, comma list or repeated (default h2o): full, a registered policy (h2o, tova, ...) or "
        "kvpress:NAME (pip install 'h2o-lens[kvpress]')",
    )
    ev.add_argument(
        "--ratios", action="extend", nargs="+", default=None, help="keep ratios, comma list (default 1,0.2)"
    )
    ev.add_argument("--out", default="eval_runs", help="runs root (default ./eval_runs)")
    add_force_arg(ev, "into --out")
    ev.add_argument("--limit", type=int, default=None, help="the first N documents of each task")
    ev.add_argument("--no-replay", action="store_true", help="record only, no replay against the full cache")
    ev.add_argument(
        "--threshold", type=float, default=0.5, help="value from which a metric that is not 0/1 counts as correct"
    )
    ev.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    ev.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter dtype of the model")
    ev.set_defaults(func=run)


def _require_lm_eval() -> None:
    from h2o_lens.errors import ConfigError

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(INSTALL_HINT)


def _cells(policies: Sequence[tuple[str, str]], ratios: Sequence[float]) -> list[tuple[str, str, float]]:
    """``(label, policy, ratio)`` per cell: every keep ratio of 1 is the one ``full`` cell."""
    from h2o_lens import policies as registry
    from h2o_lens import presses

    from .grid import sweep_label

    cells: list[tuple[str, str, float]] = []
    for policy, gqa in policies:
        evicts = presses.is_press_policy(policy) or registry.get(policy).evicts
        for ratio in ratios:
            if not evicts or ratio >= 1.0:
                cell = ("full", registry.FULL_CACHE, 1.0)
            else:
                cell = (sweep_label(policy, gqa), policy, ratio)
            if cell not in cells:
                cells.append(cell)
    return cells


def _cell_id(label: str, ratio: float) -> str:
    return label if ratio >= 1.0 else f"{label}_r{ratio:g}".replace(":", "_")


def _check_out(out: str, cells: Sequence[str], force: bool) -> None:
    """Refuse, in one line, an ``--out`` (or a cell's folder in it) holding anything h2o-lens did not
    write, unless ``force`` (DESIGN.md §5.1): the root holds the cells' folders and result files."""
    from runlog.ownership import check_output_root

    from .paths import ROOT_OUTPUTS

    names = (*ROOT_OUTPUTS, *cells, *(f"eval_{c}.json" for c in cells))
    check_output_root(out, names=names, force=force)
    for cell in cells:
        check_output_root(Path(out) / cell, names=ROOT_OUTPUTS, force=force, option=f"--out cell {cell!r}:")


def _check_tasks(names: Sequence[str], include_path: str | None) -> Any:
    """lm-eval's task manager, every name of ``names`` known to it (else one line naming it)."""
    from h2o_lens.errors import ConfigError
    from recorders.harness import task_manager

    manager = task_manager(include_path)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"--tasks {', '.join(unknown)}: not an lm-eval task"
            + (f" (nor in --include-path {include_path})" if include_path else "")
            + "; see lm-eval --tasks list"
        )
    return manager


def evaluate(
    tasks: Sequence[str],
    *,
    out: str | os.PathLike,
    policies: Sequence[tuple[str, str]] = (("h2o", "sum"),),
    ratios: Sequence[float] = (1.0, 0.2),
    model: Any = None,
    tokenizer: Any = None,
    model_name: str | None = None,
    include_path: str | None = None,
    limit: int | None = None,
    replay: bool = True,
    record: bool = True,
    threshold: float = 0.5,
) -> dict[str, dict[str, Any]]:
    """Run lm-eval ``tasks`` with the model under each policy and keep ratio; returns, per cell,
    ``{"policy", "ratio", "results", "requests", "output_types"}`` (lm-eval's aggregate per task in
    ``results``, one row per generated request in ``requests``). Cells already done under ``out``
    are read back, not run again."""
    from lm_eval import evaluator

    from recorders.harness import LensLM, task_manager

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    spec = {"tasks": list(tasks), "limit": limit, "model": model_name, "include_path": include_path}
    spec |= {"replay": replay, "record": record, "threshold": threshold}
    done: dict[str, dict[str, Any]] = {}
    for label, policy, ratio in _cells(policies, ratios):
        cell = _cell_id(label, ratio)
        path = root / f"eval_{cell}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            if saved.get("spec") == spec:
                done[cell] = saved
                continue
        lm = LensLM(
            model=model,
            tokenizer=tokenizer,
            policy=policy,
            ratio=ratio,
            gqa=dict(policies).get(policy, "sum"),
            out=str(root / cell),
            record=record,
            replay=replay,
            include_path=include_path,
            threshold=threshold,
        )
        result = evaluator.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            limit=limit,
            task_manager=task_manager(include_path),
            log_samples=False,
            verbosity="ERROR",
        )
        saved = {
            "spec": spec,
            "policy": label,
            "ratio": ratio,
            "results": result["results"],
            "versions": {k: v for k, v in result.get("versions", {}).items()},
            "output_types": {k: v.get("output_type") for k, v in result.get("configs", {}).items()},
            "requests": lm.rows,
            "seconds": lm.seconds,
        }
        from .jobs import write_text_atomic

        write_text_atomic(path, json.dumps(saved, indent=1, default=str) + "\n")
        done[cell] = saved
    return done


def _value(v: Any) -> str:
    """A metric value as lm-eval's results table shows it: a float with 4 decimals, else as is."""
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def format_table(cells: dict[str, dict[str, Any]]) -> str:
    """One row per policy × ratio × task × metric: value and standard error, as lm-eval prints them."""
    rows = [["policy", "ratio", "task", "filter", "metric", "value", "stderr"]]
    for saved in cells.values():
        for task, metrics in saved["results"].items():
            for key, value in sorted(metrics.items()):
                metric, _, filt = key.partition(",")
                if not filt or metric.endswith("_stderr"):
                    continue
                err = metrics.get(f"{metric}_stderr,{filt}", "")
                err = "N/A" if err == "N/A" else _value(err)
                rows.append([saved["policy"], f"{saved['ratio']:g}", task, filt, metric, _value(value), err])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run(args: argparse.Namespace) -> int:
    from h2o_lens.errors import ConfigError

    from .sweep import sweep_grid

    _require_lm_eval()
    names = split_list([args.tasks])
    if not names:
        raise ConfigError("--tasks: give at least one lm-eval task name")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise ConfigError(f"--include-path {args.include_path!r} is not a folder of lm-eval YAML tasks")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {args.limit}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out!r} is an existing file; give a folder for the runs")
    ratios = [number(v, float, "--ratios") for v in split_list(args.ratios)] or [1.0, 0.2]
    bad = [r for r in ratios if not 0 < r <= 1]
    if bad:
        raise ConfigError(f"--ratios {bad[0]:g}: a keep ratio is in (0, 1]")
    grid = sweep_grid(args.policies or ["h2o"])  # ConfigError naming the known policies
    _check_out(args.out, [_cell_id(label, ratio) for label, _, ratio in _cells(grid, ratios)], args.force)
    _check_tasks(names, args.include_path)
    model, tok = load_model_args(args)
    cells = evaluate(
        names,
        out=args.out,
        policies=grid,
        ratios=ratios,
        model=model,
        tokenizer=tok,
        model_name=args.model,
        include_path=args.include_path,
        limit=args.limit,
        replay=not args.no_replay,
        threshold=args.threshold,
    )
    print(format_table(cells))
    _say_no_eviction(cells)
    runs = sum(1 for c in cells.values() for r in c["requests"] if r["run_id"])
    print(f"{runs} recorded requests under {args.out} (h2o-lens app {args.out}; h2o-lens explain RUN)")
    return 0


def _say_no_eviction(cells: dict[str, dict[str, Any]]) -> None:
    """Name the tasks whose requests are scored with one forward, where no policy evicts anything."""
    from recorders.harness import NO_EVICTION

    kinds: dict[str, str] = {}
    for saved in cells.values():
        kinds |= {k: v for k, v in saved.get("output_types", {}).items() if v}
    flat = sorted(t for t, kind in kinds.items() if kind in NO_EVICTION)
    if flat:
        print(
            f"no eviction effect possible in {', '.join(flat)}: {'its' if len(flat) == 1 else 'their'} "
            "requests are scored with one forward of the prompt and answer (no generation), so every "
            "policy scores them as the full cache does",
            file=sys.stderr,
        )
