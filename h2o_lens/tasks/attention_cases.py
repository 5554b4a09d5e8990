"""Policy-level cases: synthetic attention logits with a known failure signature (DESIGN.md §8.1).

Each case is a stack of pre-softmax logits ``(L, Hkv, G, N, N)`` (row t is
the query at position t, column i the key at position i; only ``i <= t`` is
read) plus a toy output model, so that a run of any policy over it has a
well-defined next-token distribution, KL to the full-cache teacher and a
correctness verdict, with no language model at all:

* every input position i carries a toy token ``token_ids[i]`` (its value
  vector is that token's one-hot);
* the next-token logits at step t are ``sharpness`` times the attention
  weight each token receives, averaged over layers and query heads — a copy
  model: the prediction is the token the heads look at — plus
  ``default_logit`` on token 0 (``" the"``, a frequent token). Unless the
  heads put more than ``default_logit / sharpness`` (0.9) of their weight on
  one token, the prediction is ``" the"`` for the run and the teacher alike;
* at ``answer_step`` every head looks sharply at the answer position (an
  evidence position): the teacher predicts its token, and a run that lost
  it predicts ``" the"``;
* the token sequence is fixed (teacher forcing): the run attends over its
  candidate set D_t, the teacher over all ``i <= t``;
  the answer is correct when the run's top-1 equals the teacher's at
  ``answer_step``.

The five cases (all deterministic in ``seed``):

``uniform``
    Flat attention. Cumulative scores then grow with age alone, so the heavy
    slots end up holding the oldest positions (age bias); the answer needs a
    middle position, lost to age.
``far_hotspot``
    Every query attends to one far position. H2O keeps it as a heavy
    hitter; ``local`` loses it at the prefill.
``hotspot_switch``
    A hotspot that the prompt attends to, then, during decoding, attention
    switches to a new position. The old hotspot stays as a stale heavy
    hitter; the new one leaves the recent window with a score below the heavy
    threshold and is evicted, so its attention is dropped from then on.
``delayed_reference``
    An evidence position that receives almost no attention until a late
    query needs it. It leaves the recent window with a low score and is
    evicted at once (``left_recent``); the late query cannot recover it.
``gqa_split``
    One KV head shared by three query heads that each prefer their own
    position, plus a position all of them attend to moderately: ``sum`` and
    ``max`` aggregation keep different sets; the answer needs the favourite
    that ``sum`` drops.

At each case's own budget (``heavy``, ``recent``) the answer is right with
the full cache, wrong with ``local``, and right with H2O only for
``far_hotspot`` (and for ``gqa_split`` with ``gqa="max"``). Runs and teacher
agree on every step before ``answer_step``, so the first divergence is the
answer itself. :func:`recorders.policy_cases.write_policy_case` writes a
case as a complete run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "PolicyCase",
    "CASES",
    "policy_case",
    "policy_cases",
    "uniform",
    "far_hotspot",
    "hotspot_switch",
    "delayed_reference",
    "gqa_split",
]

VOCAB = 32


@dataclass(eq=False)
class PolicyCase:
    """A synthetic attention pattern with its toy output model.

    Attributes
    ----------
    name : str
    description : str
    logits : ndarray ``(L, Hkv, G, N, N)`` float64
        Pre-softmax ``q_t·k_i/√d`` of every layer, KV head and query head of
        its group.
    prompt_len : int
        Prompt length P; positions ``P .. N-1`` are fed by decode steps.
    evidence : dict label -> tuple of positions
    answer_step : int
        Query position whose next-token prediction is the answer (``>= P-1``).
    token_ids : ndarray ``(N + 1,)`` int
        Toy token of every position (position ``N`` is the one the last step
        predicts). Generated positions carry seeded filler tokens too: runs
        are teacher-forced on this one sequence, so no policy can copy the
        answer from tokens the teacher generated.
    vocab : tuple of str
        Text of each toy token id.
    heavy, recent : int
        The budget at which the case shows its signature.
    sharpness : float
        Scale of the toy output head.
    default_logit : float
        Logit of the frequent token 0 at every step.
    seed : int
    marks : dict str -> int
        Named positions and steps of the case's signature (``hotspot``,
        ``switch``, ``exit_step`` ...), for tests and captions.
    """

    name: str
    description: str
    logits: np.ndarray
    prompt_len: int
    evidence: dict[str, tuple[int, ...]]
    answer_step: int
    token_ids: np.ndarray
    vocab: tuple[str, ...]
    heavy: int
    recent: int
    sharpness: float = 8.0
    default_logit: float = 7.2
    seed: int = 0
    marks: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        x = self.logits
        if x.ndim != 5 or x.shape[-1] != x.shape[-2]:
            raise ValueError(f"case {self.name!r}: logits must have shape (L, Hkv, G, N, N), got {x.shape}")
        if not 1 <= self.prompt_len <= self.n:
            raise ValueError(f"case {self.name!r}: prompt_len must be in [1, {self.n}], got {self.prompt_len}")
        if not self.prompt_len - 1 <= self.answer_step < self.n:
            raise ValueError(
                f"case {self.name!r}: answer_step must be in [{self.prompt_len - 1}, {self.n - 1}], "
                f"got {self.answer_step}"
            )
        if self.token_ids.shape != (self.n + 1,):
            raise ValueError(
                f"case {self.name!r}: token_ids must have shape ({self.n + 1},), got {self.token_ids.shape}"
            )

    # ------------------------------------------------------------------ shape
    @property
    def layers(self) -> int:
        return self.logits.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.logits.shape[1]

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.logits.shape[2]

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.group

    @property
    def n(self) -> int:
        """Input positions N (the prompt plus the decode steps)."""
        return self.logits.shape[-1]

    def evidence_labels(self) -> list[str | None]:
        """Evidence label of each of the ``N + 1`` positions (``None`` if none)."""
        labels: list[str | None] = [None] * (self.n + 1)
        for label, positions in self.evidence.items():
            for p in positions:
                labels[p] = label
        return labels

    # ------------------------------------------------------------ toy model
    def attention(self, t: int, visible: np.ndarray | None = None) -> np.ndarray:
        """Softmax weights of query position ``t`` over the keys ``0..t``.

        Parameters
        ----------
        t : int
        visible : bool array broadcastable to ``(L, Hkv, G, t + 1)``, optional
            Keys the query may see (a run's candidate set D_t); default all.

        Returns
        -------
        ndarray ``(L, Hkv, G, t + 1)`` float64, zero on invisible keys.
        """
        x = self.logits[..., t, : t + 1].copy()  # (L, Hkv, G, t+1)
        if visible is not None:
            x = np.where(visible, x, -np.inf)
        x -= x.max(axis=-1, keepdims=True)
        e = np.exp(x)
        return e / e.sum(axis=-1, keepdims=True)

    def output_logits(self, weights: np.ndarray) -> np.ndarray:
        """Next-token logits ``(V,)`` of the toy output head from ``weights (L, Hkv, G, t + 1)``."""
        t1 = weights.shape[-1]
        mean = weights.reshape(-1, t1).mean(axis=0)  # (t+1,)
        z = self.sharpness * np.bincount(self.token_ids[:t1], weights=mean, minlength=len(self.vocab))
        z[0] += self.default_logit
        return z


# ---------------------------------------------------------------------------- builders


def _tokens(
    rng: np.random.Generator, n: int, evidence: dict[str, tuple[int, ...]]
) -> tuple[np.ndarray, tuple[str, ...]]:
    """Random filler tokens, one reserved token per evidence label (the last ids); id 0 is " the"."""
    labels = list(evidence)
    filler = VOCAB - len(labels)
    ids = rng.integers(1, filler, n + 1)
    vocab = [" the"] + [f" w{k}" for k in range(1, filler)] + [f" {label.upper()}" for label in labels]
    for k, label in enumerate(labels):
        ids[list(evidence[label])] = filler + k
    return ids, tuple(vocab)


def _noise(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    return scale * rng.standard_normal(shape)


def _ask(logits: np.ndarray, step: int, position: int, bonus: float = 10.0) -> None:
    """The query at ``step`` looks sharply at ``position`` in every head (the answer needs it)."""
    logits[..., step, position] += bonus


def uniform(seed: int = 0) -> PolicyCase:
    """Flat attention (small noise): the heavy slots end up holding the oldest positions.

    The answer needs a middle prompt position, which age alone already evicted.
    """
    rng = np.random.default_rng([seed, 1])
    n, p, middle = 48, 24, 12
    logits = _noise(rng, (1, 1, 1, n, n), 0.05)
    _ask(logits, n - 1, middle)
    evidence = {"middle": (middle,)}
    ids, vocab = _tokens(rng, n, evidence)
    return PolicyCase(
        "uniform",
        "uniform attention: cumulative scores grow with age, the oldest positions hold the heavy slots",
        logits,
        p,
        evidence,
        n - 1,
        ids,
        vocab,
        heavy=4,
        recent=4,
        seed=seed,
        marks={"answer_position": middle},
    )


def far_hotspot(seed: int = 0) -> PolicyCase:
    """Every query attends to one far position: heavy hitters keep it, a recent window loses it."""
    rng = np.random.default_rng([seed, 2])
    n, p, hot = 56, 32, 10
    logits = _noise(rng, (1, 1, 1, n, n), 0.3)
    logits[..., hot + 1 :, hot] += 3.0
    _ask(logits, n - 1, hot)
    evidence = {"hotspot": (hot,)}
    ids, vocab = _tokens(rng, n, evidence)
    return PolicyCase(
        "far_hotspot",
        "one far position every query attends to: kept by heavy hitters, lost by a recent window",
        logits,
        p,
        evidence,
        n - 1,
        ids,
        vocab,
        heavy=4,
        recent=4,
        seed=seed,
        marks={"hotspot": hot, "answer_position": hot},
    )


def hotspot_switch(seed: int = 0) -> PolicyCase:
    """A prompt hotspot, then attention switches to a new position during decoding.

    Two sink-like positions (0, 1) that every query attends to a little set a
    heavy threshold that the new hotspot, scored over the recent window only,
    cannot reach: it is evicted as it leaves the window while the old
    hotspot, no longer attended to, keeps its slot. The answer needs the new one.
    """
    rng = np.random.default_rng([seed, 3])
    n, p, old, switch = 64, 32, 8, 40
    logits = _noise(rng, (1, 1, 1, n, n), 0.3)
    logits[..., 2:, 0:2] += 1.5  # sinks
    logits[..., old + 1 : switch, old] += 3.0  # old hotspot, until the switch
    logits[..., switch + 1 :, switch] += 3.0  # new hotspot from the switch on
    _ask(logits, n - 1, switch)
    evidence = {"old_hotspot": (old,), "new_hotspot": (switch,)}
    ids, vocab = _tokens(rng, n, evidence)
    return PolicyCase(
        "hotspot_switch",
        "attention switches from an old hotspot to a new one: the old "
        "stays as a stale heavy hitter, the new one is not promoted",
        logits,
        p,
        evidence,
        n - 1,
        ids,
        vocab,
        heavy=3,
        recent=4,
        seed=seed,
        marks={"old_hotspot": old, "new_hotspot": switch, "switch": switch, "answer_position": switch},
    )


def delayed_reference(seed: int = 0) -> PolicyCase:
    """An evidence position ignored until a late query needs it: evicted unrecoverably."""
    rng = np.random.default_rng([seed, 4])
    n, p, recent = 56, 32, 4
    ev = p - 3  # inside the recent window at the end of the prefill
    logits = _noise(rng, (1, 1, 1, n, n), 0.3)
    logits[..., ev + 1 :, ev] -= 4.0  # nobody looks at it ...
    _ask(logits, n - 1, ev, bonus=14.0)  # ... until the answer needs it
    evidence = {"evidence": (ev,)}
    ids, vocab = _tokens(rng, n, evidence)
    return PolicyCase(
        "delayed_reference",
        "evidence ignored until a late query: evicted with a low score right after it leaves the recent window",
        logits,
        p,
        evidence,
        n - 1,
        ids,
        vocab,
        heavy=4,
        recent=recent,
        seed=seed,
        marks={"evidence": ev, "exit_step": ev + recent, "answer_position": ev},
    )


def gqa_split(seed: int = 0) -> PolicyCase:
    """Three query heads of one KV head, each with its own favourite, plus a shared position.

    From row 5 on, head h gives its favourite (position h + 1) about a third
    of its weight and every head gives the shared position 4 about a sixth.
    Summed over the group the shared position leads (3 × 1/6 > 1/3), by the
    maximum the favourites do (1/3 > 1/6): with three heavy slots ``sum``
    keeps the shared position and two favourites, ``max`` the three
    favourites. The answer needs the favourite that ``sum`` drops.
    """
    rng = np.random.default_rng([seed, 5])
    n, p, g = 48, 32, 3
    favourites, shared, start = (1, 2, 3), 4, 5
    logits = _noise(rng, (1, 1, g, n, n), 0.3)
    for h, f in enumerate(favourites):
        logits[0, 0, h, start:, f] += 3.0
    logits[0, 0, :, start:, shared] += 2.3
    # sum drops the favourite with the lowest summed prefill score: the answer needs that one
    prefill = _column_sums(logits[0, 0], p)
    asked = min(favourites, key=lambda f: (prefill[f], f))
    _ask(logits, n - 1, asked)
    evidence = {f"head{h}": (f,) for h, f in enumerate(favourites)}
    evidence["shared"] = (shared,)
    ids, vocab = _tokens(rng, n, evidence)
    return PolicyCase(
        "gqa_split",
        "query heads of one group prefer different positions: sum and max aggregation keep different sets",
        logits,
        p,
        evidence,
        n - 1,
        ids,
        vocab,
        heavy=3,
        recent=4,
        seed=seed,
        marks={"shared": shared, "answer_position": asked},
    )


def _column_sums(logits: np.ndarray, prefill: int) -> np.ndarray:
    """Prefill scores ``(P,)`` of one group ``(G, N, N)`` summed over its heads."""
    x = logits[:, :prefill, :prefill]
    x = np.where(np.tril(np.ones((prefill, prefill), bool)), x, -np.inf)
    w = np.exp(x - x.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)).sum(axis=(0, 1))


CASES: dict[str, Callable[[int], PolicyCase]] = {
    "uniform": uniform,
    "far_hotspot": far_hotspot,
    "hotspot_switch": hotspot_switch,
    "delayed_reference": delayed_reference,
    "gqa_split": gqa_split,
}


def policy_case(name: str, seed: int = 0) -> PolicyCase:
    """The case called ``name`` (one of :data:`CASES`), built from ``seed``."""
    try:
        build = CASES[name]
    except KeyError:
        raise KeyError(f"unknown policy case {name!r}; expected one of {', '.join(CASES)}") from None
    return build(seed)


def policy_cases(seed: int = 0) -> list[PolicyCase]:
    """All cases of :data:`CASES`, built from ``seed``."""
    return [build(seed) for build in CASES.values()]
