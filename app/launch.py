"""Starting the dashboard server: ``streamlit run app/main.py -- --root ROOT`` (through :mod:`app.serve`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
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


class _Stopped(Exception):
    """The launcher got SIGTERM or SIGINT."""


def _end_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGTERM when the launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_app(root: str | os.PathLike | None = None, port: int = 8501, open_browser: bool = False) -> int:
    """Serve the dashboard over ``root`` until stopped; returns the server's exit code.

    ``root`` defaults to the repository's ``sample_runs/`` folder. The page
    is at ``http://127.0.0.1:<port>/``. The server runs in a child process that
    ends with the launcher: SIGTERM or SIGINT (Ctrl+C) to the launcher stop the
    server first (SIGTERM, then SIGKILL after 10 s), and on Linux a launcher
    killed outright takes the server with it.
    """
    cmd = server_command(root, port, open_browser=open_browser)
    print(f"H2O Lens dashboard: http://127.0.0.1:{port}/  (runs root {cmd[-1]}; Ctrl+C stops it)", flush=True)

    def stop(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        proc = subprocess.Popen(cmd, preexec_fn=_end_with_parent if sys.platform == "linux" else None)
        try:
            return proc.wait()
        except (KeyboardInterrupt, _Stopped) as exc:
            code = 128 + (exc.args[0] if isinstance(exc, _Stopped) else signal.SIGINT)
            for sig in handlers:  # a second signal while the server stops must not orphan it
                signal.signal(sig, signal.SIG_IGN)
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return int(code)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
