"""``h2o-lens tasks``: task files: export the built-in families, check a file, list families, import a
benchmark's data file."""

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
    _add_import(ts)


def _add_import(ts: Any) -> None:
    im = ts.add_parser(
        "import",
        help="a local RULER, LongBench, kvpress or needle-in-a-haystack file as a task file (DESIGN.md §20.2)",
    )
    im.add_argument("file", help="the data file (JSONL; kvpress also Parquet); nothing is downloaded")
    im.add_argument("--from", dest="fmt", required=True, choices=["ruler", "longbench", "kvpress", "niah"])
    im.add_argument("-o", "--output", required=True, help="task file to write")
    im.add_argument(
        "--match", choices=["all", "part"], default="all", help="ruler: every output must occur (default) or any one"
    )
    im.add_argument("--dataset", default=None, help="longbench: the data set of lines without a 'dataset' field")
    im.add_argument(
        "--f1-min", type=float, default=0.5, help="longbench: token F1 from which an answer is correct (default 0.5)"
    )
    im.add_argument("--max-new-tokens", type=int, default=None, help="generation length (default: the format's)")
    im.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return {"export": _export, "check": _check, "list": _list, "import": _import}[args.tasks_command](args)


def _import(args: argparse.Namespace) -> int:
    """``tasks import FILE --from FORMAT -o OUT``: a benchmark's local data file as a task file."""
    from h2o_lens.errors import ConfigError
    from h2o_lens.tasks.importers import import_tasks
    from h2o_lens.tasks.taskfile import summarise_tasks, write_tasks

    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise ConfigError(f"-o {args.output!r}: its folder does not exist; create it or give another path")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    tasks = import_tasks(
        args.file,
        args.fmt,
        match=args.match,
        dataset=args.dataset,
        f1_min=args.f1_min,
        max_new_tokens=args.max_new_tokens,
    )
    write_tasks(tasks, args.output)
    print(f"wrote {len(tasks)} requests to {args.output}")
    for kind, summary in summarise_tasks(tasks):
        print(f"  {kind}: {summary}")
    unchecked = sorted({t.kind for t in tasks if t.answer is None})
    if unchecked:
        print(
            f"  no checker for {', '.join(unchecked)} (its metric is not a string match or F1): "
            "verdicts are null, explain compares with the full-cache answer"
        )
    return 0


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
