"""``h2o-lens bench decode --plan FILE``: ms per decode step of H2O under a budget plan (DESIGN.md
§2.14) ÷ uniform H2O at the same total slots, per context and batch size, measured side by side
in alternating rounds on the same process and data.

The same total: at each context the plan is resolved to slot counts (a share r of the prompt is
max(2, round(r · n)) slots per layer and KV set); its sum over every layer and KV set is the
plan's total, and the uniform side runs one B per layer and KV set, that total divided by layers
× KV sets, rounded to a whole slot count (so the two totals differ by less than half a slot per
layer and KV set; the table prints both).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from .common import check_ints, halves, model_config

__all__ = ["check_plan_args", "load_plan", "bench_decode_plan", "uniform_slots"]


def _plan_gqa(path: str) -> str:
    """The gqa mode the plan was made under (its evidence's; ``sum`` when it does not say)."""
    try:
        with open(path, encoding="utf-8") as f:
            gqa = (json.load(f).get("evidence") or {}).get("gqa")
    except (OSError, ValueError, AttributeError):
        return "sum"
    return gqa if gqa in ("sum", "max", "none") else "sum"


def load_plan(path: str, model_name: str | None, model: Any = None) -> tuple[Any, str]:
    """``(plan, gqa)`` of a plan file, checked against the model's layers and KV sets when its
    config is readable (``model``'s, else the folder's, without loading weights); a ConfigError
    naming ``--plan`` otherwise."""
    from h2o_lens import plan as budget_plan
    from h2o_lens.config import H2OConfig
    from h2o_lens.errors import ConfigError
    from h2o_lens.shape import model_shape

    try:
        plan = budget_plan.load(path)
        gqa = _plan_gqa(path)
        H2OConfig(plan=plan, gqa=gqa)  # entries the policy cannot split
        config = model.config if model is not None else model_config(model_name)
        if config is not None:
            shape = model_shape(config)
            plan.check(shape.layers, shape.sets(gqa))
    except ConfigError as exc:
        raise ConfigError(f"bench decode --plan {path}: {exc}") from None
    return plan, gqa


def check_plan_args(args: argparse.Namespace) -> None:
    """Refuse, before the model loads, the options ``--plan`` contradicts: it gives the budget
    (no ``--keep``) and is a benchmark of its own (no ``--guard``, ``--assistant``, ``--cold``)."""
    from h2o_lens.errors import ConfigError

    given = [
        flag
        for flag, on in (
            ("--keep", args.keep is not None),
            ("--guard", args.guard),
            ("--assistant", args.assistant is not None),
            ("--cold", args.cold is not None),
        )
        if on
    ]
    if given:
        raise ConfigError(
            f"bench decode: --plan gives the budget and times planned against uniform H2O; drop {' and '.join(given)}"
        )


def uniform_slots(plan: Any, context: int, sets: int) -> tuple[Any, int, int]:
    """``(resolved plan, its total slots, uniform B)`` at ``context`` tokens with ``sets`` KV sets
    per layer: B is the total over layers × sets, rounded, at least 2."""
    resolved = plan.resolve(context)
    total = resolved.total(sets)
    return resolved, total, max(2, round(total / (resolved.layers * sets)))


def _plan_keep(plan: Any, contexts: list[int]) -> float:
    """The widest share of a context the plan's storage may take (the memory check's ``keep``)."""
    flat = [x for row in plan.table for x in row]
    share = max(flat) if not plan.resolved else max(flat) / min(contexts)
    return min(0.99, max(0.01, share))


def _times(model: Any, uniform: Any, planned: Any, ctx: Any, steps: int, rounds: int) -> tuple[dict, dict]:
    """Median seconds per decode step of uniform and planned H2O (their configs) and the bytes each
    cache holds, in rounds that alternate the order of the two (the first round, 2 steps each, warms up)."""
    from h2o_lens.cache import H2OCache
    from h2o_lens.runtime import h2o
    from h2o_lens.timing import Decoder, median_time

    with h2o(model, uniform):
        model.set_attn_implementation("h2o_lens")
        decoders = {
            name: Decoder(model, H2OCache(cfg, model.config), ctx, last_logits_only=True)
            for name, cfg in (("uniform", uniform), ("planned", planned))
        }  # both built alike; the session registers the attention that routes a step to its cache
        times: dict[str, list[float]] = {name: [] for name in decoders}
        names = list(decoders)
        for i in range(rounds + 1):
            n = steps if i else 2
            for name in names if i % 2 == 0 else names[::-1]:
                t = median_time(lambda d=decoders[name], n=n: d.run(n), 1) / n
                if i:
                    times[name].append(t)
    nbytes = {}
    for name, d in decoders.items():
        held = d.cache.nbytes()
        nbytes[name] = held["kv"] + held["metadata"]
    return {name: statistics.median(t) for name, t in times.items()}, nbytes


def bench_decode_plan(
    plan_path: str,
    model_name: str | None = None,
    contexts=(512, 2048),
    batches=(1, 8),
    steps: int = 8,
    rounds: int = 3,
    model: Any = None,
    backend: str = "auto",
) -> int:
    """Decode ms/step of H2O under the plan in ``plan_path`` ÷ uniform H2O at the same total slots
    (module docstring), per context and batch size; the table prints both totals, both ms/step and
    tokens/s, the ratio planned/uniform and the KV bytes each cache holds. ``backend``: both sides'
    (:class:`~h2o_lens.config.H2OConfig`'s). Returns 0."""
    import torch

    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model
    from h2o_lens.shape import model_shape

    from .decode_checks import check_decode

    contexts = check_ints("decode", "contexts", contexts, 2)
    batches = check_ints("decode", "batch", batches, 1)
    plan, gqa = load_plan(plan_path, model_name, model)
    keep = _plan_keep(plan, contexts)
    check_decode(model_name, contexts, batches, keep, steps, rounds, None if model is None else model.config)
    if model is None:
        model, _ = load_model(model_name, progress=False)
        plan, gqa = load_plan(plan_path, None, model)  # a model converted just now
        check_decode(None, contexts, batches, keep, steps, rounds, model.config)
    shape = model_shape(model.config)
    sets = shape.sets(gqa)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(0)
    by = "KV set" if any(len(row) > 1 for row in plan.table) else "layer"
    print(
        f"model {type(model).__name__}: {shape.layers} layers, {sets} KV sets per layer (gqa {gqa}); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; --plan {plan_path}: {plan.describe()}, "
        f"by {by}; backend {backend}; {steps} steps x {rounds} rounds alternating uniform / planned, medians",
        flush=True,
    )
    for n in contexts:
        resolved, total, budget = uniform_slots(plan, n, sets)
        ragged = sum(len(set(resolved.counts(i, sets))) > 1 for i in range(resolved.layers))
        uniform = H2OConfig(**halves(budget), gqa=gqa, backend=backend)
        planned = H2OConfig(plan=resolved, gqa=gqa, backend=backend)
        print(
            f"\ncontext {n}: planned {total} slots ({resolved.describe()}, {ragged} ragged layers); "
            f"uniform H2O B={budget} x {shape.layers} layers x {sets} KV sets = {budget * shape.layers * sets} "
            "slots (the same total: the plan's slots at this context over layers x KV sets, rounded to a whole B)"
        )
        print(
            f"{'batch':>6} {'uniform ms/step':>16} {'planned ms/step':>16} {'planned/uniform':>16} "
            f"{'uniform tok/s':>14} {'planned tok/s':>14} {'KV MiB uniform':>15} {'KV MiB planned':>15}"
        )
        for b in batches:
            ctx = torch.randint(0, vocab, (b, n), generator=gen)
            t, nbytes = _times(model, uniform, planned, ctx, steps, rounds)
            tu, tp = t["uniform"], t["planned"]
            print(
                f"{b:>6} {tu * 1e3:>16.2f} {tp * 1e3:>16.2f} {tp / tu:>16.3f} {b / tu:>14.1f} {b / tp:>14.1f} "
                f"{nbytes['uniform'] / 2**20:>15.3f} {nbytes['planned'] / 2**20:>15.3f}",
                flush=True,
            )
    return 0
