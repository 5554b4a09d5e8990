"""The built-in task families, by name, as :class:`~h2o_lens.tasks.taskfile.FileTask` lists.

``builtin:NAME`` on the command line resolves here. A family is a callable
``family(*, seed, length, count, tokenizer) -> list[FileTask]``: ``length`` is the
prompt length in tokens of ``tokenizer`` (``None``: the family's own), ``count``
the number of requests (``None``: the family's default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .taskfile import FileTask, from_builtin

__all__ = ["FAMILIES", "family", "Family"]

Family = Callable[..., list[FileTask]]


def _suite(size: str) -> Family:
    def build(*, seed: int = 0, length: int | None = None, count: int | None = None, tokenizer: Any = None):
        from .real import suite

        if length is not None:
            raise ValueError(
                f"builtin:{size} has fixed short prompts (155-252 tokens) and takes no --length; "
                "the long-context families do (see h2o-lens tasks list)"
            )
        tasks = [from_builtin(t) for t in suite(seed=seed, size=size)]
        return tasks[:count] if count is not None else tasks

    build.__doc__ = f"The short real-model suite, size {size!r} (h2o_lens.tasks.real)."
    return build


#: name -> family; the short suites of :mod:`h2o_lens.tasks.real`, then the long-context families
FAMILIES: dict[str, Family] = {"demo": _suite("demo"), "small": _suite("small"), "full": _suite("full")}

# the long-context families (h2o_lens.tasks.longctx): needle, multi_needle, delayed_reference,
# restated_fact, variable_tracking, topic_switch_long, long_generation
from .longctx import LONG_FAMILIES  # noqa: E402

FAMILIES.update(LONG_FAMILIES)


def family(name: str) -> Family:
    """The family ``name`` (a ``ValueError`` listing the known names otherwise)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown built-in task family {name!r}; known: {', '.join(FAMILIES)}") from None
