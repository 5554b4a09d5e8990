"""``h2o-lens check``: the state lifecycle check of a run (DESIGN.md §15.1)."""

from __future__ import annotations

import argparse
from typing import Any

from .options import add_model_args, given_model, nonnegative
from .paths import run_dir as _run_dir

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    ck = sub.add_parser(
        "check", help="state lifecycle: the run's logged kept sets against its tokens run alone (DESIGN.md §15.1)"
    )
    ck.add_argument("run", help="run folder, or run id under --root")
    ck.add_argument("--root", default="runs")
    ck.add_argument(
        "--tolerance",
        type=nonnegative,
        default=None,
        help="relative near-tie bound on a victim's margin (default: derived from the dtype; 0: exact)",
    )
    ck.add_argument("-v", "--verbose", action="store_true", help="one line per request, not only the failing ones")
    add_model_args(ck)
    ck.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recorders.lifecycle import check_lifecycle

    run_dir = _run_dir(args.run, args.root)
    result = check_lifecycle(
        run_dir,
        given_model(args, run_dir),
        tolerance=args.tolerance,
        progress=True,
        allow_other_model=args.allow_other_model,
    )
    verdict = "ok" if result.ok else f"LIFECYCLE ERROR in {len(result.failed)} request(s)"
    print(f"state lifecycle {result.run_id}: {len(result.requests)} request(s) in {result.seconds:.1f} s ({verdict})")
    for r in result.requests:
        if not r.ok or args.verbose:
            print("  " + r.describe())
    return 0 if result.ok else 3
