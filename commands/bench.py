"""Benchmarks that print ratios measured side by side in one run.

Timings belong here, not in tests: each figure is the median over rounds
that alternate the two paths being compared, on the same process and data.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence

import torch

from h2o_lens import compat
from h2o_lens.errors import ConfigError
from h2o_lens.policies import half_split, ratio_slots
from h2o_lens.shape import model_shape
from h2o_lens.timing import Decoder as _Decoder
from h2o_lens.timing import median_time as _median_time

__all__ = ["bench_decode", "bench_record", "bench_sweep", "bench_explain", "bench_assistant"]


def _halves(budget: int) -> dict[str, int]:
    """``heavy`` and ``recent`` of a slot count, split in halves like a keep ratio's budget."""
    return dict(zip(("heavy", "recent"), half_split(budget)))


def _check_keep(what: str, keep: float) -> None:
    """``keep`` a share of the context in (0, 1), or SystemExit naming the option."""
    if not 0 < keep < 1:
        raise SystemExit(f"bench {what}: --keep is the kept share of the context, in (0, 1); got {keep!r}")


def _check_ints(what: str, name: str, values, low: int) -> list[int]:
    """``values`` as a list of ints >= ``low``, or a ConfigError naming the option."""
    values = [values] if isinstance(values, int) else list(values)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < low]
    if not values or bad:
        raise ConfigError(f"bench {what}: --{name} takes ints >= {low}, got {values!r}")
    return values


def _in_fresh_process(code: str) -> dict | str:
    """Run ``python -c code`` in a fresh process; its last JSON line, or the error text."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return json.loads(lines[-1])


def _prefill_phase(phase: str, model_name: str, context: int, keep: float) -> None:
    """One prefill of a ``context``-token prompt in this (fresh) process: SDPA (``phase="sdpa"``)
    or H2O with scores (``"h2o"``); prints one JSON line with the peak RSS."""
    import json

    from transformers import DynamicCache

    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model
    from h2o_lens.runtime import h2o

    torch.set_grad_enabled(False)
    model, _ = load_model(model_name, progress=False)
    text = model.config.get_text_config(decoder=True)
    ids = torch.randint(0, text.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    loaded = _peak_rss_bytes()
    t0 = time.perf_counter()
    if phase == "sdpa":
        model.set_attn_implementation("sdpa")
        model(input_ids=ids, **compat.cache_kwargs(DynamicCache(config=model.config)), use_cache=True, logits_to_keep=1)
    else:
        with h2o(model, H2OConfig(**_halves(ratio_slots(keep, context)))) as session:
            model(input_ids=ids, **compat.cache_kwargs(session.new_cache()), use_cache=True, logits_to_keep=1)
    out = {"phase": phase, "seconds": time.perf_counter() - t0, "loaded_bytes": loaded, "peak_bytes": _peak_rss_bytes()}
    print(json.dumps(out), flush=True)


def _prefill_rss(model_name: str, context: int, keep: float) -> int:
    """Peak RSS of the SDPA prefill and of the prefill with scores, each in a fresh process; prints one line."""
    res = {}
    for phase in ("sdpa", "h2o"):
        args = f"{phase!r}, {model_name!r}, {context!r}, {keep!r}"
        code = f"from commands.bench import _prefill_phase; _prefill_phase({args})"
        res[phase] = _in_fresh_process(code)
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
    from transformers import DynamicCache

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


def _decode_times(model, cfg, ctx: torch.Tensor, steps: int, rounds: int):
    """Median seconds per decode step of the full cache and of H2O, alternating, and the H2O cache's bytes."""
    from transformers import DynamicCache

    from h2o_lens.runtime import h2o

    model.set_attn_implementation("sdpa")
    full = _Decoder(model, DynamicCache(config=model.config), ctx, last_logits_only=True)
    with h2o(model, cfg) as session:
        fast = _Decoder(model, session.new_cache(), ctx, last_logits_only=True)
        fast.run(2)  # warm-up
        model.set_attn_implementation("sdpa")
        full.run(2)
        t_full, t_h2o = [], []
        for _ in range(rounds):
            model.set_attn_implementation("sdpa")
            t_full.append(_median_time(lambda: full.run(steps), 1) / steps)
            model.set_attn_implementation("h2o_lens")
            t_h2o.append(_median_time(lambda: fast.run(steps), 1) / steps)
        nbytes = fast.cache.nbytes()
    return statistics.median(t_full), statistics.median(t_h2o), nbytes


def bench_decode(
    model_name: str | None = None,
    contexts=(512, 2048),
    batches=(1, 8),
    keep: float = 0.2,
    steps: int = 8,
    rounds: int = 3,
    model=None,
    memory: bool = True,
) -> int:
    """Decode tokens/s of H2O at ``keep`` ÷ the full cache, per context and batch size, and the
    prefill with scores ÷ the SDPA prefill, in time and in peak RSS, side by side in one run.

    For each context: a table with a row per batch size (every row of the batch the same
    context of random tokens): full-cache and H2O ms/step and tokens/s, measured in
    alternating rounds, their ratio and the KV bytes held; then the prefill of one prompt
    with scores ÷ SDPA (time, in this process), and the peak RSS of each, each in a fresh
    process that does only that prefill (``memory``; it loads ``model_name``, so it is
    skipped when only ``model`` is given). Returns 0 (1 when a memory process failed).
    """
    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model
    from h2o_lens.runtime import full_kv_bytes

    contexts = _check_ints("decode", "contexts", contexts, 2)
    batches = _check_ints("decode", "batch", batches, 1)
    _check_ints("decode", "steps", steps, 1)
    _check_ints("decode", "rounds", rounds, 1)
    _check_keep("decode", keep)
    fresh = memory and (model is None or model_name is not None)
    if model is None:
        model, _ = load_model(model_name, progress=False)
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
        cfg = H2OConfig(**_halves(budget))
        print(f"\ncontext {n}, H2O B={budget} ({cfg.describe()})")
        print(
            f"{'batch':>6} {'full ms/step':>13} {'full tok/s':>11} {'h2o ms/step':>12} {'h2o tok/s':>10} "
            f"{'h2o/full tok/s':>15} {'KV MiB h2o':>11} {'KV h2o/full':>12}"
        )
        for b in batches:
            ctx = torch.randint(0, text.vocab_size, (b, n), generator=gen)
            tf, th, nbytes = _decode_times(model, cfg, ctx, steps, rounds)
            tokens = n + 2 + rounds * steps + 1
            kv = nbytes["kv"] + nbytes["metadata"]
            print(
                f"{b:>6} {tf * 1e3:>13.2f} {b / tf:>11.1f} {th * 1e3:>12.2f} {b / th:>10.1f} {tf / th:>15.3f} "
                f"{kv / 2**20:>11.3f} {kv / full_kv_bytes(model, tokens, batch=b):>12.4f}",
                flush=True,
            )
        ts, th = _prefill_time(model, cfg, torch.randint(0, text.vocab_size, (1, n), generator=gen), rounds)
        print(f"prefill {n} tokens: SDPA {ts * 1e3:.0f} ms, with scores {th * 1e3:.0f} ms: ratio {th / ts:.3f}")
        if fresh:
            failed |= _prefill_rss(model_name, n, keep)
        elif memory:
            print(f"prefill {n} peak RSS: skipped (give the model by name to load it in fresh processes)")
    return failed


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


# -- peak memory of a long record and its replay ----------------------------------------------


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (``VmHWM``; ``ru_maxrss`` where there is no procfs)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory_phase(phase: str, model_name: str | None, root: str, context: int, new_tokens: int, keep: float) -> None:
    """One phase of :func:`bench_record_memory`, in a fresh process; prints one JSON line.

    ``seconds``: the generation alone (record) or the whole replay (replay), each after the
    same short warm-up forward, so neither pays the process's first-call costs.
    """
    import json

    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model

    torch.set_grad_enabled(False)
    model, _ = load_model(model_name, progress=False)
    loaded = _peak_rss_bytes()
    model(input_ids=torch.zeros(1, 16, dtype=torch.long))  # warm-up
    out: dict = {"phase": phase, "loaded_bytes": loaded}
    if phase == "record":
        from recorders.recorder import record

        text = model.config.get_text_config(decoder=True)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, text.vocab_size, (1, context), generator=gen)
        cfg = H2OConfig(**_halves(max(2, int(round(keep * context)))))
        with record(model, cfg, out=root, run_id="bench-memory", fsync=False) as run:
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            out["seconds"] = time.perf_counter() - t0
        out["run_dir"] = str(run.run_dir)
        out["budget"] = cfg.describe()
    else:
        from recorders.replay import replay

        t0 = time.perf_counter()
        summary = replay(root, model=model, progress=False)
        out["seconds"] = time.perf_counter() - t0
        out["max_logit_diff"] = summary.max_logit_diff
        out["implementation_ok"] = summary.implementation_ok
    out["peak_bytes"] = _peak_rss_bytes()
    print(json.dumps(out, default=str), flush=True)


def bench_record_memory(
    model_name: str | None = None, context: int = 4096, new_tokens: int = 256, keep: float = 0.2
) -> int:
    """Generation time, replay time and peak RSS of recording one ``context``-token prompt with
    ``new_tokens`` new tokens and of replaying that run, each phase in a fresh process (one
    phase's peak cannot hide the other's).

    Prints one line per phase, then replay ÷ generation and both peaks side by side; returns 0
    when both phases ran.
    """
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    for name, value in (("context", context), ("new_tokens", new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SystemExit(f"bench record: --{name.replace('_', '-')} must be an int >= 1, got {value!r}")
    root = tempfile.mkdtemp(prefix="h2o-lens-bench-memory-")
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
        print(
            f"record and replay, each in a fresh process: prompt {context} tokens, {new_tokens} new, keep {keep:g}, "
            f"model {model_name or 'default'}, torch {torch.__version__} on CPU ({torch.get_num_threads()} threads)"
        )
        target = root
        res: dict[str, dict] = {}
        for phase in ("record", "replay"):
            code = (
                "from commands.bench import _memory_phase; "
                f"_memory_phase({phase!r}, {model_name!r}, {target!r}, {context!r}, {new_tokens!r}, {keep!r})"
            )
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                print(f"{phase}: failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                return 1
            res[phase] = r = json.loads(lines[-1])
            what = "generation (recorded)" if phase == "record" else "replay"
            print(
                f"{phase:>7}: {what} {r['seconds']:.2f} s, peak RSS {r['peak_bytes'] / 2**30:.2f} GiB (model loaded: "
                f"{r['loaded_bytes'] / 2**30:.2f} GiB)"
                + (f", {r['budget']}" if "budget" in r else "")
                + (f", max |logit diff| {r['max_logit_diff']:.3g}" if "max_logit_diff" in r else "")
                + ("" if r.get("implementation_ok", True) else ", IMPLEMENTATION CHECK FAILED")
            )
            target = r.get("run_dir", target)
        rec, rep = res["record"], res["replay"]
        print(
            f"replay {rep['seconds']:.2f} s / generation {rec['seconds']:.2f} s: ratio "
            f"{rep['seconds'] / rec['seconds']:.3f}; peak RSS record {rec['peak_bytes'] / 2**30:.2f} GiB, "
            f"replay {rep['peak_bytes'] / 2**30:.2f} GiB"
        )
    finally:  # the runs are only measured: nothing is left behind
        shutil.rmtree(root, ignore_errors=True)
    return 0


# -- a runs root of thousands of runs ---------------------------------------------------------


def _timed_cli(argv: list[str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of ``h2o-lens ARGV`` in a fresh process, and its last output line."""
    import os
    import resource
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "commands.cli", *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"h2o-lens {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = proc.stdout.strip().splitlines()
    return wall, cpu, lines[-1] if lines else ""


def _page_paint(context, url: str, title: str) -> float:
    """Seconds from opening ``url`` in a new tab until the page's script finished with its
    heading and, on the Runs page, its table shown."""
    from app.bench import DONE

    page = context.new_page()
    try:
        t0 = time.perf_counter()
        page.goto(url, wait_until="domcontentloaded", timeout=300_000)
        page.wait_for_selector(f"{DONE} [data-testid=stMain] h1:has-text('{title}')", timeout=300_000)
        if title == "Runs":
            page.wait_for_selector("[data-testid=stDataFrame]", state="visible", timeout=300_000)
        seconds = time.perf_counter() - t0
        errors = page.locator("[data-testid=stException]").count()
        if errors:
            print(f"  {url}: {errors} exception(s) shown")
        return seconds
    finally:
        page.close()


def bench_runs(runs: int = 5000, root: str | None = None, browser: bool = True) -> int:
    """Timings over a synthetic root of ``runs`` runs (:func:`runlog.synthetic_root.make_root`).

    Prints: the root's build time; ``h2o-lens runs`` in a fresh process with no catalog cache
    (every file read in full) and with it; ``runs_table`` and the sweep curve points of every
    run in this process; the Runs and Compare pages in Chromium (first visit to a fresh server,
    then a new tab). Targets: ``h2o-lens runs`` and the Runs page first paint ≤ 3 s.
    """
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from runlog.catalog import CACHE_NAME
    from runlog.synthetic_root import make_root

    temp = None
    if root is None:
        temp = tempfile.mkdtemp(prefix="h2o-lens-bench-runs-")
        root = os.path.join(temp, "runs")
    try:
        print(
            f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; "
            "wall seconds (CPU seconds of the process in brackets)",
            flush=True,
        )
        if not Path(root).is_dir():
            t0 = time.perf_counter()
            make_root(root, runs)
            print(f"synthetic root: {runs} runs written in {time.perf_counter() - t0:.1f} s to {root}", flush=True)
        n = sum(1 for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        (Path(root) / CACHE_NAME).unlink(missing_ok=True)
        for label in ("no cache (every file read in full)", "catalog cache warm"):
            wall, cpu, last = _timed_cli(["runs", root, "--max-rows", "20"])
            print(f"h2o-lens runs ({n} runs), {label}: {wall:.2f} s ({cpu:.2f} s CPU)   [{last}]", flush=True)
        wall, cpu, _ = _timed_cli(["runs", root, "--max-rows", "100000"])
        print(f"h2o-lens runs --max-rows 100000 (every row printed): {wall:.2f} s ({cpu:.2f} s CPU)", flush=True)

        from analyses import run_curve_points, runs_table
        from runlog import open_runs

        t0, c0 = time.perf_counter(), time.process_time()
        con = open_runs(root, warn=False)
        t1, c1 = time.perf_counter(), time.process_time()
        table = runs_table(con).df()
        t2, c2 = time.perf_counter(), time.process_time()
        points = run_curve_points(con, table["run_id"].tolist()).df()
        t3, c3 = time.perf_counter(), time.process_time()
        print(
            f"open_runs {t1 - t0:.2f} s ({c1 - c0:.2f}), runs_table {t2 - t1:.2f} s ({c2 - c1:.2f}) for "
            f"{len(table)} rows, run_curve_points of every run {t3 - t2:.2f} s ({c3 - c2:.2f}) for "
            f"{len(points)} points",
            flush=True,
        )
        con.close()
        if not browser:
            return 0
        from app.bench import CHROMIUM, serve
        from app.bench import browser as open_browser

        if not Path(CHROMIUM).exists():
            print(f"dashboard: skipped, no Chromium at {CHROMIUM}")
            return 0
        from runlog import write_synthetic_run

        other = table["run_id"].iloc[len(table) // 2]
        added = Path(root) / "bench-added-run"
        try:
            with serve(root, timeout=300) as url, open_browser() as b:
                context = b.new_context(viewport={"width": 1500, "height": 1000})
                first = _page_paint(context, f"{url}/", "Runs")
                again = _page_paint(context, f"{url}/", "Runs")
                # a run appears (as during a sweep): the server scans the root again, the cache spares
                # every file but the new run's, and the runs table is built anew
                write_synthetic_run(root, added.name, layers=2, kv_heads=1, steps=8, prompt_len=32, fsync=False)
                changed = _page_paint(context, f"{url}/", "Runs")
                compare = _page_paint(context, f"{url}/compare?run={table['run_id'].iloc[0]}&other={other}", "Compare")
                context.close()
        finally:
            shutil.rmtree(added, ignore_errors=True)
        print(
            f"Runs page: first paint {first:.2f} s on a fresh server (its imports, scan, views and table), "
            f"{changed:.2f} s after a run was added (scan, views and table again), new tab {again:.2f} s; "
            f"Compare page {compare:.2f} s",
            flush=True,
        )
        return 0
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _prompt_tokens(tok, task) -> int:
    """``task``'s prompt tokens as a run counts them (its chat text, no special tokens added)."""
    return len(tok(task.chat_text(tok), add_special_tokens=False)["input_ids"])


def _long_requests(model, tok, family: str, length: int, count: int = 3):
    """``count`` requests of the long-context ``family`` at ``length`` prompt tokens, the length
    capped so that each prompt and its new tokens fit the model's window (DESIGN.md §6.10).
    Returns the requests and the prompt length asked of the family (``length`` unless capped);
    a ConfigError naming the option when ``length`` is past the window or the cap leaves too little."""
    from h2o_lens.models import context_window
    from h2o_lens.tasks.longctx import LONG_FAMILIES

    window = context_window(model)
    if window is not None and length > window:
        raise ConfigError(
            f"bench explain: --length {length} is past the model's window of {window:,} positions "
            f"(config.max_position_embeddings); expected at most {window} (the prompt is capped at the "
            f"window less the request's new tokens)"
        )
    want, margin = length, 1
    for _ in range(10):  # a fit lands within half a filler sentence of the length asked, above or below
        try:
            reqs = LONG_FAMILIES[family](length=want, count=count, tokenizer=tok)
        except ValueError as exc:
            capped = f" (capped at {want} to fit the window of {window:,} positions)" if want != length else ""
            raise ConfigError(f"bench explain: --length {length}{capped}: {exc}") from None
        over = 0 if window is None else max(_prompt_tokens(tok, r) + r.max_new_tokens for r in reqs) - window
        if over <= 0:
            return reqs, want
        want, margin = want - over - margin, 2 * margin
    raise ConfigError(
        f"bench explain: cannot fit {family} requests of about {length} prompt tokens in {window:,} positions"
    )


def _explain_candidates(model, tok, task: str | None, length: int | None):
    """The requests the bench tries, in order, and a line per family whose length was capped:
    the built-in ``task`` (default ``delayed_recall_1``) without ``length``; with it, the
    requests of the long family ``task``, or of every family the full cache solves (needle
    first) when ``task`` is None, at ``length`` prompt tokens capped to the model's window less
    each request's new tokens."""
    from h2o_lens.models import context_window
    from h2o_lens.tasks import get_task
    from h2o_lens.tasks.longctx import FULL_CACHE_SOLVES, LONG_FAMILIES

    if length is None:
        return [get_task(task or "delayed_recall_1")], {}
    if task is not None and task not in LONG_FAMILIES:
        raise ConfigError(
            f"bench explain: --length takes a long-context family (--tasks builtin:NAME), got {task!r}; "
            f"expected one of {', '.join(LONG_FAMILIES)}"
        )
    families = [task] if task is not None else [f for f in LONG_FAMILIES if FULL_CACHE_SOLVES[f]]
    candidates, capped = [], {}
    for family in families:
        reqs, want = _long_requests(model, tok, family, length)
        candidates += reqs
        if want != length:
            capped[family] = (
                f"{family}: --length {length} capped at {want} prompt tokens (the window of "
                f"{context_window(model):,} positions less {reqs[0].max_new_tokens} new tokens)"
            )
    return candidates, capped


def _explain_request_task(model, tok, candidates, keep: float, root: str, what: str):
    """The first of ``candidates`` that the full cache answers right and H2O at ``keep`` wrong,
    with its runs under ``root``: the full-cache run (what a sweep's full cell would hold) and
    the parent under H2O. Returns the parent's TaskRun and the task, or None and a line saying
    why there is none (no H2O run is made for a request the full cache gets wrong)."""
    from h2o_lens.config import H2OConfig

    from .jobs import run_task

    answered = 0
    for chosen in candidates:
        print(f"trying {chosen.name} ({what})", flush=True)
        full = run_task(model, tok, chosen, H2OConfig(policy="full"), root, replay=False, name=f"{chosen.name} full")
        if not full.correct:
            continue
        answered += 1
        parent = run_task(model, tok, chosen, H2OConfig(ratio=keep), root, ratio=keep, replay=True)
        if not parent.correct:
            return parent, chosen
    if not answered:
        return None, (
            f"bench explain: the full cache answers none of the {len(candidates)} requests tried ({what}), "
            "so no failure of H2O can be explained there on this model; try a shorter --length"
        )
    return None, (
        f"bench explain: no request of {what} fails at keep {keep:.0%} while the full cache answers it right "
        f"({answered} of {len(candidates)} answered by the full cache)"
    )


def bench_explain(
    model_name: str | None = None,
    task: str | None = None,
    keep: float = 0.2,
    resolution: float = 0.05,
    out: str | None = None,
    length: int | None = None,
    rounds: int = 2,
) -> int:
    """Explaining one failed request (every counterfactual, both bisections, the replays) ÷ one
    generation of the same request, on this machine (DESIGN.md §6.10).

    The request is the built-in ``task`` (default ``delayed_recall_1``), or with ``length`` the
    first request that H2O at ``keep`` fails and the full cache answers, of the long-context
    family ``task`` (default: each family the full cache solves in turn, ``needle`` first) at
    that many prompt tokens, capped at the model's window less the request's new tokens (the
    header says so; past the window is an error). Its root holds the full-cache run of the
    request, as a sweep's would, which the explanation copies. The two sides alternate on the
    same process: a plain (unrecorded) generation under the parent's config, an explanation from
    scratch (its counterfactual folders removed first), ``rounds`` times, then a last
    generation; the ratio is of the medians, printed with each round and the load average seen
    at the start and the end (a shared machine moves both sides). Returns 0 (1 when no request
    fails, or the full cache answers none).
    """
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from h2o_lens.models import load_model
    from h2o_lens.runtime import h2o
    from recorders.counterfactual import explain_request, load_parent

    rounds = _check_ints("explain", "rounds", rounds, 1)[0]
    if length is not None:
        _check_ints("explain", "length", length, 1)
        from h2o_lens.tasks.longctx import LONG_FAMILIES

        if task is not None and task not in LONG_FAMILIES:  # before the model loads
            _explain_candidates(None, None, task, length)
    model, tok = load_model(model_name)
    candidates, capped = _explain_candidates(model, tok, task, length)
    for line in capped.values():
        print(line, flush=True)
    what = f"{task or 'the long families'} at {length} tokens" if length else candidates[0].name
    root = out or tempfile.mkdtemp(prefix="h2o-lens-bench-explain-")
    load = [os.getloadavg()[0]]
    parent, chosen = _explain_request_task(model, tok, candidates, keep, root, what)
    if parent is None:
        print(chosen)
        return 1
    req = load_parent(parent.run_dir, 0)
    ids = torch.tensor([req.prompt_ids])

    def generate() -> float:
        t0 = time.perf_counter()
        with torch.no_grad(), h2o(model, req.config):
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=req.max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        return time.perf_counter() - t0

    def explain():
        for done in Path(root).glob(f"{req.run_id}-r0-*"):
            shutil.rmtree(done)
        return explain_request(model, tok, parent.run_dir, 0, resolution=resolution)

    print(
        f"model {type(model).__name__}, {torch.get_num_threads()} threads; {chosen.name}, keep {keep:.0%} "
        f"({req.slots} slots of a {req.prompt_len}-token prompt, {req.max_new_tokens} new tokens)"
        + "".join(f"; {line}" for f, line in capped.items() if f == getattr(chosen, "meta", {}).get("family")),
        flush=True,
    )
    gen, spent, last = [generate()], [], None
    for i in range(rounds):
        t0 = time.perf_counter()
        last = explain()
        spent.append(time.perf_counter() - t0)
        gen.append(generate())
        print(f"  round {i + 1}: generation {gen[i]:.2f} s, explain {spent[i]:.1f} s, generation {gen[i + 1]:.2f} s")
    load.append(os.getloadavg()[0])
    g, e = statistics.median(gen), statistics.median(spent)
    ran = {k: o.slots for k, o in last.outcomes.items() if o.ran}
    print(f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end")
    print(f"{'generation s':>13} {'explain s':>10} {'ratio':>7} {'probes':>7} {'oracle forwards':>16} {'reused':>7}")
    print(
        f"{g:>13.2f} {e:>10.1f} {e / g:>6.1f}x {len(last.probe_seconds):>7} "
        f"{last.oracle_forwards if last.oracle_forwards is not None else '-':>16} {last.prompts_reused:>7}"
    )
    print(
        f"full cache: {'copied from ' + last.full_copied_from if last.full_copied_from else 'generated'}; "
        f"re-runs recorded: {ran}; runs under {root}"
    )
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
    executor: str = "inprocess",
    workers: int = 2,
    policies: Sequence[tuple[str, str]] = (("h2o", "sum"),),
    sharing: bool = False,
    length: int | None = None,
) -> int:
    """Requests per minute of the same sweep grid batched and one request at a time, side by side.

    ``executor="ray"`` compares instead the in-process executor with a Ray sweep of
    ``workers`` workers on a local cluster (:func:`_bench_sweep_ray`), on the grid of
    ``batch_size``. ``sharing`` compares instead the batched grid with its cells sharing one
    prompt forward per batch (DESIGN.md §12.5) and with every cell forwarding its prompts.

    The grid is ``count`` requests of ``tasks`` (each with ``new_tokens`` new
    tokens, so that they share batches; ``length``: prompt tokens of a long-context built-in
    family) under ``policies`` (``(name, gqa)`` pairs; default
    h2o gqa sum) at one budget:
    ``budget="slots"`` gives every request the slot count of ``keep`` times the
    median prompt length (one budget), ``budget="ratio"`` the keep ratio itself
    (resolved on each prompt: a budget per row; the batch still decodes in one
    step, DESIGN.md §2.7). Each mode records (and
    replays) into a fresh root; the modes alternate over ``rounds``. Prints the
    time of each, split into recording and replay, and the ratio.
    """
    import dataclasses
    import shutil
    import tempfile
    from pathlib import Path

    from h2o_lens import policies as registry
    from h2o_lens.errors import ConfigError
    from h2o_lens.models import load_model, model_info
    from h2o_lens.packed import packing_available
    from h2o_lens.tasks.builtins import resolve_tasks

    from .grid import plan_grid, run_grid

    if sharing:
        if executor != "inprocess":
            raise ConfigError("bench sweep --sharing compares two in-process sweeps; drop --executor ray")
        if len({(p, g) for p, g in policies if registry.get(p).evicts}) < 2:
            raise ConfigError(
                "bench sweep --sharing: each batch of this grid has one H2O configuration, so there is "
                "no prompt forward to share; give several, e.g. --policies h2o,tova,local or --gqa sum,max"
            )
    if model is None:
        model, tokenizer = load_model(model_name, progress=False)
    reqs = [
        dataclasses.replace(t, max_new_tokens=new_tokens)
        for t in resolve_tasks(tasks, count=count, tokenizer=tokenizer, length=length)
    ]
    lengths = [len(tokenizer(t.chat_text(tokenizer), add_special_tokens=False)["input_ids"]) for t in reqs]
    if budget not in ("slots", "ratio"):
        raise ValueError(f"budget must be 'slots' or 'ratio', got {budget!r}")
    slots = ratio_slots(keep, int(statistics.median(lengths)))
    what = f"{slots} slots ({keep:.0%} of the median prompt)" if budget == "slots" else f"keep ratio {keep:.0%}"
    names = ", ".join(f"{p} gqa {g}" for p, g in policies)
    print(
        f"{model_info(model)['name']}: {len(reqs)} requests of {tasks} ({min(lengths)}-{max(lengths)} prompt "
        f"tokens, {new_tokens} new), {names} at {what}, replay {'on' if replay else 'off'}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, packed decode products "
        f"{'on' if packing_available(model) else 'off'} (DESIGN.md §16); {rounds} round(s), modes alternating"
    )
    grids = {
        size: plan_grid(
            reqs,
            tokenizer,
            model=str(model_info(model)["name"]),
            tasks_spec=f"bench:{tasks}",
            policies=list(policies),
            ratios=[keep] if budget == "ratio" else None,
            slots=[slots] if budget == "slots" else None,
            batch_size=size,
            dtype=str(model.dtype).removeprefix("torch."),
            replay=replay,
        )
        for size in (batch_size, 1)
    }
    with torch.no_grad():  # warm-up: the first generate of a process pays one-time costs
        enc = tokenizer(
            [reqs[0].chat_text(tokenizer)], return_tensors="pt", add_special_tokens=False, return_token_type_ids=False
        )
        model.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    if executor == "ray":
        return _bench_sweep_ray(model_name, model, tokenizer, reqs, grids[batch_size], rounds, workers)
    if executor != "inprocess":
        raise ValueError(f"executor must be 'inprocess' or 'ray', got {executor!r}")
    # (label, grid, whether the cells of a batch share its prompt forward)
    if sharing:
        modes = [(f"batch {batch_size}, shared", grids[batch_size], True)]
        modes.append((f"batch {batch_size}, each cell", grids[batch_size], False))
    else:
        modes = [(f"batch {batch_size}" if batch_size > 1 else "batch 1", grids[batch_size], True)]
        modes.append(("one at a time", grids[1], True))
    times: dict[str, list[tuple[float, float, float]]] = {label: [] for label, _, _ in modes}
    shared: dict[str, int] = {}
    for _ in range(rounds):
        for label, grid, share in modes:
            root = Path(tempfile.mkdtemp(prefix="h2o-lens-bench-sweep-"))
            try:
                report = run_grid(root, grid, reqs, model, tokenizer, progress=False, share_prompts=share)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            if report.failed:
                raise RuntimeError(f"bench sweep: cells failed: {report.failed}")
            times[label].append((report.seconds, report.record_seconds, report.replay_seconds))
            shared[label] = report.prompts_reused
    head = f"{'mode':<22} {'runs':>5} {'seconds':>8} {'record s':>9} {'replay s':>9} {'requests/min':>13}"
    print(head + " prompt forwards shared")
    rate, rec, rep = {}, {}, {}
    for label, grid, _ in modes:
        total, rec[label], rep[label] = (statistics.median(t[i] for t in times[label]) for i in range(3))
        rate[label] = 60 * len(reqs) / total
        print(
            f"{label:<22} {len(grid.cells):>5} {total:>8.1f} {rec[label]:>9.1f} {rep[label]:>9.1f} "
            f"{rate[label]:>13.1f} {shared[label]:>22}"
        )
    (first, *_), (second, *_) = modes
    what = "shared / each cell" if sharing else "batched / one at a time"
    print(f"{what}: {rate[first] / rate[second]:.2f}x requests per minute")
    if replay:  # the two stages side by side: only the generation has rows to batch
        print(
            f"  recording alone (generation, eviction logs, verdicts: what `sweep --no-replay` runs): "
            f"{rec[second] / rec[first]:.2f}x; the replay (teacher-forced forwards, one request at a "
            f"time in both modes): {rep[second] / rep[first]:.2f}x"
        )
    return 0


def _bench_sweep_ray(model_name, model, tokenizer, reqs, grid, rounds: int, workers: int) -> int:
    """Cells per minute of one grid in-process and on ``workers`` Ray workers, side by side.

    The Ray workers are started (and warmed up) once, before the clock; each round
    runs the grid into a fresh root both ways. The per-cell scheduling overhead is
    the workers' time outside the cells, ``(wall × workers − Σ cell seconds) / cells``,
    and the median round trip of a call that runs nothing.
    """
    import shutil
    import tempfile
    from pathlib import Path

    import recorders.recorder  # noqa: F401  (imported before the clock, as the workers do)
    import recorders.replay  # noqa: F401

    from .grid import run_grid
    from .ray_sweep import RayOptions, RaySweep, scheduling_overhead_ms

    dtype = str(model.dtype).removeprefix("torch.")
    with RaySweep(model_name, dtype, RayOptions(workers=workers)) as pool:
        t0 = time.perf_counter()
        pool.start()
        pool.warm_up()
        start = time.perf_counter() - t0
        round_trip = pool.round_trip_ms()
        times: dict[str, list[float]] = {"in-process": [], f"ray x{workers}": []}
        overheads = []
        for _ in range(rounds):
            for mode in times:
                root = Path(tempfile.mkdtemp(prefix="h2o-lens-bench-sweep-"))
                busy = [w.busy_seconds for w in pool.workers]
                try:
                    if mode == "in-process":
                        report = run_grid(root, grid, reqs, model, tokenizer, progress=False)
                    else:
                        report = pool.run(root, grid, reqs, progress=False)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                if report.failed or len(report.ran) != len(grid.cells):
                    raise RuntimeError(f"bench sweep: cells not run: {report.failed or report.busy}")
                times[mode].append(report.seconds)
                if mode != "in-process":
                    spent = [w.busy_seconds - b for w, b in zip(pool.workers, busy)]
                    overheads.append(scheduling_overhead_ms(report.seconds, spent, len(grid.cells)))
    print(f"{'executor':<14} {'cells':>6} {'seconds':>8} {'cells/min':>10} {'requests/min':>13}")
    rate = {}
    for mode, ts in times.items():
        total = statistics.median(ts)
        rate[mode] = 60 * len(grid.cells) / total
        print(f"{mode:<14} {len(grid.cells):>6} {total:>8.1f} {rate[mode]:>10.1f} {60 * len(reqs) / total:>13.1f}")
    ray_mode = f"ray x{workers}"
    print(f"ray / in-process: {rate[ray_mode] / rate['in-process']:.2f}x cells per minute")
    print(
        f"scheduling overhead per cell: {statistics.median(overheads):.1f} ms (worker time outside cells), "
        f"{round_trip:.2f} ms (no-op round trip); workers started and warm in {start:.1f} s (not timed above)"
    )
    return 0


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
    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model
    from h2o_lens.runtime import h2o

    if draft not in ("lookup", "layers"):
        raise ValueError(f"draft must be 'lookup' or 'layers', got {draft!r}")
    _check_keep("decode --assistant", keep)
    _check_ints("decode --assistant", "rounds", rounds, 1)
    _check_ints("decode --assistant", "new-tokens", new_tokens, 2)
    if model is None:
        model, tokenizer = load_model(model_name)
    text = "Copy this text exactly, twice:\n\n" + _COPY_TEXT * 3
    messages = [{"role": "user", "content": text}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(chat, return_tensors="pt", add_special_tokens=False)["input_ids"]
    cfg = H2OConfig(**_halves(ratio_slots(keep, ids.shape[1])))
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
    full_tokens, h2o_tokens = outs[ways[0]][0, ids.shape[1] :], outs[ways[2]][0, ids.shape[1] :]
    if torch.equal(full_tokens, h2o_tokens):
        print("H2O's tokens are the full cache's: the drafts are accepted alike, the ratio is the runtime's")
    else:
        first = int((full_tokens != h2o_tokens).nonzero()[0])
        print(
            f"H2O's tokens differ from the full cache's from new token {first} on, so its drafts are accepted "
            f"differently ({calls[ways[3]]} against {calls[ways[1]]} forwards): the ratio mixes H2O's answer with "
            "the runtime (DESIGN.md §14.1); a larger --keep gives both the same tokens"
        )
    print(f"H2O keeps {h2o_up / full_up:.3f} of the full cache's speed-up (target >= 0.90)")
    return 0
