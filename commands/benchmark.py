"""``h2o-lens bench``: the benchmarks that print ratios measured side by side.

The parser and the dispatch only; the benchmarks themselves live beside it (:mod:`commands.bench`,
:mod:`commands.bench_press`) and in the layers they time, imported when one runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from .options import press_items

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks that print ratios measured side by side")
    b.add_argument("what", choices=["decode", "record", "kernels", "sql", "runs", "explain", "sweep", "press", "guard"])
    b.add_argument("--model", default=None)
    b.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="decode: context lengths (512 2048); press: (2048 4096)"
    )
    b.add_argument(
        "--agreement",
        action="store_true",
        help="press: kept-set agreement of ObservedAttention and TOVA presses with h2o and tova (DESIGN.md §17.2)",
    )
    b.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode: batch sizes")
    b.add_argument("--keep", type=float, default=0.2, help="B as a share of the context")
    b.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--memory-limit", default="512MB", help="sql: the console's memory limit")
    b.add_argument(
        "--context",
        type=int,
        default=None,
        help="record: time and peak RSS of recording, then replaying, one prompt of this many tokens",
    )
    b.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="record: new tokens of that prompt (default 256); sweep: of each request (default 16); "
        "decode --assistant: tokens generated (default 96); guard: each request's limit (default its task's)",
    )
    b.add_argument("--runs", type=int, default=5000, help="runs: synthetic runs in the root")
    b.add_argument("--root", default=None, help="runs: reuse (or write once) this synthetic root")
    b.add_argument("--no-browser", action="store_true", help="runs: skip the dashboard timings")
    b.add_argument("--tasks", default="builtin:full", help="sweep, guard: the requests (FILE or builtin:NAME)")
    b.add_argument("--ratio", type=float, default=0.2, help="guard: the base keep ratio (DESIGN.md §18.6)")
    b.add_argument("--seed", type=int, default=0, help="guard: the seed of the requests the guard runs on")
    b.add_argument(
        "--threshold", type=float, default=None, help="guard: act at this risk instead of fitting it on seed + 1"
    )
    b.add_argument(
        "--guard", action="store_true", help="decode: the guard's cost per decode step (default context 4096)"
    )
    b.add_argument(
        "--guard-policies",
        nargs="+",
        default=None,
        metavar="ACTION:TARGET[:RESCUE][@THRESHOLD]",
        help="guard: the guard's policies to run, e.g. raise:0.35:0.15 refill:1.0 raise:0.35:0.25@0 (@: act at "
        "that risk instead of the fitted or --threshold one; 0: every request; none: no policy, the AUROC "
        "alone) (default raise:0.35:0.15 raise:0.5 refill:1.0)",
    )
    b.add_argument(
        "--fit-tasks",
        default=None,
        metavar="FILE|builtin:NAME",
        help="guard: the requests the weights and threshold are fitted on (default: --tasks at seed + 1 when "
        "built-in; a task file needs another file of the same traffic)",
    )
    b.add_argument(
        "--fit",
        default=None,
        metavar="FILE",
        help="guard: measure a fit saved by --save-fit (on other requests) instead of fitting here",
    )
    b.add_argument(
        "--save-fit",
        default=None,
        metavar="FILE",
        help="guard: write the fitted weights, heads and threshold as JSON (for record --guard-fit)",
    )
    b.add_argument(
        "--threshold-rule",
        choices=["midpoint", "lowest"],
        default=None,
        help="guard: where the fitted threshold sits in the fit set's gap: halfway (midpoint, the default) "
        "or at the lowest score it flags",
    )
    b.add_argument(
        "--heads",
        type=int,
        default=5,
        help="guard: the layers and KV sets the prefill signal reads, chosen on the fit set (0: all of them)",
    )
    b.add_argument(
        "--dump", default=None, metavar="FILE", help="guard: write each request's outcome and signals as JSON"
    )
    b.add_argument(
        "--fixed",
        nargs="+",
        type=float,
        default=None,
        help="guard: the fixed keep ratios of the accuracy table (default 0.05 0.1 0.2 0.35 0.5 1.0)",
    )
    b.add_argument("--count", type=int, default=16, help="sweep: requests of the grid")
    b.add_argument(
        "--length",
        type=int,
        default=None,
        help="sweep, explain: prompt tokens of a long-context built-in family (explain: --tasks builtin:NAME, "
        "default each family the full cache solves; capped at the model's window less the new tokens)",
    )
    b.add_argument("--batch-size", type=int, default=8, help="sweep: batch size compared with one at a time")
    b.add_argument("--no-replay", action="store_true", help="sweep: record only")
    b.add_argument(
        "--budget", choices=["slots", "ratio"], default="slots", help="sweep: one slot count, or --keep per prompt"
    )
    b.add_argument(
        "--executor",
        choices=["inprocess", "ray"],
        default="inprocess",
        help="sweep: ray compares the in-process executor with --workers Ray workers (local cluster)",
    )
    b.add_argument("--workers", type=int, default=2, help="sweep --executor ray: Ray workers (default 2)")
    b.add_argument(
        "--policies",
        action="extend",
        nargs="+",
        default=None,
        metavar="NAME[:GQA]",
        help="sweep: the grid's policies, as for `sweep --policies` (default h2o); press: the presses timed "
        "(kvpress:NAME, default snapkv, streaming_llm, tova, observed_attention, knorm)",
    )
    b.add_argument(
        "--gqa", action="extend", nargs="+", default=None, help="sweep: aggregations of the policies (default sum)"
    )
    b.add_argument(
        "--sharing",
        action="store_true",
        help="sweep: compare the batched grid with its cells sharing one prompt forward per batch "
        "(DESIGN.md §12.5) and with each cell forwarding its prompts",
    )
    b.add_argument(
        "--assistant",
        nargs="?",
        const="lookup",
        choices=["lookup", "layers"],
        default=None,
        help="decode: speculative decoding's speed-up under H2O vs the full cache, with prompt lookup "
        "(default) or a draft of the model's first layers (DESIGN.md §14)",
    )
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from . import bench
    from .sweep import sweep_grid

    if args.what == "decode" and args.guard:
        from .bench_guard import bench_decode_guard

        return bench_decode_guard(
            model_name=args.model,
            contexts=tuple(args.contexts or (4096,)),
            batches=tuple(args.batch),
            keep=args.keep,
            steps=args.steps,
            rounds=args.rounds,
        )
    if args.what == "decode" and args.assistant:
        return bench.bench_assistant(
            model_name=args.model,
            draft=args.assistant,
            keep=args.keep,
            rounds=args.rounds,
            new_tokens=args.new_tokens or 96,
        )
    if args.what == "decode":
        return bench.bench_decode(
            model_name=args.model,
            contexts=args.contexts or [512, 2048],
            batches=args.batch,
            keep=args.keep,
            steps=args.steps,
            rounds=args.rounds,
        )
    if args.what == "record" and (args.context or args.new_tokens):
        return bench.bench_record_memory(
            model_name=args.model, context=args.context or 4096, new_tokens=args.new_tokens or 256, keep=args.keep
        )
    if args.what == "record":
        return bench.bench_record(model_name=args.model, keep=args.keep, rounds=args.rounds)
    if args.what == "explain":
        return bench.bench_explain(
            model_name=args.model,
            task=None if args.tasks == "builtin:full" else args.tasks.removeprefix("builtin:"),
            keep=args.keep,
            length=args.length,
            rounds=args.rounds,
        )
    if args.what == "runs":
        return bench.bench_runs(runs=args.runs, root=args.root, browser=not args.no_browser)
    if args.what == "sweep":
        return bench.bench_sweep(
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
    if args.what == "guard":
        from .bench_guard import BUDGETS, bench_guard

        return bench_guard(
            model_name=args.model,
            tasks=args.tasks,
            ratio=args.ratio,
            count=args.count,
            length=args.length,
            seed=args.seed,
            fit_seed=args.seed + 1,
            threshold=args.threshold,
            policies=guard_policies(args.guard_policies),
            budgets=tuple(args.fixed) if args.fixed else BUDGETS,
            dump=args.dump,
            fit_tasks=args.fit_tasks,
            heads=args.heads,
            save_fit=args.save_fit,
            fit_file=args.fit,
            new_tokens=args.new_tokens,
            threshold_rule=args.threshold_rule,
        )
    if args.what == "press":
        from .bench_press import bench_press, bench_press_agreement

        if args.agreement:
            return bench_press_agreement(model_name=args.model)
        from h2o_lens import presses

        timed = tuple(presses.parse_sweep_policy(p) for p in press_items(args.policies)) or None
        return bench_press(
            model_name=args.model,
            contexts=tuple(args.contexts or (2048, 4096)),
            rounds=args.rounds,
            new_tokens=args.new_tokens or 16,
            **({"timed": timed} if timed else {}),
        )
    if args.what == "sql":
        from analyses.bench import bench_sql

        bench_sql(memory_limit=args.memory_limit)
        return 0
    if args.what == "kernels":
        from h2o_lens.kernels.bench import bench_kernels

        bench_kernels()
        return 0
    raise SystemExit(f"unknown benchmark {args.what!r}")


def guard_policies(items: list[str] | None) -> tuple[tuple, ...]:
    """``--guard-policies``: ``ACTION:TARGET[:RESCUE][@THRESHOLD]`` items as ``(action, target,
    rescue)``, or ``(action, target, rescue, threshold)`` with ``@`` (the bench's defaults when
    None); a malformed item is a one-line error."""
    if not items:
        from .bench_guard import POLICIES

        return POLICIES
    if items == ["none"]:
        return ()
    from .options import guard_item

    out = []
    for item in items:
        action, target, rescue, threshold = guard_item(item, "bench guard --guard-policies")
        out.append((action, target, rescue) if threshold is None else (action, target, rescue, threshold))
    return tuple(out)
