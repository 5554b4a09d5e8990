"""``h2o-lens runs``: list the runs of a runs root with headline numbers."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .options import at_least

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    ru = sub.add_parser("runs", help="list the runs of a runs root with headline numbers")
    ru.add_argument("root", nargs="?", default="runs")
    ru.add_argument("--format", choices=["table", "csv", "json"], default="table")
    ru.add_argument("--max-rows", type=at_least(1), default=1000, help="rows printed at most (default 1000)")
    ru.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from analyses import ParameterError, format_result, runs_headline

    if not os.path.isdir(args.root):
        raise ParameterError(f"runs root {args.root} does not exist or is not a folder")
    df = runs_headline(args.root).df()
    truncated = len(df) > args.max_rows
    df = df.head(args.max_rows)
    df.attrs["truncated"] = truncated
    print(format_result(df, args.format))
    return 0
