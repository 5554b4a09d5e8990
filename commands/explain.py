"""``h2o-lens explain``: counterfactual re-runs of a run's failed requests, and their verdicts.

The re-runs are :func:`recorders.counterfactual.explain_request` (model
needed); the verdicts :func:`analyses.causal_verdicts` (logs only). With
``--cached`` nothing is re-run: the verdicts of earlier re-runs are shown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .options import add_model_args, at_least, fraction
from .paths import run_dir

__all__ = ["explain_run", "explainable_runs", "add_parser", "run", "format_verdicts"]


def _failed(root: str, run_id: str) -> list[int]:
    from analyses import failed_requests

    table = failed_requests(root, run_id)
    if not len(table):
        return []
    return [int(r) for r, why in zip(table["request"], table["failed_by"]) if len(why)]


def explain_run(
    run_dir: str,
    *,
    requests: list[int] | None = None,
    model: Any = None,
    tokenizer: Any = None,
    bisect: bool = True,
    replay: bool = True,
    rerun: bool = True,
    resolution: float = 0.05,
    progress: bool = True,
    force: bool = False,
    model_name: str | None = None,
    allow_other_model: bool = False,
    culprits: str = "off",
    max_runs: int = 40,
    culprit_seconds: float = 900.0,
    culprit_batch: int = 4,
    recall: bool | None = None,
    plan: Any = None,
) -> list[Any]:
    """Explain the failed requests of a run (or ``requests``): re-run, then decide.

    A parent that is not ``complete`` with a complete replay is refused in one line
    (:func:`recorders.counterfactual.check_parent`) unless ``force``. The model is ``model``,
    else loaded from ``model_name``, else from where the parent's manifest says it was; one
    whose fingerprint differs from the parent's is refused unless ``allow_other_model``.
    ``culprits`` (``off``, ``auto``: requests without evidence spans, ``on``) adds the culprit
    search of DESIGN.md §19 (:mod:`commands.explain_culprits`), at most ``max_runs`` re-runs and
    ``culprit_seconds`` per request, ``culprit_batch`` probes per batched re-run. ``recall`` runs the
    recall variant (DESIGN.md §6.11; None: with the searches, ``bisect``). ``plan`` (a budget plan
    or its file) runs the plan variant (DESIGN.md §6.12): refused in one line, before anything
    runs, when it cannot be read or does not fit the model.

    Returns the :class:`analyses.CausalVerdict` of each explained request.
    """
    from tqdm.auto import tqdm

    from analyses import causal_verdicts, connect
    from recorders.counterfactual import check_parent
    from runlog import model_source, read_manifest

    run_dir = os.path.abspath(run_dir)
    root, run_id = os.path.dirname(run_dir), os.path.basename(os.path.normpath(run_dir))
    if not force:
        check_parent(run_dir)
    plan = _checked_plan(plan, run_dir, model_name, model)
    if rerun:
        from .explain_culprits import check_request

        check_request(run_dir, culprits)  # culprit search: refused before any model loads
    todo = list(requests) if requests is not None else _failed(root, run_id)
    if rerun and todo:
        from recorders.counterfactual import explain_request

        if model is None:
            from h2o_lens.models import load_model

            model, tokenizer = load_model(model_name or model_source(read_manifest(run_dir)), progress=progress)
        bar = tqdm(desc="explain", unit=" re-runs", disable=not progress)
        try:
            for r in todo:

                def say(label: str, r: int = r) -> None:
                    bar.set_description_str(f"request {r}, {label}")
                    bar.update(1)

                explain_request(
                    model,
                    tokenizer,
                    run_dir,
                    r,
                    bisect=bisect,
                    replay=replay,
                    resolution=resolution,
                    progress=say,
                    allow_other_model=allow_other_model,
                    recall=recall,
                    plan=plan,
                )
            from .explain_culprits import search_failures

            search_failures(
                model,
                tokenizer,
                run_dir,
                todo,
                mode=culprits,
                max_runs=max_runs,
                seconds=culprit_seconds,
                batch=culprit_batch,
                say=lambda r, label: (bar.set_description_str(f"request {r}, {label}"), bar.update(1)),
                allow_other_model=allow_other_model,
            )
        finally:
            bar.close()
    found = causal_verdicts(connect(root), run_id)
    return [v for v in found if requests is None or v.request in requests]


def _checked_plan(plan: Any, run_dir: str, model_name: str | None, model: Any) -> Any:
    """``plan`` (a plan, its dict or file, or None) as a plan when it has the layers and KV sets of
    the run's model (read from its config, no weights loaded), else a ConfigError naming ``--plan``."""
    from h2o_lens.errors import ConfigError
    from h2o_lens.plan import coerce
    from h2o_lens.shape import model_shape
    from runlog import model_source, read_manifest

    from .limits import model_config

    plan = coerce(plan)
    if plan is None:
        return None
    manifest = read_manifest(run_dir)
    gqa = (manifest.get("config") or {}).get("gqa") or "sum"
    config = model.config if model is not None else model_config(model_name or model_source(manifest))
    if config is not None:
        shape = model_shape(config)
        try:
            plan.check(shape.layers, shape.sets(gqa))
        except ConfigError as exc:
            raise ConfigError(f"--plan: {exc}") from None
    return plan


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def format_verdicts(verdicts: list[Any], fmt: str = "table") -> str:
    """The verdicts as JSON (one object per request) or as text tables."""
    from .explain_culprits import culprit_lines

    if fmt == "json":
        return json.dumps([_json(v) for v in verdicts], indent=1)
    if not verdicts:
        return "no explained request (no failed request, or run `h2o-lens explain` without --cached)"
    blocks = []
    for v in verdicts:
        head = f"request {v.request}: {v.verdict}" + (f" ({v.sub_label})" if v.sub_label else "")
        lines = [head, f"  why: {v.reason}"]
        if v.estimate is not None and not v.agrees:
            lines.append(f"  fast estimate (thresholds, no re-run) says: {v.estimate}")
        status = {r["variant"]: r.get("status") for r in v.table}
        for kind, err in v.could_not_run.items():
            lines.append(f"  {'not judged' if status.get(kind) == 'not_judged' else 'could not run'}: {kind}: {err}")
        lines += _budget_lines(v)
        if getattr(v, "recall", None):
            lines.append(f"  recall: {v.recall['text']}")
        if getattr(v, "plan", None):
            lines.append(f"  plan: {v.plan['text']}")
        rows = [
            [
                r["variant"],
                _slots_cell(r),
                (r["answer"] or "").replace("\n", " ")[:40],
                {True: "yes", False: "NO", None: "-"}[r["right"]],
                _agreement(r.get("teacher_agreement")),
                "-" if r["kl_mean"] is None else f"{r['kl_mean']:.3f}",
                r["run_id"] or "-",
            ]
            for r in v.table
        ]
        lines.append(_grid(rows, ["variant", "slots", "answer", "right", "agrees with the teacher", "KL", "run"]))
        if any(r.get("teacher_agreement") for r in v.table):
            lines.append(
                "  (the oracle's answer is its own; fed the teacher's tokens instead, its top-1 is the "
                "teacher's at k of n steps)"
            )
        lines.append(f"  decided by: {', '.join(v.decided_by) or '-'}")
        lines += culprit_lines(v)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _budget_lines(v: Any) -> list[str]:
    """The minimal passing budgets; a search that was not monotone shows every count it tried."""
    from analyses.causal import describe_search

    def one(name: str) -> str:
        if v.monotone.get(name) is False:
            return f"{name} not monotone (below)"
        slots = v.min_slots.get(name)
        return f"{name} {slots if slots is not None else '-'} slots ({_pct(v.keep_ratio.get(name))})"

    lines = [f"  minimal passing budget: {one('policy')}, {one('oracle')}; run at {v.slots} slots of {v.prompt_len}"]
    probes = getattr(v, "budget_probes", {}) or {}
    for name, mono in v.monotone.items():
        if mono is False and probes.get(name):
            lines.append(f"  {name}: {describe_search(probes[name])}")
        elif mono is False:
            lines.append(f"  {name}: the pass test is not monotone in the budget; no minimal budget stated")
    return lines


def _slots_cell(row: dict[str, Any]) -> str:
    """A variant's slot count, with the recall window inside it (``8 (window 5)``)."""
    if row["slots"] is None:
        return "-"
    window = row.get("window")
    return f"{row['slots']} (window {window})" if window is not None else str(row["slots"])


def _agreement(kn: Any) -> str:
    """``[k, n]`` as "k/n steps" (``-`` for a variant that is not the oracle)."""
    if not kn:
        return "-"
    k, n = kn
    return f"{k}/{n} steps"


def _grid(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def _json(v: Any) -> dict[str, Any]:
    from .explain_culprits import culprit_json

    return {
        "run_id": v.run_id,
        "request": v.request,
        "verdict": v.verdict,
        "sub_label": v.sub_label,
        "reason": v.reason,
        "passes": v.passes,
        "could_not_run": v.could_not_run,
        "slots": v.slots,
        "prompt_len": v.prompt_len,
        "min_slots": v.min_slots,
        "keep_ratio": v.keep_ratio,
        "monotone": v.monotone,
        "budget_probes": v.budget_probes,
        "counterfactual_runs": v.runs,
        "decided_by": list(v.decided_by),
        "estimate": v.estimate,
        "estimate_agrees": v.agrees,
        "table": [dict(r) for r in v.table],
        "recall": getattr(v, "recall", None),
        "plan": getattr(v, "plan", None),
        **culprit_json(v),
    }


def explainable_runs(root: str) -> list[str]:
    """Complete runs of an evicting policy or a kvpress press under ``root`` that are not themselves
    re-runs."""
    from analyses import connect
    from h2o_lens import policies, presses

    rows = connect(root).sql("SELECT run_id, policy FROM runs WHERE parent_run IS NULL AND status = 'complete'")
    return sorted(
        r
        for r, p in rows.fetchall()
        if (p in policies.names() and policies.get(p).evicts and not policies.get(p).teacher)
        or presses.is_press_policy(p)
    )


def run(args: argparse.Namespace) -> int:
    from .explain_culprits import culprit_mode

    if (args.run is None) == (not args.all):
        raise SystemExit("h2o-lens explain: give a RUN, or --all to explain every failed run under --root")
    options = dict(
        bisect=not args.no_bisect,
        replay=not args.no_replay,
        rerun=not args.cached,
        resolution=args.resolution,
        progress=not args.quiet,
        force=args.force,
        model_name=args.model,
        allow_other_model=args.allow_other_model,
        culprits=culprit_mode(args),
        max_runs=args.max_runs,
        culprit_seconds=args.culprit_seconds,
        culprit_batch=args.culprit_batch,
        recall=args.recall,
        plan=args.plan,
    )
    if not args.all:
        verdicts = explain_run(run_dir(args.run, args.root), requests=args.request, **options)
        print(format_verdicts(verdicts, args.format))
        sys.stdout.flush()
        return 0
    from analyses import budget_distribution, connect
    from runlog import read_manifest, replay_complete

    verdicts = []
    for run_id in explainable_runs(args.root):
        path = os.path.join(args.root, run_id)
        if not args.force and not replay_complete(path):
            print(
                f"h2o-lens: note: {run_id} skipped: it has no complete replay (h2o-lens replay {path})",
                file=sys.stderr,
            )
            continue
        if not args.force and isinstance(read_manifest(path).get("guard"), dict):
            print(
                f"h2o-lens: note: {run_id} skipped: it was recorded under the guard, and explain's re-runs "
                "have none (--force explains it as unguarded H2O)",
                file=sys.stderr,
            )
            continue
        verdicts += explain_run(path, requests=args.request, **options)
    dist = budget_distribution(connect(args.root))
    if args.format == "json":
        print(json.dumps({"requests": [_json(v) for v in verdicts], "budget_distribution": dist.to_dict("records")}))
    else:
        print(format_verdicts(verdicts, args.format))
        if len(dist):
            wide = dist.pivot(index="keep_ratio", columns="curve", values="share")
            print("\nshare of explained requests passing at each keep ratio:")
            print(wide.to_string(float_format=lambda v: f"{v:.2f}"))
    sys.stdout.flush()
    return 0


def add_parser(sub: Any) -> None:
    """The ``explain`` subcommand."""
    ex = sub.add_parser("explain", help="re-run a run's failed requests with one thing changed: why did they fail?")
    ex.add_argument("run", nargs="?", default=None, help="run folder, or run id under --root")
    ex.add_argument("--all", action="store_true", help="explain every failed run under --root (e.g. a sweep)")
    ex.add_argument("--root", default="runs")
    ex.add_argument(
        "--request", type=at_least(0), nargs="+", default=None, help="requests to explain (default: the failed)"
    )
    ex.add_argument("--format", choices=["table", "json"], default="table")
    ex.add_argument("--no-bisect", action="store_true", help="skip the minimal-budget searches")
    ex.add_argument("--no-replay", action="store_true", help="skip the teacher replay of the re-runs (no KL)")
    ex.add_argument("--cached", action="store_true", help="re-run nothing: show the verdicts of earlier re-runs")
    ex.add_argument(
        "--recall",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the recall variant: the run's policy and slots with a recall window inside them (a cold tier, "
        "cpu store, exact selection), the smallest window that fixes the answer bisected (default: with the "
        "budget searches, for a policy a cold tier takes; --no-recall skips it)",
    )
    ex.add_argument(
        "--resolution",
        type=fraction,
        default=0.05,
        help="budget searches stop within this share of the prompt, the recall window's within this share of "
        "the run's slots (default 0.05; 0: to the slot)",
    )
    ex.add_argument("--quiet", action="store_true", help="no progress bar")
    ex.add_argument(
        "--force",
        action="store_true",
        help="explain a run that is not complete with a replayed log (failed, interrupted, not replayed)",
    )
    ex.add_argument(
        "--plan",
        metavar="FILE",
        default=None,
        help="a budget plan (h2o-lens plan -o FILE): also re-run each request with the run's total slots shared "
        "out by the plan (the plan variant): would per-layer or per-head budgets have fixed it?",
    )
    from .explain_culprits import add_culprit_args

    add_culprit_args(ex)
    add_model_args(ex)
    ex.set_defaults(func=run)
