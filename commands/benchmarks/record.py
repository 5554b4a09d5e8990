"""``h2o-lens bench record``: recorder overhead, replay cost and log size side by side; with
``--context`` or ``--new-tokens``, the time and peak RSS of recording one long prompt and of
replaying it, each phase in a fresh process."""

from __future__ import annotations

import argparse
import statistics
import time

from ..options import at_least, keep_share
from .common import check_ints, check_keep, fresh_env, halves, peak_rss_bytes

__all__ = ["add_arguments", "run", "bench_record", "bench_record_memory", "replay_verdict"]

NAME = "record"
HELP = "recorder overhead, replay cost and log size; --context: peak RSS of a long record and its replay"


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default=None, help="HF id or local path (default: the packaged SmolLM2-135M-Instruct)")
    b.add_argument("--keep", type=keep_share, default=0.2, help="B as a share of the prompt, in (0, 1)")
    b.add_argument("--rounds", type=at_least(1), default=3, help="rounds alternating with and without the recorder")
    b.add_argument(
        "--context",
        type=at_least(2),
        default=None,
        help="time and peak RSS of recording, then replaying, one prompt of this many tokens (default 4096)",
    )
    b.add_argument("--new-tokens", type=at_least(1), default=None, help="new tokens of that prompt (default 256)")


def run(args: argparse.Namespace) -> int:
    if args.context or args.new_tokens:
        return bench_record_memory(
            model_name=args.model, context=args.context or 4096, new_tokens=args.new_tokens or 256, keep=args.keep
        )
    return bench_record(model_name=args.model, keep=args.keep, rounds=args.rounds)


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
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model

    check_keep("record", keep)
    check_ints("record", "rounds", rounds, 1)
    check_ints("record", "prompt-tokens", prompt_tokens, 2)
    check_ints("record", "new-tokens", new_tokens, 1)
    if model is None:
        model, _ = load_model(model_name)
    text = model.config.get_text_config(decoder=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, text.vocab_size, (1, prompt_tokens), generator=gen)
    budget = max(2, int(round(keep * prompt_tokens)))
    cfg = H2OConfig(**halves(budget))
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    root = Path(tempfile.mkdtemp(prefix="h2o-lens-bench-"))
    try:
        _record_rounds(model, ids, cfg, kw, root, rounds, budget, prompt_tokens, new_tokens)
    finally:  # the runs are only measured: nothing is left behind (the folder is the bench's own)
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _record_rounds(model, ids, cfg, kw: dict, root, rounds: int, budget: int, prompt_tokens: int, new_tokens: int):
    """:func:`bench_record`'s rounds under ``root`` and its printout; the opening of each run
    (its manifest's model description, the model's fingerprint among it) is timed beside the
    fingerprint alone."""
    import os
    from pathlib import Path

    import pyarrow.parquet as pq
    import torch

    from h2o_lens.fingerprint import model_fingerprint
    from h2o_lens.runtime import h2o
    from recorders.recorder import record
    from recorders.replay import replay

    folder = getattr(model.config, "_name_or_path", None)
    t_plain, t_rec, t_open, t_close, t_print, runs = [], [], [], [], [], []
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
            t_open.append(t1 - t0)
            t_rec.append(t2 - t1)
            t_close.append(time.perf_counter() - t2)
            runs.append(run)
            t0 = time.perf_counter()
            model_fingerprint(folder)
            t_print.append(time.perf_counter() - t0)
    plain, rec = statistics.median(t_plain), statistics.median(t_rec)
    replay_times = [replay(r.run_dir, model=model, progress=False).seconds for r in runs[:2]]
    rep = statistics.median(replay_times)
    files = list(Path(runs[-1].run_dir).glob("evictions-*.parquet"))
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    size = sum(os.path.getsize(f) for f in files)
    opened, printed = statistics.median(t_open), statistics.median(t_print)
    print(
        f"generate without recorder {plain:.2f} s, with recorder {rec:.2f} s: ratio {rec / plain:.3f} "
        f"(+ {opened * 1e3:.0f} ms to open the run, {statistics.median(t_close) * 1e3:.0f} ms to close it: "
        "flush, fsync, manifest)"
    )
    print(
        f"the model's fingerprint (digests cached): {printed * 1e3:.1f} ms, {printed / opened:.0%} of opening the run, "
        f"{printed / (opened + rec + statistics.median(t_close)):.3%} of the whole record"
    )
    print(f"replay {rep:.2f} s / generation {plain:.2f} s: ratio {rep / plain:.3f}")
    print(f"evictions: {rows} rows, {size} bytes: {size / max(rows, 1):.2f} bytes per row")


# -- peak memory of a long record and its replay ----------------------------------------------


def _memory_phase(phase: str, model_name: str | None, root: str, context: int, new_tokens: int, keep: float) -> None:
    """One phase of :func:`bench_record_memory`, in a fresh process; prints one JSON line.

    ``seconds``: the generation alone (record) or the whole replay (replay), each after the
    same short warm-up forward, so neither pays the process's first-call costs. ``handed``: a
    record as ``h2o-lens record --replay`` runs it, the recording keeping each request's prompt
    pass and the replay starting from it in the same process (DESIGN.md §6.1); its
    ``replay_seconds`` is that replay's.
    """
    import json

    import torch

    from h2o_lens.config import H2OConfig
    from h2o_lens.models import load_model

    torch.set_grad_enabled(False)
    model, _ = load_model(model_name, progress=False)
    loaded = peak_rss_bytes()
    model(input_ids=torch.zeros(1, 16, dtype=torch.long))  # warm-up
    out: dict = {"phase": phase, "loaded_bytes": loaded}
    if phase in ("record", "handed"):
        from recorders.recorder import record

        text = model.config.get_text_config(decoder=True)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, text.vocab_size, (1, context), generator=gen)
        cfg = H2OConfig(**halves(max(2, int(round(keep * context)))))
        handed = phase == "handed"
        run_id = "bench-handed" if handed else "bench-memory"
        with record(model, cfg, out=root, run_id=run_id, fsync=False, keep_prompt_pass=handed) as run:
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            out["seconds"] = time.perf_counter() - t0
        out["run_dir"] = str(run.run_dir)
        out["budget"] = cfg.describe()
        if handed:
            from recorders.replay import replay

            t0 = time.perf_counter()
            summary = replay(run.run_dir, model=model, progress=False, prompt_passes=run.prompt_passes)
            out["replay_seconds"] = time.perf_counter() - t0
            out["max_logit_diff"] = summary.max_logit_diff
            out["implementation_ok"] = summary.implementation_ok
            out["prompts_from_run"] = summary.prompts_from_run
    else:
        from recorders.replay import replay

        t0 = time.perf_counter()
        summary = replay(root, model=model, progress=False)
        out["seconds"] = time.perf_counter() - t0
        out["max_logit_diff"] = summary.max_logit_diff
        out["implementation_ok"] = summary.implementation_ok
    out["peak_bytes"] = peak_rss_bytes()
    print(json.dumps(out, default=str), flush=True)


def replay_verdict(phase: dict) -> str:
    """What a phase's line adds about its replay: nothing when it reproduced the run (or was no
    replay), else that the model, the code or the log differ (as ``h2o-lens replay`` says: a
    failed check does not tell which)."""
    if phase.get("implementation_ok", True):
        return ""
    return "; the replay does not reproduce the run: the model, the code or the log differ"


def bench_record_memory(
    model_name: str | None = None, context: int = 4096, new_tokens: int = 256, keep: float = 0.2
) -> int:
    """Generation time, replay time and peak RSS of recording one ``context``-token prompt with
    ``new_tokens`` new tokens and of replaying that run, each phase in a fresh process (one
    phase's peak cannot hide the other's).

    Prints one line per phase, then replay ÷ generation and both peaks side by side; returns 0
    when both phases ran. A third process records the same prompt as ``h2o-lens record --replay``
    does and replays it from the recording's prompt pass (DESIGN.md §6.1): its replay ÷ its
    generation is printed last.
    """
    import json
    import shutil
    import subprocess
    import sys
    import tempfile

    import torch

    check_ints("record", "context", context, 2)
    check_ints("record", "new-tokens", new_tokens, 1)
    check_keep("record", keep)
    root = tempfile.mkdtemp(prefix="h2o-lens-bench-memory-")
    try:
        env = fresh_env()
        print(
            f"record and replay, each in a fresh process: prompt {context} tokens, {new_tokens} new, keep {keep:g}, "
            f"model {model_name or 'default'}, torch {torch.__version__} on CPU ({torch.get_num_threads()} threads)"
        )
        res: dict[str, dict] = {}
        for phase in ("record", "replay", "handed"):
            target = res["record"]["run_dir"] if phase == "replay" else root
            code = (
                "from commands.benchmarks.record import _memory_phase; "
                f"_memory_phase({phase!r}, {model_name!r}, {target!r}, {context!r}, {new_tokens!r}, {keep!r})"
            )
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                print(f"{phase}: failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                return 1
            res[phase] = r = json.loads(lines[-1])
            print(_phase_line(phase, r))
        rec, rep, handed = res["record"], res["replay"], res["handed"]
        print(
            f"replay {rep['seconds']:.2f} s / generation {rec['seconds']:.2f} s: ratio "
            f"{rep['seconds'] / rec['seconds']:.3f}; peak RSS record {rec['peak_bytes'] / 2**30:.2f} GiB, "
            f"replay {rep['peak_bytes'] / 2**30:.2f} GiB"
        )
        print(
            f"record --replay (the replay starts from the recording's prompt pass): replay "
            f"{handed['replay_seconds']:.2f} s / generation {handed['seconds']:.2f} s: ratio "
            f"{handed['replay_seconds'] / handed['seconds']:.3f}"
        )
    finally:  # the runs are only measured: nothing is left behind
        shutil.rmtree(root, ignore_errors=True)
    return 0 if rep.get("implementation_ok", True) and handed.get("implementation_ok", True) else 3


def _phase_line(phase: str, r: dict) -> str:
    """One phase's line of :func:`bench_record_memory`."""
    if phase == "handed":
        what = (
            f"record --replay: generation (recorded) {r['seconds']:.2f} s, then its replay from the prompt pass "
            f"of {r['prompts_from_run']} request(s) {r['replay_seconds']:.2f} s, peak RSS of both"
        )
    else:
        what = f"{'generation (recorded)' if phase == 'record' else 'replay'} {r['seconds']:.2f} s, peak RSS"
    return (
        f"{phase:>7}: {what} {r['peak_bytes'] / 2**30:.2f} GiB (model loaded: {r['loaded_bytes'] / 2**30:.2f} GiB)"
        + (f", {r['budget']}" if "budget" in r and phase == "record" else "")
        + (f", max |logit diff| {r['max_logit_diff']:.3g}" if "max_logit_diff" in r else "")
        + replay_verdict(r)
    )


# -- a runs root of thousands of runs ---------------------------------------------------------
