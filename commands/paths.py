"""Where a command finds a run: shared by the subcommands that take a RUN argument."""

from __future__ import annotations

import os

__all__ = ["run_dir"]


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
