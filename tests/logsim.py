"""A plain-numpy H2O simulator that writes schema-valid runs, for the analyses tests.

It follows DESIGN.md §2 (candidates D = C ∪ {t}, softmax over D, scores
aggregated over the query heads of a KV set, evict the lowest score outside
the recent window, ties evict the older position; prefill keeps the recent
tail and the top-``heavy`` of the rest, ties keep the newer) on given
full-cache attention rows, so every logged number has an independent
ground truth: the candidate sets, the dropped mass and the scores.

Also the hand-written runs of the tests (``write_run``). The simulator's own
tests are in ``test_analyses_sim.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runlog import RunWriter


def random_attention(
    rng: np.random.Generator,
    layers: int,
    q_heads: int,
    n: int,
    sharp: float = 2.0,
    recency: float = 5.0,
    tau: float = 4.0,
) -> np.ndarray:
    """Causal attention rows ``(L, Hq, N, N)``: row ``t`` sums to 1 over ``i <= t``.

    Logits are a per-head salience of each key, a recency bonus
    ``recency * exp(-(t - i) / tau)`` and noise, so that heavy hitters form
    and new tokens are sometimes promoted.
    """
    salience = rng.normal(0.0, sharp, (layers, q_heads, 1, n))
    t, i = np.arange(n)[:, None], np.arange(n)[None, :]
    logits = salience + rng.normal(0.0, 1.0, (layers, q_heads, n, n)) + recency * np.exp(-np.clip(t - i, 0, None) / tau)
    logits = np.where(i <= t, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


@dataclass
class SimRun:
    """Everything a simulated run logged, plus the ground truth behind it."""

    evictions: dict[str, list] = field(
        default_factory=lambda: {
            k: []
            for k in (
                "request",
                "step",
                "layer",
                "kv_head",
                "q_head",
                "position",
                "score",
                "margin",
                "age",
                "left_recent",
                "phase",
            )
        }
    )
    steps: dict[str, list] = field(
        default_factory=lambda: {
            k: []
            for k in (
                "request",
                "step",
                "layer",
                "kv_head",
                "q_head",
                "min_heavy_score",
                "promoted",
                "exiting_position",
                "kept",
                "heavy_age_mean",
            )
        }
    )
    replay: dict[str, list] = field(
        default_factory=lambda: {k: [] for k in ("request", "step", "layer", "q_head", "kv_head", "dropped_mass")}
    )
    #: candidate set D_t per (request, layer, kv_head, q_head or -1, step)
    sets: dict[tuple[int, int, int, int, int], frozenset[int]] = field(default_factory=dict)
    #: scores of the kept positions after each step, same keys
    scores: dict[tuple[int, int, int, int, int], dict[int, float]] = field(default_factory=dict)


def _agg(w: np.ndarray, gqa: str) -> np.ndarray:
    return w.max(0) if gqa == "max" else w.sum(0)


def h2o_log_from_attention(
    att: np.ndarray,
    *,
    prompt_len: int,
    heavy: int,
    recent: int,
    kv_heads: int,
    gqa: str = "sum",
    request: int = 0,
    out: SimRun | None = None,
) -> SimRun:
    """Run H2O over attention rows ``att (L, Hq, N, N)`` and log it like the recorder."""
    out = out or SimRun()
    layers, hq, n, _ = att.shape
    group = hq // kv_heads
    budget, p = heavy + recent, prompt_len
    sets = (
        [(h, None, list(range(h * group, (h + 1) * group))) for h in range(kv_heads)]
        if gqa != "none"
        else [(q // group, q, [q]) for q in range(hq)]
    )
    for layer in range(layers):
        for kv, qh, qs in sets:
            key = (request, layer, kv, -1 if qh is None else qh)
            _one_set(att[layer, qs], out, key, p, heavy, recent, budget, gqa, n)
    return out


def _log_eviction(
    out: SimRun, key: tuple, step: int, pos: int, score: float, margin: float, left_recent: bool, phase: str
) -> None:
    request, layer, kv, qh = key
    for name, value in (
        ("request", request),
        ("step", step),
        ("layer", layer),
        ("kv_head", kv),
        ("q_head", None if qh < 0 else qh),
        ("position", pos),
        ("score", score),
        ("margin", margin),
        ("age", step - pos),
        ("left_recent", left_recent),
        ("phase", phase),
    ):
        out.evictions[name].append(value)


def _one_set(
    a: np.ndarray, out: SimRun, key: tuple, p: int, heavy: int, recent: int, budget: int, gqa: str, n: int
) -> None:
    """One KV set: ``a (G, N, N)`` are the rows of its query heads."""
    request, layer, kv, qh = key
    agg = _agg(a[:, :p, :p], gqa)  # (P, P) aggregated full causal weights
    score = {i: float(agg[i:, i].sum()) for i in range(p)}  # prefill: column sums
    kept = list(range(p))
    if p > budget:
        rec = list(range(p - recent, p))
        rest = sorted(range(p - recent), key=lambda i: (-score[i], -i))
        keep_h, gone = rest[:heavy], rest[heavy:]
        low = min(score[i] for i in keep_h) if keep_h else float("nan")
        for i in sorted(gone):
            _log_eviction(out, key, p - 1, i, score[i], low - score[i], False, "prefill")
        kept = sorted(keep_h + rec)
    out.sets[key + (p - 1,)] = frozenset(range(p))
    out.scores[key + (p - 1,)] = {i: score[i] for i in kept}
    _log_replay(out, key, a, p - 1, set(range(p)), kv)
    for t in range(p, n):
        d = kept + [t]
        out.sets[key + (t,)] = frozenset(d)
        _log_replay(out, key, a, t, set(d), kv)
        w = a[:, t, d] / a[:, t, d].sum(-1, keepdims=True)  # (G, |D|) renormalised over D
        for i, inc in zip(d, _agg(w, gqa)):
            score[i] = score.get(i, 0.0) + float(inc)
        eligible = [i for i in d if i <= t - recent]
        victim = None
        if len(d) > budget:
            victim = min(eligible, key=lambda i: (score[i], i))
            survivors = [i for i in eligible if i != victim]
            low = min(score[i] for i in survivors) if survivors else float("nan")
            _log_eviction(out, key, t, victim, score[victim], low - score[victim], victim == t - recent, "decode")
            d = [i for i in d if i != victim]
        heavy_now = [i for i in d if i <= t - recent]
        exiting = t - recent if t - recent >= 0 else None
        row = {
            "request": request,
            "step": t,
            "layer": layer,
            "kv_head": kv,
            "q_head": None if qh < 0 else qh,
            "min_heavy_score": min(score[i] for i in heavy_now) if heavy_now else None,
            "promoted": None if exiting is None else exiting != victim,
            "exiting_position": exiting,
            "kept": len(d),
            "heavy_age_mean": float(np.mean([t - i for i in heavy_now])) if heavy_now else None,
        }
        for name, value in row.items():
            out.steps[name].append(value)
        out.scores[key + (t,)] = {i: score[i] for i in d}
        kept = d


def _log_replay(out: SimRun, key: tuple, a: np.ndarray, t: int, d: set[int], kv: int) -> None:
    request, layer, _, qh = key
    group = a.shape[0]
    heads = [qh] if qh >= 0 else [kv * group + g for g in range(group)]
    for g, q in enumerate(heads):
        dropped = float(sum(a[g, t, i] for i in range(t + 1) if i not in d))
        for name, value in (
            ("request", request),
            ("step", t),
            ("layer", layer),
            ("q_head", q),
            ("kv_head", kv),
            ("dropped_mass", dropped),
        ):
            out.replay[name].append(value)


def _clean(columns: dict[str, list]) -> dict[str, Any]:
    out = {}
    for name, values in columns.items():
        if any(v is None for v in values):
            out[name] = values  # pyarrow keeps the nulls
        else:
            out[name] = np.asarray(values)
    return out


def write_run(
    root,
    run_id: str,
    *,
    tokens: dict[str, Any],
    evictions: dict[str, Any] | None = None,
    steps: dict[str, Any] | None = None,
    replay: dict[str, Any] | None = None,
    replay_steps: dict[str, Any] | None = None,
    heavy: int = 3,
    recent: int = 3,
    gqa: str = "sum",
    policy: str = "h2o",
    prompt_len: int | None = None,
    new_tokens: int | None = None,
    **info: Any,
) -> str:
    """Write one run with :class:`runlog.RunWriter` from column dicts."""
    config = {"policy": policy, "heavy": heavy, "recent": recent, "gqa": gqa}
    if prompt_len is None:
        prompt_len = int(np.sum(tokens["is_prompt"]))
    if new_tokens is None:
        new_tokens = int(len(tokens["is_prompt"]) - np.sum(tokens["is_prompt"]))
    with RunWriter(
        root,
        run_id,
        config=config,
        model={"name": "sim/llama"},
        fsync=False,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        **info,
    ) as run:
        for name, cols in (
            ("tokens", tokens),
            ("evictions", evictions),
            ("steps", steps),
            ("replay", replay),
            ("replay_steps", replay_steps),
        ):
            if cols is not None and len(next(iter(cols.values()))):
                run.append(name, _clean(cols) if isinstance(next(iter(cols.values())), list) else cols)
    return run_id


def tokens_for(n: int, prompt_len: int, request: int = 0, evidence: dict[int, str] | None = None) -> dict[str, list]:
    evidence = evidence or {}
    return {
        "request": [request] * n,
        "position": list(range(n)),
        "token_id": [(7 * i + 3) % 101 for i in range(n)],
        "text": [f"t{i}" for i in range(n)],
        "is_prompt": [i < prompt_len for i in range(n)],
        "evidence": [evidence.get(i) for i in range(n)],
    }


def sim_tables(sim: SimRun) -> dict[str, dict[str, list]]:
    return {"evictions": sim.evictions, "steps": sim.steps, "replay": sim.replay}


# -- the simulator itself ---------------------------------------------------------------
