"""What a cache policy is: one object that the runtime, kernels, recorder, analyses and CLI read.

A :class:`Policy` says, in one place, whether it evicts, whether attention drives its
choices, how it splits the slot count, how it scores the prompt and updates the scores
at a decode step, which Triton kernels implement it, its FP64 reference and how it is
shown. The rules every policy shares (GQA aggregation, eligibility, victim choice,
prefill selection) stay in :mod:`h2o_lens.eviction`; a policy only supplies the value it
ranks slots by (DESIGN.md §2.9).

This module and the policy files import neither torch nor numpy at module level, so the
layers that never load a model (``analyses``, through it the dashboard) can read the
registry. Their tensor hooks import torch when they run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Policy", "StepContext", "ratio_slots", "half_split"]


def ratio_slots(ratio: float, prompt_len: int) -> int:
    """Slots of a keep ratio of a ``prompt_len``-token prompt: ``max(2, round(ratio · P))`` (DESIGN.md §2.7)."""
    return max(2, int(round(ratio * prompt_len)))


def half_split(total: int) -> tuple[int, int]:
    """``(heavy, recent)`` halves of a slot count: ``heavy = ⌊B / 2⌋``, ``recent = B − heavy``."""
    heavy = total // 2
    return heavy, total - heavy


class StepContext(NamedTuple):
    """What a policy's score hooks may need besides the weights.

    ``step`` the query position, an int or a tensor broadcastable to ``(b, Hs, 1)``;
    ``layer`` the layer index; ``seed`` the config's seed; ``gqa`` the aggregation mode;
    ``group`` the query heads per KV set (1 under ``gqa="none"``).
    """

    step: Any
    layer: int = 0
    seed: int = 0
    gqa: str = "sum"
    group: int = 1


@dataclass(frozen=True)
class Policy:
    """A cache policy, declared once in its own file under :mod:`h2o_lens.policies`.

    Attributes
    ----------
    name : the config and CLI name (``H2OConfig(policy=name)``)
    label : the display name
    colour : hex colour of the policy in plots and the dashboard
    summary : what it isolates, one line (the table of DESIGN.md §2.5)
    evicts : False for the full cache (transformers' own cache, no H2O cache at all)
    baseline : an ablation of H2O at the same slot count (DESIGN.md §2.5): the demo runs
        these next to the method; other evicting policies are alternatives to it
    scored : attention drives its choices: the recorder logs its prefill score and
        margin and attribution may call a loss of evidence a scoring lag (DESIGN.md §6.10)
    accumulates : its score is the running sum of aggregated weights (H2O's rule); the
        fused Triton decode step implements this rule and the unscored one
    kernels : Triton kernels that implement it (``"decode"``, ``"prefill"``); other
        backends fall back to the torch path, which implements every policy
    prefill : what its prompt scores are computed from: ``"columns"`` (the column sums
        of the prompt's attention), ``"rows"`` (the weights of the last
        :attr:`prefill_rows` prompt rows) or ``"none"`` (no attention at all)
    prefill_rows : how many last prompt rows ``prefill="rows"`` needs
    history : bits of per-slot history kept next to the score (0: none); the cache
        stores it as an int64 per slot and moves it with K, V, score and position
    teacher : it ranks by a full-cache teacher's future attention (the oracle, DESIGN.md
        §2.12): it runs only with a teacher table installed, so it is neither a baseline nor
        an alternative the demo or a sweep could run on its own
    reference : the FP64 reference ``simulate(logits, prefill, heavy, recent, gqa, pinned=())``
        (kept sets per step, the contract of :func:`h2o_lens.reference.simulate`), or None
    rank : registry order (names, CLI help, the demo's baselines): lower first
    """

    name: str
    label: str
    colour: str
    summary: str
    evicts: bool = True
    baseline: bool = False
    scored: bool = False
    accumulates: bool = False
    kernels: frozenset[str] = field(default_factory=frozenset)
    prefill: str = "none"
    prefill_rows: int = 0
    history: int = 0
    teacher: bool = False
    reference: Callable[..., list[list[int]]] | None = None
    rank: int = 100

    def __post_init__(self) -> None:
        if self.prefill not in ("columns", "rows", "none"):
            raise ValueError(f"policy {self.name!r}: prefill={self.prefill!r}; expected columns, rows or none")
        if (self.prefill == "rows") != (self.prefill_rows > 0):
            raise ValueError(f"policy {self.name!r}: prefill_rows={self.prefill_rows} goes with prefill='rows'")
        if not 0 <= self.history <= 63:
            raise ValueError(f"policy {self.name!r}: history={self.history} bits; expected 0 to 63")

    # -- the budget ------------------------------------------------------------------
    def split(self, heavy: int, recent: int, sink: int) -> tuple[int, int, int]:
        """``(heavy, recent, sink)`` slots used, at the slot count ``B = heavy + recent``.

        The default keeps the budget as given (H2O's split, no sink).
        """
        return heavy, recent, 0

    def check_budget(self, heavy: int, recent: int, sink: int) -> str | None:
        """Why a resolved budget does not fit this policy (None when it does)."""
        return None

    # -- the scores ------------------------------------------------------------------
    def prefill_scores(self, columns: Any, rows: Any, positions: Any, ctx: StepContext) -> tuple[Any, Any]:
        """Ranking values of the prompt positions, and their history.

        Parameters
        ----------
        columns : ``(b, Hs, P)`` float column sums of the aggregated prompt weights
            (``prefill="columns"``; else None)
        rows : ``(b, Hs, R, P)`` float aggregated weights of the last ``R`` prompt rows,
            zero on padding and future keys (``prefill="rows"``; else None)
        positions : ``(b, Hs, P)`` integer original positions, ``-1`` for padding
        ctx : :class:`StepContext` with ``step`` the last prompt position ``(b, Hs, 1)``

        Returns
        -------
        scores : ``(b, Hs, P)`` float, higher keeps (the prefill keeps the top ``heavy``)
        history : ``(b, Hs, P)`` int64 or None (``history == 0``)
        """
        raise NotImplementedError(f"policy {self.name!r} has no prefill scores")

    def decode_scores(
        self, scores: Any, history: Any, weights: Any, positions: Any, ctx: StepContext
    ) -> tuple[Any, Any]:
        """Update the slots' ranking values for one decode step, in place.

        Parameters
        ----------
        scores : ``(b, Hs, B)`` float, updated in place
        history : ``(b, Hs, B)`` int64 updated in place, or None (``history == 0``)
        weights : ``(b, Hs, B + 1)`` float aggregated weights over D (slots, then the new
            token; 0 on empty slots), or None for a policy that is not :attr:`scored`
        positions : ``(b, Hs, B)`` integer original positions of the slots, ``-1`` empty
        ctx : :class:`StepContext`, ``step`` broadcastable to ``(b, Hs, 1)``

        Returns
        -------
        new_score : ``(b, Hs, 1)`` the new token's ranking value
        new_history : ``(b, Hs, 1)`` int64 or None
        """
        raise NotImplementedError(f"policy {self.name!r} has no decode scores")

    # -- display ---------------------------------------------------------------------
    def __str__(self) -> str:
        return self.name
