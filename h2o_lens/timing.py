"""Timing helpers shared by the runtime's benchmarks (:mod:`h2o_lens.kernels.bench`) and
the commands layer's (:mod:`commands.benchmarks`): medians of paired rounds, a warm decoder."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from . import compat

__all__ = ["median_time", "Decoder", "step_parts", "frozen_steps", "PARTS"]


def median_time(fn: Callable[[], None], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Decoder:
    """Keeps one cache warm and decodes ``steps`` tokens per call; ``graphs`` (``"cuda"`` or
    ``"traced"``) replays the decode steps from a captured graph (:mod:`h2o_lens.graphs`)."""

    def __init__(self, model, cache, context: torch.Tensor, last_logits_only: bool = False, graphs: str | None = None):
        from .graphs import GraphedForward

        self.model, self.cache = model, cache
        self.forward = model if graphs is None else GraphedForward(model.__call__, graphs, model)
        extra = {"logits_to_keep": 1} if last_logits_only else {}  # long batched prompts: no P x vocab
        with torch.no_grad():
            out = model(input_ids=context, **compat.cache_kwargs(cache), use_cache=True, **extra)
        self.token = out.logits[:, -1:].argmax(-1)

    @classmethod
    def resume(cls, model, cache, token: torch.Tensor, graphs: str | None = None) -> Decoder:
        """A decoder on a cache that already holds its prompt (a restored state), next feeding ``token``."""
        from .graphs import GraphedForward

        dec = cls.__new__(cls)
        dec.model, dec.cache, dec.token = model, cache, token
        dec.forward = model if graphs is None else GraphedForward(model.__call__, graphs, model)
        return dec

    def run(self, steps: int) -> None:
        with torch.no_grad():
            for _ in range(steps):
                out = self.forward(input_ids=self.token, **compat.cache_kwargs(self.cache), use_cache=True)
                self.token = out.logits[:, -1:].argmax(-1)


#: the parts of an H2O decode step that :func:`step_parts` times, in the step's order (DESIGN.md §2.1)
PARTS = ("attention", "scores", "victim", "copy")


def step_parts(cache, reps: int = 10, seed: int = 0) -> dict[str, float]:
    """Seconds one decode step of ``cache`` (an :class:`~h2o_lens.cache.H2OCache` whose rows are
    full, one budget) spends in each part of :func:`h2o_lens.ops.decode_step`, summed over its
    layers: ``attention`` (the softmax over the slots and the new token, and the output),
    ``scores`` (the group aggregation and the policy's score update), ``victim`` (the eligible
    slots and the lowest of them) and ``copy`` (the new token's K, V, score and position written
    into the victim's slot). Each part runs ``reps`` times on copies of every layer's real slots
    with a random query and new token, and its median counts; the rest of a measured step (the
    model's projections and MLP, the hooks, the cache's bookkeeping) is the caller's to derive."""
    gen = torch.Generator().manual_seed(seed)
    total = dict.fromkeys(PARTS, 0.0)
    with torch.no_grad():
        for layer in cache.layers:
            for name, seconds in _layer_parts(cache, layer, reps, gen).items():
                total[name] += max(seconds, 0.0)
    return total


def _layer_parts(cache, layer, reps: int, gen: torch.Generator) -> dict[str, float]:
    """:func:`step_parts` of one layer."""
    from . import eviction, ops, policies

    args = cache.args
    spec = args.spec
    keys, values, scores, positions = layer.keys, layer.values, layer.scores, layer.positions
    b, hs, cap, d = keys.shape
    hq = cache.num_query_heads if args.gqa != "none" else hs
    q, k, v = (torch.randn(b, h, d, generator=gen).to(keys.dtype) for h in (hq, hs, hs))
    step_col = layer.next_pos[:, None, None]
    new_pos = step_col.expand(b, hs, 1).to(positions.dtype)
    qg = ops._group_view(q, hs) * (d**-0.5)
    ctx = policies.StepContext(step=step_col, layer=layer.layer_idx, seed=args.seed, gqa=args.gqa, group=qg.shape[2])
    w = ops._attend(qg, keys, values, k, v, None, scores.dtype)[1]
    history = layer.history

    def update():
        agg = eviction.aggregate_group(w, args.gqa, 2) if spec.scored else None
        return spec.decode_scores(scores.clone(), None if history is None else history.clone(), agg, positions, ctx)

    new_score = update()[0]
    choose = (scores, positions, new_score, new_pos, step_col, None, args, None)
    slot = ops._choose_slot(*choose)[0]
    state = [t.clone() for t in (keys, values, scores, positions)]
    return {
        "attention": _median(reps, lambda: ops._attend(qg, keys, values, k, v, None, scores.dtype)),
        "scores": _median(reps, update) - _median(reps, scores.clone),  # the copy kept aside
        "victim": _median(reps, lambda: ops._choose_slot(*choose)),
        "copy": _median(
            reps, lambda: ops._write_slot(*state, slot, k, v, new_score, new_pos, may_skip=args.recent == 0)
        ),
    }


@contextlib.contextmanager
def frozen_steps() -> Iterator[None]:
    """Inside, every layer's decode step (the torch step :func:`h2o_lens.ops.decode_step`, or the
    fused CPU step :func:`h2o_lens.kernels.cpu.decode_step_cpu`) is computed once per slot storage
    and then returned again without being computed: a model's decode step costs
    everything but H2O's attention and eviction. H2O's step less this one is what its attention and
    eviction cost inside the model, where the model's weights push the slots and temporaries out of
    the caches between layers (:func:`step_parts` times the parts apart, with warm caches). For
    timing only: the cache's slots stop changing, so a cache stepped inside is not one to decode
    from afterwards."""
    from . import ops
    from .kernels import cpu

    first: dict[int, object] = {}

    def freeze(real):
        def frozen(query, key, value, keys, *args, **kwargs):
            if id(keys) not in first:  # keys kept beside the result: their ids stay unique
                first[id(keys)] = (keys, real(query, key, value, keys, *args, **kwargs))
            return first[id(keys)][1]

        return frozen

    steps = [(ops, "decode_step"), (cpu, "decode_step_cpu")]
    reals = [getattr(mod, name) for mod, name in steps]
    for (mod, name), real in zip(steps, reals):
        setattr(mod, name, freeze(real))
    try:
        yield
    finally:
        for (mod, name), real in zip(steps, reals):
            setattr(mod, name, real)


def _median(reps: int, fn: Callable[[], object]) -> float:
    fn()  # warm
    return median_time(fn, reps)
