"""Timing helpers shared by the runtime's benchmarks (:mod:`h2o_lens.kernels.bench`) and
the commands layer's (:mod:`commands.benchmarks`): medians of paired rounds, a warm decoder."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from . import compat

__all__ = ["median_time", "Decoder"]


def median_time(fn: Callable[[], None], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Decoder:
    """Keeps one cache warm and decodes ``steps`` tokens per call."""

    def __init__(self, model, cache, context: torch.Tensor, last_logits_only: bool = False):
        self.model, self.cache = model, cache
        extra = {"logits_to_keep": 1} if last_logits_only else {}  # long batched prompts: no P x vocab
        with torch.no_grad():
            out = model(input_ids=context, **compat.cache_kwargs(cache), use_cache=True, **extra)
        self.token = out.logits[:, -1:].argmax(-1)

    def run(self, steps: int) -> None:
        with torch.no_grad():
            for _ in range(steps):
                out = self.model(input_ids=self.token, **compat.cache_kwargs(self.cache), use_cache=True)
                self.token = out.logits[:, -1:].argmax(-1)
