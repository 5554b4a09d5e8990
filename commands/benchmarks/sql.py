"""``h2o-lens bench sql``: the analyses' stress queries under a memory limit (:mod:`analyses.bench`)."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]

NAME = "sql"
HELP = "the analyses' stress queries under the console's memory limit"


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--memory-limit", default="512MB", help="the console's memory limit (default 512MB)")


def run(args: argparse.Namespace) -> int:
    from analyses.bench import bench_sql

    bench_sql(memory_limit=args.memory_limit)
    return 0
