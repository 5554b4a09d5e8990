"""``h2o-lens app``: open the dashboard."""

from __future__ import annotations

import argparse
from typing import Any

from .options import port

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    ap = sub.add_parser("app", help="open the dashboard (Streamlit, bound to 127.0.0.1)")
    ap.add_argument("root", nargs="?", default=None, help="runs root (default: the shipped sample_runs/)")
    ap.add_argument("--port", type=port, default=8501)
    ap.add_argument("--open", action="store_true", help="open a browser tab")
    ap.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from app.launch import run_app

    return int(run_app(args.root, port=args.port, open_browser=args.open) or 0)
