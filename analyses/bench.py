"""Benchmark of the analyses at scale: ``python -m analyses.bench [tmpdir]``.

A synthetic run of about 10 million eviction rows at 32 layers × 8 KV heads
(32 query heads, 1024 logged steps) is written in a child process, so the
peak memory measured here is the analyses' own. Every analysis the report
needs is then timed (materialised as the report does: aggregated rows only),
and the report is rendered. Targets on 2 cores: analyses ≤ 10 s in total,
peak RSS ≤ 3 GB, report render ≤ 20 s.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from runlog import open_runs, write_synthetic_run

from .attribution import attribute
from .coverage import (
    coverage_by_span,
    coverage_stats,
    dropped_mass,
    dropped_mass_by_layer,
    dropped_mass_series,
    head_coverage,
)
from .divergence import divergence_summary, replay_series
from .dynamics import freeze_onset, margin_sensitivity
from .errors import SQLSandboxError
from .evidence import evidence_held
from .report import build_report
from .sql import Sandbox
from .stale import stale_holders, stale_victims

__all__ = ["bench_analyses", "bench_sql", "SHAPE", "SQL_QUERIES"]

SHAPE = {"layers": 32, "kv_heads": 8, "q_heads": 32, "steps": 1024, "prompt_len": 2048, "heavy": 256, "recent": 256}
RUN_ID = "bench-10m"


def _generate(root: str, run_id: str, shape: dict[str, int], k: int) -> None:
    write_synthetic_run(root, run_id, evictions_per_step=k, fsync=False, **shape)


class _PeakRSS:
    """Peak resident memory of this process, sampled every 10 ms while running."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> _PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def _analyses(con: Any, run_id: str) -> dict[str, Callable[[], Any]]:
    """Every analysis the report runs, materialised the way the report does."""
    return {
        "coverage overall": lambda: coverage_stats(dropped_mass(con, run_id), by=()).fetchall(),
        "coverage per head": lambda: head_coverage(con, run_id).df(),
        "coverage by span": lambda: coverage_by_span(con, run_id, by_head=False).df(),
        "dropped mass series": lambda: dropped_mass_series(con, run_id).df(),
        "dropped mass by layer": lambda: dropped_mass_by_layer(con, run_id, bucket=22).df(),
        "divergence": lambda: divergence_summary(con, run_id).df(),
        "kl series": lambda: replay_series(con, run_id).df(),
        "evidence held": lambda: evidence_held(con, run_id).df(),
        "freeze onset": lambda: freeze_onset(con, run_id, window=32).df(),
        "margin sensitivity": lambda: margin_sensitivity(con, run_id).df(),
        "stale victims": lambda: (
            stale_victims(con, run_id)
            .query("sv", "SELECT layer, kv_head, count(*) n, count(*) FILTER (WHERE stale) s FROM sv GROUP BY ALL")
            .df()
        ),
        "stale holders": lambda: (
            stale_holders(con, run_id)
            .query("sh", "SELECT layer, kv_head, avg(stale_holder::INT) s FROM sh GROUP BY ALL")
            .df()
        ),
        "attribution": lambda: attribute(con, run_id, failed=True),
    }


def bench_analyses(
    tmpdir: str | os.PathLike,
    *,
    evictions: int = 10_000_000,
    threads: int = 2,
    memory_limit: str = "2GB",
    shape: Mapping[str, int] | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Generate the benchmark run under ``tmpdir``, time the analyses and the report.

    ``shape`` overrides entries of :data:`SHAPE` (layers, kv_heads, q_heads,
    steps, prompt_len, heavy, recent); a run already under ``tmpdir`` is reused.

    Returns
    -------
    dict
        ``rows`` (eviction rows), ``generate_s``, ``analyses`` (seconds per
        analysis), ``analyses_total_s``, ``report_s``, ``report_bytes``,
        ``peak_rss_bytes`` (sampled) and ``max_rss_bytes`` (this process's VmHWM).
    """
    root = Path(tmpdir) / "bench-runs"
    shape = {**SHAPE, **(shape or {})}
    sets = shape["layers"] * shape["kv_heads"]
    prefill = shape["prompt_len"] - shape["heavy"] - shape["recent"]
    k = max(1, math.ceil((evictions / sets - prefill) / shape["steps"]))
    t0 = time.perf_counter()
    if not (root / RUN_ID / "manifest.json").exists():
        proc = mp.get_context("spawn").Process(target=_generate, args=(str(root), RUN_ID, shape, k))
        proc.start()
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"generating the benchmark run failed (exit code {proc.exitcode})")
    generate_s = time.perf_counter() - t0

    con = open_runs(root, warn=False)
    con.execute("SET threads = $1", [threads])
    con.execute("SET memory_limit = $1", [memory_limit])
    con.execute("SET enable_progress_bar = false")
    rows = con.execute("SELECT count(*) FROM evictions").fetchall()[0][0]
    times: dict[str, float] = {}
    with _PeakRSS() as rss:
        for name, run in _analyses(con, RUN_ID).items():
            t = time.perf_counter()
            run()
            times[name] = time.perf_counter() - t
        t = time.perf_counter()
        html = build_report(con, RUN_ID, fmt="html", failed=True)
        report_s = time.perf_counter() - t
    out = {
        "rows": rows,
        "shape": shape,
        "evictions_per_step": k,
        "generate_s": generate_s,
        "analyses": times,
        "analyses_total_s": sum(times.values()),
        "report_s": report_s,
        "report_bytes": len(html),
        "peak_rss_bytes": rss.peak,
        "max_rss_bytes": _own_peak(),
    }
    if verbose:
        _print(out)
    return out


def _print(out: dict[str, Any]) -> None:
    shape = out["shape"]
    print(
        f"benchmark run: {out['rows']:,} eviction rows ({shape['layers']} layers x "
        f"{shape['kv_heads']} KV heads, "
        f"{out['evictions_per_step']} evictions per logged step), generated in {out['generate_s']:.1f} s"
    )
    for name, seconds in out["analyses"].items():
        print(f"  {name:<24} {seconds:7.3f} s")
    print(f"analyses total            {out['analyses_total_s']:7.3f} s   (target <= 10 s)")
    print(f"report render (html)      {out['report_s']:7.3f} s   (target <= 20 s), {out['report_bytes'] / 1e6:.1f} MB")
    print(
        f"peak RSS                  {out['peak_rss_bytes'] / 2**30:7.3f} GiB (target <= 3 GB; "
        f"getrusage max {out['max_rss_bytes'] / 2**30:.3f} GiB)"
    )


#: The console's stress queries: (what it shows, SQL). The first four build huge values in a
#: single expression, which DuckDB's own memory limit does not bound; the fifth spills; the
#: last passes the result byte cap.
SQL_QUERIES = (
    ("list of 1e9 BIGINTs (8 GB)", "SELECT length(list(range(1e9::BIGINT))) AS n"),
    ("string of 2e9 bytes", "SELECT length(repeat('x', 2e9::BIGINT)) AS n"),
    ("list of 5e7 BIGINTs (400 MB)", "SELECT length(list(range(5e7::BIGINT))) AS n"),
    (
        "3 lists of 2e7 BIGINTs joined",
        ("SELECT length(list_concat(range(2e7::BIGINT), range(2e7::BIGINT), range(2e7::BIGINT))) AS n"),
    ),
    (
        "DISTINCT over 6e6 strings",
        ("SELECT count(*) AS n FROM (SELECT DISTINCT i::VARCHAR || 'abcdefghijkl' AS s FROM range(6000000) t(i))"),
    ),
    ("1e6 rows of 1 kB (byte cap)", "SELECT repeat('x', 1000) AS s FROM range(1000000)"),
)


def _own_peak() -> int:
    """This process's peak resident bytes: ``VmHWM`` (its own address space's), else ``ru_maxrss``,
    which on Linux a child forked from a larger process inherits across exec."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_sql(*, memory_limit: str | int = "512MB", timeout_s: float = 120.0, verbose: bool = True) -> dict[str, Any]:
    """Run :data:`SQL_QUERIES` in a :class:`~analyses.sql.Sandbox` limited to ``memory_limit``.

    Returns
    -------
    dict
        ``memory_limit`` (bytes), ``queries`` (label, outcome, seconds) and the peak RSS
        (getrusage) of the worker processes (``worker_max_rss_bytes``, the largest child
        this process has waited for) and of this process (``self_max_rss_bytes``).
    """
    rows = []
    with tempfile.TemporaryDirectory(prefix="h2o-lens-bench-sql-") as tmp:
        root = Path(tmp) / "runs"
        write_synthetic_run(root, "bench-sql", steps=8, prompt_len=32, fsync=False)
        with Sandbox(root, memory_limit=memory_limit) as box:
            box.run("SELECT 1 AS x")
            for label, sql in SQL_QUERIES:
                t = time.perf_counter()
                try:
                    df = box.run(sql, timeout_s=timeout_s, max_rows=10_000_000)
                    outcome = f"returned {len(df)} row(s): {df.iloc[0, 0] if len(df) else ''}"
                except SQLSandboxError as exc:
                    outcome = str(exc)
                rows.append({"label": label, "sql": sql, "outcome": outcome, "seconds": time.perf_counter() - t})
            limit = box.memory_limit
    out = {
        "memory_limit": limit,
        "queries": rows,
        "worker_max_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "self_max_rss_bytes": _own_peak(),
    }
    if verbose:
        print(f"SQL console memory limit: {limit / 1e6:,.0f} MB (worker data segment capped at start-up size + limit)")
        for row in rows:
            print(f"  {row['label']:<30} {row['seconds']:6.2f} s  {row['outcome'][:120]}")
        print(
            f"peak RSS: query worker {out['worker_max_rss_bytes'] / 2**20:,.0f} MiB, "
            f"this process {out['self_max_rss_bytes'] / 2**20:,.0f} MiB (VmHWM)"
        )
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1:
        bench_analyses(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory(prefix="h2o-lens-bench-") as tmp:
            bench_analyses(tmp)
