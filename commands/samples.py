"""``h2o-lens samples``: regenerate the shipped sample runs."""

from __future__ import annotations

import argparse
from typing import Any

from .paths import add_force_arg

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    sm = sub.add_parser("samples", help="regenerate the shipped sample runs (policy cases and a few tasks)")
    sm.add_argument("--out", default="sample_runs", help="runs root; its run folders are replaced, nothing else")
    add_force_arg(sm, "into --out")
    sm.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .jobs import make_sample_runs
    from .paths import check_out_root

    check_out_root(args.out, force=args.force)  # before the model loads
    make_sample_runs(args.out, force=args.force)
    return 0
