"""The memory H2O saves, turned into batch: the largest batch of ``context``-token requests whose
decode state fits beside the weights, for the full cache and for H2O, and the tokens/s of each at
that batch (``h2o-lens bench kernels --max-batch``, DESIGN.md §2.16).

Each path prefills one request once; its batch is that request repeated (``batch_repeat_interleave``
for H2O, the prompt's K/V written into every row of a ``StaticCache``), so the batch costs one
prefill, not ``batch``: a serving system prefills in chunks and decodes the batch together, and the
decode step is what is timed. What fits is ``(free memory - headroom) / bytes per row``, the row's
bytes being its cache (H2O: keys, values, scores and positions) and its logits; a batch that still
does not fit is cut by a tenth until one runs, and the batch that ran is the one printed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .. import compat, policies

__all__ = ["bench_max_batch", "random_llama"]

#: memory left free beside the weights and the rows (the decode step's activations, the allocator)
HEADROOM = 4 << 30


def random_llama(shape: dict, positions: int, device: torch.device, dtype: torch.dtype):
    """A Llama of ``shape`` with random weights (seed 0) on ``device`` in ``dtype``, for up to
    ``positions`` positions: decode time does not depend on the weights' values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, max_position_embeddings=positions)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # an 8B model is initialised in its own dtype, not float32 first
    try:
        with torch.device(device):
            return LlamaForCausalLM(cfg).to(dtype).eval()
    finally:
        torch.set_default_dtype(default)


def _free_bytes(device: torch.device, memory: int | None) -> int:
    if memory is not None:
        return memory
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _full_rows(model, dyn, token: torch.Tensor, batch: int, positions: int):
    """A ``StaticCache`` of ``batch`` rows, each holding the one prefilled request of ``dyn``."""
    from transformers import StaticCache

    static = StaticCache(config=model.config, max_cache_len=positions)
    for i, layer in enumerate(dyn.layers):
        key, value = layer.keys, layer.values  # (1, Hkv, P, d)
        at = torch.arange(key.shape[2], device=key.device)
        shape = (batch, *key.shape[1:])
        static.update(key.expand(shape), value.expand(shape), i, {"cache_position": at})
    return static, token.expand(batch, 1).clone()


def _time(dec, steps: int, rounds: int, device: torch.device) -> float:
    """Median tokens/s of ``rounds`` runs of ``steps`` decode steps (after a warm-up run)."""
    times = []
    for r in range(rounds + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dec.run(steps if r else 3)  # round 0 warms up (and captures, under graphs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r:
            times.append(time.perf_counter() - t0)
    return dec.token.shape[0] * steps / statistics.median(times)


def bench_max_batch(
    *,
    shape: dict,
    context: int = 32768,
    keep: float = 0.2,
    steps: int = 16,
    rounds: int = 2,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "triton",
    graphs: bool = True,
    memory: int | None = None,
    headroom: int = HEADROOM,
) -> dict[str, Any]:
    """The largest batch of ``context``-token requests each path holds, and its tokens/s there.

    ``memory``: the bytes free beside the weights (default: what the CUDA device has free once the
    model is loaded). Prints one table; returns, per path (``full``: ``StaticCache``; ``h2o``),
    the bytes per row, the batch that ran, and its tokens/s eager and, with ``graphs``, under a
    captured graph.
    """
    from transformers import DynamicCache

    from ..config import H2OConfig
    from ..graphs import graph_kind
    from ..runtime import full_kv_bytes, h2o
    from ..timing import Decoder

    device = torch.device(device)
    kind = graph_kind(graphs, device)
    positions = context + (rounds + 2) * steps + 8
    model = random_llama(shape, positions, device, dtype)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    budget = max(2, int(round(keep * context)))
    logits_row = 2 * vocab * 4  # a step's logits, and their float copy
    out: dict[str, Any] = {}
    print(
        f"\nmax batch at {context} tokens: Llama {model.config.num_hidden_layers} layers, "
        f"{model.config.num_attention_heads}/{model.config.num_key_value_heads} heads, random weights ({dtype}); "
        f"H2O B={budget} ({keep:.0%}, {backend}); {steps} steps x {rounds} rounds, medians",
        flush=True,
    )
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        dyn = DynamicCache(config=model.config)
        token = model(input_ids=ids, **compat.cache_kwargs(dyn), use_cache=True, logits_to_keep=1).logits[:, -1:]
        token = token.argmax(-1)
        per_row = full_kv_bytes(model, positions, 1) + logits_row
        free = _free_bytes(device, memory)
        out["full"] = _run_path(
            lambda b: _full_rows(model, dyn, token, b, positions),
            lambda cache, tok, g: Decoder.resume(model, cache, tok, graphs=g),
            per_row, free, headroom, kind, steps, rounds, device,
        )  # fmt: skip
        dyn = None  # the one request's full cache: no longer needed
        heavy, recent = policies.half_split(budget)
        with h2o(model, H2OConfig(heavy=heavy, recent=recent, backend=backend)) as session:
            one = session.new_cache()
            first = model(input_ids=ids, **compat.cache_kwargs(one), use_cache=True, logits_to_keep=1).logits
            token = first[:, -1:].argmax(-1)
            nbytes = one.nbytes()
            per_row = nbytes["kv"] + nbytes["metadata"] + logits_row
            free = _free_bytes(device, memory)

            def rows(b: int):
                cache = session.new_cache()
                header, tensors = one.export_state()
                cache.import_state(header, {k: v.clone() for k, v in tensors.items()})
                cache.batch_repeat_interleave(b)
                return cache, token.expand(b, 1).clone()

            out["h2o"] = _run_path(
                rows,
                lambda cache, tok, g: Decoder.resume(model, cache, tok, graphs=g),
                per_row, free, headroom, kind, steps, rounds, device,
            )  # fmt: skip
    _print(out, kind)
    return out


def _run_path(build, decoder, per_row, free, headroom, kind, steps, rounds, device) -> dict[str, Any]:
    """The largest batch ``build`` makes that runs, timed eager and (``kind``) under a graph."""
    batch = max(1, int((free - headroom) // per_row))
    while True:
        try:
            res = {"bytes_per_row": per_row, "batch": batch}
            for name, graphs in (("eager", None), ("graphs", kind)):
                if name == "graphs" and kind is None:
                    continue
                cache, token = build(batch)
                res[name] = _time(decoder(cache, token, graphs), steps, rounds, device)
                del cache
            return res
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
            batch = max(1, batch * 9 // 10)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _print(out: dict[str, Any], kind: str | None) -> None:
    full = out["full"]
    extra = f" {'graphs tok/s':>12} {'÷ full graphs':>13}" if kind else ""
    print(f"{'path':>6} {'GiB/row':>8} {'batch':>6} {'tok/s':>9} {'÷ full':>7}{extra}")
    for name, res in out.items():
        shown = ""
        if kind:
            shown = f" {res['graphs']:>12.1f} {res['graphs'] / full['graphs']:>13.2f}"
        print(
            f"{name:>6} {res['bytes_per_row'] / 2**30:>8.3f} {res['batch']:>6} {res['eager']:>9.1f} "
            f"{res['eager'] / full['eager']:>7.2f}{shown}",
            flush=True,
        )
