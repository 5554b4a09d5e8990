"""What several subcommands share: the policy and request options, loading the model, the
requests of ``--tasks``, small parsers and printers."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "add_model_args",
    "DEFAULT_PROMPT",
    "add_plan_arg",
    "add_policy_args",
    "add_backend_arg",
    "add_task_args",
    "policy_config",
    "mib",
    "read_prompt",
    "chat",
    "print_replay",
    "given_model",
    "DTYPES",
    "task_source",
    "load_model_args",
    "resolve_requests",
    "split_list",
    "press_items",
    "number",
    "guard_item",
    "guard_target",
    "guard_config",
    "guard_summary",
    "guard_scope",
    "at_least",
    "keep_share",
    "share",
    "fraction",
    "positive_seconds",
    "positive",
    "nonnegative",
    "port",
    "machine_count",
    "cpu_count",
]


DEFAULT_PROMPT = (
    "Read the notes and answer the question.\n"
    "Notes: The orange cable goes to port 7. The backup server is called Heron. "
    "Lunch is at noon on Fridays. The access code for the lab is 4419. "
    "The printer on the second floor is out of toner. Maria moved to the Lisbon office in May.\n"
    "Question: What is the access code for the lab, and where did Maria move?"
)


def add_policy_args(p: argparse.ArgumentParser) -> None:
    from h2o_lens import policies

    g = p.add_argument_group("policy")
    g.add_argument(
        "--policy",
        default=policies.DEFAULT,
        metavar="{" + ",".join(policies.names()) + "}",
        help="; ".join(f"{q.name}: {q.summary}" for q in policies.all_policies()),
    )
    g.add_argument("--heavy", type=at_least(0), default=None, help="heavy-hitter slots per layer and KV head")
    g.add_argument("--recent", type=at_least(0), default=None, help="recent-window slots per layer and KV head")
    g.add_argument("--ratio", type=share, default=None, help="total keep ratio of the prompt instead of slots")
    g.add_argument("--gqa", default="sum", help="sum | max | none")
    g.add_argument("--sink", type=at_least(0), default=4, help="first tokens kept by the sink policy")
    g.add_argument("--seed", type=int, default=0, help="seed of the random policy and of sampling")
    add_backend_arg(g)


def add_backend_arg(p) -> None:
    """``--backend``: the decode step (:class:`~h2o_lens.config.H2OConfig`'s ``backend``)."""
    p.add_argument(
        "--backend",
        choices=["auto", "torch", "cpp", "triton"],
        default="auto",
        help="the decode step: auto (Triton on CUDA, else torch), torch, cpp (the fused CPU step, compiled on "
        "first use; DESIGN.md §2.8) or triton",
    )


def add_task_args(p: argparse.ArgumentParser, default: str) -> None:
    g = p.add_argument_group("requests and model")
    g.add_argument(
        "--tasks",
        default=None,
        metavar="FILE|builtin:NAME",
        help=f"a JSONL task file or a built-in family (default: {default}); a number N is --count N",
    )
    g.add_argument("--count", type=int, default=None, help="take only the first N requests")
    g.add_argument("--length", type=at_least(1), default=None, help="prompt tokens of a long-context built-in family")
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the built-in families (and of the random policy in a sweep)"
    )
    g.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter dtype of the model")


def add_plan_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plan",
        metavar="FILE",
        default=None,
        help="a budget plan (h2o-lens plan -o FILE): slots per layer and KV set instead of --heavy/--recent/--ratio",
    )


def policy_config(args: argparse.Namespace):
    from h2o_lens import policies
    from h2o_lens.config import H2OConfig
    from h2o_lens.errors import ConfigError

    heavy, recent, ratio = args.heavy, args.recent, args.ratio
    common = dict(policy=args.policy, gqa=args.gqa, sink=args.sink, seed=args.seed, backend=args.backend)
    if getattr(args, "plan", None) is not None:  # a budget plan (DESIGN.md §2.14), read before any model loads
        if not policies.get(args.policy).evicts:
            raise ConfigError(f"--plan gives slots to an evicting policy; --policy {args.policy} keeps every token")
        given = [f"--{k}" for k in ("heavy", "recent", "ratio") if getattr(args, k) is not None]
        if given:
            raise ConfigError(f"--plan gives the budget; drop {' and '.join(given)}")
        try:
            return H2OConfig(plan=args.plan, **common)
        except ConfigError as exc:
            raise ConfigError(f"--plan {args.plan}: {exc}") from None
    if not policies.get(args.policy).evicts:  # no slots: a budget given with it is ignored
        heavy = recent = ratio = None
    elif ratio is None and heavy is None and recent is None:
        heavy, recent = 64, 64
    return H2OConfig(heavy=heavy, recent=recent, ratio=ratio, **common)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    return args.prompt if args.prompt is not None else DEFAULT_PROMPT


def chat(tok, prompt: str, raw: bool) -> str:
    if not raw and getattr(tok, "chat_template", None):
        return tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt


def print_replay(summary) -> None:
    verdict = "ok" if summary.implementation_ok else "FAILED: the masked replay does not reproduce the run"
    print(
        f"replay {summary.run_id}: {summary.requests} request(s), {summary.steps} steps "
        f"in {summary.seconds:.1f} s | mean KL {summary.mean_kl:.4f} | "
        f"top-1 agreement {summary.top1_agreement:.3f} | "
        f"mean dropped mass {summary.mean_dropped_mass:.4f} | "
        f"max |logit diff| {summary.max_logit_diff:.2e} ({verdict})"
    )


def given_model(args: argparse.Namespace, run_dir: str):
    """The model of ``--model`` in the run's dtype, or None (the run's own is loaded then)."""
    if args.model is None:
        return None
    import torch

    from h2o_lens.models import load_model
    from runlog import read_manifest

    info = read_manifest(run_dir).get("model")
    dtype = info.get("dtype") if isinstance(info, dict) else None
    return load_model(args.model, dtype=getattr(torch, dtype) if dtype in (*DTYPES, "float64") else torch.float32)[0]


DTYPES = ("float32", "bfloat16", "float16")


def task_source(value: str | None, count: int | None, default: str) -> tuple[str, int | None]:
    """``--tasks``: a spec (``builtin:NAME`` or a task file); a bare number N is the earlier
    spelling of ``--count N`` on the default suite."""
    from h2o_lens.errors import ConfigError

    if value is not None and value.isdigit():
        if count is not None:
            raise ConfigError(f"--tasks {value} is a count and --count {count} is given too; keep one")
        value, count = None, int(value)
    spec = value or default
    if count is not None and count < 1:
        raise ConfigError(f"--count must be at least 1, got {count}")
    if not spec.startswith("builtin:"):
        if not os.path.isfile(spec):
            raise ConfigError(
                f"--tasks {spec!r} is neither builtin:NAME nor an existing task file; give a JSONL "
                "task file (see h2o_lens.tasks.taskfile) or e.g. builtin:demo"
            )
    else:
        from h2o_lens.tasks.builtins import FAMILIES

        if spec.removeprefix("builtin:") not in FAMILIES:
            raise ConfigError(f"--tasks {spec!r}: unknown built-in family; known: {', '.join(FAMILIES)}")
    return spec, count


def load_model_args(args: argparse.Namespace):
    import torch

    from h2o_lens.models import load_model

    return load_model(args.model, dtype=getattr(torch, args.dtype))


def resolve_requests(spec: str, args: argparse.Namespace, tokenizer):
    from h2o_lens.errors import ConfigError
    from h2o_lens.tasks.builtins import resolve_tasks

    try:
        return resolve_tasks(spec, seed=args.seed, length=args.length, count=args.count, tokenizer=tokenizer)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ConfigError(f"--tasks {spec!r}: {exc}") from None


def split_list(items: Sequence[str] | None) -> list[str]:
    """``a,b c`` (comma lists and/or repeated options) → ``[a, b, c]``."""
    return [part.strip() for item in items or () for part in item.split(",") if part.strip()]


def press_items(items: Sequence[str] | None) -> list[str]:
    """``--policies`` items split at commas outside a press's parentheses
    (``kvpress:snapkv(window_size=32,kernel_size=3)`` stays one item)."""
    out = []
    for item in items or ():
        depth, part = 0, ""
        for ch in item:
            depth += (ch == "(") - (ch == ")")
            if ch == "," and depth == 0:
                out.append(part.strip())
                part = ""
            else:
                part += ch
        out.append(part.strip())
    return [p for p in out if p]


def number(text: str, kind: type, option: str):
    """One item of ``--slots`` (``int``: a slot count >= 1) or ``--ratios`` (``float``: a keep
    ratio in (0, 1]); anything else is a :class:`~h2o_lens.errors.ConfigError` naming ``option``."""
    from h2o_lens.errors import ConfigError

    what = "whole slot counts >= 1, e.g. --slots 64,128" if kind is int else "keep ratios in (0, 1], e.g. 1,0.2"
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a number; give {what}") from None
    if not (value >= 1 if kind is int else 0.0 < value <= 1.0):  # NaN fails both
        raise ConfigError(f"{option}: {text!r} is out of range; give {what}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model`` and ``--allow-other-model`` of the commands that run a recorded run's model again."""
    p.add_argument(
        "--model",
        default=None,
        help="the run's model (default: where its manifest says it was); one with another fingerprint is refused",
    )
    p.add_argument(
        "--allow-other-model",
        action="store_true",
        help="use --model even though its fingerprint differs from the run's (logged in the manifest)",
    )


def guard_item(item: str, where: str) -> tuple[str, float, float, float | None]:
    """A guard policy ``ACTION:TARGET[:RESCUE][@THRESHOLD]`` (ACTION ``raise`` or ``refill``) or
    ``recall:WINDOW[@THRESHOLD]`` as ``(action, target, rescue, threshold or None)``; a recall's
    WINDOW is a whole number of slots (an ``int``) or a share of the prompt in (0, 1] (a ``float``,
    written with a point, as 0.05); ``where`` names the option in the one-line error a malformed
    item gets (DESIGN.md §18.2)."""
    from h2o_lens.errors import ConfigError

    spec, at, level = item.partition("@")
    parts = spec.split(":")
    if parts[0] == "recall":
        return _recall_item(item, parts, at, level, where)
    try:
        if len(parts) not in (2, 3) or parts[0] not in ("raise", "refill") or (at and not level):
            raise ValueError
        target = float(parts[1])
        rescue = float(parts[2]) if len(parts) == 3 else 0.0
        threshold = float(level) if at else None
    except ValueError:
        raise ConfigError(
            f"{where} {item!r}: expected ACTION:TARGET[:RESCUE][@THRESHOLD] with ACTION raise or refill, "
            "or recall:WINDOW[@THRESHOLD], e.g. raise:0.35:0.15, raise:0.35:0.25@0 or recall:0.05"
        ) from None
    if not 0.0 < target <= 1.0 or not 0.0 <= rescue <= 1.0:
        raise ConfigError(f"{where} {item!r}: the target keep ratio must be in (0, 1] and the rescue share in [0, 1]")
    _check_level(item, threshold, where)
    return parts[0], target, rescue, threshold


def _recall_item(item: str, parts: list[str], at: str, level: str, where: str) -> tuple[str, Any, float, float | None]:
    """:func:`guard_item` of ``recall:WINDOW[@THRESHOLD]``."""
    from h2o_lens.errors import ConfigError

    try:
        if len(parts) != 2 or (at and not level):
            raise ValueError
        window = int(parts[1]) if parts[1].isdigit() else float(parts[1])
        threshold = float(level) if at else None
    except ValueError:
        raise ConfigError(
            f"{where} {item!r}: expected recall:WINDOW[@THRESHOLD], WINDOW the recall window in slots (16) or "
            "as a share of the prompt (0.05), e.g. recall:0.05@0.4"
        ) from None
    if isinstance(window, int) and window < 1 or isinstance(window, float) and not 0.0 < window <= 1.0:
        raise ConfigError(
            f"{where} {item!r}: the recall window must be a whole number of slots >= 1 (16) or a share of the "
            "prompt in (0, 1] (0.05)"
        )
    _check_level(item, threshold, where)
    return "recall", window, 0.0, threshold


def _check_level(item: str, threshold: float | None, where: str) -> None:
    from h2o_lens.errors import ConfigError

    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"{where} {item!r}: the threshold after @ must be in [0, 1]")


def guard_target(action: str, target: float) -> dict[str, Any]:
    """The ``GuardConfig`` fields of a parsed policy's target (:func:`guard_item`): a keep ratio,
    or a recall window in slots (an ``int``) or as a share of the prompt."""
    if action == "recall" and isinstance(target, int):
        return {"raise_slots": target}
    return {"raise_ratio": target}


def guard_config(
    item: str | None,
    where: str = "--guard",
    fit: str | None = None,
    model: Any = ...,
    allow_other_model: bool = False,
):
    """``--guard``: ``log`` (the risk only) or a guard policy (:func:`guard_item`; without
    ``@`` it acts at the default threshold, or at the fit's) as a ``GuardConfig``; ``fit`` a fit
    file of ``bench guard --save-fit`` whose weights, bias, heads and threshold it takes, made for
    ``model`` (the name ``--model`` took; unchecked when not given) unless ``allow_other_model``;
    None when not given."""
    from h2o_lens.errors import ConfigError
    from h2o_lens.guard import GuardConfig

    if item is None:
        if fit is not None:
            raise ConfigError("--guard-fit FILE sets how a guard scores the risk; give --guard too (log or a policy)")
        return None
    fitted = {}
    if fit is not None:
        from .benchmarks.guard_fit import read_fit

        fitted = read_fit(fit, model=model, allow_other_model=allow_other_model)
    if item == "log":
        return GuardConfig(**fitted)
    action, target, rescue, threshold = guard_item(item, where)
    if threshold is not None:
        fitted["threshold"] = threshold
    return GuardConfig(action=action, rescue=rescue, **guard_target(action, target), **fitted)


def guard_summary(state) -> str:
    """One line on a guarded request: its highest risk and step, and what the guard did."""
    rows = state.risk_rows()
    if not rows:
        return "guard: no step scored"
    top = max(rows, key=lambda r: r["risk"])
    acts = "; ".join(
        f"{e['action']} at step {e['step']} ({e['slots_before']} -> {e['slots_after']} slots, "
        f"{e['evicted']:.0f} positions already evicted)"
        for e in state.event_rows()
    )
    return (
        f"guard: highest risk {top['risk']:.3f} at step {top['step']} (threshold {state.config.threshold:.2f}); "
        + (acts or "no action")
        + f"; its own computations {state.seconds:.3f} s over {state.scored} decode steps"
    )


@contextlib.contextmanager
def guard_scope(config: Any, model: Any, tok: Any, input_ids: Any) -> Iterator[tuple[Any, Any]]:
    """``(logits processors, guard)`` for one ``generate`` under ``config`` (a ``GuardConfig``):
    the token cues, known for the prompt up front, and under ``refill`` the refill; ``(None,
    None)`` without a config."""
    if config is None:
        yield None, None
        return
    from transformers import LogitsProcessorList

    from h2o_lens.guard import guarded

    with guarded(config) as g:
        processors = [g.cues(tok, input_ids)]
        if config.acting == "refill":
            processors.append(g.refill(model))
        yield LogitsProcessorList(processors), g


# -- argparse types: a bad number is one line (``h2o-lens: error: ...``, exit 2) at parse time ----


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low`` (a size: tokens, rows, rounds, requests)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def keep_share(text: str) -> float:
    """An argparse type: a kept share of a context, in (0, 1)."""
    value = _finite(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a kept share of the context in (0, 1), such as 0.2; got {text}")
    return value


def share(text: str) -> float:
    """An argparse type: a keep ratio in (0, 1] (1: the full cache)."""
    value = _finite(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a keep ratio in (0, 1], such as 0.2; got {text}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a share in [0, 1]."""
    value = _finite(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], such as 0.05; got {text}")
    return value


def nonnegative(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def positive(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def port(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    value = at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, such as 10; got {text}")
    return value


def cpu_count() -> int:
    """The CPU cores this process may run on (its affinity where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_count(what: str) -> Callable[[str], int]:
    """An argparse type: a count of ``what`` (threads, workers) from 1 to this machine's cores, the
    most it can run at once; more only oversubscribes it (or is killed for its memory)."""

    def parse(text: str) -> int:
        value = at_least(1)(text)
        cores = cpu_count()
        if value > cores:
            raise argparse.ArgumentTypeError(
                f"{value} {what} on a machine of {cores} CPU core{'s' if cores > 1 else ''}; give 1 to {cores}"
            )
        return value

    parse.__name__ = "machine_count"
    return parse
