"""The culprit search inside ``h2o-lens explain`` (DESIGN.md §19): its options, its pass over a
run's explained requests, and its lines in explain's table and JSON."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["add_culprit_args", "culprit_mode", "search_failures", "culprit_lines", "culprit_json"]

#: ``explain``'s culprit modes: ``auto`` searches the failed requests that label no evidence span
MODES = ("off", "auto", "on")


def add_culprit_args(parser: argparse.ArgumentParser) -> None:
    """``--culprits``, ``--no-culprits``, ``--max-runs``, ``--culprit-seconds`` and ``--culprit-batch``."""
    from recorders.culprits import BATCH, MAX_RUNS, SECONDS

    from .options import at_least

    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--culprits",
        action="store_true",
        help="search the evicted tokens that, restored, bring each failed answer back (default: only for "
        "requests without evidence spans)",
    )
    group.add_argument("--no-culprits", action="store_true", help="no culprit search")
    parser.add_argument(
        "--max-runs",
        type=at_least(1),
        default=MAX_RUNS,
        help=f"re-runs of one culprit search at most, each row of a batched re-run counted (default {MAX_RUNS})",
    )
    parser.add_argument(
        "--culprit-seconds",
        type=float,
        default=SECONDS,
        help=f"time budget of one culprit search, seconds (default {SECONDS:g})",
    )
    parser.add_argument(
        "--culprit-batch",
        type=at_least(1),
        default=BATCH,
        help=f"culprit probes re-run together, one row each, in one generate (default {BATCH}; 1: one at a time)",
    )


def culprit_mode(args: argparse.Namespace) -> str:
    """The culprit mode of parsed ``explain`` options; bad limits are a one-line error."""
    if not args.culprit_seconds > 0:
        raise SystemExit(f"h2o-lens explain: --culprit-seconds must be above 0, got {args.culprit_seconds}")
    return "on" if args.culprits else "off" if args.no_culprits else "auto"


def check_request(run_dir: str, mode: str) -> None:
    """With ``mode`` ``on``, refuse (one line, before any model loads) a run the search cannot take."""
    if mode == "on":
        from recorders.culprits import check_culprit_parent

        check_culprit_parent(run_dir)


def search_failures(
    model: Any,
    tokenizer: Any,
    run_dir: str,
    requests: list[int],
    *,
    mode: str,
    max_runs: int,
    seconds: float,
    batch: int = 4,
    say: Any = None,
    allow_other_model: bool = False,
) -> int:
    """The culprit search of each explained request of ``requests`` whose verdict is not
    ``not_the_cache`` (nor an implementation error); with ``mode`` ``auto`` only those that label no
    evidence; ``batch`` probes per re-run. A request the search refuses gets a one-line note.
    Returns the searches run."""
    from analyses import causal_verdicts, connect
    from recorders.counterfactual import load_parent
    from recorders.culprits import explain_culprits
    from runlog import RecorderError, replay_complete

    if mode == "off" or not requests:
        return 0
    root, run_id = os.path.dirname(run_dir), os.path.basename(os.path.normpath(run_dir))
    verdicts = {v.request: v for v in causal_verdicts(connect(root), run_id)}
    done = 0
    for r in requests:
        v = verdicts.get(r)
        if v is None or v.verdict in ("not_the_cache", "implementation_error"):
            continue
        if mode == "auto" and (load_parent(run_dir, r).evidence_positions or not replay_complete(run_dir)):
            continue
        try:
            explain_culprits(
                model,
                tokenizer,
                run_dir,
                r,
                max_runs=max_runs,
                seconds=seconds,
                batch=batch,
                progress=(lambda label, r=r: say(r, label)) if say else None,
                allow_other_model=allow_other_model,
            )
            done += 1
        except RecorderError as exc:
            print(f"h2o-lens: note: request {r}: no culprit search: {exc}", file=sys.stderr)
    return done


def culprit_lines(v: Any) -> list[str]:
    """Explain's table lines of a verdict's culprit search (none when it has none)."""
    from analyses.culprits import culprit_summary, why_left

    search = getattr(v, "culprits", None)
    line = culprit_summary(search)
    if line is None:
        return []
    out = [f"  culprits: {line}"]
    for c in search.get("culprits") or []:
        out.append(f"    position {c['position']} {c.get('text')!r}: {why_left(c)}")
    return out


def culprit_json(v: Any) -> dict[str, Any]:
    """``culprits`` (each with ``position`` and ``text``, and when and why it left) and
    ``culprit_search`` of a verdict, for ``explain --format json``."""
    search = getattr(v, "culprits", None)
    if not search:
        return {"culprits": [], "culprit_search": None}
    keys = ("run_id", "status", "found", "minimal", "stopped", "runs", "calls", "candidates", "tried")
    meta = {k: search.get(k) for k in keys}
    return {"culprits": [dict(c) for c in search.get("culprits") or []], "culprit_search": meta}
