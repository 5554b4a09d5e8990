"""``h2o-lens record``: generate with a policy and record every eviction."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .limits import check_new_tokens
from .options import (
    add_plan_arg,
    add_policy_args,
    chat,
    guard_config,
    guard_scope,
    guard_summary,
    policy_config,
    print_replay,
    read_prompt,
)
from .paths import run_dir as _run_dir

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    r = sub.add_parser("record", help="generate with a policy and record every eviction")
    r.add_argument("--prompt", default=None)
    r.add_argument("--prompt-file", default=None)
    r.add_argument("--task", default=None, help="a task of the suite instead of a prompt, e.g. delayed_recall_0")
    r.add_argument("--model", default=None)
    r.add_argument("--out", default="runs", help="runs root (default: ./runs)")
    r.add_argument("--name", default=None, help="free-form run name")
    r.add_argument(
        "--evidence",
        action="append",
        default=[],
        metavar="LABEL=TEXT",
        help="an evidence span: a substring of the prompt (repeatable)",
    )
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--raw", action="store_true", help="do not apply the chat template")
    r.add_argument(
        "--teacher-force",
        metavar="RUN",
        default=None,
        help="re-record RUN's exact tokens under this policy (paired comparison)",
    )
    r.add_argument("--with-full", action="store_true", help="also record the full-cache generation")
    r.add_argument("--replay", action="store_true", help="replay against the full-cache teacher afterwards")
    r.add_argument(
        "--guard",
        default=None,
        metavar="log|ACTION:TARGET[:RESCUE][@THRESHOLD]",
        help="run the request guarded, its risk and actions logged (DESIGN.md §18): log (the risk only), or "
        "raise:0.35:0.15 (raise to 35 %% with 15 %% rescued when the risk reaches 0.5), refill:1.0@0.6, "
        "recall:0.05 (open a recall window of 5 %% of the prompt on the evicted entries; recall:16 in slots), ...",
    )
    r.add_argument(
        "--guard-fit",
        default=None,
        metavar="FILE",
        help="the guard's weights, heads and threshold fitted by bench guard --save-fit (an @ threshold wins)",
    )
    r.add_argument(
        "--allow-other-model",
        action="store_true",
        help="use a --guard-fit made for another model than --model (its heads must still lie inside this one)",
    )
    r.add_argument(
        "--cold",
        default=None,
        metavar="STORE:RECALL[:SELECTION[:EVERY]]",
        help="a cold tier: evicted K/V kept in STORE (cpu | disk) and a window of RECALL slots inside the "
        "budget refilled with the cold entries the queries attend to most, SELECTION exact | pages | pages=N "
        "(the N best pages), a refill every EVERY decode steps (default 1) (DESIGN.md §2.13); e.g. cpu:16",
    )
    r.add_argument(
        "--graphs",
        action="store_true",
        help="replay the decode steps over a full cache from a captured graph: CUDA graphs on a GPU, on a "
        "CPU a traced rehearsal (the same log, no speed-up); the manifest's graphs says what ran how "
        "(DESIGN.md §2.16)",
    )
    add_policy_args(r)
    add_plan_arg(r)
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from h2o_lens.models import load_model
    from recorders.recorder import record, record_teacher_forced
    from recorders.replay import replay

    config, task, prompt, evidence, guard = _check_record(args)
    if task is not None:
        from .jobs import run_task

        model, tok = load_model(args.model)
        done = run_task(model, tok, task, config, args.out, replay=args.replay, name=args.name, guard=guard)
        print(done.answer.strip())
        if done.guard:
            print(done.guard, file=sys.stderr)
        print(
            f"recorded {done.run_id} ({config.describe()}), task {task.name}: "
            f"{'correct' if done.correct else 'WRONG'} (expected {task.expected}): {done.run_dir}",
            file=sys.stderr,
        )
        return 0
    if args.teacher_force:
        from runlog import read_manifest

        src = _run_dir(args.teacher_force, args.out)
        model_name = args.model or (read_manifest(src).get("model") or {}).get("name")
        model, tok = load_model(model_name)
        rec = record_teacher_forced(model, src, config, out=args.out, tokenizer=tok, name=args.name)
        runs = [rec]
    else:
        model, tok = load_model(args.model)
        if args.graphs and next(model.parameters()).device.type != "cuda":
            print(
                "h2o-lens: note: --graphs without a CUDA device runs the traced rehearsal of CUDA graphs: the same "
                "log, no faster (DESIGN.md §2.16)",
                file=sys.stderr,
            )
        enc = tok(
            chat(tok, prompt, args.raw), return_tensors="pt", add_special_tokens=args.raw, return_token_type_ids=False
        )
        from h2o_lens.progress import GenerationProgress

        gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        with (
            torch.no_grad(),
            guard_scope(guard, model, tok, enc["input_ids"]) as (processors, watch),
            record(
                model,
                config,
                out=args.out,
                tokenizer=tok,
                evidence=evidence or None,
                name=args.name,
                prompts=[prompt],
                graphs=args.graphs,
            ) as rec,
        ):
            out = model.generate(
                **enc, **gen, streamer=GenerationProgress(args.max_new_tokens, "record"), logits_processor=processors
            )
        print(tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip())
        if watch is not None and watch.last is not None:
            print(guard_summary(watch.last), file=sys.stderr)
        runs = [rec]
        if args.with_full and config.spec.evicts:
            from h2o_lens import policies
            from h2o_lens.config import H2OConfig

            with (
                torch.no_grad(),
                record(
                    model,
                    H2OConfig(policy=policies.FULL_CACHE),
                    out=args.out,
                    tokenizer=tok,
                    evidence=evidence or None,
                    name=args.name,
                    prompts=[prompt],
                    info={"source_run": rec.run_id},
                ) as full,
            ):
                model.generate(**enc, **gen, streamer=GenerationProgress(args.max_new_tokens, "record full"))
            runs.append(full)
    for rec in runs:
        print(f"recorded {rec.run_id} ({rec.config.describe()}): {rec.run_dir}", file=sys.stderr)
        if args.replay:
            print_replay(replay(rec.run_dir, model=model))
    return 0


def _check_record(args: argparse.Namespace):
    """Everything ``record`` can refuse, checked before the model loads.

    Returns ``(config, task, prompt, evidence, guard)``; raises :class:`ConfigError`
    with what was received and how to fix it.
    """
    from h2o_lens.errors import ConfigError

    config = policy_config(args)
    if args.cold is not None:  # a malformed --cold, or a window the budget cannot hold, before the model loads
        import dataclasses

        from h2o_lens.cold_config import parse_cold

        if not config.spec.evicts:
            raise ConfigError(f"--cold keeps what a policy evicts; --policy {config.policy} keeps every token")
        config = dataclasses.replace(config, cold=parse_cold(args.cold))
    if config.plan is not None and args.guard is not None:
        raise ConfigError("--guard raises and refills one budget per request; it cannot be combined with --plan")
    # a malformed --guard, or a fit for another model, is refused before the model loads
    guard = guard_config(args.guard, fit=args.guard_fit, model=args.model, allow_other_model=args.allow_other_model)
    if args.graphs and (args.task is not None or args.teacher_force or not config.spec.evicts):
        raise ConfigError(
            "--graphs cannot be combined with --task, --teacher-force or a policy that keeps every token: it "
            "replays the decode steps of a generated prompt over an evicting policy's slots"
        )
    if guard is not None and args.teacher_force:
        raise ConfigError("--guard runs a request as it is generated; it cannot be combined with --teacher-force")
    if guard is not None and not config.spec.evicts:
        raise ConfigError(f"--guard watches evictions; --policy {config.policy} keeps every token")
    if guard is not None and config.cold is not None:
        raise ConfigError(
            "--guard grows a request's slots, which moves a cold tier's window (and --guard recall brings its "
            "own cold tier); drop --guard or --cold"
        )
    if guard is not None:
        guard.check_base(config)  # a raise to no more slots than the base would do nothing
    if not config.spec.evicts and (args.heavy is not None or args.recent is not None or args.ratio is not None):
        print(
            f"h2o-lens: note: --policy {config.policy} keeps every token; --heavy/--recent/--ratio are ignored",
            file=sys.stderr,
        )
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(
            f"--out {args.out!r} is an existing file; runs are written to a folder: "
            "give a folder path (it is created if missing)"
        )
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    check_new_tokens(args.model, args.max_new_tokens)
    sources = [
        name
        for name, given in (
            ("--task", args.task),
            ("--teacher-force", args.teacher_force),
            ("--prompt", args.prompt),
            ("--prompt-file", args.prompt_file),
        )
        if given is not None
    ]
    if len(sources) > 1:
        raise ConfigError(f"give one of --task, --teacher-force, --prompt, --prompt-file; got {' and '.join(sources)}")
    task = prompt = None
    evidence = dict(_parse_evidence(e) for e in args.evidence)
    if args.task is not None:
        from h2o_lens.tasks import get_task

        try:
            task = get_task(args.task)
        except KeyError as exc:
            raise ConfigError(str(exc.args[0]) + "; list the suite with h2o_lens.tasks.suite()") from None
    elif args.teacher_force is not None:
        _run_dir(args.teacher_force, args.out)
    else:
        if args.prompt_file is not None and not os.path.isfile(args.prompt_file):
            raise ConfigError(
                f"--prompt-file {args.prompt_file!r} does not exist (or is not a file); "
                "give the path of a UTF-8 text file"
            )
        try:
            prompt = read_prompt(args)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--prompt-file {args.prompt_file!r} cannot be read as UTF-8 text: {exc}") from None
        if not prompt.strip():
            where = f"--prompt-file {args.prompt_file!r}" if args.prompt_file else "--prompt"
            raise ConfigError(f"{where} is empty; give a prompt with some text")
        for label, text in evidence.items():
            if text not in prompt:
                raise ConfigError(
                    f"--evidence {label}={text!r} does not occur in the prompt; give a substring of the prompt text"
                )
    if evidence and prompt is None:
        raise ConfigError(
            "--evidence needs --prompt or --prompt-file (tasks and teacher-forced runs carry their own evidence labels)"
        )
    return config, task, prompt, evidence, guard


def _parse_evidence(text: str) -> tuple[str, str]:
    label, sep, value = text.partition("=")
    if not sep or not label or not value:
        from h2o_lens.errors import ConfigError

        raise ConfigError(f"--evidence expects LABEL=TEXT (a substring of the prompt), got {text!r}")
    return label, value
