"""Budgets that differ by layer and KV set: a budget plan (DESIGN.md §2.14).

A :class:`BudgetPlan` gives every layer, and optionally every KV set of a layer, its own slot
count; ``H2OConfig(plan=...)`` runs the policy with it. Inside each (layer, KV set) the policy is
exactly the uniform one (DESIGN.md §2): the same keep rule, tie rules and victim choice, with the
split of that set's slot count ``B`` taken as a keep ratio's is (``heavy = ⌊B / 2⌋``,
``recent = B − heavy``, then the policy's own re-split). A plan in shares of the prompt
(``ratios``) is resolved per request against its prompt length, as a keep ratio is
(``max(2, round(r · P))`` slots per entry).

The runtime sees a plan through :class:`~h2o_lens.ops.PolicyArgs`: the request's budget carries
the resolved table (``plan``, the ``(heavy, recent, sink)`` of every layer and KV set) and each
layer reads its own budget from it (:func:`layer_args`). A layer whose KV sets share one count
runs the uniform code paths unchanged (the Triton step included); a layer whose sets differ is
*ragged*: its storage is as wide as its largest set, each set uses its first ``B_s`` slots
(:func:`row_budgets`), the slots beyond hold position −1 and are never attended, eligible or
written, as for the per-request budgets of a batch (DESIGN.md §2.7).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
from typing import Any

import torch

from . import eviction, ops
from . import policies as registry
from .errors import ConfigError

__all__ = [
    "BudgetPlan",
    "coerce",
    "load",
    "policy_args",
    "layer_args",
    "row_budgets",
    "prefill_keep",
    "eligible_mask",
    "kernel_step",
    "set_windows",
    "relative",
    "scaled",
    "PLAN_FORMAT",
]

#: the ``format`` of a plan file written by :meth:`BudgetPlan.save`
PLAN_FORMAT = "h2o-lens-plan-1"
#: what the first bytes of a plan file hold (a file h2o-lens wrote, which ``plan -o`` may replace)
PLAN_MARKER = b'"format": "h2o-lens-plan-1"'


def _table(name: str, value: Any, whole: bool) -> tuple[tuple[Any, ...], ...]:
    """``value`` as a tuple of per-layer tuples of numbers (an entry per layer may be a number)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"plan {name} must be a list with one entry per layer, got {value!r}")
    rows = []
    for i, row in enumerate(value):
        row = (row,) if isinstance(row, numbers.Number) else tuple(row)
        if not row:
            raise ConfigError(f"plan {name}: layer {i} has no entry; give a number, or one per KV set")
        for x in row:
            ok = not isinstance(x, bool) and isinstance(x, numbers.Real) and math.isfinite(x)
            if whole and not (ok and isinstance(x, numbers.Integral) and x >= 1):
                raise ConfigError(f"plan slots must be whole numbers >= 1, got {x!r} in layer {i}")
            if not whole and not (ok and 0 < x <= 1):
                raise ConfigError(f"plan ratios must be numbers in (0, 1], got {x!r} in layer {i}")
        rows.append(tuple(int(x) if whole else float(x) for x in row))
    if not rows:
        raise ConfigError(f"plan {name} is empty; give one entry per layer")
    return tuple(rows)


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """Slot counts per layer and KV set.

    Parameters
    ----------
    slots : sequence, optional
        One entry per layer: a slot count for every KV set of the layer, or a sequence of one
        count per KV set (KV heads, or query heads under ``gqa="none"``).
    ratios : sequence, optional
        The same in shares of each request's prompt, each in (0, 1]; resolved per prompt
        (:meth:`resolve`). Give ``slots`` or ``ratios``, not both.
    """

    slots: tuple[tuple[int, ...], ...] | None = None
    ratios: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        if (self.slots is None) == (self.ratios is None):
            raise ConfigError("a budget plan gives either slots or ratios per layer, not both nor neither")
        if self.slots is not None:
            object.__setattr__(self, "slots", _table("slots", self.slots, True))
        else:
            object.__setattr__(self, "ratios", _table("ratios", self.ratios, False))

    @property
    def table(self) -> tuple[tuple[Any, ...], ...]:
        return self.slots if self.slots is not None else self.ratios

    @property
    def layers(self) -> int:
        return len(self.table)

    @property
    def resolved(self) -> bool:
        """True when the plan is in slot counts."""
        return self.slots is not None

    def resolve(self, prompt_len: int) -> BudgetPlan:
        """The plan in slot counts for a prompt of ``prompt_len`` tokens."""
        if self.resolved:
            return self
        return BudgetPlan(slots=tuple(tuple(registry.ratio_slots(r, prompt_len) for r in row) for row in self.ratios))

    def counts(self, layer: int, sets: int) -> tuple[int, ...]:
        """The slot counts of ``layer``'s ``sets`` KV sets (a resolved plan)."""
        row = self.slots[layer]
        return row * sets if len(row) == 1 else row

    def check(self, layers: int, sets: int) -> None:
        """A ConfigError unless the plan has ``layers`` layers of 1 or ``sets`` entries each."""
        if self.layers != layers:
            raise ConfigError(f"the budget plan has {self.layers} layers, the model {layers}; plan this model")
        bad = [i for i, row in enumerate(self.table) if len(row) not in (1, sets)]
        if bad:
            raise ConfigError(
                f"the budget plan gives layer {bad[0]} {len(self.table[bad[0]])} entries; the model has "
                f"{sets} KV sets per layer under this gqa mode: give 1 or {sets}"
            )

    def total(self, sets: int) -> int:
        """Slots of every layer and KV set together (a resolved plan)."""
        return sum(sum(self.counts(i, sets)) for i in range(self.layers))

    def to_dict(self) -> dict[str, Any]:
        key = "slots" if self.resolved else "ratios"
        return {key: [list(row) for row in self.table]}

    def save(self, path: str | os.PathLike, evidence: dict | None = None) -> None:
        """Write the plan as JSON (``format``, the table, and the planner's ``evidence`` if any)."""
        doc = {"format": PLAN_FORMAT, **self.to_dict()}
        if evidence is not None:
            doc["evidence"] = evidence
        with open(path, "w", encoding="utf-8") as f:  # the format first: it marks the file as a plan
            json.dump(doc, f, indent=1)
            f.write("\n")

    def describe(self) -> str:
        """``plan of 2 layers, 0.1..0.3 of the prompt`` / ``plan of 2 layers, 4..12 slots``."""
        flat = [x for row in self.table for x in row]
        unit = "slots" if self.resolved else "of the prompt"
        return f"plan of {self.layers} layers, {min(flat):g}..{max(flat):g} {unit}"


def load(path: str | os.PathLike) -> BudgetPlan:
    """The plan a JSON file holds (what :meth:`BudgetPlan.save` writes; ``evidence`` is not read)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read the budget plan {os.fspath(path)!r}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"the budget plan {os.fspath(path)!r} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise ConfigError(f"{os.fspath(path)!r} is not a budget plan (expected format {PLAN_FORMAT!r})")
    return coerce({k: doc[k] for k in ("slots", "ratios") if k in doc})


def coerce(value: Any) -> BudgetPlan | None:
    """A :class:`BudgetPlan` from a plan, a dict (``to_dict``'s) or a path to a plan file."""
    if value is None or isinstance(value, BudgetPlan):
        return value
    if isinstance(value, dict):
        extra = set(value) - {"slots", "ratios"}
        if extra:
            raise ConfigError(f"a budget plan has slots or ratios, got the keys {sorted(extra)}")
        return BudgetPlan(**value)
    if isinstance(value, (str, os.PathLike)):
        return load(value)
    raise ConfigError(f"plan must be a BudgetPlan, its dict or the path of a plan file, got {type(value).__name__}")


def split(config: Any, slots: int) -> tuple[int, int, int]:
    """``(heavy, recent, sink)`` the policy of ``config`` uses in a set of ``slots`` slots."""
    heavy, recent = registry.half_split(slots)
    spec = config.spec
    problem = spec.check_budget(heavy, recent, config.sink)
    if problem is not None:
        raise ConfigError(f"a plan entry of {slots} slots: {problem}")
    return spec.split(heavy, recent, config.sink)


def policy_args(config: Any, sets: int | None = None) -> ops.PolicyArgs:
    """The :class:`~h2o_lens.ops.PolicyArgs` of a resolved config: with a plan, the split of its
    largest entry (the storage width of the widest layer) and the per-layer table ``plan``."""
    if config.plan is None:
        return ops.PolicyArgs(config.policy, *config.split, config.gqa, config.seed, config.pinned)
    plan = config.plan
    table = tuple(tuple(split(config, b) for b in row) for row in plan.slots)
    widest = max((s for row in table for s in row), key=sum)
    return ops.PolicyArgs(config.policy, *widest, config.gqa, config.seed, config.pinned, plan=table)


@functools.lru_cache(maxsize=1024)
def layer_args(args: ops.PolicyArgs, layer: int) -> ops.PolicyArgs:
    """The budget of one ``layer`` from a request's budget: itself without a plan; with one, the
    layer's split (``sets`` holds each KV set's when they differ, and the split is then the widest's)."""
    if args.plan is None:
        return args
    row = args.plan[layer]
    widest = max(row, key=sum)
    sets = None if len(set(row)) == 1 else row
    return dataclasses.replace(args, heavy=widest[0], recent=widest[1], sink=widest[2], plan=None, sets=sets)


def _set_table(args: ops.PolicyArgs, hs: int) -> list[tuple[int, int, int]]:
    """``(capacity, recent, sink)`` of each of ``hs`` KV sets."""
    pins = len(args.pinned)
    if args.sets is None:
        return [(args.capacity, args.recent, args.sink)] * hs
    return [(h + r + s + pins, r, s) for h, r, s in (args.sets * hs if len(args.sets) == 1 else args.sets)]


def row_budgets(budgets: list[ops.PolicyArgs], rows: torch.Tensor, hs: int) -> ops.RowBudgets:
    """:class:`~h2o_lens.ops.RowBudgets` of a layer whose budgets ``budgets`` (one per distinct
    request budget, ``rows (b,)`` the index of each row) may differ by KV set: ``capacity``,
    ``recent`` and ``sink`` are ``(b, Hs, 1)`` when some budget has per-set counts."""
    if all(a.sets is None for a in budgets):
        return ops.RowBudgets.of(budgets, rows)
    table = torch.tensor([_set_table(a, hs) for a in budgets], dtype=torch.int64)  # (n, Hs, 3)
    t = table.to(rows.device)[rows][..., None]  # (b, Hs, 3, 1)
    used = set(rows.tolist())
    self_victim = any(r == 0 for i in used for _, r, _ in _set_table(budgets[i], hs))
    return ops.RowBudgets(t[:, :, 0], t[:, :, 1], t[:, :, 2], self_victim)


def _per_set(args: ops.PolicyArgs, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(heavy, recent, sink)`` of each KV set as ``(Hs, 1)`` tensors on ``like``'s device."""
    hs = like.shape[-2]
    sets = args.sets * hs if len(args.sets) == 1 else args.sets
    t = torch.tensor(sets, dtype=torch.int64, device=like.device)  # (Hs, 3)
    return t[:, 0:1], t[:, 1:2], t[:, 2:3]


def prefill_keep(drive, positions, args: ops.PolicyArgs, pins):
    """:func:`h2o_lens.eviction.prefill_keep` with ``args``' split, per KV set for a ragged layer:
    ``drive, positions (b, Hs, P)`` → ``(b, Hs, P)`` bool; ``pins (b, 1, K)`` the protected
    positions per row (DESIGN.md §2.11), or None."""
    if args.sets is None:
        return eviction.prefill_keep(drive, positions, args.heavy, args.recent, args.sink, pins)
    keep = torch.empty(positions.shape, dtype=torch.bool, device=positions.device)
    sets = args.sets * positions.shape[1] if len(args.sets) == 1 else args.sets
    row_pins = None if pins is None else pins[:, 0]  # (b, 1, K) → (b, K) against one set's (b, P)
    for h, (heavy, recent, sink) in enumerate(sets):
        keep[:, h] = eviction.prefill_keep(drive[:, h], positions[:, h], heavy, recent, sink, row_pins)
    return keep


def eligible_mask(positions, step, args: ops.PolicyArgs, pins):
    """:func:`h2o_lens.eviction.eligible_mask` with ``args``' recent window and sink, per KV set
    for a ragged layer (``positions (b, Hs, P)``, ``step`` broadcastable to ``(b, 1, 1)``)."""
    if args.sets is None:
        return eviction.eligible_mask(positions, step, args.recent, args.sink, pinned=pins)
    _, recent, sink = _per_set(args, positions)
    return eviction.eligible_mask(positions, step, recent, sink, pinned=pins)


def kernel_step(layer: Any, q, k, v, step, scaling: float, asks: tuple | None = None) -> ops.DecodeResult:
    """The fused step of a ragged layer (Triton's, or the compiled CPU one): one call, each (request,
    KV set) with its own capacity, recent window and sink (:func:`h2o_lens.kernels.decode_step_triton`'s
    ``rows``); ``asks``: what the CPU step also gives or takes, ``(want_candidates, weights, journal,
    protected)`` or None (the Triton step is called without them)."""
    from .kernels import fused_step

    args = layer.groups()[0][1]
    return fused_step(layer.owner.backend, asks)(
        q,
        k,
        v,
        layer.keys,
        layer.values,
        layer.scores,
        layer.positions,
        step,
        layer.fill,
        scaling,
        args,
        layer=layer.layer_idx,
        rows=layer.row_budgets(),
    )


def set_windows(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(recent, sink)`` of a cache layer's rows and KV sets as it steps now, ``(b, Hs)`` int64 on
    the CPU: what its eviction choices used (the recorder's ``left_recent`` and promotions)."""
    b, hs = layer.positions.shape[:2]
    rows = layer.row_budgets()
    if rows is None:
        args = layer.groups()[0][1]
        return torch.full((b, hs), args.recent, dtype=torch.int64), torch.full((b, hs), args.sink, dtype=torch.int64)
    return tuple(t[..., 0].expand(b, hs).to("cpu", torch.int64) for t in (rows.recent, rows.sink))


def relative(plan: BudgetPlan) -> tuple[Any, ...]:
    """A plan's entries divided by their mean over every layer and KV set (a layer of one entry
    stands for all its sets): the shape of the plan, at any total (a sweep scales it to each keep
    ratio, :func:`scaled`)."""
    mean = sum(sum(row) / len(row) for row in plan.table) / plan.layers
    return tuple(
        round(row[0] / mean, 6) if len(row) == 1 else tuple(round(x / mean, 6) for x in row) for row in plan.table
    )


def scaled(weights: tuple[Any, ...], ratio: float) -> BudgetPlan:
    """The plan of :func:`relative` ``weights`` at a mean keep ratio of ``ratio`` (an entry above 1
    keeps its whole prompt: the mean is then below ``ratio``)."""

    def one(x: float) -> float:
        return min(1.0, round(x * ratio, 6))

    return BudgetPlan(ratios=[one(w) if isinstance(w, numbers.Real) else [one(x) for x in w] for w in weights])
