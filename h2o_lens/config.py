"""Policy configuration: a frozen, validated dataclass.

A budget is a fixed slot count per layer and KV head: ``heavy`` slots chosen
by cumulative attention plus the ``recent`` newest positions. Baselines are
compared at the same slot count ``B = heavy + recent`` (DESIGN.md §2).
A keep ratio of the prompt is accepted as a convenience and resolved to
counts once, with :meth:`H2OConfig.resolve`. What depends on the policy (its
split, its budget check, whether it evicts) is read from the policy registry,
:mod:`h2o_lens.policies` (DESIGN.md §2.9).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from . import policies as registry
from .errors import ConfigError

__all__ = ["H2OConfig", "POLICIES", "GQA_MODES", "BACKENDS"]

POLICIES = registry.names()
GQA_MODES = ("sum", "max", "none")
BACKENDS = ("auto", "torch", "triton")


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
    backend : str
        ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
    """

    policy: str = "h2o"
    heavy: int | None = None
    recent: int | None = None
    ratio: float | None = None
    gqa: str = "sum"
    sink: int = 4
    seed: int = 0
    backend: str = "auto"

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
        if not self.spec.evicts:
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
        problem = self.spec.check_budget(self.heavy, self.recent, self.sink)
        if problem is not None:
            raise ConfigError(problem)

    # ------------------------------------------------------------------ derived
    @property
    def spec(self) -> registry.Policy:
        """The policy's entry in the registry (:mod:`h2o_lens.policies`)."""
        return registry.get(self.policy)

    @property
    def resolved(self) -> bool:
        """True when the budget is in slot counts (or the policy does not evict)."""
        return not self.spec.evicts or self.ratio is None

    @property
    def capacity(self) -> int | None:
        """Slots per layer and KV set, ``None`` for the full cache."""
        if not self.spec.evicts:
            return None
        self._need_resolved()
        return int(self.heavy) + int(self.recent)

    @property
    def split(self) -> tuple[int, int, int]:
        """``(heavy, recent, sink)`` slots actually used by the policy.

        Baselines keep the slot count ``B = heavy + recent`` and re-split it
        (:meth:`h2o_lens.policies.Policy.split`): local ``(0, B, 0)``, heavy
        ``(B, 0, 0)``, sink ``(0, B - s, s)``.
        """
        if self.capacity is None:
            raise ConfigError("the full-cache policy has no slot split")
        return self.spec.split(int(self.heavy), int(self.recent), self.sink)

    def resolve(self, prompt_len: int) -> H2OConfig:
        """Turn a ``ratio`` budget into slot counts for a prompt of ``prompt_len`` tokens."""
        if self.resolved:
            return self
        heavy, recent = registry.half_split(registry.ratio_slots(self.ratio, prompt_len))
        return dataclasses.replace(self, ratio=None, heavy=heavy, recent=recent)

    def _need_resolved(self) -> None:
        if not self.resolved:
            raise ConfigError(
                f"budget ratio={self.ratio} is not resolved to slot counts yet; call config.resolve(prompt_len) first"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for manifests and Parquet metadata."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for humans, e.g. ``h2o heavy=64 recent=64 gqa=sum``."""
        if not self.spec.evicts:
            return "full cache"
        if not self.resolved:
            return f"{self.policy} ratio={self.ratio} gqa={self.gqa}"
        h, r, s = self.split
        extra = f" sink={s}" if s else ""
        return f"{self.policy} heavy={h} recent={r}{extra} (B={self.capacity}) gqa={self.gqa}"
