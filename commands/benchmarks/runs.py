"""``h2o-lens bench runs``: timings over a synthetic root of thousands of runs: ``h2o-lens runs``
without and with its catalog cache, the runs table and curve points, the dashboard's pages."""

from __future__ import annotations

import argparse
import time
from typing import Any

from h2o_lens.errors import ConfigError

from ..options import at_least
from .common import check_ints, fresh_env

__all__ = ["add_arguments", "run", "bench_runs", "model_folder", "fingerprint_cost"]

NAME = "runs"
HELP = "h2o-lens runs, the runs table and the dashboard's pages over a synthetic root of thousands of runs"


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--runs", type=at_least(1), default=5000, help="synthetic runs in the root (default 5000)")
    b.add_argument("--root", default=None, help="reuse (or write once) this synthetic root")
    b.add_argument("--no-browser", action="store_true", help="skip the dashboard timings")
    b.add_argument(
        "--model",
        default=None,
        help="the model folder whose fingerprint is timed, not loaded (default: the converted SmolLM2-135M-Instruct)",
    )


def run(args: argparse.Namespace) -> int:
    return bench_runs(runs=args.runs, root=args.root, browser=not args.no_browser, model=args.model)


def model_folder(model: str | None) -> Any:
    """The folder of ``--model`` (a local folder or a cached Hugging Face id), or of the converted
    default model (None when it is not converted yet); a model that is neither is refused in one line."""
    from pathlib import Path

    from h2o_lens import compat
    from h2o_lens.models import DEFAULT_MODEL, default_cache_dir

    if model is None or model.lower() in ("default", DEFAULT_MODEL.lower()):
        folder = default_cache_dir() / compat.checkpoint_folder() / DEFAULT_MODEL
        return folder if (folder / "config.json").is_file() else None
    folder = Path(model).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - neither a folder nor a cached id
            raise ConfigError(f"bench runs: --model {model!r} is neither a model folder nor a cached id") from None
    if not (folder / "config.json").is_file():
        raise ConfigError(f"bench runs: --model {model!r}: {folder} holds no config.json; give a model folder")
    return folder


def fingerprint_cost(folder: Any) -> str:
    """The line of the model fingerprint's cost on ``folder`` (:func:`h2o_lens.fingerprint.fingerprint_timings`:
    its first use, later uses, the older partial one), with a digest cache of its own in a temporary
    ``$H2O_LENS_HOME`` so that the first use reads every byte and the user's cache is left as it is."""
    import os
    import tempfile

    from h2o_lens.fingerprint import fingerprint_timings

    if folder is None:
        return "model fingerprint: skipped, the default model is not converted yet (any command that loads it does so)"
    before = os.environ.get("H2O_LENS_HOME")
    with tempfile.TemporaryDirectory(prefix="h2o-lens-bench-digests-") as home:
        os.environ["H2O_LENS_HOME"] = home
        try:
            got = fingerprint_timings(folder)
        finally:
            if before is None:
                os.environ.pop("H2O_LENS_HOME", None)
            else:
                os.environ["H2O_LENS_HOME"] = before
    return (
        f"model fingerprint of {folder} ({got['bytes'] / 2**20:.0f} MiB of weights, not loaded): first use "
        f"{got['first']:.2f} s (every byte read, no cached digest), later uses {got['later'] * 1e3:.1f} ms "
        f"(median of 5, digests cached), the older partial one {got['partial'] * 1e3:.1f} ms "
        "(targets: first use <= 2 s, later uses <= 50 ms)"
    )


def _timed_cli(argv: list[str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of ``h2o-lens ARGV`` in a fresh process, and its last output line."""
    import resource
    import subprocess
    import sys

    env = fresh_env()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "commands.cli", *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"h2o-lens {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = proc.stdout.strip().splitlines()
    return wall, cpu, lines[-1] if lines else ""


def _page_paint(context, url: str, title: str) -> float:
    """Seconds from opening ``url`` in a new tab until the page's script finished with its
    heading and, on the Runs page, its table shown."""
    from app.bench import DONE

    page = context.new_page()
    try:
        t0 = time.perf_counter()
        page.goto(url, wait_until="domcontentloaded", timeout=300_000)
        page.wait_for_selector(f"{DONE} [data-testid=stMain] h1:has-text('{title}')", timeout=300_000)
        if title == "Runs":
            page.wait_for_selector("[data-testid=stDataFrame]", state="visible", timeout=300_000)
        seconds = time.perf_counter() - t0
        errors = page.locator("[data-testid=stException]").count()
        if errors:
            print(f"  {url}: {errors} exception(s) shown")
        return seconds
    finally:
        page.close()


def bench_runs(runs: int = 5000, root: str | None = None, browser: bool = True, model: str | None = None) -> int:
    """Timings over a synthetic root of ``runs`` runs (:func:`runlog.synthetic_root.make_root`).

    Prints: the model fingerprint's cost on ``model``'s folder (default: the converted default
    model; :func:`fingerprint_cost`); the root's build time; ``h2o-lens runs`` in a fresh process with no catalog cache
    (every file read in full) and with it; ``runs_table`` and the sweep curve points of every
    run in this process; the Runs and Compare pages in Chromium (first visit to a fresh server,
    then a new tab). Targets: ``h2o-lens runs`` and the Runs page first paint ≤ 3 s.
    """
    import contextlib
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from runlog.catalog import CACHE_NAME
    from runlog.ownership import OutputFolderError, remove_run
    from runlog.synthetic_root import make_root

    check_ints("runs", "runs", runs, 1)
    folder = model_folder(model)  # before anything runs: a model that is not there is one line
    temp = None
    if root is None:
        temp = tempfile.mkdtemp(prefix="h2o-lens-bench-runs-")
        root = os.path.join(temp, "runs")
    try:
        print(
            f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; "
            "wall seconds (CPU seconds of the process in brackets)",
            flush=True,
        )
        print(fingerprint_cost(folder), flush=True)
        if not Path(root).is_dir():
            t0 = time.perf_counter()
            make_root(root, runs)
            print(f"synthetic root: {runs} runs written in {time.perf_counter() - t0:.1f} s to {root}", flush=True)
        n = sum(1 for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        (Path(root) / CACHE_NAME).unlink(missing_ok=True)
        for label in ("no cache (every file read in full)", "catalog cache warm"):
            wall, cpu, last = _timed_cli(["runs", root, "--max-rows", "20"])
            print(f"h2o-lens runs ({n} runs), {label}: {wall:.2f} s ({cpu:.2f} s CPU)   [{last}]", flush=True)
        wall, cpu, _ = _timed_cli(["runs", root, "--max-rows", "100000"])
        print(f"h2o-lens runs --max-rows 100000 (every row printed): {wall:.2f} s ({cpu:.2f} s CPU)", flush=True)

        from analyses import run_curve_points, runs_table
        from runlog import open_runs

        t0, c0 = time.perf_counter(), time.process_time()
        con = open_runs(root, warn=False)
        t1, c1 = time.perf_counter(), time.process_time()
        table = runs_table(con).df()
        t2, c2 = time.perf_counter(), time.process_time()
        points = run_curve_points(con, table["run_id"].tolist()).df()
        t3, c3 = time.perf_counter(), time.process_time()
        print(
            f"open_runs {t1 - t0:.2f} s ({c1 - c0:.2f}), runs_table {t2 - t1:.2f} s ({c2 - c1:.2f}) for "
            f"{len(table)} rows, run_curve_points of every run {t3 - t2:.2f} s ({c3 - c2:.2f}) for "
            f"{len(points)} points",
            flush=True,
        )
        con.close()
        if not browser:
            return 0
        from app.bench import CHROMIUM, serve
        from app.bench import browser as open_browser

        if not Path(CHROMIUM).exists():
            print(f"dashboard: skipped, no Chromium at {CHROMIUM}")
            return 0
        from runlog import write_synthetic_run

        other = table["run_id"].iloc[len(table) // 2]
        added = Path(tempfile.mkdtemp(prefix="bench-added-run-", dir=root))  # a new name: nothing of --root's
        added.rmdir()
        try:
            with serve(root, timeout=300) as url, open_browser() as b:
                context = b.new_context(viewport={"width": 1500, "height": 1000})
                first = _page_paint(context, f"{url}/", "Runs")
                again = _page_paint(context, f"{url}/", "Runs")
                # a run appears (as during a sweep): the server scans the root again, the cache spares
                # every file but the new run's, and the runs table is built anew
                write_synthetic_run(root, added.name, layers=2, kv_heads=1, steps=8, prompt_len=32, fsync=False)
                changed = _page_paint(context, f"{url}/", "Runs")
                compare = _page_paint(context, f"{url}/compare?run={table['run_id'].iloc[0]}&other={other}", "Compare")
                context.close()
        finally:
            with contextlib.suppress(OSError, OutputFolderError):
                remove_run(added)  # the run written above, proven by its manifest; never anything else
        print(
            f"Runs page: first paint {first:.2f} s on a fresh server (its imports, scan, views and table), "
            f"{changed:.2f} s after a run was added (scan, views and table again), new tab {again:.2f} s; "
            f"Compare page {compare:.2f} s",
            flush=True,
        )
        return 0
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
