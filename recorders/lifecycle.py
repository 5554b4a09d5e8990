"""The state lifecycle check: do the logged kept sets follow from the accepted tokens? (DESIGN.md §15.1)

A run's log says, per request, layer and KV set, which positions left the
cache at which step, so it implies the kept set after every step (kept at
step ``t``: the positions ``<= t`` not evicted at a step ``<= t``,
:mod:`runlog.eviction_steps`). The check re-runs each request's accepted
token sequence (its prompt and generated tokens, from the ``tokens`` table)
through the plain H2O runtime on its own: the prompt prefilled, then one
token per step, on the torch path, with the run's policy, budget (the
request's own, ``requests.heavy``/``recent``) and the model in the run's
dtype. A run whose serving state was handled right (batched, reordered,
shared, saved and restored, cancelled around) keeps exactly the sets this
single-request reference keeps; a run whose state went wrong somewhere keeps
others from that step on.

Near ties. The run and the reference compute the same scores in a different
order (batch rows, padding, the Triton kernels, a restored cache), so in
finite precision two nearly equal scores can rank the other way round and the
two evict different positions, correctly. The check tolerates exactly that:
at the first step where a KV set's logged and reference kept sets differ, the
difference is a tie flip when the log evicted at that step a position the
reference kept and each such logged victim's margin (lowest surviving
eligible score − victim score, the ``margin`` column, DESIGN.md §6.5) is at most::

    tie_tolerance = TIE_ULPS · eps(dtype) · max(1, |victim score|)

(``eps`` of the coarser of the run's and the check's dtype). A set that flipped
on a tie is not compared further (its sets legitimately differ from then on)
and is counted in ``tie_flips``. Every other first difference is a lifecycle
error: the log evicted nothing where the reference did, evicted a position
with a clear margin, or kept a position the reference had already dropped. In
practice (tiny models in float32, batched against single) a correct run
matches exactly; the tolerance only matters for real models and half dtypes.

The result goes into the manifest (``lifecycle``), where the report reads it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from h2o_lens import compat
from h2o_lens.config import H2OConfig
from h2o_lens.shape import model_shape
from runlog.errors import RecorderError
from runlog.eviction_steps import NEVER, evict_steps
from runlog.manifest import read_manifest, write_manifest
from runlog.recorded_model import check_model, log_override, model_source
from runlog.store import load_run, request_order

__all__ = ["check_lifecycle", "LifecycleResult", "RequestLifecycle", "TIE_ULPS", "tie_tolerance"]

#: K of the near-tie bound K · eps(dtype) · max(1, |score|) (module docstring)
TIE_ULPS = 64.0
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHOWN = 16  # differing positions listed per request


def tie_tolerance(dtype: torch.dtype | str) -> float:
    """Relative bound under which a victim's margin counts as a near tie (module docstring)."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise RecorderError(f"unknown dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[name]
    return TIE_ULPS * torch.finfo(dtype).eps


@dataclass
class RequestLifecycle:
    """The check of one request.

    ``first_bad_step`` is the first step whose logged kept set disagrees with the
    reference beyond a near tie (None: none), in ``layer`` and ``kv_set`` (the KV
    head, or the query head of a ``gqa="none"`` run); ``logged_only`` are the
    positions the log keeps there and the reference does not, ``reference_only``
    the reverse. ``tie_flips``: KV sets that parted on a tolerated near tie.
    """

    request: int
    ok: bool
    steps: int
    first_bad_step: int | None = None
    layer: int | None = None
    kv_set: int | None = None
    logged_only: list[int] = field(default_factory=list)
    reference_only: list[int] = field(default_factory=list)
    tie_flips: int = 0

    def describe(self) -> str:
        if self.ok:
            flips = f" ({self.tie_flips} near-tie flip(s) tolerated)" if self.tie_flips else ""
            return f"request {self.request}: ok over {self.steps} steps{flips}"
        return (
            f"request {self.request}: kept set differs from the reference at step {self.first_bad_step}, "
            f"layer {self.layer}, KV set {self.kv_set}: logged only {self.logged_only}, "
            f"reference only {self.reference_only}"
        )


@dataclass
class LifecycleResult:
    """The check of a run: ``ok`` when every request's logged kept sets match the reference."""

    run_id: str
    ok: bool
    requests: list[RequestLifecycle]
    tolerance: float
    dtype: str
    seconds: float = 0.0

    @property
    def failed(self) -> list[RequestLifecycle]:
        return [r for r in self.requests if not r.ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "tolerance": self.tolerance,
            "dtype": self.dtype,
            "backend": "torch",
            "seconds": self.seconds,
            "requests": [dataclasses.asdict(r) for r in self.requests],
        }


class _Collector:
    """A cache listener that records the step each position left each KV set (one request)."""

    def __init__(self, layers: int, sets: int, n: int):
        self.steps = np.full((layers, sets, n), NEVER, dtype=np.int64)

    def on_prefill(self, layer: int, ev) -> None:
        pos = ev.positions[0]  # (Hs, P)
        gone = ((pos >= 0) & ~ev.keep[0]).cpu().numpy()
        h, i = np.nonzero(gone)
        self.steps[layer, h, pos.cpu().numpy()[h, i]] = int(ev.step[0])

    def on_decode(self, layer: int, ev) -> None:
        evicts = ev.evicts[0].cpu().numpy()  # (Hs,)
        victim = ev.cand_positions[0].gather(-1, ev.slot[0][:, None].to(torch.int64))[:, 0].cpu().numpy()
        for h in np.flatnonzero(evicts):
            if victim[h] < self.steps.shape[2]:
                self.steps[layer, h, victim[h]] = int(ev.step[0])


def _config_for(manifest: dict, row: dict, prompt_len: int) -> H2OConfig:
    raw = manifest.get("config")
    if not isinstance(raw, dict):
        raise RecorderError("the manifest has no config object; the lifecycle check needs the run's policy")
    names = {f.name for f in dataclasses.fields(H2OConfig)}
    config = H2OConfig(**{k: v for k, v in raw.items() if k in names})
    config = dataclasses.replace(config, backend="torch")
    if config.spec.evicts and row.get("heavy") is not None:
        return dataclasses.replace(config, ratio=None, heavy=int(row["heavy"]), recent=int(row["recent"]))
    if config.spec.evicts and not config.resolved:
        return config.resolve(prompt_len)
    return config


def _model_for(manifest: dict, model: Any, progress: bool) -> Any:
    """The checking model: ``model``, else the run's, loaded from where the manifest says it
    was (:func:`~runlog.recorded_model.model_source`) in the run's dtype."""
    if model is not None:
        return model
    from h2o_lens.models import load_model

    info = manifest.get("model") or {}
    dtype = _DTYPES.get(str(info.get("dtype")) if isinstance(info, dict) else "", torch.float32)
    return load_model(model_source(manifest), dtype=dtype, progress=progress)[0]


def _reference(model, config: H2OConfig, ids: np.ndarray, p: int, n: int, layers: int, sets: int) -> np.ndarray:
    """``(L, Hs, N)`` eviction step of every position when the request runs alone, one token a step."""
    from h2o_lens.runtime import h2o

    collector = _Collector(layers, sets, n)
    device = next(model.parameters()).device
    x = torch.as_tensor(ids[:n], dtype=torch.long, device=device)[None]
    with torch.no_grad(), h2o(model, config) as session:
        cache = session.new_cache(listener=collector)
        model(input_ids=x[:, :p], **compat.cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        for t in range(p, n):
            pos = torch.tensor([[t]], device=device)
            model(
                input_ids=x[:, t : t + 1],
                **compat.cache_kwargs(cache),
                use_cache=True,
                position_ids=pos,
                logits_to_keep=1,
            )
    return collector.steps


def _compare(
    request: int, logged: np.ndarray, ref: np.ndarray, margins: dict, p: int, n: int, tol: float
) -> RequestLifecycle:
    """First disagreement of two ``(L, Hs, N)`` eviction-step arrays, near ties tolerated."""
    out = RequestLifecycle(request=request, ok=True, steps=max(n - p + 1, 0))
    differ = logged != ref
    if not differ.any():
        return out
    first = np.where(differ, np.minimum(logged, ref), NEVER).min(-1)  # (L, Hs)
    bad: list[tuple[int, int, int]] = []
    for layer, s in zip(*np.nonzero(first < NEVER)):
        t = int(first[layer, s])
        keep_log = logged[layer, s, : t + 1] > t
        keep_ref = ref[layer, s, : t + 1] > t
        victims = np.flatnonzero(~keep_log & keep_ref & (logged[layer, s, : t + 1] == t))
        near = [margins.get((int(layer), int(s), int(v), t)) for v in victims]
        if len(victims) and all(m is not None and m[0] <= tol * max(1.0, abs(m[1])) for m in near):
            out.tie_flips += 1
            continue
        bad.append((t, int(layer), int(s)))
    if bad:
        t, layer, s = min(bad)
        keep_log = logged[layer, s, : t + 1] > t
        keep_ref = ref[layer, s, : t + 1] > t
        out.ok = False
        out.first_bad_step, out.layer, out.kv_set = t, layer, s
        out.logged_only = np.flatnonzero(keep_log & ~keep_ref)[:_SHOWN].tolist()
        out.reference_only = np.flatnonzero(keep_ref & ~keep_log)[:_SHOWN].tolist()
    return out


def check_lifecycle(
    run_dir: str | os.PathLike,
    model: Any = None,
    *,
    tolerance: float | None = None,
    requests: list[int] | None = None,
    write: bool = True,
    progress: bool = False,
    allow_other_model: bool = False,
) -> LifecycleResult:
    """Check that a recorded run's kept sets follow from its accepted tokens (module docstring).

    Parameters
    ----------
    run_dir : the run folder ``<root>/<run_id>``
    model : the model the run used (any device); loaded from the manifest's model
        name, in the run's dtype, when omitted
    tolerance : relative near-tie bound; default :func:`tie_tolerance` of the coarser of
        the run's and the model's dtype; ``0`` demands identical kept sets
    requests : check only these requests (default: all)
    write : store the result in the manifest (``lifecycle``), for the report
    allow_other_model : check with a model whose fingerprint differs from the recorded one
        (logged in the manifest's ``model_overrides``); without it such a model is refused

    Raises
    ------
    RecorderError
        The run has no tokens, its model does not match the checking model's shape,
        ``tolerance`` is negative or not finite, or the call is inside a
        :func:`h2o_lens.cache.use_layer_class` block (the re-run must use the plain layers).
    ModelMismatchError
        The checking model is not the run's (its fingerprint differs); nothing is written.
    """
    _check_arguments(tolerance)
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    run = load_run(run_dir, tables=("tokens", "evictions", "requests"))
    manifest = run.manifest
    tok = run["tokens"].to_pydict()
    req_col = np.asarray(tok["request"], dtype=np.int64)
    if not len(req_col):
        raise RecorderError(f"{run_dir}: the run has no tokens table; nothing to check")
    model = _model_for(manifest, model, progress)
    override = check_model(manifest, model, run=run.run_id, command="check", allow_other=allow_other_model)
    layers, sets, gqa_none = _shape_of(run_dir, manifest, model)
    coarse, tol = _tolerance(manifest, model, tolerance)
    ev, margin, score = _logged(run["evictions"], gqa_none)
    rows = {r["request"]: r for r in run["requests"].to_pylist()}
    wanted = sorted(set(req_col.tolist())) if requests is None else list(requests)
    results = []
    for request in wanted:
        order = request_order(tok, request)
        if not len(order):
            raise RecorderError(f"{run_dir}: run {run.run_id!r} has no request {request}")
        ids = np.asarray(tok["token_id"])[order]
        p = int(np.asarray(tok["is_prompt"])[order].sum())
        n = len(ids) - 1 if len(ids) > p else p  # the last generated token was never fed
        config = _config_for(manifest, rows.get(request, {}), p)
        mine = np.flatnonzero(ev["request"] == request)
        if not config.spec.evicts:
            results.append(RequestLifecycle(request=request, ok=len(mine) == 0, steps=n - p + 1))
            continue
        logged = evict_steps({k: v[mine] for k, v in ev.items()}, layers, sets, n, gqa_none)
        ref = _reference(model, config, ids, p, n, layers, sets)
        results.append(_compare(request, logged, ref, _margins(ev, margin, score, mine), p, n, tol))
    result = LifecycleResult(
        run_id=run.run_id,
        ok=all(r.ok for r in results),
        requests=results,
        tolerance=tol,
        dtype=str(coarse).removeprefix("torch."),
        seconds=time.perf_counter() - t0,
    )
    if write and requests is None:
        m = read_manifest(run_dir)
        m["lifecycle"] = result.to_dict()
        log_override(m, override)
        write_manifest(run_dir, m)
    return result


def _check_arguments(tolerance: float | None) -> None:
    """Refuse a check inside a ``use_layer_class`` or extensions block and a tolerance that is not a margin."""
    from h2o_lens.cache import H2OCacheLayer, current_layer_class

    layer_class = current_layer_class()  # what the re-run's caches would be built with
    if layer_class is not H2OCacheLayer:
        raise RecorderError(
            f"the lifecycle check must run on the plain runtime, but the caches built here get the layer "
            f"class {layer_class.__qualname__} (a use_layer_class block); run the check outside that block"
        )
    from h2o_lens.extension import current_extensions

    if current_extensions():  # a guarded() or use_extensions block would attach them to the re-run's caches
        raise RecorderError(
            "the lifecycle check must run on the plain runtime, but the caches built here get extensions "
            "(a guarded or use_extensions block); run the check outside that block"
        )
    if tolerance is not None and not (0 <= tolerance < float("inf")):
        raise RecorderError(
            f"tolerance={tolerance!r}: the near-tie bound is a relative margin >= 0 (0: identical kept sets); "
            "leave it out for the bound derived from the dtype"
        )


def _shape_of(run_dir: Path, manifest: dict[str, Any], model: Any) -> tuple[int, int, bool]:
    """The checking model's layers and score sets (the run's gqa), refused when not the run's shape."""
    shape = model_shape(model.config)
    layers, hkv = shape.layers, shape.kv_heads
    info = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    if info.get("num_layers") not in (None, layers) or info.get("num_kv_heads") not in (None, hkv):
        raise RecorderError(
            f"{run_dir}: the run's model has {info.get('num_layers')} layers and {info.get('num_kv_heads')} "
            f"KV heads, the checking model {layers} and {hkv}; pass the model the run used"
        )
    gqa = (manifest.get("config") or {}).get("gqa") or H2OConfig.gqa
    return layers, shape.sets(gqa), gqa == "none"


def _tolerance(manifest: dict[str, Any], model: Any, tolerance: float | None) -> tuple[torch.dtype, float]:
    """The coarser of the run's and the model's dtype, and the near-tie bound (given, or of that dtype)."""
    info = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    run_dtype = _DTYPES.get(str(info.get("dtype")), dtype)
    coarse = max((dtype, run_dtype), key=lambda d: torch.finfo(d).eps)
    return coarse, tie_tolerance(coarse) if tolerance is None else float(tolerance)


def _logged(ev_tab: Any, gqa_none: bool) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The logged evictions as arrays (the head column is the query head under ``gqa="none"``), their
    margins and their scores (NaN where not logged)."""
    ev = {k: np.asarray(ev_tab[k].to_pylist(), dtype=np.int64) for k in ("request", "step", "layer", "position")}
    heads = ev_tab["q_head"] if gqa_none else ev_tab["kv_head"]
    ev["kv_head"] = ev["q_head"] = np.asarray(heads.fill_null(-1).to_pylist(), dtype=np.int64)
    margin = np.asarray(ev_tab["margin"].fill_null(float("nan")).to_pylist(), dtype=np.float64)
    score = np.asarray(ev_tab["score"].fill_null(float("nan")).to_pylist(), dtype=np.float64)
    return ev, margin, score


def _margins(ev: dict[str, np.ndarray], margin: np.ndarray, score: np.ndarray, rows: np.ndarray) -> dict:
    """(margin, score) of each logged eviction of ``rows`` by (layer, head, position, step)."""
    return {
        (int(ev["layer"][i]), int(ev["kv_head"][i]), int(ev["position"][i]), int(ev["step"][i])): (margin[i], score[i])
        for i in rows
        if np.isfinite(margin[i])
    }
