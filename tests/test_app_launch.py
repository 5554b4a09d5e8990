"""``h2o-lens app`` ends its server when it is told to end (DESIGN.md §7.3): SIGTERM or SIGINT to
the launcher stops the ``app.serve`` child, and nothing is left listening on the port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.bench import free_port

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_ends_its_server_and_frees_the_port(app_runs_root, sig):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "commands.cli", "app", str(app_runs_root), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not _listening(port):
            assert launcher.poll() is None, f"the launcher exited with {launcher.returncode}"
            assert time.monotonic() < deadline, "the dashboard never listened"
            time.sleep(0.25)
        servers = _children(launcher.pid)
        assert servers or not Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").exists()
        launcher.send_signal(sig)  # to the launcher alone, not its process group
        code = launcher.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _listening(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(port), f"port {port} still listens after the launcher ended (exit {code})"
        assert not [p for p in servers if _alive(p)], "the server outlived the launcher"
        assert code == 128 + sig
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in servers:  # a server left behind must not outlive the test
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
