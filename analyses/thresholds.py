"""Thresholds of failure attribution and of the report's pass/fail gate.

One frozen dataclass so that a CI job sets both from one JSON object
(``Thresholds.from_mapping``); every field is validated on construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .errors import ParameterError

__all__ = ["Thresholds"]

_FRACTIONS = (
    "min_top1_agreement",
    "dropped_mass_high",
    "evidence_lost_share",
    "low_score_ratio",
    "lag_share",
    "evidence_pin_share",
    "gate_min_coverage_p5",
    "gate_min_top1_agreement",
    "gate_max_frozen_share",
)
_NON_NEGATIVE = ("kl_high", "kl_fail", "logit_tolerance", "margin_tie", "gate_max_kl_mean")
_COUNTS = ("dropped_mass_lookback", "lag_steps", "gate_max_failures", "gate_max_lifecycle_errors")


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Decision thresholds (attribution) and gate thresholds (report verdict).

    Failure of a request
        ``min_top1_agreement``: teacher-forced top-1 agreement below it fails the
        request; ``kl_fail``: a step KL at or above it fails the request;
        ``kl_high``: a step with KL at or above it diverges (as does a top-1
        disagreement); the first diverging step is the decision step.
    Attribution (DESIGN.md §6, §8.2)
        ``logit_tolerance``: the run's ``max_logit_diff`` above it means the
        replay does not reproduce the run (implementation error); a replay that
        derived a larger bound from the run's dtype (``runs.logit_tolerance``,
        bfloat16 / float16) raises it to that (:meth:`logit_bound`);
        ``dropped_mass_high``: mean dropped mass over heads and the
        ``dropped_mass_lookback`` steps up to the decision step at or above it
        is high; ``evidence_lost_share``: evidence counts as evicted when at
        least this share of KV sets lost a token of a span before the decision
        step; ``lag_steps``, ``low_score_ratio``: an evidence eviction at most
        ``lag_steps`` after the token left the recent window with a score at
        most ``low_score_ratio`` of the lowest surviving score is a lag
        eviction; ``lag_share``: scoring lag when at least this share of the
        evidence evictions are lag evictions (the lag is a sub-case of ``scoring``);
        ``evidence_pin_share``: the estimate names ``scoring`` (or ``scoring_lag``) only
        when the evicted evidence takes less than this share of the request's heavy
        slots, so that pinning it (the ``pinned`` re-run) leaves the policy most of its
        own choices, and only when the teacher departs decisively (a top-1
        disagreement with KL at least ``kl_high``); otherwise it says ``unknown``.
    Measures shown in the report
        ``margin_tie``: an eviction whose margin is at most this share of the
        lowest surviving score is near a tie (:func:`analyses.margin_sensitivity`).
    Gate (None switches a check off)
        ``gate_min_coverage_p5`` (P5 of coverage over all replay rows),
        ``gate_max_kl_mean``, ``gate_min_top1_agreement`` (over all steps),
        ``gate_max_failures`` (failed requests), ``gate_max_frozen_share``
        (share of KV sets whose cache froze), ``gate_max_lifecycle_errors``
        (requests the state lifecycle check failed). An implementation error always
        fails the gate; a check that is on and finds no data fails, as does a run that is
        not ``complete`` or was never replayed.
    """

    min_top1_agreement: float = 0.9
    kl_high: float = 0.5
    kl_fail: float | None = 1.0
    logit_tolerance: float = 2e-3
    dropped_mass_high: float = 0.1
    dropped_mass_lookback: int = 4
    evidence_lost_share: float = 0.25
    lag_steps: int = 4
    low_score_ratio: float = 0.5
    lag_share: float = 0.5
    evidence_pin_share: float = 0.5
    margin_tie: float = 1e-3
    gate_min_coverage_p5: float | None = 0.8
    gate_max_kl_mean: float | None = 0.1
    gate_min_top1_agreement: float | None = 0.9
    gate_max_failures: int | None = 0
    gate_max_frozen_share: float | None = None
    gate_max_lifecycle_errors: int | None = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and "None" in str(f.type):
                continue
            if f.name in _COUNTS:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ParameterError(f"Thresholds.{f.name} must be an int >= 0, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ParameterError(f"Thresholds.{f.name} must be a number, got {value!r}")
            if f.name in _FRACTIONS and not 0.0 <= value <= 1.0:
                raise ParameterError(f"Thresholds.{f.name} must be in [0, 1], got {value!r}")
            if f.name in _NON_NEGATIVE and value < 0:
                raise ParameterError(f"Thresholds.{f.name} must be >= 0, got {value!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | Thresholds | None) -> Thresholds:
        """Thresholds from a mapping (e.g. a CI job's JSON); missing keys keep their defaults."""
        if values is None:
            return cls()
        if isinstance(values, cls):
            return values
        if not isinstance(values, Mapping):
            raise ParameterError(f"thresholds must be a Thresholds or a mapping, got {type(values).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ParameterError(f"unknown threshold(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**dict(values))

    def logit_bound(self, run_tolerance: float | None) -> float:
        """The implementation check's bound for a run: ``logit_tolerance`` or the replay's dtype bound."""
        return max(self.logit_tolerance, run_tolerance or 0.0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
