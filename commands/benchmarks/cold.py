"""``h2o-lens bench cold``: what a cold tier's recall window buys against plain H2O at the same hot memory.

For each task, greedy generation with the full cache, with plain H2O at ``--ratio`` of the prompt,
and with H2O at the same slot count whose recall window of ``--window`` of the prompt is taken
inside it (DESIGN.md §2.13), per store, selection and refill interval (``--every``; a configuration
named ``/K`` refills every K decode steps). Printed per configuration: accuracy (the
task's checker), the requests it recovers (plain H2O wrong, the full cache right, it right), the hot
KV share (slots held over positions, layer 0's first KV set, the window included), the cold bytes
read per generated token, and the decode time per token beside plain H2O's: on the first task, every
configuration generates ``--time-tokens`` tokens per round (no listener), ``--rounds`` rounds with
the configurations in a rotated order each round, each configuration's median time and the median
over rounds of its time ÷ plain H2O's in the same round (steadier than a ratio of medians when the
machine's pace drifts between rounds), all in the same run. The H2O
configurations of a task share one prompt forward (DESIGN.md §12.5): a cold tier keeps what the
keep rule drops and acts at the decode steps only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from ..options import add_backend_arg, add_task_args, at_least, share, split_list
from .common import HeldSlots

__all__ = ["add_arguments", "run", "bench_cold"]

NAME = "cold"
HELP = "accuracy, hot KV share, cold bytes read per token and decode time of a cold tier (DESIGN.md §2.13)"


def add_arguments(b: argparse.ArgumentParser) -> None:
    add_task_args(b, "builtin:delayed_reference")
    b.add_argument("--ratio", type=share, default=0.2, help="slot count as a share of each prompt (default 0.2)")
    b.add_argument(
        "--window", type=share, default=0.05, help="recall window as a share of the prompt, inside the slots"
    )
    b.add_argument("--stores", nargs="+", default=None, metavar="STORE", help="cpu and/or disk (default both)")
    b.add_argument(
        "--selections", nargs="+", default=None, metavar="SELECTION", help="exact and/or pages (default both)"
    )
    b.add_argument(
        "--every", type=at_least(1), nargs="+", default=[1], metavar="K", help="refill every K decode steps (default 1)"
    )
    b.add_argument("--new-tokens", type=at_least(1), default=None, help="cap on each task's new tokens")
    b.add_argument(
        "--rounds", type=at_least(0), default=3, help="timing rounds, configurations rotated each round (0: none)"
    )
    b.add_argument("--time-tokens", type=at_least(2), default=16, help="tokens generated per timed generation")
    b.add_argument(
        "--time-batch",
        type=at_least(1),
        nargs="+",
        default=[1],
        metavar="B",
        help="batch sizes timed: the first task's prompt repeated B times (default 1)",
    )
    add_backend_arg(b)  # plain h2o's and the cold tier's decode step (cpp: the tier's refill compiled too)


def run(args: argparse.Namespace) -> int:
    from h2o_lens.cold_config import SELECTIONS, STORES
    from h2o_lens.errors import ConfigError

    stores = split_list(args.stores) or list(STORES)
    selections = split_list(args.selections) or list(SELECTIONS)
    bad = [s for s in stores if s not in STORES] + [s for s in selections if s not in SELECTIONS]
    if bad:
        raise ConfigError(f"bench cold: unknown store or selection {bad}; stores {STORES}, selections {SELECTIONS}")
    if args.window >= args.ratio:
        raise ConfigError(f"bench cold: --window {args.window} must be below --ratio {args.ratio} (it lies inside it)")
    return bench_cold(args, stores, selections)


@dataclass
class _Tally:
    """One configuration over the tasks."""

    correct: list[bool | None] = field(default_factory=list)
    hot: list[float] = field(default_factory=list)
    decode: dict[int, list[float | None]] = field(default_factory=dict)  # batch size -> seconds per step, per round
    cold_read: int = 0
    tokens: int = 0


class _Clock:
    """A logits processor that notes when each forward ended (the first: the prefill's)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores

    def per_step(self) -> float | None:
        t = self.times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def _timed(model, tok, task, config, tokens: int, batch: int = 1) -> float | None:
    """Decode seconds per step of ``tokens`` greedy tokens of ``task`` under ``config`` (no listener),
    the prompt repeated over ``batch`` rows."""
    import contextlib

    import torch

    from h2o_lens.runtime import h2o

    ids = tok(task.chat_text(tok), return_tensors="pt", add_special_tokens=False).input_ids.repeat(batch, 1)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    clock = _Clock()
    with contextlib.ExitStack() as stack:
        if config is not None:
            stack.enter_context(h2o(model, config))
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),  # the rows are one prompt: no padding
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=[clock],
            )
    return clock.per_step()


def _one(model, tok, task, config, new_tokens: int | None) -> tuple[bool | None, float, int, int]:
    """``(verdict, hot share, cold bytes read, tokens)`` of one greedy generation."""
    import contextlib

    import torch

    from h2o_lens.cold import cold_summary
    from h2o_lens.runtime import h2o

    ids = tok(task.chat_text(tok), return_tensors="pt", add_special_tokens=False).input_ids
    p = ids.shape[1]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    limit = min(task.max_new_tokens, new_tokens) if new_tokens else task.max_new_tokens
    held = HeldSlots()
    with contextlib.ExitStack() as stack:
        session = stack.enter_context(h2o(model, config, listener=held)) if config is not None else None
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=limit, do_sample=False, pad_token_id=pad)
        cold = cold_summary(session.last_cache) if session is not None and config.cold is not None else None
    tokens = out[0, p:].tolist()
    answer = tok.decode(tokens, skip_special_tokens=True)
    full = [p + i + 1 for i in range(len(held.held))]
    hot = sum(held.held) / sum(full) if config is not None and full else 1.0
    verdict = task.check(answer) if task.checked else None
    return verdict, hot, (cold or {}).get("read", 0), len(tokens)


def _configs(p: int, ratio: float, window: float, stores, selections, every=(1,), backend="auto") -> dict[str, Any]:
    from h2o_lens import policies
    from h2o_lens.cold_config import ColdTier
    from h2o_lens.config import H2OConfig

    from .common import halves

    slots = policies.ratio_slots(ratio, p)
    recall = max(1, round(window * p))
    out: dict[str, Any] = {"full": None, "h2o": H2OConfig(**halves(slots), backend=backend)}
    for store in stores:
        for select in selections:
            for k in every:
                name = f"cold {store} {select}" + (f" /{k}" if k != 1 else "")
                tier = ColdTier(store, recall, select=select, every=k)
                out[name] = H2OConfig(**halves(slots), cold=tier, backend=backend)
    return out


def bench_cold(args: argparse.Namespace, stores, selections) -> int:
    import torch

    from h2o_lens.models import load_model
    from h2o_lens.prompt_reuse import reuse_prompts

    from ..options import resolve_requests

    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    tasks = resolve_requests(args.tasks or "builtin:delayed_reference", args, tok)
    tally: dict[str, _Tally] = {}
    for i, task in enumerate(tasks):
        p = tok(task.chat_text(tok), return_tensors="pt", add_special_tokens=False).input_ids.shape[1]
        configs = _configs(p, args.ratio, args.window, stores, selections, args.every, args.backend)
        with reuse_prompts(model):  # one H2O prompt forward per task: a cold tier only observes it
            outcomes = {name: _one(model, tok, task, config, args.new_tokens) for name, config in configs.items()}
        for name, (verdict, hot, read, n) in outcomes.items():
            t = tally.setdefault(name, _Tally())
            t.correct.append(verdict)
            t.hot.append(hot)
            t.cold_read += read
            t.tokens += n
        print(f"task {i + 1}/{len(tasks)} {task.name}: prompt {p} tokens", flush=True)
        if i == 0 and args.rounds:  # the decode time, on the first task: rounds, the configurations rotated
            _time_all(model, tok, task, configs, tally, args)
    _print(tally, args)
    return 0


def _time_all(model, tok, task, configs: dict[str, Any], tally: dict[str, _Tally], args: argparse.Namespace) -> None:
    """Decode seconds per step of every configuration at each ``--time-batch``, ``--rounds`` rounds
    in a rotated order; the H2O configurations' rows start from one one-row prompt forward."""
    from h2o_lens.prompt_reuse import reuse_prompts

    names = list(configs)
    with reuse_prompts(model, repeated=True):
        for batch in args.time_batch:
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    step = _timed(model, tok, task, configs[name], args.time_tokens, batch)
                    tally[name].decode.setdefault(batch, []).append(step)  # None: fewer than 2 forwards
            print(f"timed {args.rounds} rounds of {args.time_tokens} tokens on {task.name}, batch {batch}", flush=True)


def _print(tally: dict[str, _Tally], args: argparse.Namespace) -> None:
    full, plain = tally["full"].correct, tally["h2o"].correct
    lost = [i for i, (f, h) in enumerate(zip(full, plain)) if f and h is False]
    print(
        f"\nratio {args.ratio}, window {args.window} of the prompt inside it (equal hot memory to plain h2o); "
        f"{len(full)} tasks, {len(lost)} that plain h2o gets wrong and the full cache right; backend {args.backend}"
    )
    print(f"{'configuration':<20} {'accuracy':>9} {'recovered':>10} {'hot KV':>7} {'cold B/token':>13}")
    for name, t in tally.items():
        checked = [c for c in t.correct if c is not None]
        acc = f"{sum(checked)}/{len(checked)}" if checked else "-"
        rec = f"{sum(1 for i in lost if t.correct[i])}/{len(lost)}" if lost else "-"
        per_token = f"{t.cold_read / t.tokens:,.0f}" if t.tokens and name.startswith("cold") else "-"
        print(f"{name:<20} {acc:>9} {rec:>10} {statistics.mean(t.hot):>7.3f} {per_token:>13}")
    batches = sorted({b for t in tally.values() for b in t.decode})
    if not batches:
        return
    print(
        f"\ndecode ms per step (median of {args.rounds} rounds of {args.time_tokens} tokens) and the median over "
        "rounds of its time ÷ plain h2o's in the same round"
    )
    print(f"{'configuration':<20}" + "".join(f" {f'b={b} ms':>10} {'x h2o':>6}" for b in batches))
    for name, t in tally.items():
        cells = []
        for b in batches:
            times = [s for s in t.decode.get(b, []) if s is not None]
            step = statistics.median(times) if times else None
            ratio = _round_ratio(t.decode.get(b, []), tally["h2o"].decode.get(b, []))
            cells.append(f" {f'{1000 * step:.2f}' if step else '-':>10} {f'{ratio:.2f}' if ratio else '-':>6}")
        print(f"{name:<20}" + "".join(cells))


def _round_ratio(times: list[float | None], base: list[float | None]) -> float | None:
    """The median over rounds of ``times[r] ÷ base[r]`` (rounds where either is missing left out)."""
    ratios = [t / p for t, p in zip(times, base) if t and p]
    return statistics.median(ratios) if ratios else None
