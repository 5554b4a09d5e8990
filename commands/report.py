"""``h2o-lens report``: a run's failure report (HTML, Markdown or JSON)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .paths import run_dir as _run_dir

__all__ = ["add_parser", "run"]

#: what the head of a report h2o-lens wrote holds (HTML title, Markdown heading, JSON key)
REPORT_MARKERS = (b"H2O Lens report", b'"report_schema_version"')


def add_parser(sub: Any) -> None:
    rep = sub.add_parser("report", help="export a run's failure report (HTML, Markdown or JSON)")
    rep.add_argument("run", help="run folder, or run id under --root")
    rep.add_argument("--root", default="runs")
    rep.add_argument("--format", choices=["html", "md", "json"], default="html")
    rep.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    rep.add_argument("--force", action="store_true", help="replace the -o file even though h2o-lens did not write it")
    rep.add_argument("--thresholds", default=None, help="JSON file of gate thresholds (see analyses.Thresholds)")
    rep.add_argument(
        "--gate",
        action="store_true",
        help="exit 1 when the verdict fails (every format; the verdict and the failed checks go to stderr too)",
    )
    rep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from analyses.report import render_report, report_data

    if args.output:  # a file the toolkit did not write is not replaced (DESIGN.md §5.1)
        from runlog.ownership import check_output_file

        check_output_file(args.output, markers=REPORT_MARKERS, force=args.force)
    run_dir = _run_dir(args.run, args.root)
    root, run_id = os.path.dirname(os.path.abspath(run_dir)), os.path.basename(os.path.normpath(run_dir))
    thresholds = None
    if args.thresholds:
        with open(args.thresholds, encoding="utf-8") as f:
            thresholds = json.load(f)
    data = report_data(root, run_id, thresholds=thresholds)
    text = render_report(data, args.format)
    if args.output:
        from pathlib import Path

        from .jobs import write_text_atomic

        write_text_atomic(Path(args.output), text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text)
    if args.gate:  # the same verdict in every format: the one the report shows
        verdict = data["verdict"]
        failed = [c for c in verdict["checks"] if c["pass"] is False]
        print(f"gate: {verdict['status']}", file=sys.stderr)
        for c in failed:
            print(f"  {c['name']}: {c['status']}: {c['reason']}", file=sys.stderr)
        return 0 if verdict["pass"] else 1
    return 0
