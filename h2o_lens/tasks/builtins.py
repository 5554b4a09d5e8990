"""The built-in task families, by name, as :class:`~h2o_lens.tasks.taskfile.FileTask` lists.

``builtin:NAME`` on the command line resolves here (:func:`resolve_tasks`, which takes the
path of a task file too). A family is a callable
``family(*, seed, length, count, tokenizer) -> list[FileTask]``: ``length`` is the
prompt length in tokens of ``tokenizer`` (``None``: the family's own), ``count``
the number of requests (``None``: the family's default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, H2OLensError
from .taskfile import FileTask, from_builtin, load_tasks

__all__ = ["FAMILIES", "family", "Family", "resolve_tasks"]

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


def resolve_tasks(
    spec: str, *, seed: int = 0, length: int | None = None, count: int | None = None, tokenizer: Any = None
) -> list[FileTask]:
    """``builtin:NAME`` (a family of :data:`FAMILIES`) or the path of a task file
    (:func:`~h2o_lens.tasks.taskfile.load_tasks`).

    Raises :class:`ConfigError` (a :class:`TaskFileError` for a bad file) for an unknown
    family, a ``count`` below 1 or a ``length`` given with a task file.
    """
    if count is not None and count < 1:
        raise ConfigError(f"count must be at least 1, got {count}")
    if spec.startswith("builtin:"):
        try:
            return family(spec.removeprefix("builtin:"))(seed=seed, length=length, count=count, tokenizer=tokenizer)
        except H2OLensError:
            raise
        except ValueError as exc:  # an unknown family, a length it does not take
            raise ConfigError(str(exc)) from None
    if length is not None:
        raise ConfigError(
            f"length {length} applies to the built-in families (builtin:NAME); the prompts of task file "
            f"{spec!r} are used as written"
        )
    tasks = load_tasks(spec)
    return tasks[:count] if count is not None else tasks
