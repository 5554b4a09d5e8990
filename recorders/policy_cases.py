"""Write policy-level cases (:mod:`h2o_lens.tasks.attention_cases`) as complete runs.

A case is a stack of attention logits plus a toy output model, no language
model. :func:`write_policy_case` drives the runtime's own cache
(:class:`h2o_lens.cache.H2OCache`, FP64, torch backend) with one-hot keys
``k_i = e_i`` and queries ``q_t = logits[t]`` at scaling 1, so that
``q_t·k_i = logits[t, i]`` exactly: selection, tie rules and baselines are
those of the runtime, and the eviction and step rows come from the
recorder's own listener. The teacher is full causal attention over the same
logits. Then it writes what a recorded and replayed run holds:

* ``tokens`` with the case's evidence labels, ``requests`` with the answer,
  the expected (teacher) answer and the verdict;
* ``evictions`` and ``steps`` (prefill row at step P-1, then every decode step);
* ``replay``: dropped mass of the full-cache teacher per step and query head;
* ``replay_steps``: KL(teacher ‖ run), top-1 agreement and the teacher
  log-probability of the next token, from the toy output model;
* ``run_logits`` and the manifest's ``max_logit_diff``: the run's logits
  recomputed from the candidate sets rebuilt out of the written evictions
  (as :func:`recorders.replay.replay` does) against those of the run itself.

The sequence is teacher-forced: generated positions carry the tokens the
full-cache teacher predicts (``case.token_ids``), so every policy sees the
same text and the attention pattern does not depend on the run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from h2o_lens import policies
from h2o_lens.config import H2OConfig
from h2o_lens.errors import ImplementationError
from h2o_lens.runtime import H2OSession
from h2o_lens.shape import kv_sets
from h2o_lens.tasks.attention_cases import PolicyCase
from runlog.eviction_steps import evict_steps
from runlog.manifest import read_manifest, write_manifest
from runlog.run import RunWriter
from runlog.store import load_run

from .recorder import Recording

__all__ = ["write_policy_case", "case_kept_sets"]


class _Tap:
    """Cache listener: forwards to the recorder and keeps each step's candidate sets."""

    def __init__(self, rec: Recording | None, layers: int, sets: int, n: int):
        self.rec = rec
        # cand[t][l, s, i]: position i is in the candidate set D_t of layer l, set s
        self.cand: dict[int, np.ndarray] = {}
        self.shape = (layers, sets, n)

    def _row(self, t: int) -> np.ndarray:
        if t not in self.cand:
            self.cand[t] = np.zeros(self.shape, bool)
        return self.cand[t]

    def on_prefill(self, layer: int, ev) -> None:
        if self.rec is not None:
            self.rec.on_prefill(layer, ev)
        keep = ev.keep[0].numpy()  # (Hs, P) bool
        self._row(int(ev.step[0]) + 1)[layer, :, : keep.shape[1]] = keep

    def on_decode(self, layer: int, ev) -> None:
        if self.rec is not None:
            self.rec.on_decode(layer, ev)
        step = int(ev.step[0])
        pos = ev.cand_positions[0].numpy()  # (Hs, B+1), -1 empty
        d = self._row(step)[layer]
        for s in range(pos.shape[0]):
            d[s, pos[s][pos[s] >= 0]] = True
        # the kept set after the step seeds the next candidate set
        kept = ev.kept[0].numpy()
        nxt = self._row(step + 1)[layer]
        for s in range(kept.shape[0]):
            nxt[s, kept[s][kept[s] >= 0]] = True


def _run_cache(case: PolicyCase, config: H2OConfig, rec: Recording | None) -> _Tap:
    """Prefill and decode the case through the runtime's cache (one-hot keys, scaling 1)."""
    n, p = case.n, case.prompt_len
    layers, hkv = case.layers, case.kv_heads
    sets = kv_sets(config.gqa, case.q_heads, hkv)
    shape = SimpleNamespace(num_hidden_layers=layers, num_attention_heads=case.q_heads, num_key_value_heads=hkv)
    tap = _Tap(rec, layers, sets, n + 1)
    session = H2OSession(SimpleNamespace(config=shape), config, listener=tap)
    if rec is not None:
        rec.session = session
    cache = session.new_cache()
    eye = torch.eye(n, dtype=torch.float64)
    logits = torch.as_tensor(case.logits, dtype=torch.float64)  # (L, Hkv, G, N, N)
    with torch.no_grad():
        for layer in range(layers):
            q = logits[layer, :, :, :p, :].reshape(1, case.q_heads, p, n)
            k = eye[:p].expand(1, hkv, p, n)
            cl = cache.layers[layer]
            cl.update(k, torch.zeros_like(k), kwargs={})
            cl.prefill(q, None, 1.0)
        for t in range(p, n):
            for layer in range(layers):
                q = logits[layer, :, :, t, :].reshape(1, case.q_heads, 1, n)
                k = eye[t].expand(1, hkv, 1, n)
                cl = cache.layers[layer]
                cl.update(k, torch.zeros_like(k), kwargs={})
                cl.decode(q, 1.0)
    if rec is not None:
        rec.flush()
    return tap


def _sets_of_heads(case: PolicyCase, gqa: str) -> np.ndarray:
    """KV set index of each query head ``(Hkv, G)``."""
    q = np.arange(case.q_heads).reshape(case.kv_heads, case.group)
    return q if gqa == "none" else np.broadcast_to(np.arange(case.kv_heads)[:, None], q.shape)


def case_kept_sets(case: PolicyCase, config: H2OConfig) -> dict[int, np.ndarray]:
    """Candidate sets D_t of a policy on a case, without writing anything.

    Returns
    -------
    dict step -> bool ndarray ``(L, Hs, N + 1)``
        For ``t = P .. N-1`` the candidate set D_t (the kept set after step
        t-1, plus t); for ``t = N`` the kept set after the last step. ``Hs``
        is the KV heads, or the query heads with ``gqa="none"``.
    """
    if not policies.get(config.policy).evicts:
        sets = kv_sets(config.gqa, case.q_heads, case.kv_heads)
        out = {}
        for t in range(case.prompt_len, case.n + 1):
            d = np.zeros((case.layers, sets, case.n + 1), bool)
            d[..., : t + 1] = True
            out[t] = d
        return out
    return _run_cache(case, config, None).cand


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def write_policy_case(
    root: str | os.PathLike,
    case: PolicyCase,
    heavy: int | None = None,
    recent: int | None = None,
    gqa: str = "sum",
    policy: str = "h2o",
    run_id: str | None = None,
    *,
    sink: int = 4,
    seed: int = 0,
    pinned: Sequence[int] = (),
    fsync: bool = False,
) -> Path:
    """Run ``policy`` on ``case`` in FP64 and write a complete, schema-valid run.

    Parameters
    ----------
    root : runs root; the run goes to ``<root>/<run_id>/``
    case : a :class:`~h2o_lens.tasks.attention_cases.PolicyCase`
    heavy, recent : slot counts (default: the case's own budget). Baselines
        use ``B = heavy + recent`` slots, split as in :attr:`H2OConfig.split`.
    gqa : ``"sum"``, ``"max"`` or ``"none"``
    policy : ``"h2o"``, ``"full"``, ``"local"``, ``"heavy"``, ``"sink"`` or ``"random"``
    run_id : folder name; default ``<case>-<policy>-<gqa>-h<heavy>r<recent>`` (``-pinned<k>`` added
        with ``k`` pins)
    sink : first positions kept by the ``sink`` policy
    seed : seed of the ``random`` policy
    pinned : prompt positions never evicted, inside the budget (DESIGN.md §2.11)
    fsync : make segments durable before they become visible

    Returns
    -------
    Path of the run folder.

    Rows: tokens ``N + 1``; replay_steps ``N - P + 1`` (steps ``P-1 .. N-1``);
    replay ``replay_steps × L × Hq``; steps ``L × Hs × (N - P + 1)`` (none
    for ``full``); requests 1.
    """
    heavy = case.heavy if heavy is None else heavy
    recent = case.recent if recent is None else recent
    evicts = policies.get(policy).evicts
    if not evicts:
        config = H2OConfig(policy=policy, gqa=gqa, backend="torch", seed=seed)
    else:
        config = H2OConfig(
            policy=policy, heavy=heavy, recent=recent, gqa=gqa, sink=sink, backend="torch", seed=seed, pinned=pinned
        )
    pins = f"-pinned{len(config.pinned)}" if config.pinned else ""
    run_id = run_id or f"{case.name}-{policy}-{gqa}-h{heavy}r{recent}{pins}".replace("_", "-")
    t0 = time.perf_counter()
    n, p = case.n, case.prompt_len
    gqa_none = gqa == "none"
    sets = kv_sets(config.gqa, case.q_heads, case.kv_heads)
    model = {
        "name": f"synthetic/{case.name}",
        "layers": case.layers,
        "kv_heads": case.kv_heads,
        "q_heads": case.q_heads,
        "vocab": len(case.vocab),
    }
    info = {
        "name": f"policy case {case.name} ({config.describe()})",
        "synthetic": True,
        "teacher_forced": True,
        "case": case.name,
        "case_seed": case.seed,
        "case_description": case.description,
    }
    writer = RunWriter(root, run_id, config=config.to_dict(), model=model, fsync=fsync, **info)
    writer.start()
    try:
        if not evicts:
            cand = case_kept_sets(case, config)
        else:
            rec = Recording(writer, config, None, None, None, flush_every=1 << 30, model=None)
            cand = _run_cache(case, config, rec).cand
        writer.flush()
        rebuilt = _rebuilt_sets(writer.run_dir, case, sets, gqa_none)
        stats = _write_outputs(writer, case, cand, rebuilt, gqa)
        writer.update(
            policy=config.policy,
            heavy=heavy if evicts else None,
            recent=recent if evicts else None,
            gqa=gqa,
            sink=config.sink,
            seed=seed,
            backend="torch",
            prompt_len=p,
            new_tokens=n - p + 1,
            requests=1,
            max_logit_diff=stats["max_logit_diff"],
        )
    except BaseException as exc:
        writer.close("failed", exc)
        raise
    writer.close("complete")
    _write_replay_summary(writer.run_dir, stats, time.perf_counter() - t0)
    return writer.run_dir


def _write_replay_summary(run_dir: Path, stats: dict[str, float], seconds: float) -> None:
    """The manifest's ``replay`` entry, as :func:`recorders.replay.replay` writes it."""
    manifest = read_manifest(run_dir)
    manifest["replay"] = {
        "implementation_ok": stats["max_logit_diff"] <= 1e-9,
        "tolerance": 1e-9,
        "mean_kl": stats["mean_kl"],
        "top1_agreement": stats["top1_agreement"],
        "mean_dropped_mass": stats["mean_dropped_mass"],
        "seconds": seconds,
    }
    write_manifest(run_dir, manifest)


def _rebuilt_sets(run_dir: Path, case: PolicyCase, sets: int, gqa_none: bool) -> np.ndarray:
    """``(L, Hs, N)`` eviction step of each position, read back from the written evictions."""
    ev_tab = load_run(run_dir, tables=("evictions",))["evictions"]
    cols = ("layer", "kv_head", "position", "step")
    ev = {c: np.asarray(ev_tab[c].to_numpy(zero_copy_only=False), dtype=np.int64) for c in cols}
    if gqa_none:  # a group of one query head logs no q_head: its set is the KV head's
        ev["q_head"] = np.asarray(ev_tab["q_head"].fill_null(ev_tab["kv_head"]).to_pylist(), dtype=np.int64)
    return evict_steps(ev, case.layers, sets, case.n, gqa_none)


@dataclass
class _Compared:
    """Teacher against run, per step ``P-1 .. N-1`` of a case."""

    steps: np.ndarray  # (S,)
    dropped: np.ndarray  # (S, L, Hkv, G) teacher weight the run no longer sees
    kl: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)
    t_logprob: list[float] = field(default_factory=list)
    run_top: list[int] = field(default_factory=list)
    teacher_top: list[int] = field(default_factory=list)
    lg_rows: list[tuple] = field(default_factory=list)  # (next token, its logit, top-1 logit, lse) of the run
    max_diff: float = 0.0  # run logits against those of the sets rebuilt from the evictions


def _compare(case: PolicyCase, cand: dict[int, np.ndarray], evict_step: np.ndarray, gqa: str) -> _Compared:
    """Teacher and run distributions per step (the run's and the rebuilt candidate sets)."""
    n, p = case.n, case.prompt_len
    set_of = _sets_of_heads(case, gqa)  # (Hkv, G)
    steps = np.arange(p - 1, n, dtype=np.int64)
    out = _Compared(steps, np.zeros((len(steps), case.layers, case.kv_heads, case.group)))
    for j, t in enumerate(steps):
        teacher_w = case.attention(t)  # (L, Hkv, G, t+1)
        if t < p:  # the prefill's last row: full attention in both
            run_w = rebuilt_w = teacher_w
        else:
            d = cand[t][:, :, : t + 1]  # (L, Hs, t+1)
            vis = d[:, set_of]  # (L, Hkv, G, t+1)
            run_w = case.attention(t, vis)
            alive = evict_step[:, :, : t + 1] >= t  # evicted at step t: still seen at t
            alive[..., t] = True
            rebuilt_w = case.attention(t, alive[:, set_of])
            out.dropped[j] = np.where(vis, 0.0, teacher_w).sum(-1)
        lt = case.output_logits(teacher_w)
        lr = case.output_logits(run_w)
        out.max_diff = max(out.max_diff, float(np.abs(case.output_logits(rebuilt_w) - lr).max()))
        slt, slr = _log_softmax(lt), _log_softmax(lr)
        nxt = int(case.token_ids[t + 1])
        out.kl.append(max(0.0, float((np.exp(slt) * (slt - slr)).sum())))
        out.agree.append(bool(np.argmax(lt) == np.argmax(lr)))
        out.t_logprob.append(float(slt[nxt]))
        out.run_top.append(int(np.argmax(lr)))
        out.teacher_top.append(int(np.argmax(lt)))
        out.lg_rows.append((nxt, lr[nxt], lr.max(), float(np.log(np.exp(lr - lr.max()).sum()) + lr.max())))
    return out


def _append_tokens(writer: RunWriter, case: PolicyCase) -> None:
    n, p = case.n, case.prompt_len
    writer.append(
        "tokens",
        {
            "request": np.zeros(n + 1, np.int32),
            "position": np.arange(n + 1, dtype=np.int64),
            "token_id": case.token_ids.astype(np.int32),
            "text": [case.vocab[i] for i in case.token_ids],
            "is_prompt": np.arange(n + 1) < p,
            "evidence": case.evidence_labels(),
        },
    )


def _append_replay(writer: RunWriter, case: PolicyCase, c: _Compared) -> None:
    """The replay (dropped mass per step, layer, query head) and replay_steps tables."""
    steps = c.steps
    qh = np.arange(case.q_heads)
    shape = (len(steps), case.layers, case.q_heads)
    writer.append(
        "replay",
        {
            "request": np.zeros(np.prod(shape), np.int32),
            "step": np.broadcast_to(steps[:, None, None], shape).ravel(),
            "layer": np.broadcast_to(np.arange(case.layers, dtype=np.int16)[None, :, None], shape).ravel(),
            "q_head": np.broadcast_to(qh.astype(np.int16)[None, None, :], shape).ravel(),
            "kv_head": np.broadcast_to((qh // case.group).astype(np.int16)[None, None, :], shape).ravel(),
            "dropped_mass": np.clip(c.dropped.reshape(shape), 0.0, 1.0).astype(np.float32).ravel(),
        },
    )
    writer.append(
        "replay_steps",
        {
            "request": np.zeros(len(steps), np.int32),
            "step": steps,
            "kl": np.asarray(c.kl, np.float32),
            "top1_agree": np.asarray(c.agree),
            "teacher_logprob": np.asarray(c.t_logprob, np.float32),
        },
    )


def _append_run_logits(writer: RunWriter, case: PolicyCase, c: _Compared) -> None:
    """The run's logits per step and the request row with its answer and verdict."""
    n, p = case.n, case.prompt_len
    lg = np.asarray(c.lg_rows)
    writer.append(
        "run_logits",
        {
            "request": np.zeros(len(c.steps), np.int32),
            "step": c.steps,
            "token_id": lg[:, 0].astype(np.int32),
            "token_logit": lg[:, 1].astype(np.float32),
            "top1_id": np.asarray(c.run_top, np.int32),
            "top1_logit": lg[:, 2].astype(np.float32),
            "lse": lg[:, 3].astype(np.float32),
        },
    )
    a = case.answer_step - (p - 1)
    writer.append(
        "requests",
        {
            "request": np.zeros(1, np.int32),
            "prompt_len": np.array([p]),
            "new_tokens": np.array([n - p + 1]),
            "answer": [case.vocab[c.run_top[a]].strip()],
            "task": [case.name],
            "expected": [case.vocab[c.teacher_top[a]].strip()],
            "correct": [c.run_top[a] == c.teacher_top[a]],
        },
    )


def _write_outputs(
    writer: RunWriter, case: PolicyCase, cand: dict[int, np.ndarray], evict_step: np.ndarray, gqa: str
) -> dict[str, float]:
    """Teacher and run distributions per step; tokens, replay, replay_steps, run_logits, requests."""
    c = _compare(case, cand, evict_step, gqa)
    _append_tokens(writer, case)
    _append_replay(writer, case, c)
    _append_run_logits(writer, case, c)
    if c.max_diff > 1e-9:
        raise ImplementationError(
            f"policy case {case.name}: the candidate sets rebuilt from the written evictions give "
            f"logits {c.max_diff:.3g} away from the run's own; the eviction rows are inconsistent"
        )
    return {
        "max_logit_diff": c.max_diff,
        "mean_kl": float(np.mean(c.kl)),
        "top1_agreement": float(np.mean(c.agree)),
        "mean_dropped_mass": float(c.dropped.mean()),
    }
