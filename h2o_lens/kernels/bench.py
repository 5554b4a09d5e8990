"""Kernel benchmarks: ratios measured side by side in one run.

On a GPU :func:`bench_kernels` prints, per shape, the median of rounds that
alternate the paths being compared (same process, same data):

* fused decode step ÷ the torch path (:func:`h2o_lens.ops.decode_step`);
* fused decode step ÷ plain SDPA over the same ``B`` slots (no scores, no eviction);
* prefill scores kernel ÷ SDPA causal prefill;
* replay kernels ÷ chunked torch replay (dropped mass and the oracle columns, as the replay runs them);
* achieved memory bandwidth of the decode step ÷ the device's peak;
* end to end: decode tokens/s of a whole model with H2O at 20 % (Triton and torch
  backends) ÷ full-cache SDPA, at 32k context and batch 8 (:func:`bench_end_to_end`).

Without a GPU it says so and prints the interpreter-mode correctness summary
(small shapes, ``TRITON_INTERPRET=1``) instead.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from .. import ops, policies

__all__ = ["bench_kernels", "bench_end_to_end", "E2E_SHAPE"]

# (Hq, Hkv, d): the default model (SmolLM2-135M) and a Llama-8B-like layer
_HEADS = ((9, 3, 64), (32, 8, 128))


def _alternate(fns: dict[str, Callable[[], object]], rounds: int, inner: int) -> dict[str, float]:
    """Median milliseconds per call of each function, rounds alternating between them."""
    for fn in fns.values():  # warm-up and compile
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / inner)
    return {name: statistics.median(t) for name, t in times.items()}


def _peak_bandwidth(device: torch.device) -> tuple[float, str]:
    """Peak DRAM bandwidth in bytes/s and where the figure comes from."""
    props = torch.cuda.get_device_properties(device)
    clock, width = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    source = "device properties"
    if not (clock and width):
        try:
            from triton.runtime import driver

            info = driver.active.utils.get_device_properties(device.index or 0)
            clock, width = info.get("mem_clock_rate"), info.get("mem_bus_width")
            source = "triton driver properties"
        except Exception:
            clock = width = None
    if clock and width:
        return 2.0 * clock * 1e3 * width / 8, source  # kHz, bits; double data rate
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = _alternate({"copy": lambda: y.copy_(x)}, rounds=5, inner=10)["copy"]
    return 2 * x.numel() / (ms * 1e-3), "copy benchmark (a lower bound of the peak)"


def _decode_case(b: int, hq: int, hs: int, cap: int, d: int, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
    state = dict(
        keys=r(b, hs, cap, d),
        values=r(b, hs, cap, d),
        scores=torch.rand(b, hs, cap, generator=g, device=device),
        positions=torch.arange(cap, device=device, dtype=torch.int32).repeat(b, hs, 1),
    )
    new = dict(query=r(b, hq, d), key=r(b, hs, d), value=r(b, hs, d))
    step = torch.full((b,), cap, dtype=torch.int32, device=device)
    return state, new, step


def _bench_decode(device, dtype, rounds: int, inner: int) -> None:
    import torch.nn.functional as F

    from .decode import decode_step_triton

    peak, source = _peak_bandwidth(device)
    print(f"\ndecode step ({dtype}), ms per layer call; peak bandwidth {peak / 1e9:.0f} GB/s from {source}")
    print(
        f"{'b':>3} {'Hq/Hkv/d':>10} {'B':>5} {'fused':>8} {'torch':>8} {'f/torch':>8} {'sdpa':>8} "
        f"{'f/sdpa':>7} {'GB/s':>7} {'of peak':>8}"
    )
    for hq, hs, d in _HEADS:
        for b in (1, 8):
            for cap in (512, 2048, 4096):
                state, new, step = _decode_case(b, hq, hs, cap, d, dtype, device)
                args = ops.PolicyArgs(policies.DEFAULT, *policies.half_split(cap), 0, "sum")
                twin = {k: v.clone() for k, v in state.items()}
                q4 = new["query"][:, :, None]  # (b, Hq, 1, d)
                scaling = d**-0.5
                t = _alternate(
                    {
                        "fused": lambda: decode_step_triton(
                            **new, **state, step=step, fill=None, scaling=scaling, args=args
                        ),
                        "torch": lambda: ops.decode_step(
                            **new, **twin, step=step, fill=None, scaling=scaling, args=args
                        ),
                        "sdpa": lambda: F.scaled_dot_product_attention(
                            q4, state["keys"], state["values"], scale=scaling, enable_gqa=True
                        ),
                    },
                    rounds,
                    inner,
                )
                elt = state["keys"].element_size()
                moved = (
                    2 * b * hs * cap * d * elt  # keys and values read
                    + b * hs * cap * (4 * 2 + 4 * 2)  # scores read+write, positions read twice
                    + b * hq * cap * 4 * 2  # scratch logits written and read back
                    + 2 * b * hq * d * elt
                    + 2 * b * hs * d * elt
                )  # q, out, new k/v
                bw = moved / (t["fused"] * 1e-3)
                print(
                    f"{b:>3} {f'{hq}/{hs}/{d}':>10} {cap:>5} {t['fused']:>8.4f} {t['torch']:>8.4f} "
                    f"{t['fused'] / t['torch']:>8.3f} {t['sdpa']:>8.4f} {t['fused'] / t['sdpa']:>7.2f} "
                    f"{bw / 1e9:>7.0f} {bw / peak:>8.1%}",
                    flush=True,
                )


def _bench_prefill_and_replay(device, dtype, rounds: int, n: int) -> None:
    import torch.nn.functional as F

    from .prefill import prefill_scores_triton
    from .replay import replay_dropped_mass_torch, replay_dropped_mass_triton

    print(f"\nprefill and replay at {n} tokens ({dtype}), ms")
    print(
        f"{'Hq/Hkv/d':>10} {'scores':>8} {'sdpa':>8} {'sc/sdpa':>8} {'torch pre':>10} {'tp/sdpa':>8} "
        f"{'replay':>8} {'torch rep':>10} {'r/torch':>8}"
    )
    g = torch.Generator(device=device).manual_seed(0)
    for hq, hs, d in _HEADS:
        q = torch.randn(1, hq, n, d, generator=g, device=device, dtype=dtype)
        k = torch.randn(1, hs, n, d, generator=g, device=device, dtype=dtype)
        v = torch.randn_like(k)
        ev = torch.randint(0, 2 * n, (1, hs, n), generator=g, device=device)
        s = d**-0.5
        t = _alternate(
            {
                "scores": lambda: prefill_scores_triton(q, k, None, s, "sum"),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s, enable_gqa=True),
                "torch_prefill": lambda: ops.prefill_attention(q, k, v, None, s, "sum"),
                # as the replay calls them: dropped mass plus the oracle's per-key split
                "replay": lambda: replay_dropped_mass_triton(q, k, ev, s, oracle="sum"),
                "torch_replay": lambda: replay_dropped_mass_torch(q, k, ev, s, chunk=512, oracle="sum"),
            },
            rounds,
            inner=1,
        )
        print(
            f"{f'{hq}/{hs}/{d}':>10} {t['scores']:>8.2f} {t['sdpa']:>8.2f} {t['scores'] / t['sdpa']:>8.2f} "
            f"{t['torch_prefill']:>10.2f} {t['torch_prefill'] / t['sdpa']:>8.2f} {t['replay']:>8.2f} "
            f"{t['torch_replay']:>10.2f} {t['replay'] / t['torch_replay']:>8.3f}",
            flush=True,
        )


#: The default model's shape (SmolLM2-135M). The end-to-end benchmark initialises it at random:
#: decode time does not depend on the weights' values, and no weights need to be fetched.
E2E_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)


#: Llama-3-8B's shape (32 layers, 32/8 heads, head dim 128), for the end-to-end table of the shape users run
LLAMA3_8B_SHAPE = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
    rope_theta=500000.0,
)
#: ``bench kernels --shape NAME``: the shape, its (batch, context) cases and the H2O backends timed
SHAPES = {
    "default": (E2E_SHAPE, ((8, 4096), (8, 32768)), ("triton", "torch")),
    "llama3-8b": (LLAMA3_8B_SHAPE, ((8, 4096), (8, 16384), (8, 32768), (1, 65536)), ("triton",)),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_end_to_end(
    *,
    context: int = 32768,
    batch: int = 8,
    keep: float = 0.2,
    steps: int = 32,
    rounds: int = 3,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    shape: dict | None = None,
    backends: tuple[str, ...] = ("triton", "torch"),
    graphs: bool = False,
    full_dynamic: bool = True,
) -> dict[str, float]:
    """Decode tokens/s of a whole model, H2O at ``keep`` ÷ a full-cache SDPA decode.

    A Llama model of ``shape`` (default :data:`E2E_SHAPE`, random weights) gets a
    ``batch × context`` prompt; each path prefills its own cache once, then the
    rounds alternate ``steps`` greedy decode steps of every path on its warm cache.
    The baseline is the faster of the two full caches transformers offers:
    ``StaticCache`` (preallocated, written in place) and ``DynamicCache`` (the
    ``generate`` default, which concatenates every step; ``full_dynamic`` False leaves it out,
    for shapes where three full caches would not fit). With ``graphs``, the ``StaticCache`` and
    each H2O backend also decode from a captured graph (:mod:`h2o_lens.graphs`: CUDA graphs on a
    GPU, the traced rehearsal elsewhere), and the graph-captured full cache is the baseline of
    the ``÷ graphed full`` column.
    Prints one table and returns, per path, tokens/s, the ratio to that baseline and
    the KV bytes held (keys and values; H2O's scores and positions not included).
    """
    from transformers import DynamicCache, StaticCache

    from ..config import H2OConfig
    from ..graphs import GraphedForward, graph_kind
    from ..runtime import full_kv_bytes, h2o
    from ..timing import Decoder as _Decoder
    from .bench_batch import random_llama

    device = torch.device(device)
    kind = graph_kind(graphs, device)
    total = context + (rounds + 1) * steps + 8
    model = random_llama(E2E_SHAPE if shape is None else shape, total, device, dtype)
    cfg = model.config
    budget = max(2, int(round(keep * context)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, context), generator=g).to(device)
    print(
        f"\nend to end: Llama {cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} heads, random weights ({dtype}); batch {batch} x {context} tokens, "
        f"H2O B={budget} ({keep:.0%}); {steps} steps x {rounds} rounds, medians",
        flush=True,
    )
    decoders: dict[str, tuple[_Decoder, str]] = {}
    times: dict[str, list[float]] = {}
    with torch.no_grad(), contextlib.ExitStack() as scopes:
        scopes.callback(model.set_attn_implementation, "sdpa")
        model.set_attn_implementation("sdpa")
        decoders["full"] = (
            _Decoder(model, StaticCache(config=model.config, max_cache_len=total), ids, last_logits_only=True),
            "sdpa",
        )
        if full_dynamic:
            dynamic = DynamicCache(config=model.config)
            decoders["full dynamic"] = (_Decoder(model, dynamic, ids, last_logits_only=True), "sdpa")
        if kind is not None:
            static = StaticCache(config=model.config, max_cache_len=total)
            decoders["full graphs"] = (_Decoder(model, static, ids, last_logits_only=True, graphs=kind), "sdpa")
        for backend in backends:
            heavy, recent = policies.half_split(budget)
            h = H2OConfig(heavy=heavy, recent=recent, backend=backend)
            session = scopes.enter_context(h2o(model, h))
            decoders[f"h2o {backend}"] = (_Decoder(model, session.new_cache(), ids, last_logits_only=True), "h2o_lens")
            if kind is not None:
                graphed = _Decoder(model, session.new_cache(), ids, last_logits_only=True, graphs=kind)
                decoders[f"h2o {backend} graphs"] = (graphed, "h2o_lens")
        times = {name: [] for name in decoders}
        for r in range(rounds + 1):
            for name, (dec, impl) in decoders.items():
                model.set_attn_implementation(impl)
                _sync(device)
                t0 = time.perf_counter()
                dec.run(steps if r else 2)  # round 0 warms up
                _sync(device)
                if r:
                    times[name].append(time.perf_counter() - t0)
    full_tps = batch * steps / min(statistics.median(times[n]) for n in ("full", "full dynamic") if n in times)
    graphed_tps = batch * steps / statistics.median(times["full graphs"]) if kind is not None else None
    tokens = context + 2 + rounds * steps + 1
    full_bytes = full_kv_bytes(model, tokens, batch=batch)
    extra = f" {'÷ graphed full':>14}" if kind is not None else ""
    print(f"{'path':>18} {'tokens/s':>10} {'÷ full':>7}{extra} {'KV GiB':>8}  (÷ full: ÷ the faster eager full cache)")
    out: dict[str, float] = {}
    for name, (dec, _) in decoders.items():
        tps = batch * steps / statistics.median(times[name])
        nbytes = full_bytes if name.startswith("full") else dec.cache.nbytes()["kv"]
        out[f"{name} tokens/s"] = tps
        out[f"{name} ÷ full"] = tps / full_tps
        out[f"{name} KV bytes"] = nbytes
        shown = ""
        if graphed_tps is not None:
            out[f"{name} ÷ graphed full"] = tps / graphed_tps
            shown = f" {tps / graphed_tps:>14.2f}"
        if isinstance(dec.forward, GraphedForward):
            out[f"{name} replayed"] = dec.forward.replayed
        print(f"{name:>18} {tps:>10.1f} {tps / full_tps:>7.2f}{shown} {nbytes / 2**30:>8.3f}", flush=True)
    return out


def _interpreter_summary() -> None:
    """Small cases through the kernels in Triton's interpreter, against the torch contract."""
    from .decode import decode_step_triton
    from .prefill import prefill_scores_triton
    from .replay import replay_dropped_mass_torch, replay_dropped_mass_triton

    g = torch.Generator().manual_seed(0)
    b, hq, hs, cap, d = 2, 6, 2, 21, 16
    args = ops.PolicyArgs("h2o", 11, 10, 0, "sum")
    state, _, step = _decode_case(b, hq, hs, cap, d, torch.float32, torch.device("cpu"))
    twin = {k: v.clone() for k, v in state.items()}
    same, err = True, 0.0
    for i in range(3):
        new = dict(
            query=torch.randn(b, hq, d, generator=g),
            key=torch.randn(b, hs, d, generator=g),
            value=torch.randn(b, hs, d, generator=g),
        )
        r_k = decode_step_triton(**new, **state, step=step + i, fill=None, scaling=d**-0.5, args=args)
        r_t = ops.decode_step(**new, **twin, step=step + i, fill=None, scaling=d**-0.5, args=args)
        same &= bool(torch.equal(r_k.slot, r_t.slot) and torch.equal(state["positions"], twin["positions"]))
        err = max(err, (r_k.out - r_t.out).abs().max().item(), (state["scores"] - twin["scores"]).abs().max().item())
    print(
        f"decode step, 3 steps b={b} Hq={hq} Hkv={hs} B={cap}: slots and positions equal torch: {same}; "
        f"max |out, score difference| {err:.2e}"
    )
    p = 37
    q, k = torch.randn(b, hq, p, d, generator=g), torch.randn(b, hs, p, d, generator=g)
    valid = torch.ones(b, p, dtype=torch.bool)
    valid[1, :5] = False
    s_k = prefill_scores_triton(q, k, valid, d**-0.5, "sum", block_m=16, block_n=16)
    _, s_t = ops.prefill_attention(q, k, k, valid, d**-0.5, "sum")
    print(f"prefill scores, P={p} with padding: max |difference| to torch {(s_k - s_t).abs().max().item():.2e}")
    ev = torch.randint(0, p + 4, (b, hs, p), generator=g)
    r_k = replay_dropped_mass_triton(q, k, ev, d**-0.5, oracle="sum", block_m=16, block_n=16)
    r_t = replay_dropped_mass_torch(q, k, ev, d**-0.5, chunk=8, oracle="sum")
    diffs = ", ".join(
        f"{name} {(a - c).abs().max().item():.2e}"
        for name, a, c in zip(("dropped mass", "oracle before", "oracle after"), r_k, r_t)
    )
    print(f"replay, N={p}: max |difference| to torch: {diffs}")


def bench_kernels(
    rounds: int = 7,
    inner: int = 20,
    prefill_tokens: int = 8192,
    dtype: torch.dtype = torch.bfloat16,
    *,
    shape: str = "default",
    cases: tuple[tuple[int, int], ...] | None = None,
    graphs: bool = True,
    kernels: bool = True,
    max_batch: int | None = None,
) -> int:
    """Print the kernel ratios on a GPU, or the interpreter correctness summary without one.

    On a GPU: the kernel tables (``kernels``), then the end-to-end table of the model ``shape``
    (:data:`SHAPES`) at each ``(batch, context)`` of ``cases`` (default: the shape's own), with the
    graph-captured paths beside the eager ones (``graphs``, DESIGN.md §2.16), then, with
    ``max_batch`` (a context), the largest batch of such requests each cache holds and its tokens/s
    (:func:`h2o_lens.kernels.bench_batch.bench_max_batch`). Returns 0.
    """
    from . import triton_available
    from ._checks import interpret_mode

    if not torch.cuda.is_available():
        print("no CUDA device: kernel timings need a GPU.")
        if not interpret_mode() and "triton" in sys.modules:
            print(
                "triton was imported without TRITON_INTERPRET=1; rerun with TRITON_INTERPRET=1 set "
                "for the interpreter-mode correctness summary"
            )
            return 0
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # read by triton at import and when a kernel is built
        try:
            if not triton_available():
                print("triton does not import on this machine (pip install 'h2o-lens[gpu]')")
                return 0
            print("Correctness summary in Triton's interpreter (TRITON_INTERPRET=1, small shapes):")
            _interpreter_summary()
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old
        return 0
    if not triton_available():
        print("triton does not import on this machine: no kernels to measure (pip install 'h2o-lens[gpu]')")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}; medians of {rounds} alternating rounds")
    if kernels:
        with torch.no_grad():
            _bench_decode(device, dtype, rounds, inner)
            _bench_prefill_and_replay(device, dtype, rounds, prefill_tokens)
    dims, own_cases, backends = SHAPES[shape]
    for batch, context in cases or own_cases:
        bench_end_to_end(
            context=context,
            batch=batch,
            device=device,
            dtype=dtype,
            shape=dims,
            backends=backends,
            graphs=graphs,
            full_dynamic=shape == "default",
        )
        torch.cuda.empty_cache()
    if max_batch is not None:
        from .bench_batch import bench_max_batch

        bench_max_batch(shape=dims, context=max_batch, device=device, dtype=dtype, graphs=graphs)
    return 0
