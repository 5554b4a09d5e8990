"""The ``h2o-lens`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .paths import run_dir as _run_dir

__all__ = ["main", "build_parser"]

DEFAULT_PROMPT = (
    "Read the notes and answer the question.\n"
    "Notes: The orange cable goes to port 7. The backup server is called Heron. "
    "Lunch is at noon on Fridays. The access code for the lab is 4419. "
    "The printer on the second floor is out of toner. Maria moved to the Lisbon office in May.\n"
    "Question: What is the access code for the lab, and where did Maria move?"
)


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    from h2o_lens import policies

    g = p.add_argument_group("policy")
    g.add_argument(
        "--policy",
        default=policies.DEFAULT,
        metavar="{" + ",".join(policies.names()) + "}",
        help="; ".join(f"{q.name}: {q.summary}" for q in policies.all_policies()),
    )
    g.add_argument("--heavy", type=int, default=None, help="heavy-hitter slots per layer and KV head")
    g.add_argument("--recent", type=int, default=None, help="recent-window slots per layer and KV head")
    g.add_argument("--ratio", type=float, default=None, help="total keep ratio of the prompt instead of slots")
    g.add_argument("--gqa", default="sum", help="sum | max | none")
    g.add_argument("--sink", type=int, default=4, help="first tokens kept by the sink policy")
    g.add_argument("--seed", type=int, default=0, help="seed of the random policy and of sampling")


def _add_task_args(p: argparse.ArgumentParser, default: str) -> None:
    g = p.add_argument_group("requests and model")
    g.add_argument(
        "--tasks",
        default=None,
        metavar="FILE|builtin:NAME",
        help=f"a JSONL task file or a built-in family (default: {default}); a number N is --count N",
    )
    g.add_argument("--count", type=int, default=None, help="take only the first N requests")
    g.add_argument("--length", type=int, default=None, help="prompt tokens of a long-context built-in family")
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the built-in families (and of the random policy in a sweep)"
    )
    g.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter dtype of the model")


def _config(args: argparse.Namespace):
    from h2o_lens import policies
    from h2o_lens.config import H2OConfig

    heavy, recent, ratio = args.heavy, args.recent, args.ratio
    if not policies.get(args.policy).evicts:  # no slots: a budget given with it is ignored
        heavy = recent = ratio = None
    elif ratio is None and heavy is None and recent is None:
        heavy, recent = 64, 64
    return H2OConfig(
        policy=args.policy, heavy=heavy, recent=recent, ratio=ratio, gqa=args.gqa, sink=args.sink, seed=args.seed
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from h2o_lens.models import load_model
    from h2o_lens.runtime import full_kv_bytes, h2o

    config = _config(args)
    prompt = args.prompt
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    if prompt is None:
        prompt = DEFAULT_PROMPT
    model, tok = load_model(args.model)
    if not args.raw and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    enc = tok(text, return_tensors="pt", add_special_tokens=args.raw)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, pad_token_id=tok.pad_token_id)
    if args.sample:
        torch.manual_seed(args.seed)
        gen.update(temperature=args.temperature, top_p=args.top_p)
    with torch.no_grad(), h2o(model, config) as session:
        out = model.generate(**enc, **gen)
    prompt_len = enc["input_ids"].shape[1]
    new = out[0, prompt_len:]
    print(tok.decode(new, skip_special_tokens=True).strip())
    total = prompt_len + len(new)
    full = full_kv_bytes(model, total)
    print("---", file=sys.stderr)
    cache = session.last_cache
    if cache is None:
        print(
            f"policy: full cache | prompt {prompt_len} tokens, generated {len(new)} | KV {_mib(full)}", file=sys.stderr
        )
        return 0
    b = cache.nbytes()
    print(
        f"policy: {cache.resolved_config.describe()} | prompt {prompt_len} tokens, generated {len(new)}",
        file=sys.stderr,
    )
    print(
        f"physical KV: {_mib(b['kv'])} (+ {b['metadata'] / 1024:.1f} KiB scores and positions) "
        f"vs full cache {_mib(full)} at {total} tokens: {b['kv'] / full:.3f} of full",
        file=sys.stderr,
    )
    return 0


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    return args.prompt if args.prompt is not None else DEFAULT_PROMPT


def _chat(tok, prompt: str, raw: bool) -> str:
    if not raw and getattr(tok, "chat_template", None):
        return tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt


def _print_replay(summary) -> None:
    verdict = (
        "ok" if summary.implementation_ok else "IMPLEMENTATION ERROR (the masked replay does not reproduce the run)"
    )
    print(
        f"replay {summary.run_id}: {summary.requests} request(s), {summary.steps} steps "
        f"in {summary.seconds:.1f} s | mean KL {summary.mean_kl:.4f} | "
        f"top-1 agreement {summary.top1_agreement:.3f} | "
        f"mean dropped mass {summary.mean_dropped_mass:.4f} | "
        f"max |logit diff| {summary.max_logit_diff:.2e} ({verdict})"
    )


def _check_record(args: argparse.Namespace):
    """Everything ``record`` can refuse, checked before the model loads.

    Returns ``(config, task, prompt, evidence)``; raises :class:`ConfigError`
    with what was received and how to fix it.
    """
    from h2o_lens.errors import ConfigError

    config = _config(args)
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
            prompt = _read_prompt(args)
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
    return config, task, prompt, evidence


def cmd_record(args: argparse.Namespace) -> int:
    import torch

    from h2o_lens.models import load_model
    from recorders.recorder import record, record_teacher_forced
    from recorders.replay import replay

    config, task, prompt, evidence = _check_record(args)
    if task is not None:
        from .jobs import run_task

        model, tok = load_model(args.model)
        done = run_task(model, tok, task, config, args.out, replay=args.replay, name=args.name)
        print(done.answer.strip())
        print(
            f"recorded {done.run_id} ({config.describe()}), task {task.name}: "
            f"{'correct' if done.correct else 'WRONG'} (expected {task.expected}): {done.run_dir}",
            file=sys.stderr,
        )
        return 0
    if args.teacher_force:
        from recorders import read_manifest

        src = _run_dir(args.teacher_force, args.out)
        model_name = args.model or (read_manifest(src).get("model") or {}).get("name")
        model, tok = load_model(model_name)
        rec = record_teacher_forced(model, src, config, out=args.out, tokenizer=tok, name=args.name)
        runs = [rec]
    else:
        model, tok = load_model(args.model)
        enc = tok(_chat(tok, prompt, args.raw), return_tensors="pt", add_special_tokens=args.raw)
        from h2o_lens.progress import GenerationProgress

        gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        with (
            torch.no_grad(),
            record(
                model, config, out=args.out, tokenizer=tok, evidence=evidence or None, name=args.name, prompts=[prompt]
            ) as rec,
        ):
            out = model.generate(**enc, **gen, streamer=GenerationProgress(args.max_new_tokens, "record"))
        print(tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip())
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
            _print_replay(replay(rec.run_dir, model=model))
    return 0


def _parse_evidence(text: str) -> tuple[str, str]:
    label, sep, value = text.partition("=")
    if not sep or not label or not value:
        from h2o_lens.errors import ConfigError

        raise ConfigError(f"--evidence expects LABEL=TEXT (a substring of the prompt), got {text!r}")
    return label, value


def _given_model(args: argparse.Namespace, run_dir: str):
    """The model of ``--model`` in the run's dtype, or None (the run's own is loaded then)."""
    if args.model is None:
        return None
    import torch

    from h2o_lens.models import load_model
    from recorders import read_manifest

    info = read_manifest(run_dir).get("model")
    dtype = info.get("dtype") if isinstance(info, dict) else None
    return load_model(args.model, dtype=getattr(torch, dtype) if dtype in (*DTYPES, "float64") else torch.float32)[0]


def cmd_replay(args: argparse.Namespace) -> int:
    from recorders.replay import replay

    run_dir = _run_dir(args.run, args.root)
    summary = replay(
        run_dir,
        model=_given_model(args, run_dir),
        tolerance=args.tolerance,
        backend=args.backend,
        allow_other_model=args.allow_other_model,
    )
    _print_replay(summary)
    return 0 if summary.implementation_ok else 3


def cmd_check(args: argparse.Namespace) -> int:
    from recorders.lifecycle import check_lifecycle

    run_dir = _run_dir(args.run, args.root)
    result = check_lifecycle(
        run_dir,
        _given_model(args, run_dir),
        tolerance=args.tolerance,
        progress=True,
        allow_other_model=args.allow_other_model,
    )
    verdict = "ok" if result.ok else f"LIFECYCLE ERROR in {len(result.failed)} request(s)"
    print(f"state lifecycle {result.run_id}: {len(result.requests)} request(s) in {result.seconds:.1f} s ({verdict})")
    for r in result.requests:
        if not r.ok or args.verbose:
            print("  " + r.describe())
    return 0 if result.ok else 3


def cmd_runs(args: argparse.Namespace) -> int:
    from analyses import ParameterError, format_result, runs_headline

    if not os.path.isdir(args.root):
        raise ParameterError(f"runs root {args.root} does not exist or is not a folder")
    df = runs_headline(args.root).df()
    truncated = len(df) > args.max_rows
    df = df.head(args.max_rows)
    df.attrs["truncated"] = truncated
    print(format_result(df, args.format))
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from analyses import format_result, run_sql

    df = run_sql(
        args.root,
        args.sql,
        max_rows=args.max_rows,
        timeout_s=args.timeout,
        max_bytes=args.max_bytes,
        memory_limit=args.memory_limit,
        threads=args.threads,
    )
    print(format_result(df, args.format))
    if df.attrs.get("truncated"):
        print(f"(cut at {args.max_rows} rows; raise --max-rows)", file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    import json

    from analyses import build_report

    run_dir = _run_dir(args.run, args.root)
    root, run_id = os.path.dirname(os.path.abspath(run_dir)), os.path.basename(os.path.normpath(run_dir))
    thresholds = None
    if args.thresholds:
        with open(args.thresholds, encoding="utf-8") as f:
            thresholds = json.load(f)
    text = build_report(root, run_id, fmt=args.format, thresholds=thresholds)
    if args.output:
        from pathlib import Path

        from .jobs import write_text_atomic

        write_text_atomic(Path(args.output), text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text)
    if args.format == "json" and args.gate:
        return 0 if json.loads(text)["verdict"]["pass"] else 1
    return 0


DTYPES = ("float32", "bfloat16", "float16")


def _task_source(value: str | None, count: int | None, default: str) -> tuple[str, int | None]:
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


def _load(args: argparse.Namespace):
    import torch

    from h2o_lens.models import load_model

    return load_model(args.model, dtype=getattr(torch, args.dtype))


def _resolve(spec: str, args: argparse.Namespace, tokenizer):
    from h2o_lens.errors import ConfigError
    from h2o_lens.tasks.builtins import resolve_tasks

    try:
        return resolve_tasks(spec, seed=args.seed, length=args.length, count=args.count, tokenizer=tokenizer)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ConfigError(f"--tasks {spec!r}: {exc}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    from .jobs import demo

    spec, args.count = _task_source(args.tasks, args.count, "builtin:demo")
    if args.tasks is None or args.tasks.isdigit():
        if args.length is not None:
            from h2o_lens.errors import ConfigError

            raise ConfigError("--length needs --tasks builtin:NAME of a long-context family")
        from h2o_lens.tasks import suite

        tasks = suite(size="demo")  # the demo suite as it always was
        tasks = tasks[: args.count] if args.count is not None else tasks
        model = tok = None
        if args.model is not None or args.dtype != "float32":
            model, tok = _load(args)
    else:
        model, tok = _load(args)
        tasks = _resolve(spec, args, tok)
    demo(args.out, tasks=tasks, model=model, tokenizer=tok, reports=not args.no_reports, explain=not args.no_explain)
    return 0


def _split_list(items: Sequence[str] | None) -> list[str]:
    """``a,b c`` (comma lists and/or repeated options) → ``[a, b, c]``."""
    return [part.strip() for item in items or () for part in item.split(",") if part.strip()]


def _press_items(items: Sequence[str] | None) -> list[str]:
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


def sweep_grid(
    items: Sequence[str] | None, gqa: Sequence[str] | None = None, press_args: Sequence[str] | None = None
) -> tuple[tuple[str, str], ...]:
    """``--policies NAME[:GQA],...`` and ``--gqa G,...`` → ``((policy, gqa), ...)``.

    Neither given: the suite's default grid (h2o sum and max, then the baselines).
    A name without ``:GQA`` is swept with every aggregation of ``--gqa`` (default
    ``sum``); the full cache takes no aggregation. ``kvpress:NAME`` is a kvpress press
    (DESIGN.md §17), its arguments inline (``kvpress:snapkv(window_size=32)``) or from
    ``--press-args KEY=VALUE,...``, which sets them on every press of the grid that takes them.
    """
    from h2o_lens import policies, presses
    from h2o_lens.config import GQA_MODES
    from h2o_lens.errors import ConfigError

    from .jobs import SWEEP_POLICIES

    names, modes = _press_items(items), _split_list(gqa)
    shared = presses.parse_press_args(press_args)
    press_names = [n for n in names if presses.is_press_policy(n)]
    if shared and not press_names:
        raise ConfigError("--press-args sets parameters of kvpress presses; add one to --policies, e.g. kvpress:snapkv")
    grid: list[tuple[str, str]] = []
    taken: set[str] = set()
    for item in press_names:
        cls, args = presses.parse_sweep_policy(item)
        fields = presses.check_args(cls, {**args})  # kvpress imported: a press is used
        own = {k: v for k, v in shared.items() if k in fields}
        taken |= set(own)
        presses.check_args(cls, {**own, **args})
        name = presses.sweep_policy(cls, {**own, **args})
        if (name, "sum") not in grid:
            grid.append((name, "sum"))
    if set(shared) - taken:
        raise ConfigError(
            f"--press-args {', '.join(sorted(set(shared) - taken))}: no press of --policies takes it "
            f"({', '.join(press_names)})"
        )
    names = [n for n in names if not presses.is_press_policy(n)]
    if not names and grid:
        return tuple(grid)
    for mode in modes:
        if mode not in GQA_MODES:
            raise ConfigError(f"--gqa {mode!r}: unknown aggregation; expected a comma list of {', '.join(GQA_MODES)}")
    if not names:
        if not modes:
            return SWEEP_POLICIES
        names = [policies.DEFAULT, *policies.baselines()]
    presses_first, grid = grid, []
    for item in names:
        name, _, mode = item.partition(":")
        policies.get(name)  # ConfigError naming the known policies
        if mode and mode not in GQA_MODES:
            raise ConfigError(
                f"--policies {item!r}: unknown gqa {mode!r}; expected NAME or NAME:GQA with GQA "
                f"one of {', '.join(GQA_MODES)}, e.g. h2o:max"
            )
        for m in [mode] if mode else (modes or ["sum"]) if policies.get(name).evicts else ["sum"]:
            if (name, m) not in grid:
                grid.append((name, m))
    return tuple(grid + presses_first)


def cmd_sweep(args: argparse.Namespace) -> int:
    from h2o_lens import presses
    from h2o_lens.errors import ConfigError

    from .grid import grid_status
    from .jobs import SWEEP_RATIOS, sweep

    if args.status is not None:
        print(grid_status(args.status))
        return 0
    executor = _sweep_executor(args)  # ConfigError (Ray missing, bad options): exit 2 before any load
    grid = sweep_grid(args.policies, args.gqa, args.press_args)  # ConfigError: exit 2 before the model loads
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out!r} is an existing file; give a folder for the sweep's runs")
    spec, args.count = _task_source(args.tasks, args.count, f"builtin:{args.size}")
    ratios = slots = None
    if args.slots:
        slots = [_number(v, int, "--slots") for v in _split_list(args.slots)]
        pressed = [p for p, _ in grid if presses.is_press_policy(p)]
        if pressed:
            raise ConfigError(
                f"{pressed[0]}: a press takes a keep ratio (compression_ratio = 1 - ratio), not a slot count; "
                "give --ratios for a grid with presses"
            )
    else:
        ratios = [_number(v, float, "--ratios") for v in _split_list(args.ratios)] or list(SWEEP_RATIOS)
    if executor is None:
        model, tok = _load(args)
    else:  # the Ray workers load the model; the plan needs only the tokenizer here
        from h2o_lens.models import load_tokenizer

        model, tok = None, load_tokenizer(args.model)
    tasks = _resolve(spec, args, tok)
    try:
        sweep(
            args.out,
            tasks=tasks,
            tasks_spec=spec,
            model=model,
            tokenizer=tok,
            ratios=ratios,
            slots=slots,
            policies=grid,
            batch_size=args.batch_size,
            replay=not args.no_replay,
            seed=args.seed,
            page_size=args.page_size,
            command=["h2o-lens", *sys.argv[1:]] if sys.argv[1:2] == ["sweep"] else [],
            executor=executor,
            past_context=args.past_context,
        )
    finally:
        if executor is not None:
            executor.close()
    return 0


def _sweep_executor(args: argparse.Namespace):
    """``None`` for the in-process executor, else a :class:`~commands.ray_sweep.RaySweep` (not started)."""
    from h2o_lens.errors import ConfigError

    if args.executor != "ray":
        given = [o for o, v in (("--address", args.address), ("--workers", args.workers)) if v is not None]
        given += ["--gpus-per-worker"] if args.gpus_per_worker else []
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ConfigError(f"{', '.join(given)} only {verb} to a Ray sweep; add --executor ray")
        return None
    from .ray_sweep import RayOptions, RaySweep, require_ray

    require_ray()
    options = RayOptions(
        address=args.address, workers=args.workers, gpus_per_worker=args.gpus_per_worker, retries=args.retries
    )
    return RaySweep(args.model, args.dtype, options)


def _number(text: str, kind: type, option: str):
    from h2o_lens.errors import ConfigError

    try:
        return kind(text)
    except ValueError:
        what = "whole slot counts, e.g. --slots 64,128" if kind is int else "keep ratios, e.g. --ratios 1,0.2,0.1"
        raise ConfigError(f"{option}: {text!r} is not a number; give {what}") from None


def cmd_tasks_export(args: argparse.Namespace) -> int:
    """``tasks export SPEC``: a built-in family (or a task file) as a JSONL task file."""
    from h2o_lens.errors import ConfigError
    from h2o_lens.tasks.builtins import resolve_tasks
    from h2o_lens.tasks.taskfile import dumps_tasks, write_tasks

    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise ConfigError(f"-o {args.output!r}: its folder does not exist; create it or give another path")
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


def cmd_tasks_check(args: argparse.Namespace) -> int:
    """``tasks check FILE``: validate a task file; one summary line per kind."""
    from h2o_lens.tasks.taskfile import load_tasks, summarise_tasks

    tasks = load_tasks(args.file)
    print(f"{args.file}: {len(tasks)} request{'s' * (len(tasks) != 1)}, valid")
    for kind, summary in summarise_tasks(tasks):
        print(f"  {kind}: {summary}")
    return 0


def cmd_tasks_list(args: argparse.Namespace) -> int:
    """``tasks list``: the built-in families, one line each."""
    from h2o_lens.tasks.builtins import FAMILIES

    width = max(len(name) for name in FAMILIES) + len("builtin:")
    for name, build in FAMILIES.items():
        doc = (build.__doc__ or "").strip().splitlines()
        print(f"{'builtin:' + name:<{width}}  {doc[0] if doc else ''}")
    return 0


def _add_tasks_parser(sub) -> None:
    t = sub.add_parser("tasks", help="task files: export the built-in families, check a file, list families")
    ts = t.add_subparsers(dest="tasks_command", required=True)
    ex = ts.add_parser("export", help="write builtin:NAME (or a task file) as a JSONL task file")
    ex.add_argument("spec", metavar="builtin:NAME", help="a built-in family (see `h2o-lens tasks list`) or a file")
    ex.add_argument("--length", type=int, default=None, help="prompt length in tokens (long-context families)")
    ex.add_argument("--seed", type=int, default=0, help="seed of the generated requests")
    ex.add_argument("--count", type=int, default=None, help="number of requests (default: the family's)")
    ex.add_argument("--model", default=None, help="tokenizer that counts --length (default: the packaged model)")
    ex.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    ex.set_defaults(func=cmd_tasks_export)
    ch = ts.add_parser("check", help="validate a task file and summarise it per kind")
    ch.add_argument("file")
    ch.set_defaults(func=cmd_tasks_check)
    ls = ts.add_parser("list", help="the built-in task families")
    ls.set_defaults(func=cmd_tasks_list)


def cmd_samples(args: argparse.Namespace) -> int:
    from .jobs import make_sample_runs

    make_sample_runs(args.out)
    return 0


def cmd_app(args: argparse.Namespace) -> int:
    from app.launch import run_app

    return int(run_app(args.root, port=args.port, open_browser=args.open) or 0)


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    if args.what == "decode" and args.assistant:
        return bench.bench_assistant(
            model_name=args.model,
            draft=args.assistant,
            keep=args.keep,
            rounds=args.rounds,
            new_tokens=args.new_tokens or 96,
        )
    if args.what == "decode":
        return bench.bench_decode(
            model_name=args.model,
            contexts=args.contexts or [512, 2048],
            batches=args.batch,
            keep=args.keep,
            steps=args.steps,
            rounds=args.rounds,
        )
    if args.what == "record" and (args.context or args.new_tokens):
        return bench.bench_record_memory(
            model_name=args.model, context=args.context or 4096, new_tokens=args.new_tokens or 256, keep=args.keep
        )
    if args.what == "record":
        return bench.bench_record(model_name=args.model, keep=args.keep, rounds=args.rounds)
    if args.what == "explain":
        return bench.bench_explain(
            model_name=args.model,
            task=None if args.tasks == "builtin:full" else args.tasks.removeprefix("builtin:"),
            keep=args.keep,
            length=args.length,
            rounds=args.rounds,
        )
    if args.what == "runs":
        return bench.bench_runs(runs=args.runs, root=args.root, browser=not args.no_browser)
    if args.what == "sweep":
        return bench.bench_sweep(
            model_name=args.model,
            tasks=args.tasks,
            count=args.count,
            batch_size=args.batch_size,
            keep=args.keep,
            replay=not args.no_replay,
            rounds=args.rounds,
            budget=args.budget,
            new_tokens=args.new_tokens or 16,
            executor=args.executor,
            workers=args.workers,
            policies=sweep_grid(args.policies, args.gqa) if args.policies or args.gqa else (("h2o", "sum"),),
            length=args.length,
            sharing=args.sharing,
        )
    if args.what == "press":
        from .bench_press import bench_press, bench_press_agreement

        if args.agreement:
            return bench_press_agreement(model_name=args.model)
        from h2o_lens import presses

        timed = tuple(presses.parse_sweep_policy(p) for p in _press_items(args.policies)) or None
        return bench_press(
            model_name=args.model,
            contexts=tuple(args.contexts or (2048, 4096)),
            rounds=args.rounds,
            new_tokens=args.new_tokens or 16,
            **({"timed": timed} if timed else {}),
        )
    if args.what == "sql":
        from analyses.bench import bench_sql

        bench_sql(memory_limit=args.memory_limit)
        return 0
    if args.what == "kernels":
        from h2o_lens.kernels.bench import bench_kernels

        bench_kernels()
        return 0
    raise SystemExit(f"unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    from .explain import add_model_args
    from .explain import add_parser as add_explain

    p = argparse.ArgumentParser(prog="h2o-lens", description="Exact H2O KV-cache eviction, recorded and explained.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate with an H2O cache and print the physical KV bytes")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_policy_args(g)
    g.set_defaults(func=cmd_generate)

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
    _add_policy_args(r)
    r.set_defaults(func=cmd_record)

    rp = sub.add_parser("replay", help="replay a run against a full-cache teacher")
    rp.add_argument("run", help="run folder, or run id under --root")
    rp.add_argument("--root", default="runs")
    rp.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest accepted |logit diff| of the check (default: derived from the dtype)",
    )
    rp.add_argument(
        "--backend",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="dropped mass and oracle: Triton kernels (auto: on CUDA) or chunked torch",
    )
    add_model_args(rp)
    rp.set_defaults(func=cmd_replay)

    ck = sub.add_parser(
        "check", help="state lifecycle: the run's logged kept sets against its tokens run alone (DESIGN.md §15.1)"
    )
    ck.add_argument("run", help="run folder, or run id under --root")
    ck.add_argument("--root", default="runs")
    ck.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="relative near-tie bound on a victim's margin (default: derived from the dtype; 0: exact)",
    )
    ck.add_argument("-v", "--verbose", action="store_true", help="one line per request, not only the failing ones")
    add_model_args(ck)
    ck.set_defaults(func=cmd_check)

    ru = sub.add_parser("runs", help="list the runs of a runs root with headline numbers")
    ru.add_argument("root", nargs="?", default="runs")
    ru.add_argument("--format", choices=["table", "csv", "json"], default="table")
    ru.add_argument("--max-rows", type=int, default=1000)
    ru.set_defaults(func=cmd_runs)

    q = sub.add_parser("sql", help="run a SELECT over the runs' DuckDB views")
    q.add_argument("root")
    q.add_argument("sql")
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.add_argument("--max-rows", type=int, default=1000)
    q.add_argument("--timeout", type=float, default=10.0, help="seconds before the query is stopped")
    q.add_argument("--max-bytes", default="64MB", help="largest result, e.g. 64MB; a bigger one is refused")
    q.add_argument("--memory-limit", default="1GB", help="memory the query may use, e.g. 1GB")
    q.add_argument("--threads", type=int, default=2, help="DuckDB threads")
    q.set_defaults(func=cmd_sql)

    rep = sub.add_parser("report", help="export a run's failure report (HTML, Markdown or JSON)")
    rep.add_argument("run", help="run folder, or run id under --root")
    rep.add_argument("--root", default="runs")
    rep.add_argument("--format", choices=["html", "md", "json"], default="html")
    rep.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    rep.add_argument("--thresholds", default=None, help="JSON file of gate thresholds (see analyses.Thresholds)")
    rep.add_argument("--gate", action="store_true", help="with --format json: exit 1 when the verdict fails")
    rep.set_defaults(func=cmd_report)

    add_explain(sub)

    d = sub.add_parser("demo", help="the task suite on the default model: H2O at two budgets and the baselines")
    d.add_argument("--out", default="demo_runs", help="runs root (default: ./demo_runs)")
    d.add_argument("--no-reports", action="store_true", help="skip the HTML/Markdown/JSON reports")
    d.add_argument(
        "--no-explain",
        action="store_true",
        help="skip the counterfactual re-runs of one H2O failure per task family (the table then shows estimates)",
    )
    _add_task_args(d, "the demo suite")
    d.set_defaults(func=cmd_demo)

    sw = sub.add_parser("sweep", help="keep ratio x policy over batches of requests: quality, KV and latency curves")
    sw.add_argument("--out", default="sweep_runs", help="runs root of the grid (default: ./sweep_runs)")
    sw.add_argument(
        "--status", metavar="ROOT", default=None, help="print done / failed / to do per cell group of ROOT's grids"
    )
    sw.add_argument("--size", default="small", help="built-in suite when --tasks is not given (small | demo | full)")
    _add_task_args(sw, "builtin:SIZE")
    budget = sw.add_mutually_exclusive_group()
    budget.add_argument(
        "--ratios",
        action="extend",
        nargs="+",
        default=None,
        help="keep ratios, comma list or repeated (default 1,0.4,0.2,0.1,0.05)",
    )
    budget.add_argument(
        "--slots", action="extend", nargs="+", default=None, help="slot counts per KV set instead of ratios"
    )
    sw.add_argument(
        "--policies",
        action="extend",
        nargs="+",
        default=None,
        metavar="NAME[:GQA]",
        help="policies of the grid, comma list or repeated (default: h2o:sum h2o:max and its baselines); "
        "e.g. h2o,local,sink or h2o tova scissorhands; kvpress:NAME is a kvpress press (snake_case name, "
        "e.g. kvpress:snapkv, kvpress:streaming_llm; pip install 'h2o-lens[kvpress]')",
    )
    sw.add_argument("--gqa", action="extend", nargs="+", default=None, help="aggregations, e.g. sum,max")
    sw.add_argument(
        "--press-args",
        action="extend",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="parameters of the grid's kvpress presses (kvpress:NAME in --policies), comma list or repeated, set "
        "on every press that takes them, e.g. window_size=32; compression_ratio comes from each keep ratio",
    )
    sw.add_argument("--batch-size", type=int, default=8, help="requests per generate call and run (default 8)")
    sw.add_argument("--no-replay", action="store_true", help="record only (no KL or dropped mass in the curves)")
    sw.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    sw.add_argument(
        "--past-context",
        action="store_true",
        help="run requests whose prompt and max_new_tokens go past the model's context window "
        "(refused otherwise; said once)",
    )
    ray = sw.add_argument_group("executor (DESIGN.md §13)")
    ray.add_argument(
        "--executor",
        choices=["inprocess", "ray"],
        default="inprocess",
        help="where the cells run: this process (default) or the workers of a Ray cluster "
        "(pip install 'h2o-lens[ray]'); --out must then be a folder every node sees",
    )
    ray.add_argument(
        "--address", default=None, help="ray: an existing cluster (e.g. auto, HOST:6379); default a local one"
    )
    ray.add_argument(
        "--workers",
        type=int,
        default=None,
        help="ray: worker actors, each loading the model once (default: fill the cluster)",
    )
    ray.add_argument("--gpus-per-worker", type=float, default=0.0, help="ray: GPUs per worker (0: CPU workers)")
    ray.add_argument(
        "--retries", type=int, default=1, help="ray: times a cell whose worker died is run again (default 1)"
    )
    sw.set_defaults(func=cmd_sweep)

    _add_tasks_parser(sub)

    sm = sub.add_parser("samples", help="regenerate the shipped sample runs (policy cases and a few tasks)")
    sm.add_argument("--out", default="sample_runs")
    sm.set_defaults(func=cmd_samples)

    ap = sub.add_parser("app", help="open the dashboard (Streamlit, bound to 127.0.0.1)")
    ap.add_argument("root", nargs="?", default=None, help="runs root (default: the shipped sample_runs/)")
    ap.add_argument("--port", type=int, default=8501)
    ap.add_argument("--open", action="store_true", help="open a browser tab")
    ap.set_defaults(func=cmd_app)

    b = sub.add_parser("bench", help="benchmarks that print ratios measured side by side")
    b.add_argument("what", choices=["decode", "record", "kernels", "sql", "runs", "explain", "sweep", "press"])
    b.add_argument("--model", default=None)
    b.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="decode: context lengths (512 2048); press: (2048 4096)"
    )
    b.add_argument(
        "--agreement",
        action="store_true",
        help="press: kept-set agreement of ObservedAttention and TOVA presses with h2o and tova (DESIGN.md §17.2)",
    )
    b.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode: batch sizes")
    b.add_argument("--keep", type=float, default=0.2, help="B as a share of the context")
    b.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--memory-limit", default="512MB", help="sql: the console's memory limit")
    b.add_argument(
        "--context",
        type=int,
        default=None,
        help="record: time and peak RSS of recording, then replaying, one prompt of this many tokens",
    )
    b.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="record: new tokens of that prompt (default 256); sweep: of each request (default 16); "
        "decode --assistant: tokens generated (default 96)",
    )
    b.add_argument("--runs", type=int, default=5000, help="runs: synthetic runs in the root")
    b.add_argument("--root", default=None, help="runs: reuse (or write once) this synthetic root")
    b.add_argument("--no-browser", action="store_true", help="runs: skip the dashboard timings")
    b.add_argument("--tasks", default="builtin:full", help="sweep: the requests (FILE or builtin:NAME)")
    b.add_argument("--count", type=int, default=16, help="sweep: requests of the grid")
    b.add_argument(
        "--length",
        type=int,
        default=None,
        help="sweep, explain: prompt tokens of a long-context built-in family (explain: --tasks builtin:NAME, "
        "default each family the full cache solves; capped at the model's window less the new tokens)",
    )
    b.add_argument("--batch-size", type=int, default=8, help="sweep: batch size compared with one at a time")
    b.add_argument("--no-replay", action="store_true", help="sweep: record only")
    b.add_argument(
        "--budget", choices=["slots", "ratio"], default="slots", help="sweep: one slot count, or --keep per prompt"
    )
    b.add_argument(
        "--executor",
        choices=["inprocess", "ray"],
        default="inprocess",
        help="sweep: ray compares the in-process executor with --workers Ray workers (local cluster)",
    )
    b.add_argument("--workers", type=int, default=2, help="sweep --executor ray: Ray workers (default 2)")
    b.add_argument(
        "--policies",
        action="extend",
        nargs="+",
        default=None,
        metavar="NAME[:GQA]",
        help="sweep: the grid's policies, as for `sweep --policies` (default h2o); press: the presses timed "
        "(kvpress:NAME, default snapkv, streaming_llm, tova, observed_attention, knorm)",
    )
    b.add_argument(
        "--gqa", action="extend", nargs="+", default=None, help="sweep: aggregations of the policies (default sum)"
    )
    b.add_argument(
        "--sharing",
        action="store_true",
        help="sweep: compare the batched grid with its cells sharing one prompt forward per batch "
        "(DESIGN.md §12.5) and with each cell forwarding its prompts",
    )
    b.add_argument(
        "--assistant",
        nargs="?",
        const="lookup",
        choices=["lookup", "layers"],
        default=None,
        help="decode: speculative decoding's speed-up under H2O vs the full cache, with prompt lookup "
        "(default) or a draft of the model's first layers (DESIGN.md §14)",
    )
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
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

        from recorders.errors import storage_error

        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG):
            text = str(storage_error(e.filename if e.filename is not None else "a file", e))
        else:
            text = f"{e.strerror or e}" + (f": {e.filename}" if e.filename is not None else "")
        print(f"h2o-lens: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
