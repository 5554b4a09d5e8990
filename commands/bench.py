"""Benchmarks that print ratios measured side by side in one run.

Timings belong here, not in tests: each figure is the median over rounds
that alternate the two paths being compared, on the same process and data.
"""

from __future__ import annotations

import statistics
import time

import torch

from h2o_lens.benchtools import Decoder as _Decoder
from h2o_lens.benchtools import median_time as _median_time
from h2o_lens.policies import half_split, ratio_slots

__all__ = ["bench_decode", "bench_explain"]


def _halves(budget: int) -> dict[str, int]:
    """``heavy`` and ``recent`` of a slot count, split in halves like a keep ratio's budget."""
    return dict(zip(("heavy", "recent"), half_split(budget)))


def bench_decode(
    model_name: str | None = None,
    contexts=(512, 2048, 4096),
    keep: float = 0.2,
    steps: int = 16,
    rounds: int = 3,
    prefill_context: int = 2048,
    model=None,
) -> int:
    """H2O decode step ÷ full-cache SDPA decode step, prefill ratio, and KV bytes.

    Prints one table; returns 0.
    """
    from transformers import DynamicCache

    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model
    from h2o_lens.runtime import full_kv_bytes, h2o

    if model is None:
        model, _ = load_model(model_name)
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    vocab = text.vocab_size
    gen = torch.Generator().manual_seed(0)
    print(
        f"model {type(model).__name__}: {text.num_hidden_layers} layers, {text.num_attention_heads} "
        f"query heads, {text.num_key_value_heads} KV heads, head_dim {head_dim}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{steps} steps x {rounds} rounds, medians"
    )
    print(
        f"{'context':>8} {'B':>6} {'full ms/step':>13} {'h2o ms/step':>12} {'ratio':>7} "
        f"{'KV bytes/full':>14} {'B/N+2/d':>8}"
    )
    for n in contexts:
        budget = ratio_slots(keep, n)
        cfg = H2OConfig(**_halves(budget))
        ctx = torch.randint(0, vocab, (1, n), generator=gen)
        model.set_attn_implementation("sdpa")
        full = _Decoder(model, DynamicCache(config=model.config), ctx)
        with h2o(model, cfg) as session:
            fast = _Decoder(model, session.new_cache(), ctx)
            fast.run(2)  # warm-up
            model.set_attn_implementation("sdpa")
            full.run(2)
            t_full, t_h2o = [], []
            for _ in range(rounds):
                model.set_attn_implementation("sdpa")
                t_full.append(_median_time(lambda: full.run(steps), 1) / steps)
                model.set_attn_implementation("h2o_lens")
                t_h2o.append(_median_time(lambda: fast.run(steps), 1) / steps)
            tf, th = statistics.median(t_full), statistics.median(t_h2o)
            tokens = n + 2 + rounds * steps + 1
            b = fast.cache.nbytes()
        fullb = full_kv_bytes(model, tokens)
        ratio_b = (b["kv"] + b["metadata"]) / fullb
        print(
            f"{n:>8} {budget:>6} {tf * 1e3:>13.2f} {th * 1e3:>12.2f} {th / tf:>7.3f} "
            f"{ratio_b:>14.4f} {budget / tokens + 2 / head_dim:>8.4f}",
            flush=True,
        )

    # prefill with scores vs SDPA prefill
    n = prefill_context
    budget = ratio_slots(keep, n)
    cfg = H2OConfig(**_halves(budget))
    ctx = torch.randint(0, vocab, (1, n), generator=gen)
    t_sdpa, t_h2o = [], []
    with torch.no_grad(), h2o(model, cfg) as session:
        for i in range(rounds + 1):
            model.set_attn_implementation("sdpa")
            t0 = time.perf_counter()
            model(input_ids=ctx, cache=DynamicCache(config=model.config), use_cache=True)
            t1 = time.perf_counter()
            model.set_attn_implementation("h2o_lens")
            model(input_ids=ctx, cache=session.new_cache(), use_cache=True)
            t2 = time.perf_counter()
            if i:  # the first round warms up
                t_sdpa.append(t1 - t0)
                t_h2o.append(t2 - t1)
    ts, th = statistics.median(t_sdpa), statistics.median(t_h2o)
    print(f"prefill {n} tokens: SDPA {ts * 1e3:.0f} ms, H2O with scores {th * 1e3:.0f} ms, ratio {th / ts:.3f}")
    return 0


def bench_record(
    model_name: str | None = None,
    prompt_tokens: int = 512,
    new_tokens: int = 128,
    keep: float = 0.2,
    rounds: int = 3,
    model=None,
) -> int:
    """Recorder overhead, replay cost and log size on one model, side by side.

    Prints: decode with recorder ÷ decode without (same cache, same tokens),
    replay time ÷ generation time, and Parquet bytes per eviction row.
    """
    import os
    import tempfile
    from pathlib import Path

    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model
    from h2o_lens.runtime import h2o
    from recorders.recorder import record
    from recorders.replay import replay

    if model is None:
        model, _ = load_model(model_name)
    text = model.config.get_text_config(decoder=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, text.vocab_size, (1, prompt_tokens), generator=gen)
    budget = max(2, int(round(keep * prompt_tokens)))
    cfg = H2OConfig(**_halves(budget))
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    root = Path(tempfile.mkdtemp(prefix="h2o-lens-bench-"))
    t_plain, t_rec, t_close, runs = [], [], [], []
    print(
        f"{type(model).__name__}: prompt {prompt_tokens} tokens, {new_tokens} new, B={budget} "
        f"({cfg.describe()}), {rounds} rounds alternating"
    )
    with torch.no_grad():
        with h2o(model, cfg):
            model.generate(ids, **dict(kw, max_new_tokens=4, min_new_tokens=4))  # warm-up
        for _ in range(rounds):
            with h2o(model, cfg):
                t0 = time.perf_counter()
                model.generate(ids, **kw)
                t_plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with record(model, cfg, out=root) as run:
                t1 = time.perf_counter()
                model.generate(ids, **kw)
                t2 = time.perf_counter()
            t_rec.append(t2 - t1)
            t_close.append(time.perf_counter() - t2)
            runs.append(run)
    plain, rec = statistics.median(t_plain), statistics.median(t_rec)
    replay_times = [replay(r.run_dir, model=model, progress=False).seconds for r in runs[:2]]
    rep = statistics.median(replay_times)
    files = list(Path(runs[-1].run_dir).glob("evictions-*.parquet"))
    import pyarrow.parquet as pq

    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    size = sum(os.path.getsize(f) for f in files)
    print(
        f"generate without recorder {plain:.2f} s, with recorder {rec:.2f} s: ratio {rec / plain:.3f} "
        f"(+ {statistics.median(t_close) * 1e3:.0f} ms to close the run: flush, fsync, manifest)"
    )
    print(f"replay {rep:.2f} s / generation {plain:.2f} s: ratio {rep / plain:.3f}")
    print(f"evictions: {rows} rows, {size} bytes: {size / max(rows, 1):.2f} bytes per row")
    return 0


def bench_explain(
    model_name: str | None = None,
    task: str = "delayed_recall_1",
    keep: float = 0.2,
    resolution: float = 0.05,
    out: str | None = None,
) -> int:
    """Explaining one failed demo request (every counterfactual, both bisections, the replays)
    ÷ that request's own generation time, on this machine (DESIGN.md §6.10).

    The generation time is the median of plain (unrecorded) generations of the request under
    its run's config, timed before and after the explanation. Prints both, the ratio and the
    oracle teacher's forward count; returns 0 (1 when the request does not fail).
    """
    import tempfile

    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model
    from h2o_lens.runtime import h2o
    from h2o_lens.tasks import get_task
    from recorders.counterfactual import explain_request, load_parent

    from .jobs import run_task

    model, tok = load_model(model_name)
    chosen = get_task(task)
    root = out or tempfile.mkdtemp(prefix="h2o-lens-bench-explain-")
    parent = run_task(model, tok, chosen, H2OConfig(ratio=keep), root, ratio=keep, replay=True)
    if parent.correct:
        print(f"{task} at keep {keep:.0%} answers right ({parent.answer!r}): nothing to explain")
        return 1
    req = load_parent(parent.run_dir, 0)
    ids = torch.tensor([req.prompt_ids])

    def generate() -> None:
        with torch.no_grad(), h2o(model, req.config):
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=req.max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )

    gen = []
    for _ in range(2):
        t0 = time.perf_counter()
        generate()
        gen.append(time.perf_counter() - t0)
    ex = explain_request(model, tok, parent.run_dir, 0, resolution=resolution)
    for _ in range(2):
        t0 = time.perf_counter()
        generate()
        gen.append(time.perf_counter() - t0)
    g = statistics.median(gen)
    ran = {k: o.slots for k, o in ex.outcomes.items() if o.ran}
    print(
        f"model {type(model).__name__}, {torch.get_num_threads()} threads; task {task}, keep {keep:.0%} "
        f"({req.slots} slots of a {req.prompt_len}-token prompt, {req.max_new_tokens} new tokens)"
    )
    print(f"{'own generation s':>17} {'explain s':>10} {'ratio':>7} {'probes':>7} {'oracle forwards':>16}")
    print(
        f"{g:>17.2f} {ex.seconds:>10.1f} {ex.seconds / g:>6.1f}x {len(ex.probe_seconds):>7} "
        f"{ex.oracle_forwards if ex.oracle_forwards is not None else '-':>16}"
    )
    print(f"re-runs recorded: {ran}; generation times {[round(x, 2) for x in gen]}; runs under {root}")
    return 0
