"""Replay a recorded run against a full-cache teacher (DESIGN.md §3, §6).

For each request, one prompt pass and two passes over the generated rows
(DESIGN.md §6.1):

* the **prompt**: the run's prefill attends fully, so the prompt rows are the
  same for teacher and run. One forward computes them, keeps their keys and
  values in a cache for both passes below and the column sums of their
  weights (the oracle's teacher score up to the prompt's last step);
* the **teacher**: the generated rows with full causal attention. One pass
  over each block of score tiles gives the attention output, the dropped
  mass per step and query head (the teacher weight on positions the run no
  longer held) and the oracle columns, never storing N×N; its logits give
  KL(teacher ‖ run), top-1 agreement and the teacher log-probability of the
  run's token;
* the **masked** forward: the generated rows again, each query seeing only
  the positions the run kept (rebuilt from the evictions table). It must
  reproduce the run's own logits; the largest difference goes into the
  manifest (``max_logit_diff``) and a mismatch is reported as a failed check:
  the model, the code or the log differ (an earlier replay that passed is kept).

The implementation tolerance depends on the dtype. The run and the masked
replay compute the same attention in a different order (slots against
positions, the runtime's kernels against SDPA), so in a low-precision dtype
their logits differ by rounding alone. A logit of magnitude ``L`` is stored
with a spacing of about ``eps · L`` (``eps`` the dtype's machine epsilon:
2^-7 for bfloat16, 2^-10 for float16), so the check accepts::

    tolerance = max(FLOOR, K · eps(dtype) · max|logit|)

with ``FLOOR`` = 2e-3 (float32 and float64 keep that fixed bound: their
rounding term is far below it), ``K`` = :data:`TOLERANCE_ULPS` = 8 and
``max|logit|`` the largest magnitude among the token and top-1 logits the
run logged. ``dtype`` is the coarser of the run's (manifest ``model.dtype``)
and the replay model's. Measured on the packaged 135M model on CPU (three
chat prompts, 16 and 64 new tokens, from no eviction down to 4 heavy + 8
recent slots), a correct run differs by 0.8 to 4.4 · eps · max|logit| in
bfloat16 (1 to 4 units in the last place of the largest logit) and 0.8 to
1.4 · eps · max|logit| in float16: K = 8 is 1.8 times the largest case seen.
The price: in half precision a wrong log whose effect on the logits stays
below the bound (one eviction in a small model) goes unseen; a log that
misses the evictions of whole steps is still caught (tests/test_recorders_exact_logs.py).
The tolerance used is written to the manifest (``logit_tolerance``,
``replay.tolerance``), the ``runs`` view reads it and the attribution and
the report gate use it.

Writes the ``replay``, ``replay_steps`` and ``oracle`` tables into the run folder and switches
the manifest to them in one rename, replacing an earlier replay (DESIGN.md §6.1).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import DynamicCache

from h2o_lens import compat
from h2o_lens.config import H2OConfig
from h2o_lens.hooks import attention_implementation
from h2o_lens.kernels import replay_masked_torch, replay_teacher_torch, resolve_backend
from h2o_lens.kernels.replay import TEACHER_TILE_ROWS
from h2o_lens.ops import prefill_attention
from h2o_lens.shape import ModelShape, model_shape
from runlog.contract import model_tag
from runlog.errors import RecorderError
from runlog.eviction_steps import evict_steps
from runlog.manifest import read_manifest, write_manifest
from runlog.recorded_model import check_model, model_source
from runlog.schema import REPLAY_TABLES
from runlog.segments import SEGMENT_RE, SegmentWriter, clean_temp_files, list_segments
from runlog.store import load_run, request_order

from .prompt_pass import PromptPass, PromptSink
from .replay_cold import load_recalls, masked_attention, request_windows, window_mass

__all__ = [
    "replay",
    "ReplaySummary",
    "DEFAULT_TOLERANCE",
    "TOLERANCE_ULPS",
    "implementation_tolerance",
]

REPLAY_ATTN = "h2o_lens_replay"
#: floor of the implementation tolerance: largest accepted |logit difference| in float32 / float64
DEFAULT_TOLERANCE = 2e-3
#: K of the dtype term K · eps(dtype) · max|logit| (see the module docstring for the measured spread)
TOLERANCE_ULPS = 8.0
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def implementation_tolerance(
    dtype: torch.dtype | str, logit_scale: float, *, floor: float = DEFAULT_TOLERANCE
) -> float:
    """Largest |logit difference| that rounding in ``dtype`` explains (module docstring).

    Parameters
    ----------
    dtype : the run's compute dtype (a torch dtype or its name, e.g. ``"bfloat16"``)
    logit_scale : largest |logit| the run produced
    floor : lower bound (float32 and float64 runs get exactly this)
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise RecorderError(
                f"unknown dtype {dtype!r} for the implementation tolerance; expected one of {', '.join(_DTYPES)}"
            )
        dtype = _DTYPES[name]
    if not dtype.is_floating_point:
        raise RecorderError(f"the implementation tolerance needs a floating dtype, got {dtype}")
    scale = float(logit_scale) if np.isfinite(logit_scale) else 0.0
    return max(floor, TOLERANCE_ULPS * torch.finfo(dtype).eps * abs(scale))


def _coarser(*dtypes: torch.dtype | str | None) -> torch.dtype:
    """The dtype with the largest machine epsilon among those given (float32 if none)."""
    found = [
        _DTYPES.get(str(d).removeprefix("torch."), None) if not isinstance(d, torch.dtype) else d
        for d in dtypes
        if d is not None
    ]
    found = [d for d in found if d is not None and d.is_floating_point]
    return max(found, key=lambda d: torch.finfo(d).eps, default=torch.float32)


@dataclass
class ReplaySummary:
    """Headline numbers of a replay (``tolerance``: the implementation check's bound)."""

    run_id: str
    requests: int
    steps: int
    max_logit_diff: float
    implementation_ok: bool
    mean_kl: float
    top1_agreement: float
    mean_dropped_mass: float
    seconds: float
    tolerance: float = DEFAULT_TOLERANCE
    prompts_from_run: int = 0  # requests started from the recording's prompt pass (DESIGN.md §6.1)
    prompts_as_batch: int = 0  # requests whose prompt was forwarded again in its prefill batch
    #: the check failed and an earlier replay that passed it was kept: nothing was written
    kept_earlier: bool = False


class _State:
    """What the replay attention function needs for the current forward."""

    def __init__(self):
        self.mode = "teacher"
        self.evict: dict[int, torch.Tensor] = {}  # layer -> (1, Hs, N) eviction step per position
        self.sets_per_kv = 1  # 1, or G for gqa='none' (one set per query head)
        self.dropped: dict[int, torch.Tensor] = {}  # layer -> (Hq, T) dropped mass of the generated rows
        self.agg = "sum"  # how the teacher weights of a KV set's query heads aggregate (the run's gqa)
        self.prompt_cols: dict[int, torch.Tensor] = {}  # layer -> (Hs, P)
        self.before: dict[int, torch.Tensor] = {}  # layer -> (Hs, N) generated rows up to the eviction
        self.after: dict[int, torch.Tensor] = {}  # layer -> (Hs, N) generated rows after it
        self.chunk = 512
        self.backend = "auto"  # dropped mass and oracle: "torch", or the Triton kernels ("auto" on CUDA)
        #: a cold tier's recall window per layer, ``(Hs, M, N)`` (:mod:`recorders.replay_cold`)
        self.window: dict[int, torch.Tensor] = {}
        #: a cold-tier run's teacher mass on evicted positions: [held by the window, dropped]
        self.cold_mass: list[float] | None = None
        #: a prompt pass of several requests at once (:func:`_batch_passes`): the padding mask
        #: (or None) and the row blocks of the recording's prefill; None: one request alone
        self.batch: tuple[torch.Tensor | None, int] | None = None


def _attention(state: _State, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of the replay forwards; queries are the last rows of the keys.

    ``prompt``: full causal attention over the prompt (shared by teacher and
    masked run) and its column sums. ``teacher``: full attention of the generated
    rows (the masked pass's kernel with nothing evicted, so a row that lost nothing
    has the masked run's bits), their dropped mass and oracle columns from one pass
    over the score tiles.
    ``masked``: the generated rows see only what the run kept. Every pass works
    ``state.chunk`` rows at a time: O(chunk · N) per layer, never N x N.
    """
    d = query.shape[-1]
    scaling = scaling if scaling is not None else d**-0.5
    rep = state.sets_per_kv
    k_sets = key.repeat_interleave(rep, dim=1) if rep > 1 else key  # (1, Hs, N, d)
    v_sets = value.repeat_interleave(rep, dim=1) if rep > 1 else value
    if state.mode == "prompt":
        if state.batch is not None:  # as the recording's prefill called it (DESIGN.md §6.1)
            valid, chunk = state.batch
            out, cols = prefill_attention(query, k_sets, v_sets, valid, scaling, state.agg, chunk=chunk)
            state.prompt_cols[module.layer_idx] = cols  # (b, Hs, P)
            return out, None
        out, cols = prefill_attention(query, k_sets, v_sets, None, scaling, state.agg)
        state.prompt_cols[module.layer_idx] = cols[0]  # (Hs, P) teacher column sums of the prompt rows
        return out, None
    layer = module.layer_idx
    ev = state.evict[layer]  # (1, Hs, N)
    if state.backend not in ("torch", "triton"):
        state.backend = "torch" if query.dtype == torch.float64 else resolve_backend(state.backend, query.device)
    if state.mode == "masked" and layer in state.window:  # recalled positions seen (DESIGN.md §2.13)
        return masked_attention(query, k_sets, v_sets, ev, state.window[layer], scaling).transpose(1, 2), None
    if state.mode == "masked":
        return replay_masked_torch(query, k_sets, v_sets, ev, scaling, chunk=state.chunk).transpose(1, 2), None
    # the teacher's output comes from the masked pass with nothing evicted: the same kernel on
    # the same inputs, so a row that lost nothing has the same bits in both runs (KL exactly 0)
    # (each row's log-sum-exp comes with it on CPU: the tile pass then needs no softmax)
    out, lse = replay_masked_torch(
        query, k_sets, v_sets, torch.full_like(ev, key.shape[2]), scaling, chunk=state.chunk, lse=True
    )
    if state.backend == "torch":  # dropped mass and oracle columns from one pass over the score tiles
        _, dropped, before, after = replay_teacher_torch(
            query,
            k_sets,
            v_sets,
            ev,
            scaling,
            chunk=min(state.chunk, TEACHER_TILE_ROWS),
            oracle=state.agg,
            output=False,
            lse=lse,
        )
    else:
        from h2o_lens.kernels import replay_dropped_mass_triton

        dropped, before, after = replay_dropped_mass_triton(
            query.contiguous(), k_sets.contiguous(), ev, scaling, oracle=state.agg
        )
    if state.mode == "teacher" and layer in state.window:  # a recalled position is present, not dropped
        held = window_mass(query, k_sets, ev, state.window[layer], scaling)[None]
        dropped = (dropped - held).clamp(min=0)
        state.cold_mass[0] += float(held.sum())
    if state.mode == "teacher" and state.cold_mass is not None:
        state.cold_mass[1] += float(dropped.sum())
    if state.mode == "teacher":
        state.dropped[layer] = dropped[0]  # (Hq, T - 1)
        state.before[layer], state.after[layer] = before[0], after[0]  # (Hs, N)
    return out.transpose(1, 2), None


def _no_mask(*args, **kwargs):
    return None


def _replay_attention(model, state: _State) -> contextlib.AbstractContextManager[None]:
    """Run ``model`` with the replay attention (:func:`_attention` on ``state``) under :data:`REPLAY_ATTN`."""
    return attention_implementation(model, REPLAY_ATTN, functools.partial(_attention, state), _no_mask)


def _request_evict_steps(
    ev: dict[str, np.ndarray], request: int, layers: int, sets: int, n: int, gqa_none: bool
) -> dict[int, torch.Tensor]:
    """Per layer ``(1, Hs, N)`` step at which each position of ``request`` left the cache."""
    sel = ev["request"] == request
    out = evict_steps({k: v[sel] for k, v in ev.items()}, layers, sets, n, gqa_none)
    return {layer: torch.from_numpy(out[layer])[None] for layer in range(layers)}


def _oracle_rows(
    rows: dict[str, list[np.ndarray]],
    ev: dict[str, np.ndarray],
    request: int,
    p: int,
    n: int,
    layers: int,
    state: _State,
    gqa_none: bool,
    group: int,
) -> None:
    """Teacher weight on every evicted position, before and after its eviction step."""
    sel = np.flatnonzero((ev["request"] == request) & (ev["position"] < n))
    if not len(sel):
        return
    layer, pos, step = ev["layer"][sel], ev["position"][sel], ev["step"][sel]
    head = ev["q_head"][sel] if gqa_none else ev["kv_head"][sel]
    score = np.zeros(len(sel), np.float32)
    future = np.zeros(len(sel), np.float32)
    for lyr in range(layers):
        here = layer == lyr
        h, q = head[here], pos[here]
        s = state.prompt_cols[lyr].float().numpy()[h, np.minimum(q, p - 1)] * (q < p)
        if lyr in state.before:
            s = s + state.before[lyr].float().numpy()[h, q]
            future[here] = state.after[lyr].float().numpy()[h, q]
        score[here] = s
    rows["request"].append(np.full(len(sel), request, np.int32))
    rows["step"].append(step)
    rows["layer"].append(layer.astype(np.int16))
    rows["kv_head"].append((head // group if gqa_none else head).astype(np.int16))
    rows["q_head"].append(head.astype(np.int16))
    rows["position"].append(pos)
    rows["teacher_score"].append(score)
    rows["teacher_future_mass"].append(future)


@dataclass
class _Run:
    """The recorded run as the replay reads it: token, eviction and logit columns."""

    run_id: str
    manifest: dict
    config: dict
    tokens: dict[str, list]
    ev: dict[str, np.ndarray]  # request, step, layer, kv_head, position (+ q_head with gqa='none')
    logits: dict[str, np.ndarray]  # the run_logits table without run_id
    requests: list[int]
    batches: list[dict] = field(default_factory=list)  # the manifest's prefill_batches
    recalls: dict[str, np.ndarray] | None = None  # a cold tier's window occupants (recorders.replay_cold)

    @property
    def gqa(self) -> str:
        """The run's aggregation (the configuration's default when the manifest has none)."""
        return self.config.get("gqa") or H2OConfig.gqa


class _Rows:
    """Rows of the replay, replay_steps and oracle tables, and the implementation check's figures."""

    def __init__(self):
        self.oracle: dict[str, list[np.ndarray]] = {
            k: []
            for k in (
                "request",
                "step",
                "layer",
                "kv_head",
                "q_head",
                "position",
                "teacher_score",
                "teacher_future_mass",
            )
        }
        self.replay: dict[str, list[np.ndarray]] = {
            k: [] for k in ("request", "step", "layer", "q_head", "kv_head", "dropped_mass")
        }
        self.steps: dict[str, list[np.ndarray]] = {
            k: [] for k in ("request", "step", "kl", "top1_agree", "teacher_logprob")
        }
        self.max_diff, self.n_steps, self.logit_scale = 0.0, 0, 0.0
        self.prompts_from_run = 0  # requests started from the recording's prompt pass
        self.prompts_as_batch = 0  # ... from their prefill batch forwarded again


def _cat(rows: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate(v) for k, v in rows.items()}


def _load(run_dir: Path) -> _Run:
    """Read the tokens, evictions and run_logits of the run in ``run_dir``."""
    run = load_run(run_dir, tables=("tokens", "evictions", "run_logits"))
    config = run.manifest.get("config") or {}
    tokens = run["tokens"].to_pydict()
    evictions = run["evictions"]
    ev = {
        k: evictions[k].to_numpy().astype(np.int64, copy=False)
        for k in ("request", "step", "layer", "kv_head", "position")
    }
    if config.get("gqa") == "none":
        ev["q_head"] = evictions["q_head"].fill_null(-1).to_numpy().astype(np.int64, copy=False)
    logits = {k: np.asarray(v) for k, v in run["run_logits"].to_pydict().items() if k != "run_id"}
    requests = sorted(set(np.asarray(tokens["request"]).tolist()))
    if not requests:
        raise RecorderError(f"{run_dir}: the run has no tokens table; nothing to replay")
    batches = run.manifest.get("prefill_batches") or []
    recalls = load_recalls(run_dir, run.manifest)
    return _Run(run.run_id, run.manifest, config, tokens, ev, logits, requests, batches, recalls)


def _model_for(run: _Run, model: Any, progress: bool) -> tuple[Any, ModelShape]:
    """The replay model (loaded from where the manifest says it was, :func:`model_source`,
    when not given) and its shape."""
    if model is None:
        from h2o_lens.models import load_model

        model, _ = load_model(model_source(run.manifest), progress=progress)
    return model, model_shape(model.config)


def _new_state(run: _Run, shape: ModelShape, chunk: int, backend: str) -> _State:
    state = _State()
    state.chunk = chunk
    state.backend = backend
    resolve_backend(backend, "cpu" if backend != "triton" else "cuda")  # reject unknown names early
    state.sets_per_kv = shape.copies(run.gqa)
    state.agg = "max" if run.gqa == "max" else "sum"
    return state


def _request_tokens(run: _Run, request: int) -> tuple[np.ndarray, int, int]:
    """Token ids of ``request`` in position order, prompt length P and positions fed N."""
    tokens = run.tokens
    order = request_order(tokens, request)
    ids = np.asarray(tokens["token_id"])[order]
    p = int(np.asarray(tokens["is_prompt"])[order].sum())
    return ids, p, len(ids) - 1  # the last generated token was never fed to the model


def _forward(
    model,
    state: _State,
    ids: np.ndarray,
    p: int,
    n: int,
    bar,
    prompt_pass: PromptPass | None = None,
    lost_nothing: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and masked logits ``(T, vocab)`` of rows ``P-1 .. N-1``; the prompt is forwarded
    once, or not at all when the recording handed its ``prompt_pass`` on (DESIGN.md §6.1).
    ``lost_nothing``: no row lost a key (a full-cache run, or a budget the request never
    filled), so the masked forward is the teacher's, call for call: it is not run again."""
    x = torch.as_tensor(ids[:n], dtype=torch.long)[None]
    # the prompt rows are identical in both runs (full attention): forward them once
    cache = DynamicCache(config=model.config)
    if prompt_pass is not None:
        for layer, (key, value) in enumerate(zip(prompt_pass.keys, prompt_pass.values)):
            cache.update(key, value, layer)
        state.prompt_cols.update(enumerate(prompt_pass.cols))
        first = prompt_pass.first
    else:
        state.mode = "prompt"
        first = (
            model(input_ids=x[:, :p], **compat.cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[0].float()
        )
    teacher, masked = first, first
    if n > p:
        state.mode = "teacher"
        teacher = torch.cat(
            [first, model(input_ids=x[:, p:], **compat.cache_kwargs(cache), use_cache=True).logits[0].float()]
        )
        bar.update()
        if lost_nothing:
            masked = teacher
        else:
            cache.crop(p - n)
            state.mode = "masked"
            masked = torch.cat(
                [first, model(input_ids=x[:, p:], **compat.cache_kwargs(cache), use_cache=True).logits[0].float()]
            )
    bar.update()
    return teacher, masked


def _step_rows(
    rows: _Rows, request: int, ids: np.ndarray, p: int, teacher: torch.Tensor, masked: torch.Tensor
) -> np.ndarray:
    """KL(teacher ‖ masked), top-1 agreement and teacher log-probability per step; returns the steps."""
    t = teacher.shape[0]
    steps = np.arange(p - 1, p - 1 + t, dtype=np.int64)
    nxt = torch.as_tensor(ids[p : p + t], dtype=torch.long)
    lt = torch.log_softmax(teacher, -1)
    lm = lt if masked is teacher else torch.log_softmax(masked, -1)  # a request that lost nothing
    kl = (lt.exp() * (lt - lm)).sum(-1)
    rows.steps["request"].append(np.full(t, request, np.int32))
    rows.steps["step"].append(steps)
    rows.steps["kl"].append(kl.clamp(min=0).numpy())
    # max(-1) gives argmax's index (the first of tied maxima) at half its cost over a vocabulary
    top1 = teacher.max(-1).indices
    rows.steps["top1_agree"].append((top1 == (top1 if masked is teacher else masked.max(-1).indices)).numpy())
    rows.steps["teacher_logprob"].append(lt.gather(-1, nxt[:, None])[:, 0].numpy())
    rows.n_steps += t
    return steps


def _check_implementation(
    rows: _Rows, logits: dict[str, np.ndarray], request: int, p: int, masked: torch.Tensor
) -> None:
    """Compare the masked replay's logits with those the run itself logged (max |difference|)."""
    ls = logits["request"] == request
    if not ls.any():
        return
    idx = logits["step"][ls] - (p - 1)
    ok = (idx >= 0) & (idx < masked.shape[0])
    idx = idx[ok]
    m = masked[torch.as_tensor(idx)]
    diffs = [
        np.abs(
            m.gather(-1, torch.as_tensor(logits[c][ls][ok], dtype=torch.long)[:, None])[:, 0].numpy()
            - logits[v][ls][ok]
        )
        for c, v in (("token_id", "token_logit"), ("top1_id", "top1_logit"))
    ]
    diffs.append(np.abs(torch.logsumexp(m, -1).numpy() - logits["lse"][ls][ok]))
    rows.max_diff = max(rows.max_diff, float(max(d.max() for d in diffs)))
    if ok.any():
        rows.logit_scale = max(
            rows.logit_scale, *(float(np.abs(logits[c][ls][ok]).max()) for c in ("token_logit", "top1_logit"))
        )


def _replay_rows(rows: _Rows, request: int, steps: np.ndarray, state: _State, shape: ModelShape) -> None:
    """Dropped mass per step, layer and query head."""
    hq, t = shape.q_heads, len(steps)
    for layer in range(shape.layers):
        dm = np.zeros((hq, t), np.float32)  # step p-1 (the prompt's last row) drops nothing
        if t > 1:
            dm[:, 1:] = state.dropped[layer].float().numpy()  # (Hq, T - 1)
        qh = np.repeat(np.arange(hq, dtype=np.int16), t)
        rows.replay["request"].append(np.full(hq * t, request, np.int32))
        rows.replay["step"].append(np.tile(steps, hq))
        rows.replay["layer"].append(np.full(hq * t, layer, np.int16))
        rows.replay["q_head"].append(qh)
        rows.replay["kv_head"].append((qh // shape.group).astype(np.int16))
        rows.replay["dropped_mass"].append(dm.reshape(-1))


def _batch_passes(model, run: _Run, state: _State, entry: dict) -> dict[int, PromptPass]:
    """The prompt passes of a batch the recording prefilled at once, from one forward of the same
    rows at the same columns of the same width, with the prefill's own attention calls: the bits
    the run's prefill computed (DESIGN.md §6.1). Empty when a request of the batch is not in the
    run or does not fit where the manifest puts it."""
    requests = [int(q) for q in entry["requests"]]
    if not set(requests) <= set(run.requests):
        return {}
    prompts = []
    for q in requests:
        ids, p, _ = _request_tokens(run, q)
        prompts.append(ids[:p].tolist())
    width = int(entry["width"])
    starts = [int(a) for a in entry.get("starts") or [width - len(p) for p in prompts]]  # default: left padding
    if any(a < 0 or a + len(p) > width for a, p in zip(starts, prompts)):
        return {}
    x = torch.zeros(len(requests), width, dtype=torch.long)
    valid = torch.zeros(len(requests), width, dtype=torch.bool)
    for r, (a, p) in enumerate(zip(starts, prompts)):  # each row where the prefill had it
        x[r, a : a + len(p)] = torch.tensor(p, dtype=torch.long)
        valid[r, a : a + len(p)] = True
    pos = (valid.long().cumsum(-1) - 1).masked_fill(~valid, 1)
    cache = DynamicCache(config=model.config)
    state.mode, state.batch = "prompt", (valid if entry.get("masked", True) else None, int(entry.get("chunk", 512)))
    try:
        logits = model(
            input_ids=x, position_ids=pos, **compat.cache_kwargs(cache), use_cache=True, logits_to_keep=1
        ).logits
    finally:
        state.batch = None
    sink = PromptSink(keep=True)  # cut into rows as the recorder's sink cuts the prefill
    for i, layer in enumerate(cache.layers):
        sink(i, layer.keys, layer.values, state.prompt_cols[i], valid)
    sink.head_width = 1  # logits_to_keep=1: the last positions only
    state.prompt_cols.clear()
    cut = sink.passes(dict(enumerate(prompts)), logits[:, -1], len(cache.layers))
    return {requests[r]: prompt_pass for r, prompt_pass in cut.items()}


def _replay_request(
    model, run: _Run, shape: ModelShape, state: _State, rows: _Rows, request: int, bar, prompt_pass=None
) -> bool:
    """Both forwards of one request and its rows; whether it started from ``prompt_pass``."""
    ids, p, n = _request_tokens(run, request)
    if n < p:
        return False
    for per_layer in (state.dropped, state.prompt_cols, state.before, state.after):
        per_layer.clear()
    gqa_none = run.gqa == "none"
    state.evict = _request_evict_steps(run.ev, request, shape.layers, shape.sets(run.gqa), n, gqa_none)
    sets = shape.sets(run.gqa)
    state.window = {} if run.recalls is None else request_windows(run.recalls, request, shape.layers, sets, p, n)
    prompt = tuple(ids[:p].tolist())
    if prompt_pass is not None and not prompt_pass.fits(prompt, shape.layers, shape.kv_heads, model.dtype):
        prompt_pass = None  # not this request's prompt: forward it
    # a key evicted at step t is hidden from rows after t only; the last row fed is step n - 1
    lost_nothing = all(bool((ev >= n - 1).all()) for ev in state.evict.values())
    teacher, masked = _forward(model, state, ids, p, n, bar, prompt_pass, lost_nothing)
    steps = _step_rows(rows, request, ids, p, teacher, masked)
    # implementation check against the logits the run itself produced
    _check_implementation(rows, run.logits, request, p, masked)
    _oracle_rows(rows.oracle, run.ev, request, p, n, shape.layers, state, gqa_none, shape.group)
    _replay_rows(rows, request, steps, state, shape)
    return prompt_pass is not None


def _listing(run_dir: Path, manifest: dict) -> dict[str, int]:
    """The segments the run holds now (file name -> rows): the manifest's list, or for a manifest
    written before segments were listed, the untagged segment files of the folder."""
    listed = manifest.get("segments")
    if isinstance(listed, dict):
        return dict(listed)
    out = {}
    for paths in list_segments(run_dir).values():
        for path in paths:
            try:
                out[path.name] = pq.read_metadata(path).num_rows
            except (OSError, ValueError, pa.ArrowException):
                pass  # a damaged file: not listed, so the readers name it
    return out


def _commit(run_dir: Path, run: _Run, rows: _Rows, gqa_none: bool, manifest_update: dict[str, Any]) -> None:
    """Write the replay's tables and switch the run to them in one manifest rename (DESIGN.md §6.1).

    The new segments are written under tagged names the readers skip until a manifest lists
    them; the manifest then lists them in place of the earlier replay's (``superseded``), which
    are removed after. A failure at any point (a full disk) removes what this replay wrote and
    leaves the earlier replay, or none, as it was.
    """
    manifest = read_manifest(run_dir)
    listed = _listing(run_dir, manifest)
    writer = SegmentWriter(
        run_dir,
        run_id=run.run_id,
        config=run.config,
        fsync=True,
        tag=secrets.token_hex(4),
        model=model_tag(manifest.get("model")),
    )
    try:
        if rows.replay["step"]:
            writer.append("replay", _cat(rows.replay))
            writer.append("replay_steps", _cat(rows.steps))
        if rows.oracle["step"]:
            oracle = _cat(rows.oracle)
            if not gqa_none:
                oracle.pop("q_head")
            writer.append("oracle", oracle)
        writer.close()
        old = [n for n in listed if (m := SEGMENT_RE.fullmatch(n)) and m["table"] in REPLAY_TABLES]
        manifest["segments"] = {n: r for n, r in listed.items() if n not in old} | writer.files
        manifest["rows"] = {**(manifest.get("rows") or {}), **{t: writer.rows_written.get(t, 0) for t in REPLAY_TABLES}}
        earlier = [n for n in manifest.get("superseded") or () if isinstance(n, str) and (run_dir / n).exists()]
        manifest["superseded"] = sorted(set(old) | set(earlier))
        manifest.update(manifest_update)
        write_manifest(run_dir, manifest)
    except BaseException:
        for path in writer.segments:
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            clean_temp_files(run_dir)
        raise
    current = set(manifest["segments"])
    for entry in os.scandir(run_dir):  # the replaced segments, and tagged ones of replays that never switched
        m = SEGMENT_RE.fullmatch(entry.name)
        if m and entry.name not in current and (m["tag"] is not None or entry.name in manifest["superseded"]):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _summarize(run: _Run, model, rows: _Rows, tolerance: float | None, seconds: float) -> ReplaySummary:
    if tolerance is None:
        info = run.manifest.get("model")
        run_dtype = (info or {}).get("dtype") if isinstance(info, dict) else None
        replay_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        tolerance = implementation_tolerance(_coarser(run_dtype, replay_dtype), rows.logit_scale)
    steps_all = _cat(rows.steps) if rows.steps["step"] else None
    return ReplaySummary(
        run_id=run.run_id,
        requests=len(run.requests),
        steps=rows.n_steps,
        max_logit_diff=rows.max_diff,
        implementation_ok=rows.max_diff <= tolerance,
        mean_kl=float(steps_all["kl"].mean()) if steps_all is not None else 0.0,
        top1_agreement=float(steps_all["top1_agree"].mean()) if steps_all is not None else 1.0,
        mean_dropped_mass=float(np.concatenate(rows.replay["dropped_mass"]).mean())
        if rows.replay["dropped_mass"]
        else 0.0,
        seconds=seconds,
        tolerance=tolerance,
        prompts_from_run=rows.prompts_from_run,
        prompts_as_batch=rows.prompts_as_batch,
    )


def _replay_fields(summary: ReplaySummary, backend: str) -> dict[str, Any]:
    """The manifest fields a replay sets."""
    return {
        "max_logit_diff": summary.max_logit_diff,
        "logit_tolerance": summary.tolerance,
        "replay": {
            "implementation_ok": summary.implementation_ok,
            "tolerance": summary.tolerance,
            "mean_kl": summary.mean_kl,
            "top1_agreement": summary.top1_agreement,
            "mean_dropped_mass": summary.mean_dropped_mass,
            "seconds": summary.seconds,
            "backend": backend,
            "prompts_from_run": summary.prompts_from_run,
            "prompts_as_batch": summary.prompts_as_batch,
        },
    }


def replay(
    run_dir: str | os.PathLike,
    *,
    model: Any = None,
    tolerance: float | None = None,
    chunk: int = 512,
    progress: bool = True,
    backend: str = "auto",
    prompt_passes: Mapping[int, PromptPass] | None = None,
    allow_other_model: bool = False,
) -> ReplaySummary:
    """Replay one recorded run (see the module docstring) and write its replay tables.

    Parameters
    ----------
    run_dir : the run folder ``<root>/<run_id>``
    model : the model the run used; loaded from the manifest's model name when omitted
    tolerance : largest |logit difference| accepted by the implementation check; by default
        derived from the dtype (:func:`implementation_tolerance`)
    chunk : query rows per block of the torch path (memory is O(chunk · N) per layer)
    backend : "auto" (the Triton replay kernels on CUDA, else torch), "torch" or "triton"
        for the dropped mass and the oracle columns; the one used goes into the manifest
    prompt_passes : request -> its prompt pass from the recording (``record(...,
        keep_prompt_pass=True)``, DESIGN.md §6.1): that request's prompt is not forwarded again
    allow_other_model : replay with a model whose fingerprint differs from the recorded one
        (logged in the manifest's ``model_overrides``); without it such a model is refused

    The new tables replace an earlier replay's in one manifest rename (:func:`_commit`): a
    failure leaves the earlier replay, or none, never a mix. A replay whose implementation check
    fails (the model, the code or the log differ) never replaces an earlier one that passed it:
    nothing is written and the summary says ``kept_earlier``.

    Raises
    ------
    ModelMismatchError
        ``model`` (or the one loaded from the manifest) is not the run's; nothing is written.
    StorageError
        A file could not be written (a full disk); the earlier replay is left as it was.
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    run = _load(run_dir)
    model, shape = _model_for(run, model, progress)
    override = check_model(run.manifest, model, run=run.run_id, command="replay", allow_other=allow_other_model)
    state = _new_state(run, shape, chunk, backend)
    rows = _Rows()
    bar = tqdm(
        total=2 * len(run.requests), desc=f"replay {run.run_id}", disable=not progress, unit="forward", leave=False
    )
    handed = dict(prompt_passes or {})
    # a request the recording prefilled in a batch: its prompt pass from the same batch (DESIGN.md §6.1)
    batch_of = {int(q): entry for entry in run.batches for q in entry["requests"] if len(entry["requests"]) > 1}
    on_cpu = next(model.parameters()).device.type == "cpu"
    batched: dict[int, PromptPass] = {}
    forwarded: set[int] = set()  # the batches forwarded again (by first request)
    state.cold_mass = None if run.recalls is None else [0.0, 0.0]
    with torch.no_grad(), _replay_attention(model, state):
        for request in run.requests:
            passed, source = handed.pop(request, None), "prompts_from_run"
            entry = batch_of.get(request)
            if passed is None and entry is not None and on_cpu:
                if int(entry["requests"][0]) not in forwarded:
                    forwarded.add(int(entry["requests"][0]))
                    batched = _batch_passes(model, run, state, entry)
                passed, source = batched.pop(request, None), "prompts_as_batch"
            if _replay_request(model, run, shape, state, rows, request, bar, passed):
                setattr(rows, source, getattr(rows, source) + 1)
    bar.close()
    summary = _summarize(run, model, rows, tolerance, time.perf_counter() - t0)
    earlier = run.manifest.get("replay")
    if not summary.implementation_ok and isinstance(earlier, Mapping) and earlier.get("implementation_ok") is True:
        summary.kept_earlier = True  # the model, the code or the log differ: the good replay stays
        return summary
    fields = _replay_fields(summary, state.backend)
    if state.cold_mass is not None:  # recall hit rate: the share of the mass on evicted positions the window held
        held, dropped = state.cold_mass
        rate = held / (held + dropped) if held + dropped > 0 else None
        fields["cold"] = {**run.manifest["cold"], "recall_hit_rate": rate}
    if override:
        fields["model_overrides"] = [*(run.manifest.get("model_overrides") or []), override]
    _commit(run_dir, run, rows, run.gqa == "none", fields)
    return summary
