"""What several benchmarks share: budget halves, the checks of their sizes, a fresh process, peak
RSS, and the model's shape and the machine's memory read before any model loads."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from typing import Any

from ..limits import model_config

__all__ = [
    "HeldSlots",
    "generation_seconds",
    "halves",
    "check_keep",
    "check_ints",
    "fresh_env",
    "in_fresh_process",
    "peak_rss_bytes",
    "model_config",
    "available_memory",
    "check_positions",
    "check_memory",
]


def halves(budget: int) -> dict[str, int]:
    """``heavy`` and ``recent`` of a slot count, split in halves like a keep ratio's budget."""
    from h2o_lens.policies import half_split

    return dict(zip(("heavy", "recent"), half_split(budget)))


def check_keep(what: str, keep: float) -> None:
    """``keep`` a share of the context in (0, 1), or a ConfigError naming the option."""
    from h2o_lens.errors import ConfigError

    if not (isinstance(keep, int | float) and math.isfinite(keep) and 0 < keep < 1):
        raise ConfigError(f"bench {what}: --keep is the kept share of the context, in (0, 1); got {keep!r}")


def check_ints(what: str, name: str, values: Any, low: int) -> list[int]:
    """``values`` as a list of ints >= ``low``, or a ConfigError naming the option."""
    from h2o_lens.errors import ConfigError

    values = [values] if isinstance(values, int) else list(values)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < low]
    if not values or bad:
        raise ConfigError(f"bench {what}: --{name} takes ints >= {low}, got {values!r}")
    return values


def fresh_env() -> dict[str, str]:
    """This process's environment with the working directory first on ``PYTHONPATH``."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))


def in_fresh_process(code: str) -> dict | str:
    """Run ``python -c code`` in a fresh process; its last JSON line, or the error text."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], env=fresh_env(), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return json.loads(lines[-1])


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``VmHWM``; ``ru_maxrss`` where there is no procfs)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_memory() -> int | None:
    """Bytes this machine can still give a process: ``MemAvailable`` of ``/proc/meminfo`` (free
    physical pages where there is none); None when neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_positions(what: str, option: str, config: Any, positions: Iterable[tuple[int, int]]) -> None:
    """Refuse (ConfigError) a ``(context, positions)`` pair whose positions pass the model's
    ``max_position_embeddings``; ``config`` None (unknown model) checks nothing."""
    from h2o_lens.errors import ConfigError

    window = getattr(config, "max_position_embeddings", None)
    if not isinstance(window, int) or window <= 0:
        return
    for context, used in positions:
        if used > window:
            raise ConfigError(
                f"bench {what}: {option} {context} needs {used:,} positions (with the decode steps), past "
                f"the model's {window:,} (config.max_position_embeddings); give at most {window - (used - context)}"
            )


def check_memory(what: str, option: str, value: int, needed: int, about: str) -> None:
    """Refuse (ConfigError) a run that needs more than the machine's available memory: ``needed``
    bytes at least (``about`` says what they hold)."""
    from h2o_lens.errors import ConfigError

    have = available_memory()
    if have is not None and needed > have:
        raise ConfigError(
            f"bench {what}: {option} {value} needs at least {needed / 2**30:,.1f} GiB ({about}), more than the "
            f"{have / 2**30:,.1f} GiB this machine has available; give a smaller {option}"
        )


def generation_seconds(model: Any, tok: Any, parent: Any) -> float:
    """Seconds of one plain (unrecorded) greedy generation of a recorded request (``parent``, a
    :class:`recorders.counterfactual.ParentRequest`) under its own config."""
    import torch

    from h2o_lens.runtime import h2o

    ids = torch.tensor([parent.prompt_ids])
    t0 = time.perf_counter()
    with torch.no_grad(), h2o(model, parent.config):
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=parent.max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    return time.perf_counter() - t0


class HeldSlots:
    """A cache listener that counts the slots layer 0's first KV set holds after each decode step
    (``held``), the hot memory a benchmark reports."""

    def __init__(self):
        self.held: list[int] = []

    def on_prefill(self, layer: int, ev: Any) -> None:
        pass

    def on_decode(self, layer: int, ev: Any) -> None:
        if layer == 0:
            self.held.append(int((ev.kept[0, 0] >= 0).sum()))
