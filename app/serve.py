"""The dashboard's server process: ``python -m app.serve run app/main.py ... -- --root ROOT``.

It starts ``streamlit`` in this process (the arguments are those of ``streamlit``'s own
command line) and, in a thread while the server starts, opens the runs root's catalog and
imports what the pages use (:func:`app.state.warm`). The first visitor then finds the root
scanned and its views made instead of paying for it: on a root of thousands of runs that is
most of the first page's time. A warm-up that fails changes nothing: the first session
scans the root itself and shows what went wrong.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

__all__ = ["main"]


def _warm(argv: Sequence[str]) -> None:
    try:
        from app import state

        after = list(argv[list(argv).index("--") + 1 :]) if "--" in argv else []
        state.warm(state.resolve_root(after))
    except Exception:  # noqa: BLE001 - the first session does the same work and reports the error
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``streamlit`` with ``argv`` (default: this process's arguments) after starting the warm-up."""
    argv = list(sys.argv[1:] if argv is None else argv)
    threading.Thread(target=_warm, args=(argv,), daemon=True, name="h2o-lens-warm-up").start()
    from streamlit.web import cli

    sys.argv = ["streamlit", *argv]
    return int(cli.main() or 0)


if __name__ == "__main__":
    sys.exit(main())
