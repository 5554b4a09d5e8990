"""``h2o-lens bench NAME``: the benchmarks that print ratios measured side by side in one run.

One module per benchmark, each with ``NAME``, ``HELP``, ``add_arguments(parser)`` (its own
options, shown by ``h2o-lens bench NAME --help``) and ``run(args)``; heavy imports wait until it
runs. :data:`BENCHMARKS` lists them in the order ``h2o-lens bench --help`` shows; adding a
benchmark is one module here and its line in that list. What the benchmarks share (sizes checked
before a model loads, a fresh process, peak RSS) is :mod:`.common`; the layers' own benchmarks
are :mod:`h2o_lens.kernels.bench`, :mod:`analyses.bench` and :mod:`app.bench`.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

__all__ = ["BENCHMARKS", "add_parser", "run"]

#: the benchmarks' modules, in the order ``h2o-lens bench --help`` lists them
BENCHMARKS = ("decode", "record", "kernels", "sql", "runs", "explain", "sweep", "press", "guard", "culprits", "cold")


def add_parser(sub: Any) -> None:
    """``h2o-lens bench`` with one subcommand per benchmark."""
    b = sub.add_parser(
        "bench",
        help="benchmarks that print ratios measured side by side",
        description="Benchmarks that print ratios measured side by side in one run (docs/BENCHMARKS.md). "
        "h2o-lens bench NAME --help shows a benchmark's own options.",
    )
    which = b.add_subparsers(dest="what", required=True, metavar="NAME")
    for name in BENCHMARKS:
        module = importlib.import_module(f"{__name__}.{name}")
        p = which.add_parser(name, help=module.HELP, description=module.__doc__.split("\n\n")[0].replace("``", ""))
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.what`` (its module's ``run``)."""
    return int(importlib.import_module(f"{__name__}.{args.what}").run(args) or 0)
