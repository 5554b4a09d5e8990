"""``h2o-lens samples``: regenerate the shipped sample runs."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    sm = sub.add_parser("samples", help="regenerate the shipped sample runs (policy cases and a few tasks)")
    sm.add_argument("--out", default="sample_runs")
    sm.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .jobs import make_sample_runs

    make_sample_runs(args.out)
    return 0
