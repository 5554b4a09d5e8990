"""``h2o-lens bench decode``: decode tokens/s of H2O ÷ the full cache, the prefill with scores ÷
SDPA (time and peak RSS); ``--guard`` the guard's cost per decode step, ``--assistant``
speculative decoding's speed-up under H2O ÷ the full cache's (DESIGN.md §14), ``--plan`` H2O under
a budget plan ÷ uniform H2O at the same total slots (``decode_plan.py``, DESIGN.md §2.14).

Timings belong here, not in tests: each figure is the median over rounds that alternate the two
paths being compared, on the same process and data.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..options import add_backend_arg, at_least, keep_share
from .common import check_ints, check_keep, halves, in_fresh_process, peak_rss_bytes
from .decode_checks import check_decode, decode_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["add_arguments", "run", "bench_decode", "bench_assistant", "bench_decode_guard", "decode_bytes"]

NAME = "decode"
HELP = "decode tokens/s of H2O / the full cache, the prefill with scores / SDPA (--guard, --assistant, --plan: modes)"


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    b.add_argument(
        "--contexts",
        type=at_least(2),
        nargs="+",
        default=None,
        help="context lengths (default 512 2048; --guard: 4096)",
    )
    b.add_argument("--batch", type=at_least(1), nargs="+", default=[1, 8], help="batch sizes")
    b.add_argument("--keep", type=keep_share, default=None, help="B as a share of the context, in (0, 1) (default 0.2)")
    b.add_argument("--steps", type=at_least(1), default=8, help="decode steps timed per round")
    b.add_argument("--rounds", type=at_least(1), default=3, help="rounds alternating the two sides")
    add_backend_arg(b)
    b.add_argument("--guard", action="store_true", help="the guard's cost per decode step (default context 4096)")
    b.add_argument(
        "--assistant",
        nargs="?",
        const="lookup",
        choices=["lookup", "layers"],
        default=None,
        help="speculative decoding's speed-up under H2O vs the full cache, with prompt lookup "
        "(default) or a draft of the model's first layers (DESIGN.md §14)",
    )
    b.add_argument("--new-tokens", type=at_least(2), default=None, help="--assistant: tokens generated (default 96)")
    b.add_argument(
        "--cold",
        metavar="STORE:RECALL[:SELECTION[:EVERY]]",
        default=None,
        help="time H2O with a cold tier (DESIGN.md §2.13): a window of RECALL slots inside B, evicted K/V in "
        "STORE (cpu | disk), SELECTION exact | pages | pages=N, a refill every EVERY steps; the cold bytes read "
        "per step and H2O at the same B without the tier beside it",
    )
    b.add_argument(
        "--plan",
        metavar="FILE",
        default=None,
        help="a budget plan (h2o-lens plan -o FILE): ms per decode step of H2O under the plan / uniform H2O at "
        "the same total slots (the plan's slots at each context summed over layers and KV sets, spread evenly: "
        "one B per layer and KV set, rounded), alternating; no --keep",
    )


def run(args: argparse.Namespace) -> int:
    from h2o_lens.errors import ConfigError

    if args.guard and args.assistant:
        raise ConfigError("bench decode: --guard and --assistant are two benchmarks; give one")
    if args.new_tokens is not None and not args.assistant:
        raise ConfigError("bench decode: --new-tokens is the --assistant mode's; the others time --steps")
    if args.plan is not None:  # the options it contradicts here; the file and its layers before the model loads
        from .decode_plan import bench_decode_plan, check_plan_args

        check_plan_args(args)
        return bench_decode_plan(
            args.plan,
            model_name=args.model,
            contexts=tuple(args.contexts or (512, 2048)),
            batches=args.batch,
            steps=args.steps,
            rounds=args.rounds,
            backend=args.backend,
        )
    args.keep = 0.2 if args.keep is None else args.keep
    cold = _cold(args)  # before the model loads
    if args.assistant:
        return bench_assistant(
            model_name=args.model,
            draft=args.assistant,
            keep=args.keep,
            rounds=args.rounds,
            new_tokens=args.new_tokens or 96,
        )
    contexts = tuple(args.contexts or ((4096,) if args.guard else (512, 2048)))
    if args.guard:
        return bench_decode_guard(
            model_name=args.model,
            contexts=contexts,
            batches=tuple(args.batch),
            keep=args.keep,
            steps=args.steps,
            rounds=args.rounds,
        )
    return bench_decode(
        model_name=args.model,
        contexts=contexts,
        batches=args.batch,
        keep=args.keep,
        steps=args.steps,
        rounds=args.rounds,
        cold=cold,
        backend=args.backend,
    )


def _cold(args: argparse.Namespace) -> Any:
    """``--cold`` as a :class:`~h2o_lens.cold_config.ColdTier` (None without it), refused in one line
    when malformed, beside another mode, or when the smallest context's B cannot hold its window."""
    if args.cold is None:
        return None
    from h2o_lens.cold_config import parse_cold
    from h2o_lens.config import H2OConfig
    from h2o_lens.errors import ConfigError
    from h2o_lens.policies import ratio_slots

    tier = parse_cold(args.cold)
    if args.guard or args.assistant:
        mode = "--guard" if args.guard else "--assistant"
        raise ConfigError(f"bench decode: --cold times H2O's decode with a cold tier; {mode} is another benchmark")
    check_keep("decode", args.keep)
    n = min(args.contexts or (512, 2048))
    budget = ratio_slots(args.keep, n)
    try:
        H2OConfig(**halves(budget), cold=tier)
    except ConfigError as exc:
        raise ConfigError(f"bench decode --cold {args.cold} at context {n} (B={budget}): {exc}") from None
    return tier


def _prefill_phase(phase: str, model_name: str, context: int, keep: float) -> None:
    """One prefill of a ``context``-token prompt in this (fresh) process: SDPA (``phase="sdpa"``)
    or H2O with scores (``"h2o"``); prints one JSON line with the peak RSS."""
    import json

    import torch
    from transformers import DynamicCache

    from h2o_lens import compat
    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model
    from h2o_lens.policies import ratio_slots
    from h2o_lens.runtime import h2o

    torch.set_grad_enabled(False)
    model, _ = load_model(model_name, progress=False)
    text = model.config.get_text_config(decoder=True)
    ids = torch.randint(0, text.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    loaded = peak_rss_bytes()
    t0 = time.perf_counter()
    if phase == "sdpa":
        model.set_attn_implementation("sdpa")
        model(input_ids=ids, **compat.cache_kwargs(DynamicCache(config=model.config)), use_cache=True, logits_to_keep=1)
    else:
        with h2o(model, H2OConfig(**halves(ratio_slots(keep, context)))) as session:
            model(input_ids=ids, **compat.cache_kwargs(session.new_cache()), use_cache=True, logits_to_keep=1)
    out = {"phase": phase, "seconds": time.perf_counter() - t0, "loaded_bytes": loaded, "peak_bytes": peak_rss_bytes()}
    print(json.dumps(out), flush=True)


def _prefill_rss(model_name: str, context: int, keep: float) -> int:
    """Peak RSS of the SDPA prefill and of the prefill with scores, each in a fresh process; prints one line."""
    res = {}
    for phase in ("sdpa", "h2o"):
        args = f"{phase!r}, {model_name!r}, {context!r}, {keep!r}"
        code = f"from commands.benchmarks.decode import _prefill_phase; _prefill_phase({args})"
        res[phase] = in_fresh_process(code)
        if isinstance(res[phase], str):
            print(f"prefill {context} peak RSS: the {phase} process failed ({res[phase]})")
            return 1
    gib = 2**30
    s, h = res["sdpa"], res["h2o"]
    grow_s, grow_h = s["peak_bytes"] - s["loaded_bytes"], h["peak_bytes"] - h["loaded_bytes"]
    print(
        f"prefill {context} peak RSS (fresh processes): SDPA {s['peak_bytes'] / gib:.2f} GiB, with scores "
        f"{h['peak_bytes'] / gib:.2f} GiB: ratio {h['peak_bytes'] / s['peak_bytes']:.3f} (above the loaded "
        f"model: {grow_s / gib:.2f} vs {grow_h / gib:.2f} GiB)",
        flush=True,
    )
    return 0


def _prefill_time(model, cfg, ctx: torch.Tensor, rounds: int) -> tuple[float, float]:
    """Median seconds of the SDPA prefill and of the H2O prefill with scores, alternating."""
    import torch
    from transformers import DynamicCache

    from h2o_lens import compat
    from h2o_lens.runtime import h2o

    t_sdpa, t_h2o = [], []
    with torch.no_grad(), h2o(model, cfg) as session:
        for i in range(rounds + 1):
            model.set_attn_implementation("sdpa")
            t0 = time.perf_counter()
            model(
                input_ids=ctx,
                **compat.cache_kwargs(DynamicCache(config=model.config)),
                use_cache=True,
                logits_to_keep=1,
            )
            t1 = time.perf_counter()
            model.set_attn_implementation("h2o_lens")
            model(input_ids=ctx, **compat.cache_kwargs(session.new_cache()), use_cache=True, logits_to_keep=1)
            t2 = time.perf_counter()
            if i:  # the first round warms up
                t_sdpa.append(t1 - t0)
                t_h2o.append(t2 - t1)
    return statistics.median(t_sdpa), statistics.median(t_h2o)


def _decode_times(model, cfg, ctx: torch.Tensor, steps: int, rounds: int, budget: int | None = None):
    """Median seconds per decode step of the full cache, of H2O and (``budget`` given) of the limit,
    the full cache over the context's first ``budget`` tokens, in rotating rounds; the H2O cache's
    bytes; and (``budget`` given) where H2O's step goes (:func:`h2o_lens.timing.step_parts`) and what
    its attention and eviction cost inside the model (without a cold tier; else None)."""
    from transformers import DynamicCache

    from h2o_lens.cache import H2OCache
    from h2o_lens.cold import cold_summary
    from h2o_lens.runtime import h2o
    from h2o_lens.timing import Decoder as _Decoder
    from h2o_lens.timing import frozen_steps, step_parts
    from h2o_lens.timing import median_time as _median_time

    model.set_attn_implementation("sdpa")
    full = DynamicCache(config=model.config)
    sides = {"full": (_Decoder(model, full, ctx, last_logits_only=True), "sdpa")}  # side: (decoder, attention)
    if budget is not None:
        limit = _Decoder(model, DynamicCache(config=model.config), ctx[:, :budget], last_logits_only=True)
        sides["limit"] = (limit, "sdpa")
    with h2o(model, cfg) as session:
        sides["h2o"] = (_Decoder(model, session.new_cache(), ctx, last_logits_only=True), "h2o_lens")
        if budget is not None and cfg.cold is None:  # H2O's step with its attention and eviction frozen
            header, tensors = sides["h2o"][0].cache.export_state()
            frozen = session.new_cache()
            frozen.import_state(header, {k: v.clone() for k, v in tensors.items()})
            sides["frozen"] = (_Decoder.resume(model, frozen, sides["h2o"][0].token.clone()), "h2o_lens")
        if cfg.cold is not None:  # H2O at the same B without the tier, timed in the same rounds
            plain = H2OCache(dataclasses.replace(cfg, cold=None), model.config)
            sides["plain"] = (_Decoder(model, plain, ctx, last_logits_only=True), "h2o_lens")
        times = {name: [] for name in sides}
        for i in range(rounds + 1):  # the first round warms up
            for name, (side, attention) in sides.items():
                model.set_attn_implementation(attention)
                n = steps if i else 2
                with frozen_steps() if name == "frozen" else contextlib.nullcontext():
                    t = _median_time(lambda side=side, n=n: side.run(n), 1) / n
                if i:
                    times[name].append(t)
        nbytes = sides["h2o"][0].cache.nbytes()
        cold = cold_summary(sides["h2o"][0].cache)
        if cold is not None:  # a cold tier's bytes read over the steps decoded, the warm-up's included
            nbytes = {**nbytes, "cold_read": cold["read"], "cold_steps": 2 + rounds * steps}
            nbytes["plain"] = statistics.median(times["plain"])  # ms of H2O without the tier
            nbytes["rounds"] = [h / p for h, p in zip(times["h2o"], times["plain"], strict=True)]  # with ÷ without
        torch_step = sides["h2o"][0].cache.backend == "torch"  # the parts are the torch step's
        parts = step_parts(sides["h2o"][0].cache) if budget is not None and torch_step else None
    med = {name: statistics.median(t) for name, t in times.items()}
    inside = med["h2o"] - med["frozen"] if "frozen" in med else None  # attention and eviction in the model
    return med["full"], med["h2o"], nbytes, med.get("limit"), parts, inside


def _resolved(backend: str) -> str:
    """The backend H2O's step runs on here (a model on the CPU), named as the table prints it."""
    from h2o_lens.kernels import resolve_backend

    name = resolve_backend(backend, "cpu")
    return {"torch": "torch (the torch step)", "cpp": "cpp (the fused CPU step)"}.get(name, name)


def _where(step: float, parts: dict[str, float] | None, inside: float | None = None) -> str:
    """Where H2O's decode step of ``step`` seconds goes: its parts timed apart (warm caches; the torch
    step's, None for a fused step), the rest, and (``inside``, when measured) what its attention and
    eviction cost inside the model: the step less the same step with them frozen
    (:func:`h2o_lens.timing.frozen_steps`)."""
    if parts is None:
        if inside is None:
            return "H2O's step: a fused step, not split into parts"
        return f"H2O's step (ms): in the model its fused attention and eviction take {inside * 1e3:.2f}"
    rest = step - sum(parts.values())
    shown = ", ".join(f"{name} {t * 1e3:.2f}" for name, t in parts.items())
    line = f"H2O's step (ms): {shown} (timed apart), other (the model's projections and MLP, hooks, bookkeeping) "
    line += f"{rest * 1e3:.2f}"
    if inside is not None:
        line += f"; in the model its attention and eviction take {inside * 1e3:.2f} (the step less the step with "
        line += "them frozen)"
    return line


def bench_decode(
    model_name: str | None = None,
    contexts=(512, 2048),
    batches=(1, 8),
    keep: float = 0.2,
    steps: int = 8,
    rounds: int = 3,
    model=None,
    memory: bool = True,
    cold: Any = None,
    backend: str = "auto",
) -> int:
    """Decode tokens/s of H2O at ``keep`` ÷ the full cache, per context and batch size, and the
    prefill with scores ÷ the SDPA prefill, in time and in peak RSS, side by side in one run.
    ``cold``: a :class:`~h2o_lens.cold_config.ColdTier` the H2O side runs with (its window inside
    B); each row then says the cold bytes read per decode step. ``backend``: the H2O side's
    (:class:`~h2o_lens.config.H2OConfig`'s ``backend``; the table says which ran).

    For each context: a table with a row per batch size (every row of the batch the same
    context of random tokens): full-cache and H2O ms/step and tokens/s, measured in
    alternating rounds, their ratio and the KV bytes held; then the prefill of one prompt
    with scores ÷ SDPA (time, in this process), and the peak RSS of each, each in a fresh
    process that does only that prefill (``memory``; it loads ``model_name``, so it is
    skipped when only ``model`` is given). Returns 0 (1 when a memory process failed).
    """
    import torch

    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model
    from h2o_lens.policies import ratio_slots
    from h2o_lens.runtime import full_kv_bytes
    from h2o_lens.shape import model_shape

    check_decode(model_name, contexts, batches, keep, steps, rounds, None if model is None else model.config)
    contexts, batches = list(contexts), list(batches)
    fresh = memory and (model is None or model_name is not None)
    if model is None:
        model, _ = load_model(model_name, progress=False)
        check_decode(None, contexts, batches, keep, steps, rounds, model.config)  # a model converted just now
    text = model.config.get_text_config(decoder=True)
    shape = model_shape(model.config)
    gen = torch.Generator().manual_seed(0)
    print(
        f"model {type(model).__name__}: {shape.layers} layers, {shape.q_heads} "
        f"query heads, {shape.kv_heads} KV heads, head_dim {shape.head_dim}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; H2O keeps {keep:.0%}; "
        f"{steps} steps x {rounds} rounds alternating full / H2O, medians",
        flush=True,
    )
    failed = 0
    for n in contexts:
        budget = ratio_slots(keep, n)
        cfg = H2OConfig(**halves(budget), cold=cold, backend=backend)
        print(f"\ncontext {n}, H2O B={budget} ({cfg.describe()}), backend {_resolved(backend)}")
        print(
            f"{'batch':>6} {'full ms/step':>13} {'full tok/s':>11} {'h2o ms/step':>12} {'h2o tok/s':>10} "
            f"{'h2o/full tok/s':>15} {'limit ms/step':>14} {'h2o/limit':>10} {'KV MiB h2o':>11} {'KV h2o/full':>12}"
        )
        for b in batches:
            ctx = torch.randint(0, text.vocab_size, (b, n), generator=gen)
            tf, th, nbytes, tl, parts, inside = _decode_times(model, cfg, ctx, steps, rounds, budget)
            tokens = n + 2 + rounds * steps + 1
            kv = nbytes["kv"] + nbytes["metadata"]
            share = kv / full_kv_bytes(model, tokens, batch=b)
            print(
                f"{b:>6} {tf * 1e3:>13.2f} {b / tf:>11.1f} {th * 1e3:>12.2f} {b / th:>10.1f} {tf / th:>15.3f} "
                f"{tl * 1e3:>14.2f} {th / tl:>10.3f} {kv / 2**20:>11.3f} {share:>12.4f}",
                flush=True,
            )
            print(f"{'':>6} {_where(th, parts, inside)}", flush=True)
            if cold is not None:
                per_step = nbytes["cold_read"] / max(1, nbytes["cold_steps"])
                tp, each = nbytes["plain"], nbytes["rounds"]
                print(
                    f"{'':>6} cold tier: {per_step:,.0f} bytes read per step; H2O at the same B without it "
                    f"{tp * 1e3:.2f} ms/step: with ÷ without {th / tp:.3f} (per round {min(each):.3f}–{max(each):.3f})",
                    flush=True,
                )
        ts, th = _prefill_time(model, cfg, torch.randint(0, text.vocab_size, (1, n), generator=gen), rounds)
        print(f"prefill {n} tokens: SDPA {ts * 1e3:.0f} ms, with scores {th * 1e3:.0f} ms: ratio {th / ts:.3f}")
        if fresh:
            failed |= _prefill_rss(model_name, n, keep)
        elif memory:
            print(f"prefill {n} peak RSS: skipped (give the model by name to load it in fresh processes)")
    return failed


_COPY_TEXT = (
    "The lighthouse keeper wrote in the log every evening: the wind from the north-west, the sea "
    "calm near the rocks, two fishing boats back before dark, the lamp cleaned and the clock wound. "
    "On Sundays he added the letters he had received and the names of the visitors who climbed the "
    "stairs to see the lens. "
)


def _draft_from_layers(model, layers: int):
    """A draft that shares the tokenizer: the model's first ``layers`` decoder layers and its head."""
    import copy

    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft.eval()


def bench_assistant(
    model_name: str | None = None,
    draft: str = "lookup",
    new_tokens: int = 96,
    keep: float = 0.5,
    rounds: int = 3,
    lookup_tokens: int = 8,
    draft_layers: int = 6,
    model=None,
    tokenizer=None,
) -> int:
    """Speed-up of speculative decoding with a full cache and under H2O (DESIGN.md §14).

    Greedy generation of ``new_tokens`` from a prompt that asks to copy a repeated text, four
    ways, in alternating rounds: full cache plain and speculative, H2O (``keep`` of the prompt,
    halves heavy/recent) plain and speculative. ``draft`` is ``lookup`` (prompt-lookup decoding,
    ``lookup_tokens`` per draft) or ``layers`` (the model's first ``draft_layers`` layers as the
    assistant). Prints both speed-ups and their ratio (the target: at least 0.9); returns 0.
    """
    import torch

    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model
    from h2o_lens.policies import ratio_slots
    from h2o_lens.runtime import h2o

    if draft not in ("lookup", "layers"):
        raise ValueError(f"draft must be 'lookup' or 'layers', got {draft!r}")
    check_keep("decode --assistant", keep)
    check_ints("decode --assistant", "rounds", rounds, 1)
    check_ints("decode --assistant", "new-tokens", new_tokens, 2)
    if model is None:
        model, tokenizer = load_model(model_name)
    text = "Copy this text exactly, twice:\n\n" + _COPY_TEXT * 3
    messages = [{"role": "user", "content": text}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(chat, return_tensors="pt", add_special_tokens=False)["input_ids"]
    cfg = H2OConfig(**halves(ratio_slots(keep, ids.shape[1])))
    if draft == "lookup":
        spec = {"prompt_lookup_num_tokens": lookup_tokens}
        what = f"prompt lookup ({lookup_tokens} tokens)"
    else:
        spec = {"assistant_model": _draft_from_layers(model, draft_layers)}
        what = f"draft of the first {draft_layers} layers"
    kw = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )

    forwards: list[int] = []

    def run(use_h2o: bool, speculative: bool) -> tuple[float, torch.Tensor]:
        extra = spec if speculative else {}
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if use_h2o:
                stack.enter_context(h2o(model, cfg))
            t0 = time.perf_counter()
            out = model.generate(ids, **kw, **extra)
            return time.perf_counter() - t0, out

    ways = [(False, False), (False, True), (True, False), (True, True)]
    times: dict[tuple[bool, bool], list[float]] = {w: [] for w in ways}
    outs, calls = {}, {}
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        for w in ways:  # warm-up, the tokens each way produces and its forwards of the main model
            forwards.clear()
            outs[w] = run(*w)[1]
            calls[w] = len(forwards)
    finally:
        hook.remove()
    for _ in range(rounds):
        for w in ways:
            times[w].append(run(*w)[0])
    t = {w: statistics.median(v) for w, v in times.items()}
    full_up = t[(False, False)] / t[(False, True)]
    h2o_up = t[(True, False)] / t[(True, True)]
    print(
        f"model {type(model).__name__}, prompt {ids.shape[1]} tokens, {new_tokens} new, H2O {cfg.describe()}, "
        f"{what}; torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {rounds} rounds"
    )
    for name, (plain, fast) in (("full cache", ways[:2]), ("H2O", ways[2:])):
        same = torch.equal(outs[plain], outs[fast])
        per = (new_tokens - 1) / max(calls[fast] - 1, 1)  # tokens after the first forward's
        print(
            f"{name:>10}: plain {t[plain] * 1e3 / new_tokens:7.1f} ms/token, speculative "
            f"{t[fast] * 1e3 / new_tokens:7.1f} ms/token, speed-up {t[plain] / t[fast]:.2f}x, "
            f"same tokens: {'yes' if same else 'NO'}; {calls[fast]} verification forwards, "
            f"{per:.2f} tokens each"
        )
    _same_tokens(outs[ways[0]][0, ids.shape[1] :], outs[ways[2]][0, ids.shape[1] :], calls[ways[3]], calls[ways[1]])
    print(f"H2O keeps {h2o_up / full_up:.3f} of the full cache's speed-up (target >= 0.90)")
    return 0


def _same_tokens(full_tokens, h2o_tokens, h2o_calls: int, full_calls: int) -> None:
    """One line: whether H2O generated the full cache's tokens, so that its drafts were accepted alike."""
    import torch

    if torch.equal(full_tokens, h2o_tokens):
        print("H2O's tokens are the full cache's: the drafts are accepted alike, the ratio is the runtime's")
        return
    first = int((full_tokens != h2o_tokens).nonzero()[0])
    print(
        f"H2O's tokens differ from the full cache's from new token {first} on, so its drafts are accepted "
        f"differently ({h2o_calls} against {full_calls} forwards): the ratio mixes H2O's answer with "
        "the runtime (DESIGN.md §14.1); a larger --keep gives both the same tokens"
    )


def bench_decode_guard(
    model_name: str | None = None,
    contexts: Sequence[int] = (4096,),
    batches: Sequence[int] = (1, 8),
    keep: float = 0.2,
    steps: int = 8,
    rounds: int = 3,
    model: Any = None,
    strides: Sequence[int] = (1, 8),
) -> int:
    """``bench decode --guard``: ms per decode step of H2O with the guard's signals ÷ without, per
    context and batch size, measured in alternating rounds on the same prefilled state (the guarded
    cache is a restored copy of the plain one, DESIGN.md §15.2); ``guard own`` is the share of
    the guarded step spent in the guard's own code, ``same tokens`` whether both caches decoded
    the same tokens; one row per guard ``stride`` (signals from every ``stride``-th layer). Returns 0."""
    import torch

    from h2o_lens.config import H2OConfig
    from h2o_lens.guard import GuardConfig, guarded
    from h2o_lens.models import load_model
    from h2o_lens.runtime import h2o
    from h2o_lens.timing import Decoder, median_time

    check_decode(model_name, contexts, batches, keep, steps, rounds, None if model is None else model.config)
    if model is None:
        model, _ = load_model(model_name, progress=False)
        check_decode(None, contexts, batches, keep, steps, rounds, model.config)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(0)
    cfg = H2OConfig(ratio=keep)
    print(
        f"guard overhead: H2O at {keep:.0%}, {steps} steps x {rounds} rounds alternating plain / guarded, "
        f"medians; torch {torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    print(
        f"{'context':>8} {'batch':>6} {'stride':>6} {'h2o ms/step':>12} {'guard ms/step':>14} {'ratio':>7} "
        f"{'guard own':>10} {'same tokens':>12}"
    )
    for n, b in [(n, b) for n in contexts for b in batches]:
        ctx = torch.randint(0, vocab, (b, n), generator=gen)
        with h2o(model, cfg) as session:
            plain = Decoder(model, session.new_cache(), ctx, last_logits_only=True)
            header, tensors = plain.cache.export_state()
            start = plain.token.clone()
            plain.run(2)  # warm-up
            for stride in strides:
                with guarded(GuardConfig(stride=stride)):
                    cache = session.new_cache()
                cache.import_state(header, {k: v.clone() for k, v in tensors.items()})
                guard = Decoder.resume(model, cache, start.clone())
                guard.run(2)  # warm-up; the guard's first step sizes its reservoir
                same = torch.equal(guard.token, _replay(model, header, tensors, start, 2, session))
                t_plain, t_guard = [], []
                before = cache.guard.seconds
                for _ in range(rounds):
                    t_plain.append(median_time(functools.partial(plain.run, steps), 1) / steps)
                    t_guard.append(median_time(functools.partial(guard.run, steps), 1) / steps)
                own = (cache.guard.seconds - before) / (rounds * steps)
                tp, tg = statistics.median(t_plain), statistics.median(t_guard)
                print(
                    f"{n:>8} {b:>6} {stride:>6} {tp * 1e3:>12.2f} {tg * 1e3:>14.2f} {tg / tp:>7.3f} "
                    f"{own / tg:>10.1%} {'yes' if same else 'NO':>12}",
                    flush=True,
                )
    return 0


def _replay(model: Any, header: dict, tensors: dict, token: torch.Tensor, steps: int, session: Any) -> torch.Tensor:
    """The token after ``steps`` plain decode steps from a restored copy of a saved state."""
    from h2o_lens.timing import Decoder

    cache = session.new_cache()
    cache.import_state(header, {k: v.clone() for k, v in tensors.items()})
    dec = Decoder.resume(model, cache, token.clone())
    dec.run(steps)
    return dec.token
