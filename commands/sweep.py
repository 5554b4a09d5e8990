"""``h2o-lens sweep``: keep ratio x policy over batches of requests."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from .options import (
    add_task_args,
    at_least,
    cpu_count,
    load_model_args,
    nonnegative,
    number,
    press_items,
    resolve_requests,
    split_list,
    task_source,
)
from .paths import add_force_arg, check_out_root

__all__ = ["add_parser", "run", "sweep_grid"]


def add_parser(sub: Any) -> None:
    sw = sub.add_parser("sweep", help="keep ratio x policy over batches of requests: quality, KV and latency curves")
    sw.add_argument("--out", default="sweep_runs", help="runs root of the grid (default: ./sweep_runs)")
    sw.add_argument(
        "--status", metavar="ROOT", default=None, help="print done / failed / to do per cell group of ROOT's grids"
    )
    sw.add_argument("--size", default="small", help="built-in suite when --tasks is not given (small | demo | full)")
    add_task_args(sw, "builtin:SIZE")
    budget = sw.add_mutually_exclusive_group()
    budget.add_argument(
        "--ratios",
        action="extend",
        nargs="+",
        default=None,
        help="keep ratios, comma list or repeated (default 1,0.4,0.2,0.1,0.05)",
    )
    budget.add_argument(
        "--slots", action="extend", nargs="+", default=None, help="slot counts per KV set instead of ratios"
    )
    sw.add_argument(
        "--policies",
        action="extend",
        nargs="+",
        default=None,
        metavar="NAME[:GQA]",
        help="policies of the grid, comma list or repeated (default: h2o:sum h2o:max and its baselines); "
        "e.g. h2o,local,sink or h2o tova scissorhands; kvpress:NAME is a kvpress press (snake_case name, "
        "e.g. kvpress:snapkv, kvpress:streaming_llm; pip install 'h2o-lens[kvpress]')",
    )
    sw.add_argument("--gqa", action="extend", nargs="+", default=None, help="aggregations, e.g. sum,max")
    sw.add_argument(
        "--plan",
        metavar="FILE",
        default=None,
        help="a budget plan (h2o-lens plan -o FILE): every h2o cell gets a twin under the plan scaled to its "
        "keep ratio (curve h2o-GQA+plan)",
    )
    sw.add_argument(
        "--cold",
        metavar="STORE:RECALL[:SELECTION[:EVERY]]",
        default=None,
        help="a cold tier (DESIGN.md §2.13): every cell of an evicting policy gets a twin (curve POLICY+cold) "
        "whose evicted K/V go to STORE (cpu | disk) and a window of RECALL slots inside its budget is refilled "
        "with the cold entries the queries attend to most, SELECTION exact | pages | pages=N (default exact), "
        "a refill every EVERY decode steps (default 1)",
    )
    sw.add_argument(
        "--press-args",
        action="extend",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="parameters of the grid's kvpress presses (kvpress:NAME in --policies), comma list or repeated, set "
        "on every press that takes them, e.g. window_size=32; compression_ratio comes from each keep ratio",
    )
    sw.add_argument("--batch-size", type=at_least(1), default=8, help="requests per generate call and run (default 8)")
    sw.add_argument("--no-replay", action="store_true", help="record only (no KL or dropped mass in the curves)")
    sw.add_argument("--page-size", type=at_least(1), default=16, help="tokens per KV page")
    add_force_arg(sw, "into --out")
    sw.add_argument(
        "--past-context",
        action="store_true",
        help="run requests whose prompt and max_new_tokens go past the model's context window "
        "(refused otherwise; said once)",
    )
    ray = sw.add_argument_group("executor (DESIGN.md §13)")
    ray.add_argument(
        "--executor",
        choices=["inprocess", "ray"],
        default="inprocess",
        help="where the cells run: this process (default) or the workers of a Ray cluster "
        "(pip install 'h2o-lens[ray]'); --out must then be a folder every node sees",
    )
    ray.add_argument(
        "--address", default=None, help="ray: an existing cluster (e.g. auto, HOST:6379); default a local one"
    )
    ray.add_argument(
        "--workers",
        type=at_least(1),
        default=None,
        help="ray: worker actors, each loading the model once (default: fill the cluster; without --address, "
        "at most this machine's CPU cores)",
    )
    ray.add_argument("--gpus-per-worker", type=nonnegative, default=0.0, help="ray: GPUs per worker (0: CPU workers)")
    ray.add_argument(
        "--retries", type=at_least(0), default=1, help="ray: times a cell whose worker died is run again (default 1)"
    )
    sw.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from h2o_lens import presses
    from h2o_lens.errors import ConfigError

    from .grid import grid_status
    from .jobs import SWEEP_RATIOS, sweep

    if args.status is not None:
        print(grid_status(args.status))
        return 0
    executor = _sweep_executor(args)  # ConfigError (Ray missing, bad options): exit 2 before any load
    grid = sweep_grid(args.policies, args.gqa, args.press_args)  # ConfigError: exit 2 before the model loads
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out!r} is an existing file; give a folder for the sweep's runs")
    check_out_root(args.out, force=args.force)  # before the model loads
    spec, args.count = task_source(args.tasks, args.count, f"builtin:{args.size}")
    plan = None
    if args.plan is not None:  # read before the model loads
        from h2o_lens.plan import load

        if args.slots:
            raise ConfigError("--plan takes keep ratios (--ratios): the plan is scaled to each ratio")
        try:
            plan = load(args.plan)
        except ConfigError as exc:
            raise ConfigError(f"--plan {args.plan}: {exc}") from None
    cold = _cold_tier(args.cold, grid, args.slots)  # before the model loads
    ratios = slots = None
    if args.slots:
        slots = [number(v, int, "--slots") for v in split_list(args.slots)]
        pressed = [p for p, _ in grid if presses.is_press_policy(p)]
        if pressed:
            raise ConfigError(
                f"{pressed[0]}: a press takes a keep ratio (compression_ratio = 1 - ratio), not a slot count; "
                "give --ratios for a grid with presses"
            )
    else:
        ratios = [number(v, float, "--ratios") for v in split_list(args.ratios)] or list(SWEEP_RATIOS)
    if executor is None:
        model, tok = load_model_args(args)
    else:  # the Ray workers load the model; the plan needs only the tokenizer here
        from h2o_lens.models import load_tokenizer

        model, tok = None, load_tokenizer(args.model)
    tasks = resolve_requests(spec, args, tok)
    try:
        sweep(
            args.out,
            tasks=tasks,
            tasks_spec=spec,
            model=model,
            tokenizer=tok,
            ratios=ratios,
            slots=slots,
            policies=grid,
            batch_size=args.batch_size,
            replay=not args.no_replay,
            seed=args.seed,
            page_size=args.page_size,
            command=["h2o-lens", *sys.argv[1:]] if sys.argv[1:2] == ["sweep"] else [],
            executor=executor,
            past_context=args.past_context,
            force=args.force,
            plan=plan,
            cold=cold,
        )
    finally:
        if executor is not None:
            executor.close()
    return 0


def sweep_grid(
    items: Sequence[str] | None, gqa: Sequence[str] | None = None, press_args: Sequence[str] | None = None
) -> tuple[tuple[str, str], ...]:
    """``--policies NAME[:GQA],...`` and ``--gqa G,...`` → ``((policy, gqa), ...)``.

    Neither given: the suite's default grid (h2o sum and max, then the baselines).
    A name without ``:GQA`` is swept with every aggregation of ``--gqa`` (default
    ``sum``); the full cache takes no aggregation. ``kvpress:NAME`` is a kvpress press
    (DESIGN.md §17), its arguments inline (``kvpress:snapkv(window_size=32)``) or from
    ``--press-args KEY=VALUE,...``, which sets them on every press of the grid that takes them.
    """
    from h2o_lens import policies, presses
    from h2o_lens.config import GQA_MODES
    from h2o_lens.errors import ConfigError

    from .jobs import SWEEP_POLICIES

    names, modes = press_items(items), split_list(gqa)
    shared = presses.parse_press_args(press_args)
    press_names = [n for n in names if presses.is_press_policy(n)]
    if shared and not press_names:
        raise ConfigError("--press-args sets parameters of kvpress presses; add one to --policies, e.g. kvpress:snapkv")
    grid: list[tuple[str, str]] = []
    taken: set[str] = set()
    for item in press_names:
        cls, args = presses.parse_sweep_policy(item)
        fields = presses.check_args(cls, {**args})  # kvpress imported: a press is used
        own = {k: v for k, v in shared.items() if k in fields}
        taken |= set(own)
        presses.check_args(cls, {**own, **args})
        name = presses.sweep_policy(cls, {**own, **args})
        if (name, "sum") not in grid:
            grid.append((name, "sum"))
    if set(shared) - taken:
        raise ConfigError(
            f"--press-args {', '.join(sorted(set(shared) - taken))}: no press of --policies takes it "
            f"({', '.join(press_names)})"
        )
    names = [n for n in names if not presses.is_press_policy(n)]
    if not names and grid:
        return tuple(grid)
    for mode in modes:
        if mode not in GQA_MODES:
            raise ConfigError(f"--gqa {mode!r}: unknown aggregation; expected a comma list of {', '.join(GQA_MODES)}")
    if not names:
        if not modes:
            return SWEEP_POLICIES
        names = [policies.DEFAULT, *policies.baselines()]
    presses_first, grid = grid, []
    for item in names:
        name, _, mode = item.partition(":")
        policies.get(name)  # ConfigError naming the known policies
        if mode and mode not in GQA_MODES:
            raise ConfigError(
                f"--policies {item!r}: unknown gqa {mode!r}; expected NAME or NAME:GQA with GQA "
                f"one of {', '.join(GQA_MODES)}, e.g. h2o:max"
            )
        for m in [mode] if mode else (modes or ["sum"]) if policies.get(name).evicts else ["sum"]:
            if (name, m) not in grid:
                grid.append((name, m))
    return tuple(grid + presses_first)


def _cold_tier(text: str | None, grid: Sequence[tuple[str, str]], slots: Sequence[str] | None) -> Any:
    """``--cold`` as a :class:`~h2o_lens.cold_config.ColdTier` (None without it), refused in one line
    when malformed, when no policy of the grid evicts into it, or when a ``--slots`` count cannot
    hold its window beside what the policy needs (a keep ratio is checked per prompt, before any cell)."""
    if text is None:
        return None
    from h2o_lens import policies
    from h2o_lens.cold_config import parse_cold
    from h2o_lens.config import H2OConfig
    from h2o_lens.errors import ConfigError

    from .grid import cold_takes

    tier = parse_cold(text)
    takers = [(p, g) for p, g in grid if cold_takes(p)]
    if not takers:
        raise ConfigError(
            f"--cold keeps what a policy evicts; no policy of the grid ({', '.join(p for p, _ in grid)}) takes a cold "
            "tier (a kvpress press or the full cache does not); add one, e.g. --policies h2o"
        )
    for count in [number(v, int, "--slots") for v in split_list(slots)] if slots else []:
        for policy, gqa in takers:
            try:
                heavy, recent = policies.half_split(count)
                H2OConfig(policy=policy, gqa=gqa, heavy=heavy, recent=recent, cold=tier)
            except ConfigError as exc:
                raise ConfigError(f"--cold {text} at --slots {count} ({policy}): {exc}") from None
    return tier


def _sweep_executor(args: argparse.Namespace):
    """``None`` for the in-process executor, else a :class:`~commands.ray_sweep.RaySweep` (not started)."""
    from h2o_lens.errors import ConfigError

    if args.executor != "ray":
        given = [o for o, v in (("--address", args.address), ("--workers", args.workers)) if v is not None]
        given += ["--gpus-per-worker"] if args.gpus_per_worker else []
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ConfigError(f"{', '.join(given)} only {verb} to a Ray sweep; add --executor ray")
        return None
    if args.address is None and args.workers is not None and args.workers > cpu_count():
        cores = cpu_count()
        raise ConfigError(
            f"--workers {args.workers}: the local Ray cluster runs on this machine of {cores} CPU "
            f"core{'s' if cores > 1 else ''}, which cannot start more workers than that; give 1 to {cores}, "
            "or --address of a cluster that has them"
        )
    from .ray_sweep import RayOptions, RaySweep, require_ray

    require_ray()
    options = RayOptions(
        address=args.address, workers=args.workers, gpus_per_worker=args.gpus_per_worker, retries=args.retries
    )
    return RaySweep(args.model, args.dtype, options)
