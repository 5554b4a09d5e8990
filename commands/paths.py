"""Where a command finds a run, and where it may write: shared by the subcommands."""

from __future__ import annotations

import os

__all__ = ["run_dir", "ROOT_OUTPUTS", "check_out_root", "add_force_arg"]


def run_dir(run: str, root: str) -> str:
    """A run given as a folder, or as a run id under ``root``."""
    if os.path.isdir(run):
        return run
    path = os.path.join(root, run)
    if os.path.isdir(path):
        return path
    from h2o_lens.errors import H2OLensError

    raise H2OLensError(
        f"no run {run!r}: neither a folder nor a run id under {root!r}; list runs with `h2o-lens runs ROOT`"
    )


#: what the toolkit writes in a runs root beside its runs: the sweep's plan, locks and outputs, the
#: demo's summary and reports (a README is left as it is)
ROOT_OUTPUTS = (
    "sweep_plan.json",
    ".sweep_locks",
    "sweep.csv",
    "sweep.md",
    "sweep.html",
    "demo_summary.json",
    "reports",
    "README.md",
)


def check_out_root(root: str | os.PathLike, *, force: bool = False, option: str = "--out") -> None:
    """Refuse, in one line, an output folder holding anything the toolkit did not write, unless
    ``force`` (:func:`runlog.ownership.check_output_root`, DESIGN.md §5.1)."""
    from runlog.ownership import check_output_root

    check_output_root(root, names=ROOT_OUTPUTS, force=force, option=option)


def add_force_arg(parser, what: str) -> None:
    """``--force``: write into a folder (or over a file) that holds what h2o-lens did not write."""
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"write {what} even though it holds files or folders h2o-lens did not write (they are never "
        "removed; a .git never is touched)",
    )
