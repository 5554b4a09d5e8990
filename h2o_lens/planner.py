"""A budget planner for H2O: where does this model need its slots (DESIGN.md §2.15)?

Given calibration prompts, :func:`plan_budgets`

1. measures each layer's and KV set's *concentration* on the teacher's attention (full attention,
   no eviction): for the last ``rows`` query rows of every prompt, the weights of the set's query
   heads (their mean, a distribution over the keys) sorted in descending order give the keys that
   hold 90 % and 95 % of the mass (``k90``, ``k95``, as shares of the prompt) and the coverage of
   the best ``B`` keys at the uniform budget (the most any kept set of ``B`` slots could hold; its
   1st and 5th percentiles over rows, ``p1``, ``p5``);
2. calibrates each layer's (``by="head"``: each layer's and KV set's) *sensitivity* with short
   sweeps: every layer (set) in turn gets half the uniform budget while the others keep it, and
   the mean KL(full ‖ planned) over ``steps`` teacher-forced tokens (the full model's own greedy
   continuation) above the uniform budget's, divided by the mass that halving takes from its best
   keys, is its loss per unit of dropped mass;
3. allocates the total greedily, one share unit (``1 / GRID`` of the prompt) at a time, to the
   layer (``by="layer"``) or layer and KV set (``by="head"``) whose next unit buys the largest
   loss saved: sensitivity × coverage gained. The coverage curves are concave, so the greedy
   choice is the best allocation of the estimated loss. Calibrated, every entry stays between half
   and twice the total, the range where its loss was measured; with ``steps=0`` (no sweep) the
   plan follows the attention mass alone, from 2 % of the prompt up.

The plan is in shares of the prompt (``BudgetPlan(ratios=...)``), averaging ``total`` over every
layer and KV set, so it applies to prompts of any length as a keep ratio does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from . import compat, hooks
from .config import H2OConfig
from .errors import ConfigError
from .plan import BudgetPlan
from .shape import model_shape

__all__ = ["Concentration", "concentration", "sensitivity", "allocate", "plan_budgets"]

GRID = 200  # share units per prompt: a plan's entries are multiples of 1 / GRID


@dataclasses.dataclass
class Concentration:
    """Per layer and KV set ``(L, S)``: ``k90``, ``k95`` (shares of the prompt), ``p1``, ``p5``
    (coverage of the best keys at the uniform budget) and ``curve (L, S, GRID + 1)``: the mean
    coverage of the best ``q · P`` keys at each share ``q = i / GRID`` (linear between whole counts)."""

    k90: np.ndarray
    k95: np.ndarray
    p1: np.ndarray
    p5: np.ndarray
    curve: np.ndarray


@contextlib.contextmanager
def _teacher_rows(store: dict, rows: int, sets: int, gqa: str) -> Iterator[None]:
    """Inside an H2O scope that evicts nothing: the attention weights of the last ``rows`` query rows
    of each layer, averaged over each KV set's query heads, land in ``store[layer]`` ``(S, R, P)``."""
    from transformers import AttentionInterface

    def spy(module, query, key, value, attention_mask, **kw):
        if query.shape[2] > 1:  # the prompt
            q = query[0, :, -rows:].double()  # (Hq, R, d)
            k = key[0].double()  # (Hkv, P, d)
            hq, p = q.shape[0], k.shape[1]
            k = k.repeat_interleave(hq // k.shape[0], 0)
            scaling = kw.get("scaling") or q.shape[-1] ** -0.5
            logits = torch.einsum("hrd,hpd->hrp", q, k) * scaling
            r = q.shape[1]
            causal = torch.arange(p)[None, :] > torch.arange(p - r, p)[:, None]
            w = torch.softmax(logits.masked_fill(causal, float("-inf")), -1)  # (Hq, R, P)
            store[module.layer_idx] = w.reshape(sets, hq // sets, r, p).mean(1)
        return hooks.h2o_attention(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(hooks.ATTN_NAME, spy)
    try:
        yield
    finally:
        AttentionInterface.register(hooks.ATTN_NAME, hooks.h2o_attention)


def concentration(model: Any, prompts: Sequence[Sequence[int]], total: float, gqa: str = "sum", rows: int = 32):
    """:class:`Concentration` of every layer and KV set on the teacher's attention over ``prompts``
    (token ids, each run alone), with ``total`` the uniform keep ratio."""
    from .runtime import h2o

    shape = model_shape(model.config)
    sets = shape.sets(gqa)
    k90, k95, cov, curves = [], [], [], []
    q = np.arange(GRID + 1) / GRID
    for ids in prompts:
        p = len(ids)
        store: dict = {}
        cfg = H2OConfig(heavy=p, recent=1, gqa=gqa, backend="torch")  # evicts nothing: the teacher
        with h2o(model, cfg) as session, _teacher_rows(store, rows, sets, gqa), torch.no_grad():
            model(torch.tensor([list(ids)]), **compat.cache_kwargs(session.new_cache()), use_cache=True)
        w = torch.stack([store[i] for i in range(shape.layers)]).numpy()  # (L, S, R, P)
        top = -np.sort(-w, -1).cumsum(-1)  # (L, S, R, P): coverage of the best b + 1 keys
        k90.append(((top < 0.9).sum(-1) + 1) / p)
        k95.append(((top < 0.95).sum(-1) + 1) / p)
        b = max(2, int(round(total * p)))
        cov.append(top[..., min(b, p) - 1])
        # coverage of x = q · P keys, linear between whole key counts (0 keys hold 0): a concave curve
        topz = np.concatenate([np.zeros(top.shape[:-1] + (1,)), top], -1)  # (L, S, R, P + 1)
        x = q * p
        lo = np.floor(x).astype(int)
        hi = np.minimum(lo + 1, p)
        at = np.take(topz, lo, -1) + (x - lo) * (np.take(topz, hi, -1) - np.take(topz, lo, -1))
        curves.append(at.mean(2))  # (L, S, GRID + 1)
    cov_all = np.concatenate(cov, -1)  # (L, S, rows of every prompt)
    return Concentration(
        k90=np.concatenate(k90, -1).mean(-1),
        k95=np.concatenate(k95, -1).mean(-1),
        p1=np.percentile(cov_all, 1, axis=-1),
        p5=np.percentile(cov_all, 5, axis=-1),
        curve=np.mean(curves, 0),
    )


def _forced_logits(model: Any, ids: list[int], new: list[int], cache: Any) -> torch.Tensor:
    """Log-probabilities ``(len(new), V)`` of the steps that predict each of ``new`` after ``ids``."""
    out = [model(input_ids=torch.tensor([ids]), **compat.cache_kwargs(cache), use_cache=True).logits[0, -1]]
    for j, tok in enumerate(new[:-1]):
        pos = torch.tensor([[len(ids) + j]])
        step = model(input_ids=torch.tensor([[tok]]), **compat.cache_kwargs(cache), use_cache=True, position_ids=pos)
        out.append(step.logits[0, -1])
    return torch.log_softmax(torch.stack(out).double(), -1)


class _Force:
    """A logits processor that makes ``generate`` pick ``new[i]`` at its i-th step (the raw logits,
    ``output_logits``, stay the model's own)."""

    def __init__(self, new: list[int]):
        self.new, self.i = new, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, float("-inf"))
        out[:, self.new[self.i]] = 0.0
        self.i += 1
        return out


def _kl(model: Any, ids: list[int], new: list[int], teacher: torch.Tensor, config: H2OConfig) -> float:
    """Mean KL(teacher ‖ config) over the forced steps. The steps run through ``generate`` so that,
    inside :func:`~h2o_lens.prompt_reuse.reuse_prompts`, every configuration of one prompt starts
    from one prompt forward (DESIGN.md §12.5): a calibration sweep then costs its decode steps."""
    from transformers import LogitsProcessorList

    from .runtime import h2o

    x = torch.tensor([ids])
    with h2o(model, config), torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=len(new),
            do_sample=False,
            logits_processor=LogitsProcessorList([_Force(new)]),
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    got = torch.log_softmax(torch.stack([row[0] for row in out.logits]).double(), -1)
    if got.shape[0] != teacher.shape[0]:  # an end-of-text token forced before the last step
        raise RuntimeError(f"the forced generation gave {got.shape[0]} steps of {teacher.shape[0]}")
    return float((teacher.exp() * (teacher - got)).sum(-1).mean())


def sensitivity(
    model: Any,
    prompts: Sequence[Sequence[int]],
    total: float,
    conc: Concentration,
    gqa: str,
    steps: int,
    by: str = "layer",
    progress: bool = False,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Each layer's (``by="head"``: each layer's and KV set's) loss per unit of dropped mass
    ``(L, S)``, normalised to mean 1, from the short sweeps (module docstring); all ones when
    ``steps`` is 0 or no sweep moves the loss. ``progress``: a bar over the sweeps' runs."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    layers, sets = conc.curve.shape[:2]
    if steps == 0:
        return np.ones((layers, sets)), {"steps": 0}
    half = total / 2
    units = (
        [(layer, None) for layer in range(layers)]
        if by == "layer"
        else [(layer, s) for layer in range(layers) for s in range(sets)]
    )
    from .prompt_reuse import reuse_prompts

    base, loss = [], np.zeros(len(units))
    bar = tqdm(
        total=len(prompts) * (len(units) + 1), desc="plan: calibration sweeps", unit=" runs", disable=not progress
    )
    with reuse_prompts(model) as shared:  # one prompt forward per prompt for all its sweeps
        for ids in prompts:
            ids = list(ids)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
                new = out[0, len(ids) :].tolist()
                teacher = _forced_logits(model, ids, new, DynamicCache(config=model.config))
            uniform = H2OConfig(plan=BudgetPlan(ratios=[total] * layers), gqa=gqa, backend="torch")
            b0 = _kl(model, ids, new, teacher, uniform)
            base.append(b0)
            bar.update(1)
            for u, (layer, s) in enumerate(units):
                ratios: list[Any] = [total] * layers
                ratios[layer] = half if s is None else [half if i == s else total for i in range(sets)]
                cfg = H2OConfig(plan=BudgetPlan(ratios=ratios), gqa=gqa, backend="torch")
                loss[u] += _kl(model, ids, new, teacher, cfg) - b0
                bar.update(1)
    bar.close()
    loss /= len(prompts)
    i0, i1 = int(round(half * GRID)), int(round(total * GRID))
    dropped = conc.curve[:, :, i1] - conc.curve[:, :, i0]  # (L, S) mass the halving takes
    if by == "layer":
        dropped = np.repeat(dropped.mean(1, keepdims=True), sets, 1)
        gain = np.repeat(loss[:, None], sets, 1)
    else:
        gain = loss.reshape(layers, sets)
    s = np.maximum(gain, 0.0) / np.maximum(dropped, 1e-6)
    evidence = {
        "steps": steps,
        "uniform_kl": float(np.mean(base)),
        "half_kl_increase": gain.round(6).tolist(),
        "prompts_reused": shared.hits,
    }
    if not np.any(s > 0):
        return np.ones((layers, sets)), evidence
    return s / s.mean(), evidence


def allocate(curve: np.ndarray, weight: np.ndarray, total: float, floor: float = 0.02, cap: float = 1.0) -> np.ndarray:
    """Shares per row of ``curve (N, GRID + 1)`` (coverage by share) summing to ``total · N``: each
    starts at ``floor`` (at most ``total``) and the rest goes one unit at a time, up to ``cap``
    (at least ``total``), to the row whose next unit gains the most ``weight × coverage``."""
    n = curve.shape[0]
    units = int(round(total * GRID)) * n
    start = min(int(round(floor * GRID)), int(round(total * GRID)))
    top = max(int(round(cap * GRID)), int(round(total * GRID)))
    have = np.full(n, start)
    heap = [(-weight[i] * (curve[i, start + 1] - curve[i, start]), i) for i in range(n) if start < top]
    heapq.heapify(heap)
    for _ in range(units - start * n):
        if not heap:
            break
        _, i = heapq.heappop(heap)
        have[i] += 1
        if have[i] < top:
            j = have[i]
            heapq.heappush(heap, (-weight[i] * (curve[i, j + 1] - curve[i, j]), i))
    return have / GRID


def plan_budgets(
    model: Any,
    prompts: Sequence[Sequence[int]],
    total: float,
    *,
    by: str = "layer",
    gqa: str = "sum",
    steps: int = 8,
    rows: int = 32,
    progress: bool = False,
) -> tuple[BudgetPlan, dict[str, Any]]:
    """The plan of ``total`` (a keep ratio, the mean over every layer and KV set) for ``model`` on
    the calibration ``prompts`` (token ids), and its evidence (module docstring); ``progress``: a
    bar over the calibration sweeps."""
    if by not in ("layer", "head"):
        raise ConfigError(f"by must be 'layer' or 'head', got {by!r}")
    if not 0 < total <= 1:
        raise ConfigError(f"the total must be a keep ratio in (0, 1], got {total!r}")
    if not prompts:
        raise ConfigError("the planner needs at least one calibration prompt")
    conc = concentration(model, prompts, total, gqa, rows)
    sens, sweep = sensitivity(model, prompts, total, conc, gqa, steps, by, progress)
    layers, sets = conc.curve.shape[:2]
    # calibrated, each entry stays where the sweeps measured its loss: between half and twice the
    # total (the loss per unit of mass is not known further out); uncalibrated, anywhere
    bounds = (total / 2, 2 * total) if steps else (0.02, 1.0)
    if by == "layer":
        shares = allocate(conc.curve.mean(1), sens[:, 0], total, *bounds)
        table = [float(x) for x in shares]
        slots = np.repeat(shares[:, None], sets, 1)
    else:
        shares = allocate(conc.curve.reshape(layers * sets, -1), sens.ravel(), total, *bounds)
        slots = shares.reshape(layers, sets)
        table = [[float(x) for x in row] for row in slots]
    plan = BudgetPlan(
        ratios=[max(x, 1 / GRID) if isinstance(x, float) else [max(y, 1 / GRID) for y in x] for x in table]
    )
    evidence = {
        "total": total,
        "by": by,
        "gqa": gqa,
        "prompts": len(prompts),
        "mean_prompt_len": float(np.mean([len(p) for p in prompts])),
        "rows": rows,
        "k90": conc.k90.round(4).tolist(),
        "k95": conc.k95.round(4).tolist(),
        "p1_coverage": conc.p1.round(4).tolist(),
        "p5_coverage": conc.p5.round(4).tolist(),
        "sensitivity": sens.round(4).tolist(),
        "sweep": sweep,
        "shares": slots.round(4).tolist(),
    }
    return plan, evidence
