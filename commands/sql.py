"""``h2o-lens sql``: a SELECT over the runs' DuckDB views."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .options import at_least, machine_count, positive_seconds

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    q = sub.add_parser("sql", help="run a SELECT over the runs' DuckDB views")
    q.add_argument("root")
    q.add_argument("sql")
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.add_argument("--max-rows", type=at_least(1), default=1000, help="rows returned at most (default 1000)")
    q.add_argument("--timeout", type=positive_seconds, default=10.0, help="seconds before the query is stopped")
    q.add_argument("--max-bytes", default="64MB", help="largest result, e.g. 64MB; a bigger one is refused")
    q.add_argument("--memory-limit", default="1GB", help="memory the query may use, e.g. 1GB")
    q.add_argument(
        "--threads", type=machine_count("threads"), default=2, help="DuckDB threads (at most this machine's cores)"
    )
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from analyses import format_result, run_sql

    df = run_sql(
        args.root,
        args.sql,
        max_rows=args.max_rows,
        timeout_s=args.timeout,
        max_bytes=args.max_bytes,
        memory_limit=args.memory_limit,
        threads=args.threads,
    )
    print(format_result(df, args.format))
    if df.attrs.get("truncated"):
        print(f"(cut at {args.max_rows} rows; raise --max-rows)", file=sys.stderr)
    return 0
