"""What the guard computes and does: its signals, actions and :class:`GuardConfig` (DESIGN.md §18).

The guard itself is :mod:`h2o_lens.guard`; this module holds its vocabulary, read by the
runtime, the recorder's log (:mod:`recorders.guard_log`) and the CLI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .policies.base import ratio_slots

__all__ = [
    "SIGNALS",
    "ACTIONS",
    "FALLBACKS",
    "LOGGED_ACTIONS",
    "DEFAULT_WEIGHTS",
    "DEFAULT_BIAS",
    "STRUCTURE_MARKS",
    "REFER_WORDS",
    "GuardConfig",
]

#: the signals, in the order of :attr:`GuardConfig.weights` and of the logged rows
SIGNALS = ("margin", "trend", "uniform", "far", "entropy", "dropped", "structure", "refer", "prefill", "canary")
#: the actions a guard can take (DESIGN.md §18.2)
ACTIONS = ("none", "raise", "refill", "canary", "recall")
#: what the ``canary`` action does to a request whose risk reaches the threshold (DESIGN.md §18.2)
FALLBACKS = ("none", "raise", "refill")
#: the actions a logged guard event names (``guard_events.action``, DESIGN.md §18.2)
LOGGED_ACTIONS = ("raise", "refill", "canary", "recall")
#: per-layer signals, averaged over the layers and KV sets of a step
LAYER_SIGNALS = ("margin", "uniform", "far", "entropy", "dropped")

#: the neighbours on each side that a rescued position brings along (a fact spans a few tokens)
RESCUE_POOL = 7
#: the weights and bias of the logistic combination (DESIGN.md §18.3)
DEFAULT_WEIGHTS = (1.0, 2.0, 2.0, 2.0, 1.0, 4.0, 1.0, 1.0, 16.0, 6.0)
DEFAULT_BIAS = -5.0

#: text pieces of structured output (code, JSON, markup, tables) and "refer back" words
STRUCTURE_MARKS = ("`", "{", "}", "[", "]", "<", ">", "|", "=", "\t")
REFER_WORDS = (
    "above",
    "earlier",
    "previous",
    "previously",
    "mentioned",
    "beginning",
    "recall",
    "repeat",
    "quote",
    "verbatim",
    "exact",
    "exactly",
    "passage",
    "document",
    "text",
    "first",
)


@dataclass(frozen=True)
class GuardConfig:
    """What the guard computes and does.

    Parameters
    ----------
    action : ``none`` (log the risk only), ``raise`` (grow the slot count), ``refill`` (prefill
        the tokens so far again at the target), ``canary`` (a share of the batch also runs at the
        target; their KL and agreement feed the risk, and ``fallback`` acts on it) or ``recall``
        (open a recall window of a cold tier that keeps every eviction, DESIGN.md §18.2)
    threshold : the risk in [0, 1] at which the action runs on a row
    raise_slots : slots per KV set after a raise or refill (at least the row's current count), or
    raise_ratio : a keep ratio of the row's prompt length after it (one of the two with ``raise``
        and ``refill``); under ``recall`` the two give the window the row gains instead:
        ``raise_slots`` slots (at least 1), or ``ratio_slots(raise_ratio, P)``
    reservoir : the share of a row's slots kept as a sampled reservoir of evicted keys, e.g. 0.02
        (0, the default, turns the ``dropped`` signal off: it predicted no failure in
        ``bench guard`` and its upkeep costs a few per cent of a decode step, DESIGN.md §18.3);
        the reservoir holds ``max(1, ⌈share · B⌉)`` keys
    weights, bias : the logistic combination of :data:`SIGNALS` into the risk
    span : steps of the exponential average of ``trend``
    cue_window : the last generated tokens that the ``structure`` cue looks at
    seed : of the reservoir's sampling
    stride : the layers that compute decode-time signals, ``0, stride, 2·stride, …`` (1: every
        layer; 8 by default); the per-layer signals are averaged over those (fewer layers, less
        cost, DESIGN.md §18.1; the ``prefill`` signal reads every layer)
    tail : the prompt's last rows whose attention the guard reads at the prefill (the rescue's
        rows; 0 turns the ``prefill`` signal off)
    signal_rows : the last of the ``tail`` rows that the ``prefill`` signal averages (the question's
        rows; more rows reach into the text before it, which reads locally, DESIGN.md §18.1)
    heads : ``(layer, KV set)`` pairs whose lost shares the ``prefill`` signal averages, the heads
        that read back (``bench guard`` fits them on known failures and prints them); () averages
        every layer and KV set
    canary_share : under ``canary``, the share of the batch's requests that get a canary copy
        (at least one; :meth:`Guard.canary_batch` makes them)
    fallback : under ``canary``, what a request (not a canary) whose risk reaches the threshold
        gets: ``none`` (the default: the risk is logged), ``raise`` or ``refill`` to the same target
        as the canaries, as those actions do it (the safe fallback of DESIGN.md §18.2)
    rescue : at a raise at the prefill, the share of the prompt pinned to the positions the
        prompt's last rows read most, pooled over ``±7`` neighbours; the pins come out of the
        raised row's heavy slots (at most all of them), so a rescue larger than the raise trades
        heavy hitters for what the question reads (0: no pins, DESIGN.md §18.2)
    """

    action: str = "none"
    threshold: float = 0.5
    raise_slots: int | None = None
    raise_ratio: float | None = None
    reservoir: float = 0.0
    weights: tuple[float, ...] = DEFAULT_WEIGHTS
    bias: float = DEFAULT_BIAS
    span: int = 8
    cue_window: int = 8
    seed: int = 0
    stride: int = 8
    tail: int = 32
    signal_rows: int = 8
    heads: tuple[tuple[int, int], ...] = ()
    rescue: float = 0.0
    canary_share: float = 0.125
    fallback: str = "none"

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ConfigError(f"guard action {self.action!r} is not known; expected one of {', '.join(ACTIONS)}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"guard threshold={self.threshold} is outside [0, 1]; give a risk level such as 0.5")
        if self.raise_slots is not None and self.raise_ratio is not None:
            raise ConfigError("give the raise target as raise_slots or raise_ratio, not both")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"guard fallback {self.fallback!r} is not known; expected one of {', '.join(FALLBACKS)}")
        if self.fallback != "none" and self.action != "canary":
            raise ConfigError(
                f"guard fallback={self.fallback!r} is what the 'canary' action does to a risky request; with action "
                f"{self.action!r} leave it out (action='{self.fallback}' acts on the risk itself)"
            )
        if not 0.0 < self.canary_share <= 1.0:
            raise ConfigError(f"canary_share={self.canary_share} is outside (0, 1]; give a share such as 0.125")
        if self.action != "none" and self.raise_slots is None and self.raise_ratio is None:
            raise ConfigError(
                f"guard action {self.action!r} needs a target: raise_slots=N or raise_ratio=R (0 < R <= 1)"
            )
        if self.action == "recall" and self.raise_slots is not None and self.raise_slots < 1:
            raise ConfigError(f"recall window raise_slots={self.raise_slots}; expected at least 1 slot")
        if self.action != "recall" and self.raise_slots is not None and self.raise_slots < 2:
            raise ConfigError(f"raise_slots={self.raise_slots}; expected at least 2 slots")
        if self.action == "recall" and self.rescue:
            raise ConfigError(
                f"rescue={self.rescue} pins positions at a raise; the 'recall' action opens a recall window "
                "instead, leave rescue out"
            )
        if self.raise_ratio is not None and not 0.0 < self.raise_ratio <= 1.0:
            raise ConfigError(f"raise_ratio={self.raise_ratio} is outside (0, 1]; give a keep ratio such as 0.35")
        if not 0.0 <= self.reservoir <= 0.5:
            raise ConfigError(f"reservoir={self.reservoir} is outside [0, 0.5]; the guard samples 1-2 % (0.01-0.02)")
        if len(self.weights) != len(SIGNALS):
            raise ConfigError(
                f"guard weights has {len(self.weights)} values; expected {len(SIGNALS)}, one per signal "
                f"({', '.join(SIGNALS)})"
            )
        bad = [w for w in self.weights if not math.isfinite(w)]
        if bad or not math.isfinite(self.bias):
            what = f"weights {tuple(self.weights)}" if bad else f"bias={self.bias}"
            raise ConfigError(
                f"guard {what}: every weight and the bias must be finite numbers (a NaN risk never reaches "
                "the threshold, so the guard would never act); refit with bench guard or give finite values"
            )
        if not 0.0 <= self.rescue <= 1.0:
            raise ConfigError(f"rescue={self.rescue} is outside [0, 1]; give a share of the prompt such as 0.05")
        if self.tail < 0:
            raise ConfigError(f"tail={self.tail}; expected the number of last prompt rows to read (0: off), e.g. 32")
        if self.signal_rows < 1:
            raise ConfigError(f"signal_rows={self.signal_rows}; expected at least 1 of the prompt's last rows, e.g. 8")
        heads = tuple(self.heads)
        if not all(len(h) == 2 and all(isinstance(v, int) and v >= 0 for v in h) for h in heads):
            raise ConfigError(
                f"heads={self.heads!r}: expected (layer, KV set) pairs of indices, such as ((12, 0), (17, 2))"
            )
        object.__setattr__(self, "heads", tuple(tuple(h) for h in heads))
        if self.span < 1 or self.cue_window < 1 or self.stride < 1:
            raise ConfigError(
                f"span={self.span}, cue_window={self.cue_window} and stride={self.stride} must be at least 1"
            )

    @property
    def acting(self) -> str:
        """What a request whose risk reaches the threshold gets: ``raise``, ``refill``, ``recall``
        or ``none`` (the action itself, or the ``canary`` action's fallback)."""
        if self.action in ("raise", "refill", "recall"):
            return self.action
        return self.fallback if self.action == "canary" else "none"

    def check_base(self, base: Any) -> None:
        """Refuse a raise target at or below the base budget ``base`` (an :class:`~h2o_lens.config.H2OConfig`)
        where both are known up front: slots against slots, a keep ratio against a keep ratio (a
        raise to no more slots than a row holds would log a raise that does nothing)."""
        if (self.acting == "none" and self.action != "canary") or self.action == "recall":
            return  # a recall window adds slots to any base
        if self.raise_slots is not None and base.ratio is None and base.heavy is not None:
            have = int(base.heavy) + int(base.recent)
            if self.raise_slots <= have:
                raise ConfigError(
                    f"guard raise_slots={self.raise_slots} is not above the base budget of {have} slots "
                    f"(heavy {base.heavy} + recent {base.recent}); give a target above {have}, e.g. {2 * have}"
                )
        if self.raise_ratio is not None and base.ratio is not None and self.raise_ratio <= base.ratio:
            raise ConfigError(
                f"guard raise target {self.raise_ratio} is not above the base keep ratio {base.ratio}; give a "
                f"target keep ratio above {base.ratio}, e.g. {min(1.0, round(2 * base.ratio, 3))}"
            )

    def target(self, capacity: int, prompt_len: int) -> int:
        """Slots per KV set after a raise of a row that holds ``capacity`` slots."""
        n = self.raise_slots if self.raise_slots is not None else ratio_slots(self.raise_ratio, prompt_len)
        return max(int(n), capacity)

    def window(self, prompt_len: int) -> int:
        """Under ``recall``: the recall window's slots for a row whose prompt has ``prompt_len``
        tokens (``raise_slots``, or ``ratio_slots(raise_ratio, prompt_len)``)."""
        n = self.raise_slots if self.raise_slots is not None else ratio_slots(self.raise_ratio, prompt_len)
        return max(1, int(n))
