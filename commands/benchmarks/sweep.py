"""``h2o-lens bench sweep``: requests per minute of the same sweep grid batched and one request at
a time, side by side; ``--sharing`` with and without the cells of a batch sharing its prompt
forward (DESIGN.md §12.5); ``--executor ray`` in-process against Ray workers."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from h2o_lens.policies import ratio_slots

from ..options import at_least, keep_share, machine_count
from .common import check_ints, check_keep

__all__ = ["add_arguments", "run", "bench_sweep"]

NAME = "sweep"
HELP = "requests per minute of one sweep grid batched / one request at a time (--sharing, --executor ray)"


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    b.add_argument("--tasks", default="builtin:full", metavar="FILE|builtin:NAME", help="the requests")
    b.add_argument("--count", type=at_least(1), default=16, help="requests of the grid")
    b.add_argument("--length", type=at_least(1), default=None, help="prompt tokens of a long-context built-in family")
    b.add_argument("--new-tokens", type=at_least(1), default=None, help="new tokens of each request (default 16)")
    b.add_argument("--keep", type=keep_share, default=0.2, help="the budget as a share of the prompt, in (0, 1)")
    b.add_argument("--budget", choices=["slots", "ratio"], default="slots", help="one slot count, or --keep per prompt")
    b.add_argument("--batch-size", type=at_least(1), default=8, help="batch size compared with one at a time")
    b.add_argument("--rounds", type=at_least(1), default=3, help="rounds alternating the modes")
    b.add_argument("--no-replay", action="store_true", help="record only")
    b.add_argument(
        "--policies",
        action="extend",
        nargs="+",
        default=None,
        metavar="NAME[:GQA]",
        help="the grid's policies, as for `sweep --policies` (default h2o)",
    )
    b.add_argument("--gqa", action="extend", nargs="+", default=None, help="aggregations of the policies (default sum)")
    b.add_argument(
        "--sharing",
        action="store_true",
        help="compare the batched grid with its cells sharing one prompt forward per batch "
        "(DESIGN.md §12.5) and with each cell forwarding its prompts",
    )
    b.add_argument(
        "--executor",
        choices=["inprocess", "ray"],
        default="inprocess",
        help="ray compares the in-process executor with --workers Ray workers (local cluster)",
    )
    b.add_argument(
        "--workers", type=machine_count("workers"), default=2, help="--executor ray: Ray workers (default 2)"
    )


def run(args: argparse.Namespace) -> int:
    from ..sweep import sweep_grid

    return bench_sweep(
        model_name=args.model,
        tasks=args.tasks,
        count=args.count,
        batch_size=args.batch_size,
        keep=args.keep,
        replay=not args.no_replay,
        rounds=args.rounds,
        budget=args.budget,
        new_tokens=args.new_tokens or 16,
        executor=args.executor,
        workers=args.workers,
        policies=sweep_grid(args.policies, args.gqa) if args.policies or args.gqa else (("h2o", "sum"),),
        length=args.length,
        sharing=args.sharing,
    )


def bench_sweep(
    model_name: str | None = None,
    tasks: str = "builtin:full",
    count: int = 16,
    batch_size: int = 8,
    keep: float = 0.2,
    new_tokens: int = 16,
    replay: bool = True,
    rounds: int = 1,
    budget: str = "slots",
    model=None,
    tokenizer=None,
    executor: str = "inprocess",
    workers: int = 2,
    policies: Sequence[tuple[str, str]] = (("h2o", "sum"),),
    sharing: bool = False,
    length: int | None = None,
) -> int:
    """Requests per minute of the same sweep grid batched and one request at a time, side by side.

    ``executor="ray"`` compares instead the in-process executor with a Ray sweep of
    ``workers`` workers on a local cluster (:func:`_bench_sweep_ray`), on the grid of
    ``batch_size``. ``sharing`` compares instead the batched grid with its cells sharing one
    prompt forward per batch (DESIGN.md §12.5) and with every cell forwarding its prompts.

    The grid is ``count`` requests of ``tasks`` (each with ``new_tokens`` new
    tokens, so that they share batches; ``length``: prompt tokens of a long-context built-in
    family) under ``policies`` (``(name, gqa)`` pairs; default
    h2o gqa sum) at one budget:
    ``budget="slots"`` gives every request the slot count of ``keep`` times the
    median prompt length (one budget), ``budget="ratio"`` the keep ratio itself
    (resolved on each prompt: a budget per row; the batch still decodes in one
    step, DESIGN.md §2.7). Each mode records (and
    replays) into a fresh root; the modes alternate over ``rounds``. Prints the
    time of each, split into recording and replay, and the ratio.
    """
    import torch

    from h2o_lens.models import load_model, model_info
    from h2o_lens.packed import packing_available

    _check_sweep(executor, sharing, policies, budget, count, batch_size, keep, new_tokens, rounds, workers)
    if model is None:
        model, tokenizer = load_model(model_name, progress=False)
    reqs, lengths = _requests(tasks, count, new_tokens, length, tokenizer)
    slots = ratio_slots(keep, int(statistics.median(lengths)))
    what = f"{slots} slots ({keep:.0%} of the median prompt)" if budget == "slots" else f"keep ratio {keep:.0%}"
    names = ", ".join(f"{p} gqa {g}" for p, g in policies)
    print(
        f"{model_info(model)['name']}: {len(reqs)} requests of {tasks} ({min(lengths)}-{max(lengths)} prompt "
        f"tokens, {new_tokens} new), {names} at {what}, replay {'on' if replay else 'off'}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, packed decode products "
        f"{'on' if packing_available(model) else 'off'} (DESIGN.md §16); {rounds} round(s), modes alternating"
    )
    budgets = {"ratios": [keep]} if budget == "ratio" else {"slots": [slots]}
    grids = {size: _plan(reqs, tasks, model, tokenizer, policies, budgets, size, replay) for size in (batch_size, 1)}
    with torch.no_grad():  # warm-up: the first generate of a process pays one-time costs
        enc = tokenizer(
            [reqs[0].chat_text(tokenizer)], return_tensors="pt", add_special_tokens=False, return_token_type_ids=False
        )
        model.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    if executor == "ray":
        return _bench_sweep_ray(model_name, model, tokenizer, reqs, grids[batch_size], rounds, workers)
    # (label, grid, whether the cells of a batch share its prompt forward)
    if sharing:
        modes = [(f"batch {batch_size}, shared", grids[batch_size], True)]
        modes.append((f"batch {batch_size}, each cell", grids[batch_size], False))
    else:
        modes = [(f"batch {batch_size}" if batch_size > 1 else "batch 1", grids[batch_size], True)]
        modes.append(("one at a time", grids[1], True))
    times, shared = _time_modes(modes, rounds, reqs, model, tokenizer)
    _print_modes(modes, times, shared, len(reqs), sharing, replay)
    return 0


def _check_sweep(executor, sharing, policies, budget, count, batch_size, keep, new_tokens, rounds, workers) -> None:
    """Refuse, before the model loads, what the sweep bench cannot run (one line each)."""
    from h2o_lens import policies as registry
    from h2o_lens.errors import ConfigError

    if executor not in ("inprocess", "ray"):
        raise ConfigError(f"bench sweep --executor {executor!r}: expected inprocess or ray")
    if budget not in ("slots", "ratio"):
        raise ConfigError(f"bench sweep --budget {budget!r}: expected slots or ratio")
    for name, value in (("count", count), ("batch-size", batch_size), ("new-tokens", new_tokens)):
        check_ints("sweep", name, value, 1)
    check_ints("sweep", "rounds", rounds, 1)
    check_ints("sweep", "workers", workers, 1)
    check_keep("sweep", keep)
    if sharing:
        if executor != "inprocess":
            raise ConfigError("bench sweep --sharing compares two in-process sweeps; drop --executor ray")
        if len({(p, g) for p, g in policies if registry.get(p).evicts}) < 2:
            raise ConfigError(
                "bench sweep --sharing: each batch of this grid has one H2O configuration, so there is "
                "no prompt forward to share; give several, e.g. --policies h2o,tova,local or --gqa sum,max"
            )


def _requests(tasks: str, count: int, new_tokens: int, length: int | None, tokenizer: Any):
    """The grid's requests, each with ``new_tokens`` new tokens, and their prompt lengths."""
    import dataclasses

    from h2o_lens.tasks.builtins import resolve_tasks

    reqs = [
        dataclasses.replace(t, max_new_tokens=new_tokens)
        for t in resolve_tasks(tasks, count=count, tokenizer=tokenizer, length=length)
    ]
    lengths = [len(tokenizer(t.chat_text(tokenizer), add_special_tokens=False)["input_ids"]) for t in reqs]
    return reqs, lengths


def _plan(reqs, tasks: str, model, tokenizer, policies, budgets: dict, size: int, replay: bool):
    """The grid of ``reqs`` in batches of ``size`` (:func:`commands.grid.plan_grid`)."""
    from h2o_lens.models import model_info

    from ..grid import plan_grid

    return plan_grid(
        reqs,
        tokenizer,
        model=str(model_info(model)["name"]),
        tasks_spec=f"bench:{tasks}",
        policies=list(policies),
        ratios=budgets.get("ratios"),
        slots=budgets.get("slots"),
        batch_size=size,
        dtype=str(model.dtype).removeprefix("torch."),
        replay=replay,
    )


def _time_modes(modes, rounds: int, reqs, model, tokenizer):
    """Per mode label the ``(seconds, record seconds, replay seconds)`` of each round (the modes
    alternating, each into a fresh root) and the prompt forwards its cells shared."""
    import shutil
    import tempfile
    from pathlib import Path

    from ..grid import run_grid

    times: dict[str, list[tuple[float, float, float]]] = {label: [] for label, _, _ in modes}
    shared: dict[str, int] = {}
    for _ in range(rounds):
        for label, grid, share in modes:
            root = Path(tempfile.mkdtemp(prefix="h2o-lens-bench-sweep-"))
            try:
                report = run_grid(root, grid, reqs, model, tokenizer, progress=False, share_prompts=share)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            if report.failed:
                raise RuntimeError(f"bench sweep: cells failed: {report.failed}")
            times[label].append((report.seconds, report.record_seconds, report.replay_seconds))
            shared[label] = report.prompts_reused
    return times, shared


def _print_modes(modes, times, shared, requests: int, sharing: bool, replay: bool) -> None:
    """The table of the modes' medians and the ratio of the first mode's rate to the second's."""
    head = f"{'mode':<22} {'runs':>5} {'seconds':>8} {'record s':>9} {'replay s':>9} {'requests/min':>13}"
    print(head + " prompt forwards shared")
    rate, rec, rep = {}, {}, {}
    for label, grid, _ in modes:
        total, rec[label], rep[label] = (statistics.median(t[i] for t in times[label]) for i in range(3))
        rate[label] = 60 * requests / total
        print(
            f"{label:<22} {len(grid.cells):>5} {total:>8.1f} {rec[label]:>9.1f} {rep[label]:>9.1f} "
            f"{rate[label]:>13.1f} {shared[label]:>22}"
        )
    (first, *_), (second, *_) = modes
    what = "shared / each cell" if sharing else "batched / one at a time"
    print(f"{what}: {rate[first] / rate[second]:.2f}x requests per minute")
    if replay:  # the two stages side by side: only the generation has rows to batch
        print(
            f"  recording alone (generation, eviction logs, verdicts: what `sweep --no-replay` runs): "
            f"{rec[second] / rec[first]:.2f}x; the replay (teacher-forced forwards, one request at a "
            f"time in both modes): {rep[second] / rep[first]:.2f}x"
        )


def _bench_sweep_ray(model_name, model, tokenizer, reqs, grid, rounds: int, workers: int) -> int:
    """Cells per minute of one grid in-process and on ``workers`` Ray workers, side by side.

    The Ray workers are started (and warmed up) once, before the clock; each round
    runs the grid into a fresh root both ways. The per-cell scheduling overhead is
    the workers' time outside the cells, ``(wall × workers − Σ cell seconds) / cells``,
    and the median round trip of a call that runs nothing.
    """
    import shutil
    import tempfile
    from pathlib import Path

    import recorders.recorder  # noqa: F401  (imported before the clock, as the workers do)
    import recorders.replay  # noqa: F401

    from ..grid import run_grid
    from ..ray_sweep import RayOptions, RaySweep, scheduling_overhead_ms

    dtype = str(model.dtype).removeprefix("torch.")
    with RaySweep(model_name, dtype, RayOptions(workers=workers)) as pool:
        t0 = time.perf_counter()
        pool.start()
        pool.warm_up()
        start = time.perf_counter() - t0
        round_trip = pool.round_trip_ms()
        times: dict[str, list[float]] = {"in-process": [], f"ray x{workers}": []}
        overheads = []
        for _ in range(rounds):
            for mode in times:
                root = Path(tempfile.mkdtemp(prefix="h2o-lens-bench-sweep-"))
                busy = [w.busy_seconds for w in pool.workers]
                try:
                    if mode == "in-process":
                        report = run_grid(root, grid, reqs, model, tokenizer, progress=False)
                    else:
                        report = pool.run(root, grid, reqs, progress=False)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                if report.failed or len(report.ran) != len(grid.cells):
                    raise RuntimeError(f"bench sweep: cells not run: {report.failed or report.busy}")
                times[mode].append(report.seconds)
                if mode != "in-process":
                    spent = [w.busy_seconds - b for w, b in zip(pool.workers, busy)]
                    overheads.append(scheduling_overhead_ms(report.seconds, spent, len(grid.cells)))
    print(f"{'executor':<14} {'cells':>6} {'seconds':>8} {'cells/min':>10} {'requests/min':>13}")
    rate = {}
    for mode, ts in times.items():
        total = statistics.median(ts)
        rate[mode] = 60 * len(grid.cells) / total
        print(f"{mode:<14} {len(grid.cells):>6} {total:>8.1f} {rate[mode]:>10.1f} {60 * len(reqs) / total:>13.1f}")
    ray_mode = f"ray x{workers}"
    print(f"ray / in-process: {rate[ray_mode] / rate['in-process']:.2f}x cells per minute")
    print(
        f"scheduling overhead per cell: {statistics.median(overheads):.1f} ms (worker time outside cells), "
        f"{round_trip:.2f} ms (no-op round trip); workers started and warm in {start:.1f} s (not timed above)"
    )
    return 0
