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

__all__ = ["bench_decode", "bench_record", "bench_sweep"]


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


def bench_sweep(
    model_name: str | None = None,
    tasks: str = "builtin:full",
    count: int = 16,
    batch_size: int = 8,
    keep: float = 0.2,
    new_tokens: int = 16,
    replay: bool = True,
    rounds: int = 1,
    budget: str = "slots",
    model=None,
    tokenizer=None,
) -> int:
    """Requests per minute of the same sweep grid batched and one request at a time, side by side.

    The grid is ``count`` requests of ``tasks`` (each with ``new_tokens`` new
    tokens, so that they share batches) under h2o gqa sum at one budget:
    ``budget="slots"`` gives every request the slot count of ``keep`` times the
    median prompt length (one budget: a batch decodes in one step),
    ``budget="ratio"`` the keep ratio itself (resolved on each prompt: rows of
    different budgets decode apart, DESIGN.md §12.2). Each mode records (and
    replays) into a fresh root; the modes alternate over ``rounds``. Prints the
    time of each, split into recording and replay, and the ratio.
    """
    import dataclasses
    import shutil
    import tempfile
    from pathlib import Path

    from h2o_lens.models import load_model, model_info
    from h2o_lens.tasks.taskfile import resolve_tasks

    from .grid import plan_grid, run_grid

    if model is None:
        model, tokenizer = load_model(model_name, progress=False)
    reqs = [
        dataclasses.replace(t, max_new_tokens=new_tokens)
        for t in resolve_tasks(tasks, count=count, tokenizer=tokenizer)
    ]
    lengths = [len(tokenizer(t.chat_text(tokenizer), add_special_tokens=False)["input_ids"]) for t in reqs]
    if budget not in ("slots", "ratio"):
        raise ValueError(f"budget must be 'slots' or 'ratio', got {budget!r}")
    slots = ratio_slots(keep, int(statistics.median(lengths)))
    what = f"{slots} slots ({keep:.0%} of the median prompt)" if budget == "slots" else f"keep ratio {keep:.0%}"
    print(
        f"{model_info(model)['name']}: {len(reqs)} requests of {tasks} ({min(lengths)}-{max(lengths)} prompt "
        f"tokens, {new_tokens} new), h2o at {what}, gqa sum, replay {'on' if replay else 'off'}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {rounds} round(s), modes alternating"
    )
    grids = {
        size: plan_grid(
            reqs,
            tokenizer,
            model=str(model_info(model)["name"]),
            tasks_spec=f"bench:{tasks}",
            policies=[("h2o", "sum")],
            ratios=[keep] if budget == "ratio" else None,
            slots=[slots] if budget == "slots" else None,
            batch_size=size,
            dtype=str(model.dtype).removeprefix("torch."),
            replay=replay,
        )
        for size in (batch_size, 1)
    }
    with torch.no_grad():  # warm-up: the first generate of a process pays one-time costs
        enc = tokenizer([reqs[0].chat_text(tokenizer)], return_tensors="pt", add_special_tokens=False)
        model.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    times: dict[int, list[tuple[float, float, float]]] = {size: [] for size in grids}
    for _ in range(rounds):
        for size, grid in grids.items():
            root = Path(tempfile.mkdtemp(prefix="h2o-lens-bench-sweep-"))
            try:
                report = run_grid(root, grid, reqs, model, tokenizer, progress=False)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            if report.failed:
                raise RuntimeError(f"bench sweep: cells failed: {report.failed}")
            times[size].append((report.seconds, report.record_seconds, report.replay_seconds))
    print(f"{'mode':<22} {'runs':>5} {'seconds':>8} {'record s':>9} {'replay s':>9} {'requests/min':>13}")
    rate = {}
    for size, grid in grids.items():
        total, rec, rep = (statistics.median(t[i] for t in times[size]) for i in range(3))
        rate[size] = 60 * len(reqs) / total
        mode = f"batch {size}" if size > 1 else "one at a time"
        print(f"{mode:<22} {len(grid.cells):>5} {total:>8.1f} {rec:>9.1f} {rep:>9.1f} {rate[size]:>13.1f}")
    print(f"batched / one at a time: {rate[batch_size] / rate[1]:.2f}x requests per minute")
    return 0
