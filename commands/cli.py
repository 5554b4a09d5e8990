"""The ``h2o-lens`` command line: one module per subcommand, each with ``add_parser(sub)`` and
``run(args)``; this module builds the parser from them and runs the one chosen."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import (
    app,
    benchmarks,
    check,
    demo,
    eval,
    explain,
    generate,
    plan,
    record,
    replay,
    report,
    runs,
    samples,
    sql,
    sweep,
    tasks,
)

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

#: the subcommands in the order ``h2o-lens --help`` lists them
SUBCOMMANDS = (
    generate,
    record,
    replay,
    check,
    runs,
    sql,
    report,
    explain,
    demo,
    sweep,
    plan,  # budgets per layer and KV set for H2O (DESIGN.md §2.15)
    tasks,
    samples,
    app,
    benchmarks,
    eval,  # lm-evaluation-harness tasks under each policy (DESIGN.md §20.1)
)


class UsageError(Exception):
    """A command line argparse refuses: its message, already in the house form."""


class Parser(argparse.ArgumentParser):
    """An argparse parser whose refusals are one line, ``h2o-lens: error: SUBCOMMAND: ...``
    (exit 2), like every other refusal of bad input; its subcommands' parsers are of this class too."""

    def error(self, message: str):  # type: ignore[override]
        where = self.prog.removeprefix("h2o-lens").strip()
        hint = f"h2o-lens {where} --help" if where else "h2o-lens --help"
        raise UsageError(f"h2o-lens: error: {where + ': ' if where else ''}{message} (see {hint})")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="h2o-lens", description="Exact H2O KV-cache eviction, recorded and explained.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    from h2o_lens.errors import H2OLensError

    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except H2OLensError as e:
        print(f"h2o-lens: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`| head`): end quietly, as Unix tools ended by SIGPIPE do.
        # Point stdout at /dev/null so the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except OSError as e:  # a write no layer wrapped (a full disk, a read-only folder): one line, no traceback
        import errno

        from runlog.errors import storage_error

        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG):
            text = str(storage_error(e.filename if e.filename is not None else "a file", e))
        else:
            text = f"{e.strerror or e}" + (f": {e.filename}" if e.filename is not None else "")
        print(f"h2o-lens: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
