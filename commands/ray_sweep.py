"""Sweeps on a Ray cluster (DESIGN.md §13): worker actors load the model once and run many cells.

The driver (the ``h2o-lens sweep`` process) plans the grid with the tokenizer
alone, writes the plan and hands out cells one at a time; each worker is an
actor that loaded the model in its constructor and runs a cell with the same
:func:`commands.grid.run_cell` as the in-process executor, under the same cell
lock, into the same runs root (a folder every node sees). A worker that dies
loses only its open cell: Ray restarts the actor (a bounded number of times)
and the cell is handed out again, up to ``retries`` times, then left
``failed`` with the error.

Ray is an optional extra (``pip install 'h2o-lens[ray]'``), imported only here
and only when a Ray sweep starts.
"""

from __future__ import annotations

import collections
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h2o_lens.errors import ConfigError, H2OLensError

from .grid import CellOutcome, Grid, GridReport, fail_cell, run_cell, write_plan

__all__ = ["RAY_EXTRA", "RayOptions", "RaySweep", "SweepWorker", "require_ray", "scheduling_overhead_ms"]

RAY_EXTRA = "pip install 'h2o-lens[ray]'"
#: restarts of one worker actor after its process died (each reloads the model)
MAX_RESTARTS = 3


def require_ray() -> Any:
    """The ``ray`` module, or a :class:`ConfigError` naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--executor ray needs Ray, which is not installed; install the extra: {RAY_EXTRA}") from None
    return ray


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide a Ray sweep runs.

    ``address``: an existing cluster (``ray://host:10001``, ``host:6379`` or
    ``auto``); ``None`` starts a local one on this machine (localhost only, no
    dashboard, ``workers × cpus_per_worker`` CPUs). ``workers``: actors; ``None``
    gives as many as the cluster's CPUs (or GPUs, with ``gpus_per_worker``) hold.
    ``retries``: how many times a cell whose worker died is handed out again.
    """

    address: str | None = None
    workers: int | None = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    retries: int = 1

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.workers}")
        if self.cpus_per_worker <= 0:
            raise ConfigError(f"cpus per worker must be positive, got {self.cpus_per_worker}")
        if self.gpus_per_worker < 0:
            raise ConfigError(f"--gpus-per-worker must be 0 or more, got {self.gpus_per_worker}")
        if self.retries < 0:
            raise ConfigError(f"--retries must be 0 or more, got {self.retries}")


class SweepWorker:
    """One Ray worker of a sweep: loads the model once, then runs the cells it is handed.

    A plain class, made an actor by :meth:`RaySweep.start` (``ray.remote``), so
    that importing this module needs no Ray.
    """

    def __init__(self, model: str | None, dtype: str, device: str, cwd: str, threads: int) -> None:
        import torch

        from h2o_lens.models import load_model

        if os.path.isdir(cwd):  # a relative --model names the same folder as for the driver
            os.chdir(cwd)
        torch.set_num_threads(max(1, threads))
        t0 = time.perf_counter()
        self.model, self.tokenizer = load_model(model, dtype=getattr(torch, dtype), device=device, progress=False)
        import recorders.recorder  # noqa: F401  (what a cell imports, loaded before the first one)
        import recorders.replay  # noqa: F401

        self.load_seconds = time.perf_counter() - t0
        self.grid: Grid | None = None
        self.tasks: Sequence[Any] = ()
        # the worker's model stays in a prompt-reuse scope for its life: the cells of a batch it
        # runs in a row share one prompt forward (DESIGN.md §12.5)
        from h2o_lens.prompt_reuse import PromptReuse

        self.reuse = PromptReuse(self.model, keep=3, any_gqa=True).__enter__()

    def describe(self) -> dict[str, Any]:
        """The worker's process and model: what the driver plans the grid with."""
        from h2o_lens.models import model_info
        from h2o_lens.runtime import full_kv_bytes

        info = model_info(self.model)
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "name": str(info["name"]),
            "dtype": info["dtype"],
            "kv_bytes_per_token": full_kv_bytes(self.model, 1),
            "load_seconds": self.load_seconds,
        }

    def run(self, root: str, index: int, grid_id: str, boxed: list[Any]) -> CellOutcome:
        """Run cell ``index`` of the grid; ``boxed`` holds the object refs of the grid and its
        requests, fetched once per grid (a restarted actor fetches them again)."""
        if self.grid is None or self.grid.grid_id != grid_id:
            import ray

            self.grid, self.tasks = ray.get(boxed)
        cell = self.grid.cells[index]
        return run_cell(root, cell, self.grid, self.tasks, self.model, self.tokenizer, reuse=self.reuse)

    def warm_up(self) -> float:
        """One short ``generate``: the one-time costs of a process's first one, paid before timing."""
        import torch

        t0 = time.perf_counter()
        with torch.no_grad():
            enc = self.tokenizer(["warm up"], return_tensors="pt", return_token_type_ids=False)
            self.model.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
        return time.perf_counter() - t0

    def noop(self) -> None:
        """A round trip that runs nothing (the scheduling overhead of one call)."""
        return None


@dataclass
class _Worker:
    """The driver's view of one actor: ``ready`` (can take a cell), ``restarting`` (its process
    died; Ray starts a new one, which loads the model again) or ``dead`` (no restart left)."""

    handle: Any
    state: str = "ready"
    deaths: int = 0
    cells: int = 0
    busy_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    batch: int | None = None  # the batch of the last cell handed to it


class RaySweep:
    """A pool of sweep workers on a Ray cluster: :meth:`start` them, :meth:`run` grids, :meth:`close`."""

    def __init__(self, model: str | None, dtype: str = "float32", options: RayOptions | None = None) -> None:
        self.model = None if model is None else os.fspath(model)
        self.dtype = dtype
        self.options = options or RayOptions()
        self.workers: list[_Worker] = []
        self.info: dict[str, Any] = {}
        self._ray: Any = None
        self._owns_cluster = False

    # -- the cluster and the actors ------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Connect (or start a local cluster), start the workers and wait until each loaded the model.

        Returns the first worker's :meth:`SweepWorker.describe`.
        """
        ray = self._ray = require_ray()
        opts = self.options
        if not ray.is_initialized():
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
            if opts.address:
                ray.init(address=opts.address, logging_level="WARNING", log_to_driver=True)
            else:
                workers = opts.workers or os.cpu_count() or 1
                ray.init(
                    num_cpus=max(1, int(workers * opts.cpus_per_worker + 0.999)),
                    num_gpus=int(workers * opts.gpus_per_worker + 0.999) if opts.gpus_per_worker else None,
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    logging_level="WARNING",
                )
            self._owns_cluster = True
        count = opts.workers or self._fits()
        if opts.workers and opts.workers > self._fits():
            print(
                f"h2o-lens: the Ray cluster holds {self._fits()} of the {opts.workers} workers asked for now "
                f"({opts.cpus_per_worker:g} CPUs, {opts.gpus_per_worker:g} GPUs each); the others start when "
                "resources free up",
                file=sys.stderr,
            )
        actor = ray.remote(
            num_cpus=opts.cpus_per_worker,
            num_gpus=opts.gpus_per_worker,
            max_restarts=MAX_RESTARTS,
            max_task_retries=0,  # a lost cell is handed out again by the driver, counted
        )(SweepWorker)
        device = "cuda" if opts.gpus_per_worker > 0 else "cpu"
        threads = max(1, int(opts.cpus_per_worker))
        self.workers = [
            _Worker(actor.remote(self.model, self.dtype, device, os.getcwd(), threads)) for _ in range(count)
        ]
        try:
            infos = ray.get([w.handle.describe.remote() for w in self.workers])
        except ray.exceptions.RayActorError as exc:
            raise ConfigError(f"the Ray workers could not load the model {self.model or 'default'}: {exc}") from None
        for w, info in zip(self.workers, infos):
            w.info = info
        self.info = infos[0]
        return self.info

    def _fits(self) -> int:
        """Workers the cluster's resources hold (at least one)."""
        total = self._ray.cluster_resources()
        opts = self.options
        if opts.gpus_per_worker > 0:
            return max(1, int(total.get("GPU", 0) // opts.gpus_per_worker))
        return max(1, int(total.get("CPU", 1) // opts.cpus_per_worker))

    def close(self) -> None:
        """End the workers (and the local cluster this pool started)."""
        ray = self._ray
        if ray is None:
            return
        for w in self.workers:
            try:
                ray.kill(w.handle, no_restart=True)
            except Exception:  # already gone
                pass
        self.workers = []
        if self._owns_cluster and ray.is_initialized():
            ray.shutdown()
        self._ray = None

    def __enter__(self) -> RaySweep:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- running a grid ------------------------------------------------------------------------

    def run(self, root: str | os.PathLike, grid: Grid, tasks: Sequence[Any], *, progress: bool = True) -> GridReport:
        """Run every cell of ``grid`` not yet done under ``root`` on the workers.

        The same rules as :func:`commands.grid.run_grid`, one cell in flight per
        worker; in addition a cell whose worker died is handed out again up to
        ``retries`` times, then left ``failed``. A worker that died gets cells
        again once its restarted process answers.
        """
        from tqdm.auto import tqdm

        if self._ray is None:
            self.start()
        ray = self._ray
        root = str(Path(root).resolve())
        write_plan(root, grid)
        boxed = [ray.put(grid), ray.put(list(tasks))]
        report = GridReport()
        queue = collections.deque(range(len(grid.cells)))
        lost: dict[int, int] = collections.Counter()
        cells: dict[Any, tuple[_Worker, int]] = {}  # a cell in flight: its worker and index
        probes: dict[Any, _Worker] = {}  # a restarting worker's describe() call
        bar = tqdm(total=len(grid.cells), desc="sweep (ray)", unit="cell", disable=not progress)

        def hand_out(worker: _Worker) -> None:
            if queue and worker.state == "ready":
                i = _next_cell(grid, queue, worker.batch, {grid.cells[j].batch for _, j in cells.values()})
                queue.remove(i)
                worker.batch = grid.cells[i].batch
                cells[worker.handle.run.remote(root, i, grid.grid_id, boxed)] = (worker, i)

        def settle(i: int, outcome: CellOutcome) -> None:
            report.add(outcome)
            bar.update(1)
            done = len(report.ran) + len(report.done)
            bar.set_postfix_str(f"done {done}, failed {len(report.failed)}, running {len(cells)}", refresh=False)

        t0 = time.perf_counter()
        try:
            for w in self.workers:
                hand_out(w)
            while cells or (queue and probes):  # cells in flight, or to do and a worker coming back
                (ref,), _ = ray.wait([*cells, *probes], num_returns=1)
                if ref in probes:  # a restarting worker: ready again, still restarting, or gone
                    worker = probes.pop(ref)
                    try:
                        worker.info = ray.get(ref)
                        worker.state = "ready"
                        hand_out(worker)
                    except ray.exceptions.ActorUnavailableError:
                        time.sleep(0.2)
                        probes[worker.handle.describe.remote()] = worker
                    except ray.exceptions.RayActorError:
                        worker.state = "dead"
                    continue
                worker, i = cells.pop(ref)
                cell = grid.cells[i]
                try:
                    outcome = ray.get(ref)
                except ray.exceptions.RayActorError as exc:  # the worker's process died with the cell open
                    worker.deaths += 1
                    worker.state = "restarting"
                    probes[worker.handle.describe.remote()] = worker
                    lost[i] += 1
                    if lost[i] <= self.options.retries:
                        report.retried[cell.key] = lost[i]
                        print(f"h2o-lens: worker lost on cell {cell.run_id}; retrying it", file=sys.stderr)
                        queue.appendleft(i)
                        for w in self.workers:
                            if w.state == "ready" and all(w is not v for v, _ in cells.values()):
                                hand_out(w)
                    else:
                        error = f"worker lost {lost[i]} times: {_first_line(exc)}"
                        fail_cell(root, cell, error)
                        settle(i, CellOutcome(cell.key, "failed", error))
                    continue
                except ray.exceptions.RayTaskError as exc:  # raised outside the cell's own handling
                    outcome = CellOutcome(cell.key, "failed", _first_line(exc))
                worker.cells += outcome.outcome == "ran"
                worker.busy_seconds += outcome.seconds
                settle(i, outcome)
                hand_out(worker)
        finally:
            bar.close()
        if queue:
            raise H2OLensError(
                f"every Ray worker died ({len(queue)} cells left to do under {root}); rerun the command to resume"
            )
        report.seconds = time.perf_counter() - t0
        return report

    def warm_up(self) -> None:
        """Each worker runs one short ``generate`` (for benchmarks: before the clock starts)."""
        self._ray.get([w.handle.warm_up.remote() for w in self.workers])

    def round_trip_ms(self, calls: int = 50) -> float:
        """Median milliseconds of one no-op call to a worker and back."""
        ray = self._ray
        handle = self.workers[0].handle
        ray.get(handle.noop.remote())
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            ray.get(handle.noop.remote())
            times.append(time.perf_counter() - t0)
        times.sort()
        return 1e3 * times[len(times) // 2]

    def summary(self, report: GridReport) -> str:
        """One line per worker (host, pid, cells, busy seconds) and the scheduling overhead."""
        lines = [f"  {'worker':<8} {'host':<20} {'pid':>8} {'cells':>6} {'busy s':>8} {'load s':>7} {'deaths':>7}"]
        for n, w in enumerate(self.workers):
            lines.append(
                f"  {n:<8} {str(w.info.get('host', '?'))[:20]:<20} {w.info.get('pid', 0):>8} {w.cells:>6} "
                f"{w.busy_seconds:>8.1f} {w.info.get('load_seconds', 0):>7.1f} {w.deaths:>7}"
            )
        handed = len(report.ran) + len(report.done) + len(report.failed) + len(report.busy)
        overhead = scheduling_overhead_ms(report.seconds, [w.busy_seconds for w in self.workers], handed)
        lines.append(
            f"ray: {len(self.workers)} workers, {handed} cells in {report.seconds:.1f} s, "
            f"{len(report.retried)} retried after a worker died, "
            f"scheduling overhead {overhead:.0f} ms per cell"
        )
        return "\n".join(lines)


def _next_cell(grid: Grid, queue: Sequence[int], batch: int | None, running: set[int]) -> int:
    """The cell to hand a worker whose last cell was of ``batch``: the next one of that batch (its
    prompt forward is still in the worker, DESIGN.md §12.5), else the first of a batch no worker
    is running (``running``), else the first in line."""
    for want in (lambda b: b == batch, lambda b: b not in running):
        for i in queue:
            if want(grid.cells[i].batch):
                return i
    return queue[0]


def scheduling_overhead_ms(wall: float, busy: Sequence[float], cells: int) -> float:
    """Worker time not spent in cells, per cell: ``(wall × workers − Σ busy) / cells``, in ms."""
    if cells == 0:
        return 0.0
    return 1e3 * max(0.0, wall * len(busy) - sum(busy)) / cells


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
