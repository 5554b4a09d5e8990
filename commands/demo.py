"""``h2o-lens demo``: the task suite on the default model: H2O at two budgets and the baselines."""

from __future__ import annotations

import argparse
from typing import Any

from .options import add_task_args, load_model_args, resolve_requests, task_source
from .paths import add_force_arg, check_out_root

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    d = sub.add_parser("demo", help="the task suite on the default model: H2O at two budgets and the baselines")
    d.add_argument("--out", default="demo_runs", help="runs root (default: ./demo_runs)")
    d.add_argument("--no-reports", action="store_true", help="skip the HTML/Markdown/JSON reports")
    d.add_argument(
        "--no-explain",
        action="store_true",
        help="skip the counterfactual re-runs of one H2O failure per task family (the table then shows estimates)",
    )
    add_task_args(d, "the demo suite")
    add_force_arg(d, "into --out")
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .jobs import demo

    check_out_root(args.out, force=args.force)  # before any model loads
    spec, args.count = task_source(args.tasks, args.count, "builtin:demo")
    if args.tasks is None or args.tasks.isdigit():
        if args.length is not None:
            from h2o_lens.errors import ConfigError

            raise ConfigError("--length needs --tasks builtin:NAME of a long-context family")
        from h2o_lens.tasks import suite

        tasks = suite(size="demo")  # the demo suite as it always was
        tasks = tasks[: args.count] if args.count is not None else tasks
        model = tok = None
        if args.model is not None or args.dtype != "float32":
            model, tok = load_model_args(args)
    else:
        model, tok = load_model_args(args)
        tasks = resolve_requests(spec, args, tok)
    demo(
        args.out,
        tasks=tasks,
        model=model,
        tokenizer=tok,
        reports=not args.no_reports,
        explain=not args.no_explain,
        force=args.force,
    )
    return 0
