"""The culprit search measured on the long families (DESIGN.md §19, docs/BENCHMARKS.md).

``h2o-lens bench culprits [--length 2048] [--count 4] [--tasks needle,delayed_reference,
restated_fact] [--keep 0.2] [--max-runs 40] [--batch 4] [--splits 1] [--out DIR]``: for each
request of each family at that prompt length (or every request of a built-in suite, ``--tasks
full``, at its own short prompts), the full cache is run (a request it fails is left
out) and H2O at ``keep`` (replayed); each H2O failure is explained (the variants without budget
searches) and, when its verdict is ``scoring``, its culprits are searched with the evidence labels
hidden from the search (the search never reads them: :func:`recorders.culprits.culprit_candidates`
ranks by the replay's teacher attention). The labels only score the result: the share of the
culprit tokens inside the family's evidence span. Printed per failure and in total: the set's size,
1-minimal or not, the re-runs (each row of a batched re-run counted) and the batched re-runs they
took, the seconds of explain (variants and search) against one generation of the request measured
on the same process next to it. ``--batch`` and ``--splits`` are the search's (``explain
--culprit-batch``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

__all__ = ["bench_culprits", "HELP", "add_arguments", "run"]

from .common import generation_seconds

FAMILIES = ("needle", "delayed_reference", "restated_fact")
#: the built-in short suites (fixed prompts of 155-252 tokens: ``--length`` does not apply)
SUITES = ("small", "demo", "full")


def _one(model: Any, tok: Any, task: Any, keep: float, root: str, limits: dict[str, Any]) -> dict | None:
    """One request: None when the full cache fails it or H2O passes it; else its row. ``limits``: the
    search's ``max_runs``, ``seconds``, ``batch`` and ``splits``."""
    from analyses import causal_verdicts, connect
    from h2o_lens.config import H2OConfig
    from recorders.counterfactual import explain_request, load_parent
    from recorders.culprits import explain_culprits

    from ..jobs import run_task

    full = run_task(model, tok, task, H2OConfig(policy="full"), root, replay=False, name=f"{task.name} full")
    if not full.correct:
        return {"task": task.name, "skipped": "the full cache fails"}
    run = run_task(model, tok, task, H2OConfig(ratio=keep), root, ratio=keep, replay=True)
    if run.correct:
        return None
    parent = load_parent(run.run_dir, 0)
    gen = generation_seconds(model, tok, parent)
    t0 = time.perf_counter()
    explain_request(model, tok, run.run_dir, 0, bisect=False, replay=False)
    t_explain = time.perf_counter() - t0
    (v,) = causal_verdicts(connect(root), run.run_id)
    row = {"task": task.name, "verdict": v.verdict, "estimate": v.estimate, "slots": parent.slots}
    row["prompt_len"] = parent.prompt_len
    row.update(generation_s=gen, explain_s=t_explain)
    if v.verdict != "scoring":
        return row
    t0 = time.perf_counter()
    got = explain_culprits(model, tok, run.run_dir, 0, **limits)
    row["culprits_s"] = time.perf_counter() - t0
    evidence = set(parent.evidence_positions)
    inside = sum(1 for p in got.culprits if p in evidence)
    row.update(
        found=got.found,
        minimal=got.minimal,
        size=len(got.culprits) if got.found else None,
        inside=inside if got.found else None,
        runs=got.runs,
        calls=got.calls,
        candidates=got.candidates,
        stopped=got.stopped,
        culprits=list(got.culprits) if got.found else [],
        evidence=len(evidence),
    )
    return row


def _summary(rows: list[dict]) -> list[str]:
    scoring = [r for r in rows if r.get("verdict") == "scoring"]
    small = [r for r in scoring if r.get("found") and r.get("minimal") and r["size"] <= 16]
    tokens = sum(r["size"] for r in small)
    inside = sum(r["inside"] for r in small)
    ratios = [(r["explain_s"] + r["culprits_s"]) / r["generation_s"] for r in scoring]
    named = [r for r in rows if r.get("estimate") not in (None, "unknown")]
    same = sum(1 for r in named if {"scoring_lag": "scoring"}.get(r["estimate"], r["estimate"]) == r["verdict"])
    out = [
        f"failures explained: {sum(1 for r in rows if 'verdict' in r)}; scoring: {len(scoring)}; "
        f"full cache fails: {sum(1 for r in rows if r.get('skipped'))}",
        f"fast estimate: names a cause for {len(named)}, agrees with explain on {same}; "
        f"'unknown (run explain)' for {sum(1 for r in rows if r.get('estimate') == 'unknown')}",
    ]
    if scoring:
        out += [
            f"1-minimal set of <= 16 tokens found: {len(small)} of {len(scoring)} ({len(small) / len(scoring):.0%})",
            f"culprit tokens inside the evidence span: {inside} of {tokens}"
            + (f" ({inside / tokens:.0%})" if tokens else ""),
            f"re-runs per search: mean {statistics.mean(r['runs'] for r in scoring):.1f}, "
            f"max {max(r['runs'] for r in scoring)}; batched re-runs (generate calls) per search: "
            f"mean {statistics.mean(r['calls'] or 0 for r in scoring):.1f}",
            f"explain with culprits / one generation: median {statistics.median(ratios):.1f}x, max {max(ratios):.1f}x",
        ]
    return out


def bench_culprits(
    model_name: str | None = None,
    families: tuple[str, ...] = FAMILIES,
    length: int = 2048,
    count: int = 4,
    keep: float = 0.2,
    max_runs: int = 40,
    seconds: float = 900.0,
    out: str | None = None,
    batch: int = 4,
    splits: int = 1,
) -> int:
    """Measure the culprit search on ``count`` requests of each long family at ``length`` prompt
    tokens under H2O at ``keep`` (module docstring), ``batch`` probes per re-run and ``splits``
    split points per bisection step. Prints one line per request and the totals;
    returns 0."""
    import torch

    from h2o_lens.models import load_model

    from .explain import _long_requests

    model, tok = load_model(model_name)
    root = out or tempfile.mkdtemp(prefix="h2o-lens-bench-culprits-")
    print(
        f"model {type(model).__name__}, {torch.get_num_threads()} threads; keep {keep:.0%}; "
        f"culprit batch {batch}, splits {splits}; runs under {root}"
    )
    limits = dict(max_runs=max_runs, seconds=seconds, batch=batch, splits=splits)
    rows: list[dict] = []
    for family in families:
        if family in SUITES:
            from h2o_lens.tasks.builtins import family as builtin

            reqs = builtin(family)(seed=0)
        else:
            reqs, _ = _long_requests(model, tok, family, length, count)
        for task in reqs:
            row = _one(model, tok, task, keep, root, limits)
            if row is None:
                print(f"  {task.name}: H2O answers right", flush=True)
                continue
            rows.append(row)
            print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
            sys.stdout.flush()
    for line in _summary(rows):
        print(line)
    return 0


HELP = "the culprit search on the long families: set size, share inside the evidence, re-runs, time"


def add_arguments(b: argparse.ArgumentParser) -> None:
    from ..options import at_least, share

    b.add_argument("--model", default=None, help="HF id or local path (default: the packaged default model)")
    b.add_argument(
        "--tasks",
        default=",".join(FAMILIES),
        help="long families, or a built-in suite (small, demo, full: all its requests), comma-separated",
    )
    b.add_argument("--length", type=at_least(1), default=2048, help="prompt tokens (default 2048)")
    b.add_argument("--count", type=at_least(1), default=4, help="requests per family (default 4)")
    b.add_argument("--keep", type=share, default=0.2, help="H2O's keep ratio (default 0.2)")
    b.add_argument(
        "--max-runs", type=at_least(1), default=40, help="re-runs per search, each batch row counted (default 40)"
    )
    b.add_argument(
        "--batch", type=at_least(1), default=4, help="probes re-run together as rows of one generate (default 4)"
    )
    b.add_argument(
        "--splits",
        type=at_least(1),
        default=1,
        help="split points each bisection step re-runs together, at most --batch (default 1: binary)",
    )
    b.add_argument("--seconds", type=float, default=900.0, help="time budget per search (default 900)")
    b.add_argument("--out", default=None, help="runs root (default: a temporary folder)")


def run(args: argparse.Namespace) -> int:
    from h2o_lens.errors import ConfigError
    from h2o_lens.tasks.longctx import LONG_FAMILIES as KNOWN

    families = tuple(f.strip() for f in args.tasks.split(",") if f.strip())
    unknown = [f for f in families if f not in KNOWN and f not in SUITES]
    if not families or unknown:
        raise ConfigError(
            f"bench culprits: --tasks {args.tasks!r}: expected long families of {', '.join(KNOWN)} "
            f"or a built-in suite ({', '.join(SUITES)})"
        )
    if args.out is not None:
        from ..paths import check_out_root

        check_out_root(args.out)
    return bench_culprits(
        args.model,
        families,
        args.length,
        args.count,
        args.keep,
        args.max_runs,
        args.seconds,
        args.out,
        batch=args.batch,
        splits=args.splits,
    )
