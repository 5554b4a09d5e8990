"""Dashboard benchmark in a real browser: ``python -m app.bench [--evictions N] [--screenshots DIR]``.

A synthetic run of about one million evictions (32 layers × 8 KV heads, 32
query heads, 1,024 logged steps of 2 evictions each after a 2,560-token
prompt) is written to a temporary root and the app is served over it. Once
the server is warm (the Runs page was loaded once), every page is opened in
one browser tab that moves through the sidebar navigation, as a user
does, and measured:

* first paint: seconds from the click on the page's link until its script
  finished (``[data-testid=stApp][data-test-script-state=notRunning]``) with
  its title shown and every chart drawn; the page's analyses are computed
  on this first visit (nothing cached);
* new tab: the same page's link opened in a new tab (a new session; the
  browser's HTTP cache and the server's analyses cache are warm);
* bytes sent to the browser: the sizes of the websocket frames received
  during each (Playwright ``framereceived``).

Targets on 2 cores: Overview and Heads first paint ≤ 3 s, every page
≤ 5 MB. The browser is Debian's ``/usr/bin/chromium`` driven by Playwright.

The server and browser helpers here (:func:`serve`, :func:`browser`,
:func:`visit`) are also used by the browser test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .launch import server_command
from .screens import PAGES

__all__ = [
    "CHROMIUM",
    "LAUNCH_ARGS",
    "BENCH_SHAPE",
    "Visit",
    "free_port",
    "serve",
    "browser",
    "visit",
    "bench_app",
    "main",
    "DONE",
]

CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
#: Shape of the benchmark run: 256 KV sets × (2,048 prefill + 2,048 decode) = 1,048,576 evictions.
BENCH_SHAPE = {
    "layers": 32,
    "kv_heads": 8,
    "q_heads": 32,
    "steps": 1024,
    "prompt_len": 2560,
    "heavy": 256,
    "recent": 256,
    "evictions_per_step": 2,
}
RUN_ID = "bench-1m"
DONE = "[data-testid=stApp][data-test-script-state=notRunning]"
#: The page is drawn: its script finished, its title is shown, no element is still a loading
#: skeleton and every chart has its SVG.
_DRAWN = f"""(title) => {{
    const h1 = document.querySelector('{DONE} [data-testid=stMain] h1');
    if (!h1 || (title && !h1.textContent.trim().startsWith(title))) return false;
    if (document.querySelector('[data-testid=stSkeletonElement], .stSkeleton')) return false;
    const charts = document.querySelectorAll('[data-testid=stPlotlyChart]');
    return Array.from(charts).every(c => c.querySelector('.main-svg'));
}}"""
_HEIGHT = (
    "() => Math.max(...Array.from(document.querySelectorAll('[data-testid=stMain], "
    "[data-testid=stMainBlockContainer]')).map(e => e.scrollHeight), 0)"
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the dashboard server exited with code {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as resp:
                if resp.read().decode().strip() == "ok":
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise TimeoutError(
        f"the dashboard server at {url} did not answer /_stcore/health within {timeout:g} s:\n"
        f"{log.read_text(errors='replace')[-3000:]}"
    )


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server's process group: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def serve(
    root: str | os.PathLike, port: int | None = None, *, timeout: float = 90.0, log: str | os.PathLike | None = None
) -> Iterator[str]:
    """Serve the app over ``root`` in a child process; yields its base URL once healthy.

    The server is always stopped on exit (its whole process group), also on errors.
    """
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(log) if log else Path(tempfile.mkstemp(prefix="h2o-lens-app-", suffix=".log")[1])
    cmd = server_command(root, port, extra=["--server.fileWatcherType", "none", "--server.runOnSave", "false"])
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            _wait_health(url, proc, log_path, timeout)
            yield url
        finally:
            _stop(proc)


@contextlib.contextmanager
def browser(executable: str = CHROMIUM) -> Iterator[Any]:
    """A headless Chromium (Playwright) using the system browser binary."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=executable, args=list(LAUNCH_ARGS), headless=True)
        try:
            yield b
        finally:
            b.close()


@dataclasses.dataclass
class Visit:
    """One page load: how long until it was drawn, what it sent, what it shows."""

    url: str
    seconds: float
    ws_bytes: int
    ws_frames: int
    exceptions: list[str]
    title: str
    screenshot: str | None


class _Frames:
    """Sizes of the websocket frames a page receives (Playwright ``framereceived``)."""

    def __init__(self, page: Any) -> None:
        self.sizes: list[int] = []
        page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: self.sizes.append(len(payload))))

    def mark(self) -> int:
        return len(self.sizes)

    def since(self, mark: int) -> tuple[int, int]:
        return sum(self.sizes[mark:]), len(self.sizes) - mark


def _finish(
    page: Any,
    url: str,
    seconds: float,
    frames: _Frames,
    mark: int,
    screenshot: Any,
    timeout_s: float,
    title: str | None,
) -> Visit:
    page.wait_for_timeout(300)  # late frames (e.g. the query-string update) count too
    errors = [
        page.locator("[data-testid=stException]").nth(i).inner_text()
        for i in range(page.locator("[data-testid=stException]").count())
    ]
    shown = page.locator("[data-testid=stMain] h1").first.inner_text()
    shot = None
    if screenshot is not None:  # the app scrolls inside its main block: grow the window to fit it
        size = page.viewport_size or {"width": 1500, "height": 1000}
        full = int(page.evaluate(_HEIGHT)) + 80
        if full > size["height"]:
            page.set_viewport_size({"width": size["width"], "height": min(full, 12_000)})
            page.wait_for_timeout(500)
            page.wait_for_function(_DRAWN, arg=title, timeout=timeout_s * 1000, polling=50)
        Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=True)
        page.set_viewport_size(size)
        shot = str(screenshot)
    sent, count = frames.since(mark)
    return Visit(url, seconds, sent, count, errors, shown, shot)


def visit(
    b: Any,
    url: str,
    *,
    screenshot: str | os.PathLike | None = None,
    timeout_s: float = 120.0,
    width: int = 1500,
    height: int = 1000,
    title: str | None = None,
) -> Visit:
    """Open ``url`` in a new browser session (a new tab of ``b``, a browser or a context) and wait
    until the page is drawn; with ``title``, until its heading starts with it."""
    page = b.new_page(viewport={"width": width, "height": height}) if hasattr(b, "new_context") else b.new_page()
    if not hasattr(b, "new_context"):
        page.set_viewport_size({"width": width, "height": height})
    frames = _Frames(page)
    try:
        start = time.perf_counter()
        page.goto(url, wait_until="domcontentloaded", timeout=timeout_s * 1000)
        page.wait_for_function(_DRAWN, arg=title, timeout=timeout_s * 1000, polling=50)
        seconds = time.perf_counter() - start
        return _finish(page, url, seconds, frames, 0, screenshot, timeout_s, title)
    finally:
        page.close()


class Session:
    """One browser tab on the app, moving between pages through the sidebar navigation."""

    def __init__(self, b: Any, url: str, *, width: int = 1500, height: int = 1000, timeout_s: float = 120.0) -> None:
        self.page = (
            b.new_page(viewport={"width": width, "height": height}) if hasattr(b, "new_context") else b.new_page()
        )
        self.frames = _Frames(self.page)
        self.timeout_s = timeout_s
        self.page.goto(url, wait_until="domcontentloaded", timeout=timeout_s * 1000)
        self.page.wait_for_function(_DRAWN, arg=None, timeout=timeout_s * 1000, polling=50)

    def go(self, key: str, title: str, *, screenshot: str | os.PathLike | None = None) -> Visit:
        """Click the page's link in the sidebar and wait until it is drawn."""
        mark = self.frames.mark()
        link = self.page.locator(f'[data-testid=stSidebarNav] a[href$="/{key}"]').first
        start = time.perf_counter()
        link.click()
        self.page.wait_for_function(_DRAWN, arg=title, timeout=self.timeout_s * 1000, polling=50)
        seconds = time.perf_counter() - start
        return _finish(self.page, self.page.url, seconds, self.frames, mark, screenshot, self.timeout_s, title)

    def close(self) -> None:
        self.page.close()


def bench_app(
    *,
    evictions: int = 1_000_000,
    root: str | os.PathLike | None = None,
    pages: Sequence[str] | None = None,
    screenshots: str | os.PathLike | None = None,
    port: int | None = None,
) -> dict[str, dict[str, float]]:
    """Measure first paint and websocket bytes of each page over a synthetic run of ~``evictions``.

    Parameters
    ----------
    evictions : int
        Target eviction rows; the decode length of :data:`BENCH_SHAPE` is scaled to reach it.
    root : path-like, optional
        Where to write the run (default a temporary folder, removed afterwards).
    pages : sequence of str, optional
        Page keys to measure (default all).
    screenshots : path-like, optional
        Folder for one full-page screenshot per page.

    Returns
    -------
    dict
        Per page: ``first_paint_s`` (sidebar navigation from the Runs page, the page's analyses
        not cached yet), ``new_tab_s`` (the page's link opened in a new tab, analyses cached),
        ``nav_bytes`` and ``tab_bytes`` (websocket bytes received by each) and ``ws_bytes``
        (the larger).
    """
    from runlog import write_synthetic_run

    pages = list(pages or [key for key, *_ in PAGES])
    shape = dict(BENCH_SHAPE)
    sets = shape["layers"] * shape["kv_heads"]
    prefill = shape["prompt_len"] - shape["heavy"] - shape["recent"]
    shape["steps"] = max(1, round((evictions / sets - prefill) / shape["evictions_per_step"]))
    with contextlib.ExitStack() as stack:
        if root is None:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="h2o-lens-bench-"))
        t0 = time.perf_counter()
        write_synthetic_run(root, RUN_ID, fsync=False, **shape)
        rows = sets * (prefill + shape["steps"] * shape["evictions_per_step"])
        print(
            f"synthetic run {RUN_ID}: {rows:,} evictions, {shape['layers']} layers × {shape['kv_heads']} "
            f"KV heads, {shape['steps']} steps, written in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        url = stack.enter_context(serve(root, port))
        context = stack.enter_context(
            contextlib.closing(stack.enter_context(browser()).new_context(viewport={"width": 1500, "height": 1000}))
        )
        titles = {key: title for key, title, *_ in PAGES}
        warm = visit(context, f"{url}/?run={RUN_ID}", title="Runs")
        print(
            f"server warm: Runs page drawn in {warm.seconds:.2f} s; load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs",
            flush=True,
        )
        session = Session(context, f"{url}/?run={RUN_ID}")
        out: dict[str, dict[str, float]] = {}
        for key in pages:
            shot = Path(screenshots) / f"bench-{key}.png" if screenshots else None
            if key == "runs":
                nav = visit(context, f"{url}/?run={RUN_ID}", title=titles[key], screenshot=shot)
            else:
                nav = session.go(key, titles[key], screenshot=shot)
            tab = visit(context, f"{url}/{'' if key == 'runs' else key}?run={RUN_ID}", title=titles[key])
            for v in (nav, tab):
                if v.exceptions:
                    print(f"  {key}: EXCEPTION {v.exceptions[0][:300]}", flush=True)
            out[key] = {
                "first_paint_s": nav.seconds,
                "new_tab_s": tab.seconds,
                "ws_bytes": max(nav.ws_bytes, tab.ws_bytes),
                "nav_bytes": nav.ws_bytes,
                "tab_bytes": tab.ws_bytes,
            }
            print(
                f"  {key:<10} first paint {nav.seconds:5.2f} s (navigation, {nav.ws_bytes / 1e6:.3f} MB)   "
                f"new tab {tab.seconds:5.2f} s ({tab.ws_bytes / 1e6:.3f} MB in {tab.ws_frames} frames)",
                flush=True,
            )
        session.close()
    targets = [
        f"{k} first paint {v['first_paint_s']:.2f} s (target ≤ 3 s)"
        for k, v in out.items()
        if k in ("overview", "heads")
    ]
    worst = max(out.items(), key=lambda kv: kv[1]["ws_bytes"])
    print("; ".join(targets) + f"; largest page {worst[0]} {worst[1]['ws_bytes'] / 1e6:.3f} MB (target ≤ 5 MB)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench", description=__doc__.split("\n")[0])
    p.add_argument("--evictions", type=int, default=1_000_000)
    p.add_argument("--pages", nargs="*", default=None, help="page keys (default: all)")
    p.add_argument("--screenshots", default=None, help="folder for full-page screenshots")
    p.add_argument("--root", default=None, help="write the run here instead of a temporary folder")
    args = p.parse_args(argv)
    bench_app(evictions=args.evictions, pages=args.pages, screenshots=args.screenshots, root=args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
