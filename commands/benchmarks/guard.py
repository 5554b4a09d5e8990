"""``h2o-lens bench guard``: does the guard's risk see failures coming, and does a raise save them
(DESIGN.md §18.6).

For every request of ``--tasks`` (greedy, one request at a time): the full-cache teacher, H2O at
``--ratio`` with the guard logging its risk, H2O at each fixed budget, and H2O under each of the
guard's policies (:data:`~.guard_eval.POLICIES`, ``--guard-policies``). A request fails when its
checker says so (the teacher's first divergence where it has no checker); a request whose teacher
fails its checker is left out, as no budget can save it. It prints:

- the AUROC of the risk taken ``k`` steps before the first wrong token (k = 1, 4, 16) against
  failure, for the default weights, the fitted ones and each signal alone (the prefill's risk
  always counts);
- accuracy against mean KV slots (a share of the full cache's) for the fixed budgets and the
  guard's policies, on the same requests;
- how many of H2O's failures at ``--ratio`` each guard policy recovered, at what mean memory and
  time per request (a ``recall`` policy's open window counts in its memory, so ``recall:0.05``
  beside ``raise:0.25`` at base 0.2 compares the two uses of the same added slots).

The heads the ``prefill`` signal reads, the weights and the threshold are fitted on the requests
of ``--seed + 1`` (:mod:`.guard_fit`), and the guard runs with them on those of ``--seed``
(:mod:`.guard_eval`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..options import at_least, keep_share, share
from .guard_eval import BUDGETS, HEADS, POLICIES, evaluate, format_report
from .guard_fit import THRESHOLD_RULES, check_heads, read_fit, write_fit, write_outcomes

__all__ = ["add_arguments", "run", "bench_guard", "guard_policies"]

NAME = "guard"
HELP = "does the guard's risk see failures coming, and does a raise save them (DESIGN.md §18.6)"


def _risk(text: str) -> float:
    """An argparse type: a risk in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a risk in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a risk in [0, 1], such as 0.5; got {text}")
    return value


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    b.add_argument("--tasks", default="builtin:full", metavar="FILE|builtin:NAME[,NAME...]", help="the requests")
    b.add_argument("--count", type=at_least(1), default=16, help="requests of each family")
    b.add_argument("--length", type=at_least(1), default=None, help="prompt tokens of a long-context built-in family")
    b.add_argument("--new-tokens", type=at_least(1), default=None, help="each request's limit (default its task's)")
    b.add_argument("--ratio", type=keep_share, default=0.2, help="the base keep ratio (DESIGN.md §18.6)")
    b.add_argument("--seed", type=int, default=0, help="the seed of the requests the guard runs on")
    b.add_argument("--threshold", type=_risk, default=None, help="act at this risk instead of fitting it on seed + 1")
    b.add_argument(
        "--guard-policies",
        nargs="+",
        default=None,
        metavar="ACTION:TARGET[:RESCUE][@THRESHOLD]",
        help="the guard's policies to run, e.g. raise:0.35:0.15 refill:1.0 raise:0.35:0.25@0, or recall:0.05 "
        "(a recall window of 5 %% of the prompt on the evicted entries; recall:16 in slots) beside raise:0.25 "
        "at the same added memory (@: act at that risk instead of the fitted or --threshold one; 0: every "
        "request; none: no policy, the AUROC alone) (default raise:0.35:0.15 raise:0.5 refill:1.0)",
    )
    b.add_argument(
        "--fit-tasks",
        default=None,
        metavar="FILE|builtin:NAME",
        help="the requests the weights and threshold are fitted on (default: --tasks at seed + 1 when "
        "built-in; a task file needs another file of the same traffic)",
    )
    b.add_argument("--fit", default=None, metavar="FILE", help="measure a fit saved by --save-fit (on other requests)")
    b.add_argument(
        "--allow-other-model",
        action="store_true",
        help="measure a --fit made for another model than --model (its heads must still lie inside this one)",
    )
    b.add_argument(
        "--save-fit",
        default=None,
        metavar="FILE",
        help="write the fitted weights, heads and threshold as JSON (for record --guard-fit)",
    )
    b.add_argument(
        "--threshold-rule",
        choices=THRESHOLD_RULES,
        default=None,
        help="where the fitted threshold sits in the fit set's gap: halfway (midpoint, the default) "
        "or at the lowest score it flags",
    )
    b.add_argument(
        "--heads",
        type=at_least(0),
        default=HEADS,
        help="the layers and KV sets the prefill signal reads, chosen on the fit set (0: all of them)",
    )
    b.add_argument("--dump", default=None, metavar="FILE", help="write each request's outcome and signals as JSON")
    b.add_argument(
        "--fixed",
        nargs="+",
        type=share,
        default=None,
        help="the fixed keep ratios of the accuracy table (default 0.05 0.1 0.2 0.35 0.5 1.0)",
    )


def run(args: argparse.Namespace) -> int:
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
        allow_other_model=args.allow_other_model,
    )


def guard_policies(items: list[str] | None) -> tuple[tuple, ...]:
    """``--guard-policies``: ``ACTION:TARGET[:RESCUE][@THRESHOLD]`` items as ``(action, target,
    rescue)``, or ``(action, target, rescue, threshold)`` with ``@`` (the bench's defaults when
    None); a malformed item is a one-line error."""
    if not items:
        return POLICIES
    if items == ["none"]:
        return ()
    from ..options import guard_item

    out = []
    for item in items:
        action, target, rescue, threshold = guard_item(item, "bench guard --guard-policies")
        out.append((action, target, rescue) if threshold is None else (action, target, rescue, threshold))
    return tuple(out)


def _check(ratio, threshold, heads, new_tokens, threshold_rule, fit_file, budgets, dump, save_fit, fit_tasks) -> None:
    """Everything ``bench guard`` refuses before the model loads, one line each."""
    from h2o_lens.errors import ConfigError

    if not 0.0 < ratio < 1.0:
        raise ConfigError(f"bench guard --ratio {ratio}: expected a keep ratio between 0 and 1, such as 0.2")
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"bench guard --threshold {threshold}: expected a risk between 0 and 1, such as 0.5")
    if heads < 0:
        raise ConfigError(f"bench guard --heads {heads}: expected how many heads to choose (0: all of them), e.g. 5")
    if new_tokens is not None and new_tokens < 1:
        raise ConfigError(f"bench guard --new-tokens {new_tokens}: expected at least 1 new token, such as 32")
    if threshold_rule is not None and (threshold is not None or fit_file is not None):
        given_by = "--threshold" if threshold is not None else "--fit"
        raise ConfigError(f"bench guard --threshold-rule places a fitted threshold; with {given_by} none is fitted")
    if threshold_rule is not None and threshold_rule not in THRESHOLD_RULES:
        raise ConfigError(
            f"bench guard --threshold-rule {threshold_rule}: expected one of {', '.join(THRESHOLD_RULES)}"
        )
    bad = [b for b in budgets if not 0.0 < b <= 1.0]
    if bad:
        raise ConfigError(f"bench guard --fixed {bad[0]}: expected keep ratios in (0, 1], such as 0.2 0.35 1.0")
    for option, path in (("--dump", dump), ("--save-fit", save_fit)):
        if path is not None and (not os.path.isdir(os.path.dirname(os.path.abspath(path))) or os.path.isdir(path)):
            raise ConfigError(
                f"bench guard {option} {path!r}: give a file path in an existing folder (checked before the runs)"
            )
    if save_fit is not None and threshold is not None:
        raise ConfigError("bench guard --save-fit saves what is fitted; with --threshold nothing is, leave one out")
    if fit_file is not None and (save_fit is not None or fit_tasks is not None):
        raise ConfigError("bench guard --fit FILE measures a saved fit; leave out --save-fit and --fit-tasks")


def _resolve(spec: str, seed: int, length, count, new_tokens, tokenizer) -> list[Any]:
    """The requests of ``spec`` at ``seed`` (``builtin:A,B``: both families), each with
    ``new_tokens`` new tokens when given."""
    from h2o_lens.tasks.builtins import resolve_tasks

    names = spec.removeprefix("builtin:").split(",") if spec.startswith("builtin:") else None
    specs = [f"builtin:{n}" for n in names] if names else [spec]
    got = [t for s in specs for t in resolve_tasks(s, seed=seed, length=length, count=count, tokenizer=tokenizer)]
    return got if new_tokens is None else [dataclasses.replace(t, max_new_tokens=new_tokens) for t in got]


def _source(fit_file, threshold, fit_tasks, fit_seed) -> str:
    """Where the guard's weights and threshold come from, as the header says it."""
    if fit_file is not None:
        return f"the fit of {fit_file}"
    if threshold is not None:
        return f"threshold {threshold} given"
    return f"fit on {fit_tasks}" if fit_tasks is not None else f"fit seed {fit_seed}"


def bench_guard(
    model_name: str | None = None,
    tasks: str = "builtin:small",
    ratio: float = 0.2,
    count: int | None = None,
    length: int | None = None,
    seed: int = 0,
    fit_seed: int | None = 1,
    policies: Sequence[tuple] = POLICIES,
    budgets: Sequence[float] = BUDGETS,
    threshold: float | None = None,
    dump: str | None = None,
    fit_tasks: str | None = None,
    heads: int = HEADS,
    save_fit: str | None = None,
    fit_file: str | None = None,
    new_tokens: int | None = None,
    threshold_rule: str | None = None,
    allow_other_model: bool = False,
) -> int:
    """The CLI's ``bench guard``: load the model, resolve the tasks (``seed`` and ``fit_seed``),
    evaluate and print; ``fit_tasks`` the requests the weights and threshold are fitted on
    (default: ``tasks`` at ``fit_seed`` when they are built-in; a task file has no seeds, so give
    another file of one's own traffic); ``heads`` the layers and KV sets the fitted ``prefill`` signal
    reads (0: all); ``save_fit`` a JSON file that gets the fitted guard (:func:`write_fit`; 1 is
    returned when nothing could be fitted); ``fit_file`` a fit saved so (by a run on other requests)
    to measure here instead of fitting, made for this model unless ``allow_other_model``;
    ``new_tokens`` each request's new-token limit instead of its task's (on both seeds);
    ``threshold_rule`` where the fitted threshold sits (default ``midpoint``); ``dump`` a JSON file
    that gets each request's outcome and per-step signals (both seeds). Returns 0."""
    from h2o_lens.models import load_model

    _check(ratio, threshold, heads, new_tokens, threshold_rule, fit_file, budgets, dump, save_fit, fit_tasks)
    where = f"bench guard --fit {fit_file!r}"
    given = None
    if fit_file is not None:
        given = read_fit(fit_file, "bench guard --fit", model=model_name, allow_other_model=allow_other_model)
    model, tokenizer = load_model(model_name, progress=False)
    if given is not None:  # the heads against the loaded model too (its config may not have been readable)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        check_heads(given["heads"], cfg.num_hidden_layers, cfg.num_key_value_heads or cfg.num_attention_heads, where)
    run = _resolve(tasks, seed, length, count, new_tokens, tokenizer)
    if given is not None:
        fit = []
    elif fit_tasks is not None:
        fit = _resolve(fit_tasks, fit_seed if fit_seed is not None else seed + 1, length, count, new_tokens, tokenizer)
    elif fit_seed is not None and tasks.startswith("builtin:"):
        fit = _resolve(tasks, fit_seed, length, count, new_tokens, tokenizer)
    else:
        fit = []
    if not fit and threshold is None and given is None:
        print(
            "bench guard: nothing to fit on (a task file has no seeds): the default weights and no action; "
            "give --fit-tasks FILE (other requests of the same traffic) or --threshold",
            file=sys.stderr,
        )

    def progress(msg: str) -> None:
        print(f"\r{msg}", end="", file=sys.stderr, flush=True)

    fitted = _source(fit_file, threshold, fit_tasks, fit_seed)
    print(f"bench guard: {tasks} (seed {seed}, {fitted}), {len(run)} requests, ratio {ratio}", flush=True)
    report = evaluate(
        model,
        tokenizer,
        run,
        fit,
        ratio=ratio,
        budgets=budgets,
        policies=policies,
        threshold=threshold,
        heads=heads,
        given=given,
        threshold_rule=threshold_rule or "midpoint",
        progress=progress,
    )
    print(file=sys.stderr)
    print(format_report(report), flush=True)
    if dump:
        write_outcomes(dump, report)
        print(f"outcomes of {len(report.outcomes)} + {len(report.fit_outcomes)} requests written to {dump}")
    if save_fit:
        return _save(save_fit, report, model_name, fit_tasks or tasks, fit_seed, length, count, ratio, new_tokens)
    return 0


def _save(path: str, report, model_name, fit_tasks, fit_seed, length, count, ratio, new_tokens) -> int:
    """Write the fitted guard to ``path`` (:func:`write_fit`) with what it was fitted on; 1 when nothing was fitted."""
    if report.weights is None:
        print(
            f"bench guard: nothing fitted (the fit set needs failing and passing requests); {path} not written",
            file=sys.stderr,
        )
        return 1
    from h2o_lens.models import DEFAULT_MODEL

    about = {
        "model": model_name or DEFAULT_MODEL,
        "fit_tasks": fit_tasks,
        "fit_seed": fit_seed,
        "length": length,
        "count": count,
        "ratio": ratio,
        "new_tokens": new_tokens,
        "threshold_rule": report.threshold_rule,
    }
    write_fit(path, report, about)
    print(f"the fitted guard written to {path} (h2o-lens record --guard ... --guard-fit {path})")
    return 0
