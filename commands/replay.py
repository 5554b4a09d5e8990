"""``h2o-lens replay``: replay a run against a full-cache teacher."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .options import add_model_args, given_model, nonnegative, print_replay
from .paths import run_dir as _run_dir

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    rp = sub.add_parser("replay", help="replay a run against a full-cache teacher")
    rp.add_argument("run", help="run folder, or run id under --root")
    rp.add_argument("--root", default="runs")
    rp.add_argument(
        "--tolerance",
        type=nonnegative,
        default=None,
        help="largest accepted |logit diff| of the check (default: derived from the dtype)",
    )
    rp.add_argument(
        "--backend",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="dropped mass and oracle: Triton kernels (auto: on CUDA) or chunked torch",
    )
    add_model_args(rp)
    rp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recorders.replay import replay

    run_dir = _run_dir(args.run, args.root)
    summary = replay(
        run_dir,
        model=given_model(args, run_dir),
        tolerance=args.tolerance,
        backend=args.backend,
        allow_other_model=args.allow_other_model,
    )
    print_replay(summary)
    if summary.implementation_ok:
        return 0
    kept = "the earlier replay, which passed, was kept" if summary.kept_earlier else "its tables say so"
    print(
        f"h2o-lens: error: the replay of {summary.run_id} does not reproduce the run (max |logit diff| "
        f"{summary.max_logit_diff:.2e} > {summary.tolerance:.2e}): the model, the code or the log differ; {kept}",
        file=sys.stderr,
    )
    return 3
