"""A synthetic runs root of many small runs: ``python -m runlog.synthetic_root ROOT [--runs N]``.

Used by the large-root benchmark (``h2o-lens bench runs``) and its tests.
Every run is written through :class:`runlog.run.RunWriter` with the rows
of :func:`runlog.synthetic.synthetic_tables`, so the catalog reads it
as any recorded run: a mix of policies, budgets, GQA aggregations and
tasks; each run holds a few requests with answer-checker verdicts, its
eviction and step logs, tokens and replay tables. About 1 % of the runs
are ``failed`` and 1 % ``interrupted`` (left ``running`` by a writer that
is gone). Same arguments, same rows; ``created_at`` comes from the clock.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from h2o_lens import policies as registry

from .manifest import read_manifest, write_manifest
from .run import RunWriter
from .schema import table_schema
from .synthetic import synthetic_tables

__all__ = ["make_root", "POLICIES", "TASKS", "main"]

POLICIES = (registry.DEFAULT, *registry.baselines()[:2])
TASKS = ("needle", "kv-lookup", "delayed-ref", "restated", "var-track", "topic-switch")
_BUDGETS = ((4, 4), (8, 8), (12, 12), (16, 16))
_GQA = ("sum", "max")
#: pid of the writer of an interrupted run: above Linux's pid_max, so no process has it
_GONE_PID = 2**22 + 1


def _requests_table(run_id: str, rng: np.random.Generator, n: int, prompt_len: int, steps: int, budget) -> pa.Table:
    correct = rng.random(n) < 0.7
    task = TASKS[int(rng.integers(len(TASKS)))]
    cols = {
        "run_id": [run_id] * n,
        "request": np.arange(n, dtype=np.int32),
        "prompt_len": np.full(n, prompt_len, np.int64),
        "new_tokens": np.full(n, steps, np.int64),
        "answer": ["42" if c else "17" for c in correct],
        "task": [task] * n,
        "expected": ["42"] * n,
        "correct": correct,
        "heavy": np.full(n, budget[0], np.int32),
        "recent": np.full(n, budget[1], np.int32),
        "prompt_index": np.arange(n, dtype=np.int32),
        "sample_index": np.zeros(n, np.int32),
    }
    schema = table_schema("requests")
    return pa.Table.from_arrays([pa.array(cols[f.name], type=f.type) for f in schema], schema=schema)


def make_root(
    root: str | os.PathLike,
    runs: int = 5000,
    *,
    seed: int = 0,
    requests: int = 2,
    layers: int = 2,
    kv_heads: int = 1,
    steps: int = 8,
    prompt_len: int = 32,
    failed_every: int = 97,
    interrupted_every: int = 89,
) -> Path:
    """Write ``runs`` small valid runs under ``root`` (created; must not hold them already).

    Parameters
    ----------
    runs : int
        Run folders to write, ``syn-00000`` .. ``syn-<runs-1>``.
    seed : int
        Same seed, same rows.
    requests, layers, kv_heads, steps, prompt_len : int
        Shape of each run (see :func:`runlog.synthetic.write_synthetic_run`).
    failed_every, interrupted_every : int
        Every n-th run is ``failed`` / left ``running`` by a writer that is gone.

    Returns
    -------
    Path
        The root.
    """
    for name, value in (("runs", runs), ("failed_every", failed_every), ("interrupted_every", interrupted_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    width = max(5, len(str(runs - 1)))
    for i in range(runs):
        run_id = f"syn-{i:0{width}d}"
        policy = POLICIES[i % len(POLICIES)]
        budget = _BUDGETS[(i // len(POLICIES)) % len(_BUDGETS)]
        gqa = _GQA[(i // (len(POLICIES) * len(_BUDGETS))) % len(_GQA)]
        run_seed = int(rng.integers(2**31))
        data = synthetic_tables(
            run_id,
            layers=layers,
            kv_heads=kv_heads,
            q_heads=2 * kv_heads,
            steps=steps,
            prompt_len=prompt_len,
            seed=run_seed,
            heavy=budget[0],
            recent=budget[1],
            requests=requests,
        )
        config = {
            "policy": policy,
            "heavy": budget[0],
            "recent": budget[1],
            "gqa": gqa,
            "sink": 4,
            "seed": run_seed,
            "backend": "torch",
            "synthetic": True,
        }
        writer = RunWriter(
            root,
            run_id,
            config=config,
            model={"name": "synthetic/llama", "layers": layers, "kv_heads": kv_heads, "q_heads": 2 * kv_heads},
            fsync=False,
            prompt_len=prompt_len,
            new_tokens=steps,
            requests=requests,
            name=f"{TASKS[i % len(TASKS)]} {policy} {sum(budget)}",
            task=TASKS[i % len(TASKS)],
            keep_ratio=round(sum(budget) / prompt_len, 4),
            seconds_per_token=float(0.01 + 0.002 * rng.random()),
        )
        writer.start()
        for name, parts in data.items():
            table = pa.concat_tables([p for p in parts if p.num_rows]) if any(p.num_rows for p in parts) else None
            if table is not None:
                writer.write_table(name, table)
        writer.write_table("requests", _requests_table(run_id, rng, requests, prompt_len, steps, budget))
        if i % interrupted_every == interrupted_every - 1:
            writer.segments.close()
            manifest = read_manifest(writer.run_dir)
            manifest["writer"] = dict(manifest["writer"], pid=_GONE_PID, start_ticks=1)
            write_manifest(writer.run_dir, manifest)
            continue
        failed = i % failed_every == failed_every - 1
        writer.close("failed" if failed else "complete", "synthetic failure" if failed else None)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runlog.synthetic_root", description=__doc__.splitlines()[0])
    p.add_argument("root", help="runs root to write (created)")
    p.add_argument("--runs", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    make_root(args.root, args.runs, seed=args.seed)
    print(f"{args.runs} runs written to {args.root} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
