"""Starting the dashboard server: ``streamlit run app/main.py -- --root ROOT`` (through :mod:`app.serve`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MAIN", "default_root", "server_command", "run_app"]

#: The entry script of the app.
MAIN = Path(__file__).resolve().with_name("main.py")


def default_root() -> Path:
    """The repository's ``sample_runs/`` folder (it may be empty or missing)."""
    return Path(__file__).resolve().parent.parent / "sample_runs"


def server_command(
    root: str | os.PathLike | None = None,
    port: int = 8501,
    *,
    open_browser: bool = False,
    address: str = "127.0.0.1",
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line that serves the app over ``root``: ``streamlit run`` in :mod:`app.serve`.

    Parameters
    ----------
    root : path-like, optional
        Runs root; default :func:`default_root`.
    port : int
        TCP port of the server.
    open_browser : bool
        Let Streamlit open a browser tab (otherwise the server runs headless).
    address : str
        Address the server listens on; the default serves this machine only.
    extra : sequence of str
        More ``streamlit run`` options, e.g. ``["--server.fileWatcherType", "none"]``.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    root = Path(root if root is not None else default_root()).expanduser().resolve()
    return [
        sys.executable,
        "-m",
        "app.serve",  # streamlit, with the root's catalog opened while the server starts
        "run",
        str(MAIN),
        "--server.headless",
        "false" if open_browser else "true",
        "--server.address",
        address,
        "--server.port",
        str(port),
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "viewer",
        # selections are written into widget state and passed as defaults on purpose (app/state.py)
        "--global.disableWidgetStateDuplicationWarning",
        "true",
        *extra,
        "--",
        "--root",
        str(root),
    ]


def run_app(root: str | os.PathLike | None = None, port: int = 8501, open_browser: bool = False) -> int:
    """Serve the dashboard over ``root`` until interrupted; returns the server's exit code.

    ``root`` defaults to the repository's ``sample_runs/`` folder. The page
    is at ``http://127.0.0.1:<port>/``.
    """
    cmd = server_command(root, port, open_browser=open_browser)
    print(f"H2O Lens dashboard: http://127.0.0.1:{port}/  (runs root {cmd[-1]}; Ctrl+C stops it)", flush=True)
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
