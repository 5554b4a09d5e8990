"""``h2o-lens tasks``: task files: export the built-in families, check a file, list families."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .options import at_least

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    t = sub.add_parser("tasks", help="task files: export the built-in families, check a file, list families")
    ts = t.add_subparsers(dest="tasks_command", required=True)
    ex = ts.add_parser("export", help="write builtin:NAME (or a task file) as a JSONL task file")
    ex.add_argument("spec", metavar="builtin:NAME", help="a built-in family (see `h2o-lens tasks list`) or a file")
    ex.add_argument("--length", type=at_least(1), default=None, help="prompt length in tokens (long-context families)")
    ex.add_argument("--seed", type=int, default=0, help="seed of the generated requests")
    ex.add_argument("--count", type=at_least(1), default=None, help="number of requests (default: the family's)")
    ex.add_argument("--model", default=None, help="tokenizer that counts --length (default: the packaged model)")
    ex.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    ex.add_argument(
        "--force", action="store_true", help="replace the -o file even though it is not a task file h2o-lens wrote"
    )
    ex.set_defaults(func=run)
    ch = ts.add_parser("check", help="validate a task file and summarise it per kind")
    ch.add_argument("file")
    ch.set_defaults(func=run)
    ls = ts.add_parser("list", help="the built-in task families")
    ls.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return {"export": _export, "check": _check, "list": _list}[args.tasks_command](args)


def _export(args: argparse.Namespace) -> int:
    """``tasks export SPEC``: a built-in family (or a task file) as a JSONL task file."""
    from h2o_lens.errors import ConfigError
    from h2o_lens.tasks.builtins import resolve_tasks
    from h2o_lens.tasks.taskfile import dumps_tasks, write_tasks

    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise ConfigError(f"-o {args.output!r}: its folder does not exist; create it or give another path")
    if args.output and not os.path.isdir(args.output):  # a file of the user's is not replaced (DESIGN.md §5.1)
        from runlog.ownership import check_output_file

        check_output_file(args.output, markers=(), force=args.force or exported(args.output))
    if args.spec.startswith("builtin:"):  # an unknown family fails before a model loads
        from h2o_lens.tasks.builtins import family

        try:
            family(args.spec.removeprefix("builtin:"))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    tokenizer = None
    builtin = args.spec.startswith("builtin:")
    if builtin and (args.length is not None or args.model is not None):  # --length counts its tokens
        from h2o_lens.models import load_model

        _, tokenizer = load_model(args.model, progress=False)
    tasks = resolve_tasks(args.spec, seed=args.seed, length=args.length, count=args.count, tokenizer=tokenizer)
    if args.output:
        write_tasks(tasks, args.output)
        print(f"wrote {len(tasks)} requests to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(dumps_tasks(tasks, source="<stdout>"))
    return 0


def exported(path: str) -> bool:
    """Whether ``path`` is a task file as ``tasks export`` writes it: it loads, and its text is
    exactly what the export writes for those tasks (a file written by hand, or any other file,
    is not)."""
    import json

    from h2o_lens.tasks.taskfile import dumps_tasks, load_tasks

    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        again = dumps_tasks(load_tasks(path), source=path)
    except Exception:  # noqa: BLE001 - unreadable, or not a task file: not one the export wrote
        return False
    if path.endswith(".json"):
        again = json.dumps([json.loads(line) for line in again.splitlines()], ensure_ascii=False, indent=1) + "\n"
    return text == again


def _check(args: argparse.Namespace) -> int:
    """``tasks check FILE``: validate a task file; one summary line per kind."""
    from h2o_lens.tasks.taskfile import load_tasks, summarise_tasks

    tasks = load_tasks(args.file)
    print(f"{args.file}: {len(tasks)} request{'s' * (len(tasks) != 1)}, valid")
    for kind, summary in summarise_tasks(tasks):
        print(f"  {kind}: {summary}")
    return 0


def _list(args: argparse.Namespace) -> int:
    """``tasks list``: the built-in families, one line each."""
    from h2o_lens.tasks.builtins import FAMILIES

    width = max(len(name) for name in FAMILIES) + len("builtin:")
    for name, build in FAMILIES.items():
        doc = (build.__doc__ or "").strip().splitlines()
        print(f"{'builtin:' + name:<{width}}  {doc[0] if doc else ''}")
    return 0
