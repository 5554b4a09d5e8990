"""``h2o-lens plan``: budgets per layer (or KV set) for H2O from a calibration set (DESIGN.md §2.15)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .options import add_task_args, at_least, load_model_args, resolve_requests, share, task_source
from .paths import add_force_arg

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="measure where the model's attention needs slots and write an H2O budget plan (record/sweep --plan)",
    )
    add_task_args(p, "builtin:small")
    p.add_argument("--total", type=share, required=True, help="the keep ratio of the plan, over all layers and sets")
    p.add_argument("--by", choices=("layer", "head"), default="layer", help="one share per layer, or per KV set")
    p.add_argument("--gqa", choices=("sum", "max", "none"), default="sum", help="the KV sets of the plan")
    p.add_argument(
        "--steps",
        type=at_least(0),
        default=8,
        help="teacher-forced tokens of each calibration sweep (0: no sweep, the attention mass alone)",
    )
    p.add_argument("--rows", type=at_least(1), default=32, help="last query rows of each prompt measured")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", required=True, help="the plan file to write (JSON)")
    add_force_arg(p, "over -o")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from h2o_lens import plan as budget_plan
    from h2o_lens.errors import ConfigError
    from h2o_lens.planner import plan_budgets
    from runlog.ownership import check_output_file

    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise ConfigError(f"-o {args.output!r}: its folder does not exist; create it or give another path")
    check_output_file(args.output, markers=(budget_plan.PLAN_MARKER,), force=args.force)
    spec, args.count = task_source(args.tasks, args.count, "builtin:small")
    model, tok = load_model_args(args)
    tasks = resolve_requests(spec, args, tok)
    prompts = [tok(t.prompt if args.raw else t.chat_text(tok), add_special_tokens=args.raw).input_ids for t in tasks]
    plan, evidence = plan_budgets(
        model, prompts, args.total, by=args.by, gqa=args.gqa, steps=args.steps, rows=args.rows, progress=not args.quiet
    )
    evidence.update(tasks=spec, model=getattr(model.config, "name_or_path", None))
    plan.save(args.output, evidence=evidence)
    for layer, row in enumerate(plan.ratios):
        shares = " ".join(f"{x:.3f}" for x in row)
        k90 = " ".join(f"{x:.3f}" for x in evidence["k90"][layer])
        sens = " ".join(f"{x:.2f}" for x in evidence["sensitivity"][layer])
        print(f"layer {layer:>2}: keep {shares}  (k90 {k90}; sensitivity {sens})")
    print(f"wrote {args.output}: {plan.describe()}, {len(prompts)} calibration prompts", file=sys.stderr)
    return 0
