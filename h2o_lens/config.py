"""Policy configuration: a frozen, validated dataclass.

A budget is a fixed slot count per layer and KV head: ``heavy`` slots chosen
by cumulative attention plus the ``recent`` newest positions. Baselines are
compared at the same slot count ``B = heavy + recent`` (DESIGN.md §2).
A keep ratio of the prompt is accepted as a convenience and resolved to
counts once, with :meth:`H2OConfig.resolve`. Pinned prompt positions, never
evicted, take slots inside the budget (:func:`pin`, DESIGN.md §2.11). What
depends on the policy (its split, its budget check, whether it evicts) is read
from the policy registry, :mod:`h2o_lens.policies` (DESIGN.md §2.9).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from . import policies as registry
from .cold_config import ColdTier, cold_tier
from .errors import ConfigError

__all__ = ["H2OConfig", "POLICIES", "GQA_MODES", "BACKENDS", "pin", "pin_positions"]

POLICIES = registry.names()
GQA_MODES = ("sum", "max", "none")
BACKENDS = ("auto", "torch", "triton", "cpp")


def _count(name: str, value: Any, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(
            f"{name} must be a whole number of KV slots, got {value!r} "
            f"({type(value).__name__}); pass an int such as {name}=64, "
            "or use ratio=0.2 for a share of the prompt"
        )
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}; pass a slot count such as {name}=64")


def pin_positions(value: Any) -> tuple[int, ...]:
    """``pinned`` as a sorted tuple of distinct prompt positions, or a ConfigError (also the check
    of a press recording's pins, DESIGN.md §17.3)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(
            f"pinned must be a sequence of prompt positions, got {value!r} ({type(value).__name__}); "
            "pass e.g. pinned=(12, 13, 14)"
        )
    out: list[int] = []
    seen: set[int] = set()
    dup: set[int] = set()
    for p in value:
        if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 0:
            raise ConfigError(
                f"pinned positions must be whole numbers >= 0 (0-based positions of the prompt's "
                f"real tokens, as in the tokens table), got {p!r} in {value!r}"
            )
        (dup if int(p) in seen else seen).add(int(p))
        out.append(int(p))
    if dup:
        raise ConfigError(f"pinned positions must be distinct, got {sorted(dup)} more than once in {value!r}")
    return tuple(sorted(out))


def unpinned_split(heavy: int, recent: int, pinned: int) -> tuple[int, int]:
    """``(heavy, recent)`` left to a policy once ``pinned`` slots are taken out of a budget:
    out of ``heavy`` first, then out of ``recent`` (DESIGN.md §2.11)."""
    from_heavy = min(heavy, pinned)
    return heavy - from_heavy, recent - (pinned - from_heavy)


@dataclasses.dataclass(frozen=True)
class H2OConfig:
    """How the KV cache of every layer and KV head is compressed.

    Parameters
    ----------
    policy : str
        A name of the policy registry (:func:`h2o_lens.policies.names`):
        ``"h2o"`` (heavy hitters + recent window), or a baseline at the same
        slot count: ``"full"`` (no eviction), ``"local"`` (recent only),
        ``"heavy"`` (heavy hitters only), ``"sink"`` (first ``sink`` tokens +
        recent, StreamingLLM), ``"random"`` (seeded random victim outside the
        recent window), ``"tova"`` (current attention only),
        ``"scissorhands"`` (count of low attention over a history window).
    heavy, recent : int
        Slot counts. For baselines, ``heavy + recent`` is the slot count and
        the split is taken from the policy (see :attr:`split`).
    ratio : float, optional
        Total keep ratio of the prompt, in (0, 1]; resolved to counts by
        :meth:`resolve` (half heavy, half recent) before generation.
    gqa : str
        How the query heads that share a KV head aggregate their weights:
        ``"sum"`` (default), ``"max"``, or ``"none"`` (one set per query head,
        K/V duplicated: the diagnostic upper bound).
    sink : int
        Number of first positions always kept by the ``sink`` policy.
    seed : int
        Seed of the ``random`` policy.
    pinned : tuple of int
        Prompt positions (0-based, real tokens, as in the ``tokens`` table) that are never
        evicted, in every layer and KV set (DESIGN.md §2.11). They occupy slots inside the
        budget ``B = heavy + recent``: out of ``heavy`` first, then out of ``recent``
        (:attr:`split` is what is left to the policy). Stored sorted.
    cold : ColdTier, optional
        A cold tier (DESIGN.md §2.13): evicted K/V move to a cold store and a recall window of
        ``cold.recall`` slots inside ``B`` (out of ``heavy`` first, then ``recent``, after the
        pins) holds the cold entries the current queries attend to most. None: off.
    backend : str
        ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"``, ``"triton"`` or ``"cpp"`` (the
        fused CPU decode step, compiled on first use: :mod:`h2o_lens.kernels.cpu`, DESIGN.md §2.8).
    plan : BudgetPlan, dict or path, optional
        Slot counts (or shares of the prompt) per layer and KV set instead of one budget
        (:class:`h2o_lens.plan.BudgetPlan`, DESIGN.md §2.14); a dict or the path of a plan
        file is read into one. Give it instead of ``heavy``/``recent``/``ratio``.
    """

    policy: str = "h2o"
    heavy: int | None = None
    recent: int | None = None
    ratio: float | None = None
    gqa: str = "sum"
    sink: int = 4
    seed: int = 0
    backend: str = "auto"
    pinned: tuple[int, ...] = ()
    cold: ColdTier | None = None
    plan: Any = None

    def __post_init__(self) -> None:
        registry.get(self.policy)  # ConfigError naming the known policies
        if self.gqa not in GQA_MODES:
            raise ConfigError(f"unknown gqa {self.gqa!r}; expected one of {', '.join(GQA_MODES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; expected one of {', '.join(BACKENDS)}")
        _count("heavy", self.heavy)
        _count("recent", self.recent)
        _count("sink", self.sink, allow_none=False)
        _count("seed", self.seed, allow_none=False)
        object.__setattr__(self, "pinned", pin_positions(self.pinned))
        object.__setattr__(self, "cold", cold_tier(self.cold))
        if self.plan is not None:
            if self.cold is not None:
                raise ConfigError("a cold tier with a budget plan is not supported; give one or the other")
            self._check_plan()
            return
        if not self.spec.evicts:
            if self.cold is not None:
                raise ConfigError(f"policy {self.policy!r} evicts nothing, so a cold tier has nothing to keep")
            if self.pinned:
                raise ConfigError(
                    f"policy {self.policy!r} evicts nothing, so pinned={list(self.pinned)} means "
                    "nothing; pin positions only with an evicting policy (h2o, local, ...)"
                )
            return
        if self.ratio is not None:
            if self.heavy is not None or self.recent is not None:
                raise ConfigError(
                    f"give either ratio or heavy/recent, got ratio={self.ratio!r}, "
                    f"heavy={self.heavy!r}, recent={self.recent!r}"
                )
            if (
                isinstance(self.ratio, bool)
                or not isinstance(self.ratio, numbers.Real)
                or not math.isfinite(self.ratio)
                or not 0 < self.ratio <= 1
            ):
                raise ConfigError(f"ratio must be a number in (0, 1], got {self.ratio!r}; e.g. ratio=0.2")
            return
        if self.heavy is None or self.recent is None:
            raise ConfigError(
                f"policy {self.policy!r} needs a budget: got heavy={self.heavy!r}, "
                f"recent={self.recent!r}; pass both (e.g. heavy=64, recent=64) or ratio=0.2"
            )
        if self.heavy + self.recent == 0:
            raise ConfigError(
                "heavy + recent is 0: a cache of zero slots cannot attend to anything; "
                "pass a positive budget such as heavy=64, recent=64"
            )
        if self.pinned or self.cold is not None:
            self._check_pinned()
            return
        problem = self.spec.check_budget(self.heavy, self.recent, self.sink)
        if problem is not None:
            raise ConfigError(problem)

    def _check_plan(self) -> None:
        """A plan replaces the budget: no heavy, recent or ratio beside it (DESIGN.md §2.14)."""
        from . import plan as _plan

        object.__setattr__(self, "plan", _plan.coerce(self.plan))
        if not self.spec.evicts:
            raise ConfigError(f"policy {self.policy!r} evicts nothing, so a budget plan means nothing")
        given = {
            k: v for k, v in (("heavy", self.heavy), ("recent", self.recent), ("ratio", self.ratio)) if v is not None
        }
        if given:
            raise ConfigError(f"give either a plan or a budget, got a plan and {given}")
        if self.pinned:
            raise ConfigError("pinned positions with a budget plan are not supported; pin with a uniform budget")
        if self.plan.resolved:
            from .plan import split

            for b in {x for row in self.plan.slots for x in row}:
                split(self, b)  # ConfigError for an entry the policy cannot split

    def _check_pinned(self) -> None:
        """The pinned positions and the recall window fit in the budget and leave the policy the
        slots it needs."""
        k, total = self.taken, self.heavy + self.recent
        if self.pinned:
            need = f"the {k} pinned position{'s' if k > 1 else ''} need{'' if k > 1 else 's'} {k} of the {total} slots"
        if self.cold is not None:
            need = f"the pins and the cold tier's recall window need {k} of the {total} slots"
        if k >= total:
            raise ConfigError(
                f"{need} and leave no slot for the {self.policy!r} policy; pass a budget of at least "
                f"{k + 1} slots (heavy + recent) or " + ("recall fewer" if self.cold else "pin fewer positions")
            )
        heavy, recent = unpinned_split(self.heavy, self.recent, k)
        problem = self.spec.check_budget(heavy, recent, self.sink)
        if problem is not None:
            raise ConfigError(f"{need}, leaving heavy={heavy}, recent={recent} to the policy: {problem}")

    # ------------------------------------------------------------------ derived
    @property
    def spec(self) -> registry.Policy:
        """The policy's entry in the registry (:mod:`h2o_lens.policies`)."""
        return registry.get(self.policy)

    @property
    def resolved(self) -> bool:
        """True when the budget is in slot counts (or the policy does not evict)."""
        if self.plan is not None:
            return self.plan.resolved
        return not self.spec.evicts or self.ratio is None

    @property
    def capacity(self) -> int | None:
        """Slots per layer and KV set, ``None`` for the full cache (with a plan: its largest entry)."""
        if not self.spec.evicts:
            return None
        self._need_resolved()
        if self.plan is not None:
            return max(x for row in self.plan.slots for x in row)
        return int(self.heavy) + int(self.recent)

    @property
    def taken(self) -> int:
        """Slots of ``B`` the policy does not split: the pins and the cold tier's recall window."""
        return len(self.pinned) + (self.cold.recall if self.cold is not None else 0)

    @property
    def split(self) -> tuple[int, int, int]:
        """``(heavy, recent, sink)`` slots actually used by the policy.

        Baselines keep the slot count ``B = heavy + recent`` and re-split it
        (:meth:`h2o_lens.policies.Policy.split`): local ``(0, B, 0)``, heavy
        ``(B, 0, 0)``, sink ``(0, B - s, s)``. With ``k`` pinned positions the
        policy splits the ``B - k`` other slots: the pins are taken out of
        ``heavy`` first, then out of ``recent`` (DESIGN.md §2.11); so is a cold tier's recall
        window, after the pins (DESIGN.md §2.13).
        """
        if self.capacity is None:
            raise ConfigError("the full-cache policy has no slot split")
        if self.plan is not None:
            raise ConfigError("a budget plan splits each layer and KV set on its own; read plan.split(config, slots)")
        heavy, recent = unpinned_split(int(self.heavy), int(self.recent), self.taken)
        return self.spec.split(heavy, recent, self.sink)

    def resolve(self, prompt_len: int) -> H2OConfig:
        """Turn a ``ratio`` budget into slot counts for a prompt of ``prompt_len`` tokens."""
        if self.resolved:
            return self
        if self.plan is not None:
            return dataclasses.replace(self, plan=self.plan.resolve(prompt_len))
        heavy, recent = registry.half_split(registry.ratio_slots(self.ratio, prompt_len))
        return dataclasses.replace(self, ratio=None, heavy=heavy, recent=recent)

    def _need_resolved(self) -> None:
        if not self.resolved:
            raise ConfigError(
                f"budget ratio={self.ratio} is not resolved to slot counts yet; call config.resolve(prompt_len) first"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for manifests and Parquet metadata (``cold`` only when a cold tier is on, a plan,
        if any, as its ``to_dict``)."""
        out = dataclasses.asdict(self)
        if out["cold"] is None:
            del out["cold"]
        if self.plan is None:
            del out["plan"]  # a config without a plan reads as before it existed
        else:
            out["plan"] = self.plan.to_dict()
        return out

    def describe(self) -> str:
        """One line for humans, e.g. ``h2o heavy=64 recent=64 gqa=sum``."""
        if not self.spec.evicts:
            return "full cache"
        pins = f" pinned={_show_positions(self.pinned)}" if self.pinned else ""
        if self.cold is not None:
            pins += f" {self.cold.describe()}"
        if self.plan is not None:
            return f"{self.policy} {self.plan.describe()} gqa={self.gqa}"
        if not self.resolved:
            return f"{self.policy} ratio={self.ratio}{pins} gqa={self.gqa}"
        h, r, s = self.split
        extra = (f" sink={s}" if s else "") + pins
        return f"{self.policy} heavy={h} recent={r}{extra} (B={self.capacity}) gqa={self.gqa}"


def _show_positions(positions: tuple[int, ...]) -> str:
    """``[3, 4, 9]``, or ``12 positions [3, 4, 5, …, 40]`` for a long list."""
    if len(positions) <= 6:
        return "[" + ", ".join(map(str, positions)) + "]"
    head = ", ".join(map(str, positions[:3]))
    return f"{len(positions)} positions [{head}, …, {positions[-1]}]"


def pin(config: H2OConfig, positions: Any) -> H2OConfig:
    """The same policy at the same slot count, with ``positions`` never evicted (DESIGN.md §2.11).

    Parameters
    ----------
    config : H2OConfig
        A resolved, evicting config (explicit ``heavy`` and ``recent``, as in a run
        manifest's ``config``); a config that already pins positions gets the new set.
    positions : sequence of int
        0-based positions of the prompt's real tokens (the ``tokens`` table's ``position``).

    Returns
    -------
    H2OConfig
        ``heavy`` and ``recent`` unchanged (the slot count ``B``), ``pinned`` sorted; its
        :attr:`~H2OConfig.split` takes the pinned slots out of ``heavy`` first, then out
        of ``recent``.

    Raises
    ------
    ConfigError
        For a full-cache or unresolved config, bad positions, or a budget the pinned set
        leaves no room in (the message says how many slots it needs).
    """
    if not isinstance(config, H2OConfig):
        raise ConfigError(f"pin needs an H2OConfig, got {type(config).__name__}")
    if not config.spec.evicts:
        raise ConfigError(f"policy {config.policy!r} evicts nothing: there is nothing to pin against")
    if not config.resolved:
        raise ConfigError(
            f"pin needs a budget in slot counts, got ratio={config.ratio}; resolve it first "
            "(config.resolve(prompt_len), or the config of the run's manifest)"
        )
    return dataclasses.replace(config, pinned=pin_positions(positions))
