"""Deterministic synthetic runs: schema-valid logs with plausible values, no model.

Used by benchmarks, app tests and documentation examples. The eviction
stream follows the H2O bookkeeping loosely but consistently: the prefill
keeps the ``recent`` last positions and ``heavy`` others; at each decode
step the token leaving the recent window is promoted when its score beats
the heavy threshold (then a heavy slot's occupant is evicted) or evicted
itself. Positions never return once evicted, ``age = step - position``,
``margin >= 0``, and the promotion rate decays on some heads (cache
freezing). Everything is vectorised over heads and steps.

With ``evictions_per_step = k > 1`` each logged step stands for a chunk of
``k`` new tokens that each evict one position (a load-test knob; H2O itself
evicts one per step).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .run import RunWriter
from .schema import TABLE_NAMES, repeat_string, table_schema

__all__ = ["write_synthetic_run", "synthetic_tables"]

_WORDS = pa.array(
    [
        "the",
        " cache",
        " key",
        " value",
        " token",
        " heavy",
        " hitter",
        " recent",
        " window",
        " score",
        " layer",
        " head",
        " attention",
        " evidence",
        " answer",
        " is",
        " of",
        " and",
        ",",
        ".",
    ]
)
_PHASES = pa.array(["prefill", "decode"])
_VOCAB = 49152
_NEEDLE = "needle"


def _table(name: str, run_id: str, n: int, columns: dict[str, Any]) -> pa.Table:
    schema = table_schema(name)
    arrays = []
    for field in schema:
        value = columns.get(field.name)
        if field.name == "run_id":
            arrays.append(repeat_string(run_id, n))
        elif isinstance(value, pa.Array):
            arrays.append(value)
        elif value is not None:
            arrays.append(pa.array(value, type=field.type))
        else:
            arrays.append(pa.nulls(n, field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _prev_occupants(promoted: np.ndarray, slot: np.ndarray, exits: np.ndarray, init: np.ndarray) -> np.ndarray:
    """Position evicted by each promotion: the previous occupant of the chosen heavy slot.

    promoted, slot: (G, M); exits: (M,) position entering the slot; init: (G, H).
    Returns (G, M) victims (undefined where not promoted).
    """
    g_count, m = promoted.shape
    h = init.shape[1]
    flat = np.flatnonzero(promoted)  # event order: head, then time
    key = (flat // m) * h + slot.ravel()[flat]  # (head, slot)
    order = np.argsort(key, kind="stable")  # group by slot, keep time order
    skey, sflat = key[order], flat[order]
    first = np.ones(len(skey), bool)
    first[1:] = skey[1:] != skey[:-1]
    prev = np.empty(len(skey), np.int64)
    prev[first] = init.ravel()[skey[first]]
    prev[~first] = exits[(sflat % m)[np.flatnonzero(~first) - 1]]
    victims = np.zeros(g_count * m, np.int64)
    victims[sflat] = prev
    return victims.reshape(g_count, m)


@dataclass
class _Stream:
    """The eviction stream of one request, per (layer, KV head) ``G`` and sub-step ``M``."""

    layer_of: np.ndarray  # (G,) layer of each stream
    head_of: np.ndarray  # (G,) KV head of each stream
    init: np.ndarray  # (G, H) heavy positions kept by the prefill
    pre: dict | None  # prefill victims: pos, score, margin (G, P - R - H); None if none
    t: np.ndarray  # (M,) sub-steps
    exits: np.ndarray  # (M,) position leaving the recent window
    logged: np.ndarray  # (M,) step column
    thr: np.ndarray  # (G, M) min heavy score
    promoted: np.ndarray  # (G, M) the exiting token took a heavy slot
    victim: np.ndarray  # (G, M) position evicted
    score: np.ndarray  # (G, M)
    margin: np.ndarray  # (G, M)


def _prefill(
    rng: np.random.Generator, scale: np.ndarray, prompt_len: int, heavy: int, recent: int
) -> tuple[np.ndarray, dict | None, int]:
    """Keep the recent tail and the top-``heavy`` of the rest: (kept heavy, victims, first sub-step)."""
    g_count, big_p = len(scale), prompt_len
    n_old = big_p - recent
    if big_p <= heavy + recent:
        return np.broadcast_to(np.arange(heavy), (g_count, heavy)).copy(), None, heavy + recent
    pos = np.arange(n_old)
    key = rng.lognormal(0.0, 0.8, (g_count, n_old)) * np.log1p(big_p - pos) * scale[:, None]
    order = np.argsort(-key, axis=1, kind="stable")  # (G, n_old)
    init = np.sort(order[:, :heavy], axis=1)  # (G, H) kept
    gone = order[:, heavy:]  # (G, n_old - H)
    thr0 = np.take_along_axis(key, order[:, heavy - 1 : heavy], 1)  # (G, 1) lowest kept
    pre_score = np.take_along_axis(key, gone, 1)
    return init, {"pos": gone, "score": pre_score, "margin": thr0 - pre_score}, big_p


def _stream(
    rng: np.random.Generator,
    *,
    layers: int,
    kv_heads: int,
    steps: int,
    prompt_len: int,
    heavy: int,
    recent: int,
    k: int,
) -> _Stream:
    """Prefill, then at each sub-step promote the exiting token if it beats the heavy threshold."""
    g_count, big_p = layers * kv_heads, prompt_len
    layer_of = np.repeat(np.arange(layers, dtype=np.int16), kv_heads)  # (G,)
    head_of = np.tile(np.arange(kv_heads, dtype=np.int16), layers)  # (G,)
    scale = rng.lognormal(0.0, 0.3, g_count)  # (G,)
    init, pre, t_start = _prefill(rng, scale, prompt_len, heavy, recent)
    t = np.arange(t_start, big_p + steps * k)  # (M,) sub-steps
    exits = t - recent  # (M,)
    m = len(t)
    logged = big_p - 1 + ((t - big_p) // k + 1) * k  # (M,) step column
    frac = np.arange(m) / max(m, 1)
    drift = rng.uniform(0.0, 1.8, g_count)[:, None]
    mu = rng.normal(0.1, 0.2, g_count)[:, None] - drift * frac  # (G, M)
    thr = scale[:, None] * (1.0 + np.log1p(t / big_p))[None, :] * 2.0  # (G, M) min heavy
    ratio = np.exp(mu + rng.normal(0.0, 0.6, (g_count, m)))
    promoted = ratio > 1.0
    slot = rng.integers(0, heavy, (g_count, m))
    victim = np.where(promoted, _prev_occupants(promoted, slot, exits, init), exits)
    gap = rng.exponential(0.05, (g_count, m))
    score = np.where(promoted, thr, thr * ratio)
    margin = np.where(promoted, thr * np.minimum(ratio - 1.0, gap), thr * (1.0 - ratio))
    return _Stream(layer_of, head_of, init, pre, t, exits, logged, thr, promoted, victim, score, margin)


def _evictions(st: _Stream, request: int, prompt_len: int) -> dict[str, Any]:
    """Evictions rows: the prefill's victims, then one per sub-step, per stream."""
    g_count, m = st.promoted.shape
    parts = {
        "step": [np.broadcast_to(st.logged, (g_count, m))],
        "position": [st.victim],
        "score": [st.score],
        "margin": [st.margin],
        "left_recent": [~st.promoted],
        "phase": [np.ones((g_count, m), np.int8)],
    }
    if st.pre is not None:
        pre = st.pre
        n_pre = pre["pos"].shape[1]
        for name, value in (
            ("step", np.full((g_count, n_pre), prompt_len - 1)),
            ("position", pre["pos"]),
            ("score", pre["score"]),
            ("margin", pre["margin"]),
            ("left_recent", np.zeros_like(pre["pos"], bool)),
            ("phase", np.zeros((g_count, n_pre), np.int8)),
        ):
            parts[name].insert(0, value)
    cols = {name: np.concatenate(v, axis=1).ravel() for name, v in parts.items()}
    per_head = cols["step"].size // g_count
    cols["step"] = cols["step"].astype(np.int64)
    cols["position"] = cols["position"].astype(np.int64)
    cols["age"] = cols["step"] - cols["position"]
    cols["score"] = cols["score"].astype(np.float32)
    cols["margin"] = np.maximum(cols["margin"], 0.0).astype(np.float32)
    cols["layer"] = np.repeat(st.layer_of, per_head)
    cols["kv_head"] = np.repeat(st.head_of, per_head)
    cols["request"] = np.full(cols["step"].size, request, np.int32)
    cols["phase"] = _PHASES.take(pa.array(cols["phase"]))
    return cols


def _steps(st: _Stream, request: int, step_rows: np.ndarray, heavy: int, recent: int) -> dict[str, Any]:
    """Steps rows at the logged sub-steps ``step_rows``, per stream."""
    g_count = len(st.layer_of)
    heavy_sum = st.init.sum(axis=1)[:, None] + np.cumsum(np.where(st.promoted, st.exits - st.victim, 0), 1)
    sel = (slice(None), step_rows)
    n = g_count * len(step_rows)
    return {
        "request": np.full(n, request, np.int32),
        "step": np.broadcast_to(st.logged[step_rows], (g_count, len(step_rows))).ravel(),
        "layer": np.repeat(st.layer_of, len(step_rows)),
        "kv_head": np.repeat(st.head_of, len(step_rows)),
        "min_heavy_score": st.thr[sel].ravel().astype(np.float32),
        "promoted": st.promoted[sel].ravel(),
        "exiting_position": np.broadcast_to(st.exits[step_rows], (g_count, len(step_rows))).ravel(),
        "kept": np.full(n, heavy + recent, np.int32),
        "heavy_age_mean": (st.t[step_rows][None, :] - heavy_sum[sel] / heavy).ravel().astype(np.float32),
    }


def _replay(
    rng: np.random.Generator, request: int, step_values: np.ndarray, layers: int, kv_heads: int, q_heads: int
) -> dict[str, Any]:
    """Replay rows: a dropped mass per step, layer and query head."""
    steps = len(step_values)
    group = q_heads // kv_heads
    n = steps * layers * q_heads
    shape = (steps, layers, q_heads)
    mass = rng.beta(0.6, 12.0, shape)
    return {
        "request": np.full(n, request, np.int32),
        "step": np.broadcast_to(step_values[:, None, None], shape).ravel(),
        "layer": np.broadcast_to(np.arange(layers, dtype=np.int16)[None, :, None], shape).ravel(),
        "q_head": np.broadcast_to(np.arange(q_heads, dtype=np.int16)[None, None, :], shape).ravel(),
        "kv_head": np.broadcast_to((np.arange(q_heads) // group).astype(np.int16)[None, None, :], shape).ravel(),
        "dropped_mass": np.clip(mass, 0.0, 1.0).astype(np.float32).ravel(),
    }


def _replay_steps(rng: np.random.Generator, request: int, step_values: np.ndarray) -> dict[str, Any]:
    """Replay_steps rows: KL, top-1 agreement and teacher log-probability per step."""
    steps = len(step_values)
    kl = rng.lognormal(-4.0, 1.5, steps)
    return {
        "request": np.full(steps, request, np.int32),
        "step": step_values,
        "kl": kl.astype(np.float32),
        "top1_agree": (kl < 0.2) & (rng.random(steps) > 0.03),
        "teacher_logprob": (-rng.exponential(0.8, steps)).astype(np.float32),
    }


def _tokens(rng: np.random.Generator, request: int, n_pos: int, prompt_len: int) -> dict[str, Any]:
    """Tokens rows: random ids, a short evidence span in the prompt's first half."""
    big_p = prompt_len
    token_id = rng.integers(0, _VOCAB, n_pos).astype(np.int32)
    span = max(1, min(8, big_p // 4))
    start = int(rng.integers(0, max(1, big_p // 2)))
    in_span = (np.arange(n_pos) >= start) & (np.arange(n_pos) < start + span)
    evidence = pa.array([_NEEDLE]).take(pa.array(np.zeros(n_pos, np.int8), mask=~in_span))
    return {
        "request": np.full(n_pos, request, np.int32),
        "position": np.arange(n_pos, dtype=np.int64),
        "token_id": token_id,
        "text": _WORDS.take(pa.array(token_id % len(_WORDS))),
        "is_prompt": np.arange(n_pos) < big_p,
        "evidence": evidence,
    }


def _request_tables(
    rng: np.random.Generator,
    *,
    request: int,
    layers: int,
    kv_heads: int,
    q_heads: int,
    steps: int,
    prompt_len: int,
    heavy: int,
    recent: int,
    k: int,
    wanted: set[str],
) -> dict[str, dict[str, Any]]:
    """Columns of the ``wanted`` tables of one request (random draws in a fixed order)."""
    st = _stream(
        rng, layers=layers, kv_heads=kv_heads, steps=steps, prompt_len=prompt_len, heavy=heavy, recent=recent, k=k
    )
    out: dict[str, dict[str, Any]] = {}
    if "evictions" in wanted:
        out["evictions"] = _evictions(st, request, prompt_len)
    m = len(st.t)
    step_rows = np.flatnonzero((st.t - prompt_len) % k == k - 1) if m else np.zeros(0, np.int64)
    if "steps" in wanted and len(step_rows):
        out["steps"] = _steps(st, request, step_rows, heavy, recent)
    step_values = prompt_len - 1 + k * np.arange(1, steps + 1)  # (S,)
    if "replay" in wanted and steps:
        out["replay"] = _replay(rng, request, step_values, layers, kv_heads, q_heads)
    if "replay_steps" in wanted and steps:
        out["replay_steps"] = _replay_steps(rng, request, step_values)
    if "tokens" in wanted:
        out["tokens"] = _tokens(rng, request, prompt_len + steps * k, prompt_len)
    return out


def synthetic_tables(
    run_id: str,
    *,
    layers: int = 4,
    kv_heads: int = 2,
    q_heads: int | None = None,
    steps: int = 64,
    prompt_len: int = 128,
    seed: int = 0,
    evictions_per_step: int = 1,
    heavy: int | None = None,
    recent: int | None = None,
    requests: int = 1,
    tables: Iterable[str] = TABLE_NAMES,
) -> dict[str, list[pa.Table]]:
    """Synthetic tables of one run in memory, one table per request (see :func:`write_synthetic_run`)."""
    q_heads = 3 * kv_heads if q_heads is None else q_heads
    heavy = max(1, prompt_len // 4) if heavy is None else heavy
    recent = max(1, prompt_len // 4) if recent is None else recent
    for name, value in (
        ("layers", layers),
        ("kv_heads", kv_heads),
        ("q_heads", q_heads),
        ("heavy", heavy),
        ("recent", recent),
        ("requests", requests),
        ("evictions_per_step", evictions_per_step),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for name, value in (("steps", steps), ("prompt_len", prompt_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads}")
    wanted = set(tables)
    unknown = wanted - set(TABLE_NAMES)
    if unknown:
        raise ValueError(f"unknown tables {sorted(unknown)}; expected some of {', '.join(TABLE_NAMES)}")
    rng = np.random.default_rng(seed)
    out: dict[str, list[pa.Table]] = {t: [] for t in TABLE_NAMES if t in wanted}
    for request in range(requests):
        cols = _request_tables(
            rng,
            request=request,
            layers=layers,
            kv_heads=kv_heads,
            q_heads=q_heads,
            steps=steps,
            prompt_len=prompt_len,
            heavy=heavy,
            recent=recent,
            k=evictions_per_step,
            wanted=wanted,
        )
        for name in out:
            columns = cols.get(name)
            out[name].append(
                _table(name, run_id, len(columns["request"]), columns) if columns else table_schema(name).empty_table()
            )
    return out


def write_synthetic_run(
    root: str | os.PathLike,
    run_id: str,
    *,
    layers: int = 4,
    kv_heads: int = 2,
    q_heads: int | None = None,
    steps: int = 64,
    prompt_len: int = 128,
    seed: int = 0,
    evictions_per_step: int = 1,
    heavy: int | None = None,
    recent: int | None = None,
    requests: int = 1,
    policy: str = "h2o",
    gqa: str = "sum",
    tables: Iterable[str] = TABLE_NAMES,
    rows_per_segment: int = 2_000_000,
    status: str = "complete",
    model: str = "synthetic/llama",
    fsync: bool = True,
) -> Path:
    """Write a deterministic synthetic run to ``<root>/<run_id>/``.

    Parameters
    ----------
    layers, kv_heads, q_heads : int
        Model shape; ``q_heads`` defaults to ``3 * kv_heads`` (GQA groups of 3).
    steps : int
        Logged decode steps per request.
    prompt_len : int
        Prompt tokens; the prefill evicts when it exceeds ``heavy + recent``.
    seed : int
        Same seed and arguments give the same rows.
    evictions_per_step : int
        Evictions per (step, layer, KV head); see the module docstring.
    heavy, recent : int, optional
        Slot counts, default ``prompt_len // 4`` each.
    requests : int
        Requests (batch rows) in the run.
    tables : iterable of str
        Tables to write (default all).
    rows_per_segment : int
        Rows per Parquet segment.
    status : {"complete", "failed", "running"}
        Final manifest status; ``running`` leaves the manifest as a live
        writer would (it reads as ``interrupted`` once this process ends).

    Returns
    -------
    Path
        The run folder.

    Rows per request: evictions ``layers * kv_heads * (prefill victims +
    steps * evictions_per_step)``, steps ``layers * kv_heads * steps``,
    replay ``layers * q_heads * steps``, replay_steps ``steps``, tokens
    ``prompt_len + steps * evictions_per_step``.
    """
    if status not in ("complete", "failed", "running"):
        raise ValueError(f"status must be complete, failed or running, got {status!r}")
    q_heads = 3 * kv_heads if q_heads is None else q_heads
    heavy = max(1, prompt_len // 4) if heavy is None else heavy
    recent = max(1, prompt_len // 4) if recent is None else recent
    data = synthetic_tables(
        run_id,
        layers=layers,
        kv_heads=kv_heads,
        q_heads=q_heads,
        steps=steps,
        prompt_len=prompt_len,
        seed=seed,
        evictions_per_step=evictions_per_step,
        heavy=heavy,
        recent=recent,
        requests=requests,
        tables=tables,
    )
    run = RunWriter(
        root,
        run_id,
        config=_config(policy, heavy, recent, gqa, seed, evictions_per_step),
        model={"name": model, "layers": layers, "kv_heads": kv_heads, "q_heads": q_heads},
        rows_per_segment=rows_per_segment,
        fsync=fsync,
        prompt_len=prompt_len,
        new_tokens=steps * evictions_per_step,
        requests=requests,
        name=f"synthetic {policy} seed {seed}",
    )
    run.start()
    _write_tables(run, data, rows_per_segment)
    if status == "running":
        return run.run_dir
    run.close(status, "synthetic failure" if status == "failed" else None)
    return run.run_dir


def _config(policy: str, heavy: int, recent: int, gqa: str, seed: int, evictions_per_step: int) -> dict[str, Any]:
    """The manifest's ``config`` of a synthetic run."""
    return {
        "policy": policy,
        "heavy": heavy,
        "recent": recent,
        "gqa": gqa,
        "sink": 4,
        "seed": seed,
        "backend": "torch",
        "synthetic": True,
        "evictions_per_step": evictions_per_step,
    }


def _write_tables(run: RunWriter, data: dict[str, list[Any]], rows_per_segment: int) -> None:
    """Every table part, in segments of at most ``rows_per_segment`` rows (empty parts write nothing)."""
    for name, parts in data.items():
        for part in parts:
            for start in range(0, part.num_rows, rows_per_segment):
                run.write_table(name, part.slice(start, rows_per_segment))
