"""The culprit search itself (DESIGN.md §19): a pure function of a ranking and a pass test.

:func:`search_culprits` finds a 1-minimal set of ranked candidate positions whose restoring passes
a test: growing prefixes of the ranking until one passes, then adaptive group testing down to a
1-minimal set. The test is a function of one set, or of a list of sets (``test_many``) that a
caller evaluates together (one batched re-run, a row per set): then the search hands it its
independent probes ``batch`` at a time (the growing prefixes, every "without one position" set of
the last check and, with ``splits``, several levels of a bisection's split points) and reads the
answers in the order the one-at-a-time search would, so that for a monotone test it finds the
same set.
:mod:`recorders.culprits` runs it on a recorded run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["MAX_RUNS", "SECONDS", "BATCH", "Probe", "CulpritSearch", "search_culprits", "search_from_dict"]

#: default cap on the search's re-runs, each row of a batched re-run counted (``explain --max-runs``)
MAX_RUNS = 40
#: default time budget of one search, seconds (``explain --culprit-seconds``)
SECONDS = 900.0
#: default probes evaluated together (``explain --culprit-batch``; 1: one at a time)
BATCH = 4


@dataclasses.dataclass(frozen=True)
class Probe:
    """One test of the search: the positions restored and whether the answer came back; ``seconds``:
    its share of the time of the batch it ran in (the batch's time over its rows)."""

    positions: tuple[int, ...]
    passed: bool
    seconds: float = dataclasses.field(default=0.0, compare=False)


@dataclasses.dataclass(frozen=True)
class CulpritSearch:
    """The result of :func:`search_culprits`.

    Attributes
    ----------
    culprits : the passing set found (in ranking order); the largest set tried when none passed
    found : some tested set passed
    minimal : ``culprits`` is 1-minimal: it passes and fails without any one of its positions
    stopped : ``"max_runs"`` or ``"seconds"`` when a limit ended the search, else None
    probes : every test, in order (a set is tested once); each row of a batch is one
    candidates : how many candidates the ranking held
    batch : the most probes evaluated together
    calls : the evaluations (batched re-runs) the probes took; None when not recorded
    """

    culprits: tuple[int, ...]
    found: bool
    minimal: bool
    stopped: str | None
    probes: tuple[Probe, ...]
    candidates: int
    batch: int = 1
    calls: int | None = None

    @property
    def runs(self) -> int:
        """Re-runs: the probes, each row of a batched re-run counted."""
        return len(self.probes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "culprits": list(self.culprits),
            "found": self.found,
            "minimal": self.minimal,
            "stopped": self.stopped,
            "runs": self.runs,
            "candidates": self.candidates,
            "batch": self.batch,
            "calls": self.calls,
            "probes": [[list(p.positions), p.passed, round(p.seconds, 3)] for p in self.probes],
        }


def search_from_dict(d: Mapping[str, Any]) -> CulpritSearch:
    """A :class:`CulpritSearch` from its ``to_dict`` (a manifest's ``counterfactual.search``)."""
    probes = tuple(Probe(tuple(int(p) for p in s), bool(ok), float(t)) for s, ok, t in d.get("probes") or ())
    calls = d.get("calls")
    return CulpritSearch(
        tuple(int(p) for p in d.get("culprits") or ()),
        bool(d.get("found")),
        bool(d.get("minimal")),
        d.get("stopped"),
        probes,
        int(d.get("candidates") or 0),
        int(d.get("batch") or 1),
        None if calls is None else int(calls),
    )


class _Stop(Exception):
    """A limit of the search was reached."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class _Tests:
    """The memoised test with the search's limits (the empty set is the parent: it fails).

    ``run(sets)`` evaluates the sets not known yet, ``batch`` per call of ``many``, as far as the
    limits allow; calling the object with one set answers it (evaluated alone when not known), or
    raises :class:`_Stop` when a limit leaves it unanswered.
    """

    def __init__(self, many: Callable, order: Mapping[int, int], max_runs: int, seconds, batch: int, splits: int):
        self.many, self.order, self.max_runs, self.seconds, self.batch = many, order, max_runs, seconds, batch
        self.splits = splits
        self.known: dict[frozenset[int], bool] = {frozenset(): False}
        self.probes: list[Probe] = []
        self.calls = 0
        self.t0 = time.perf_counter()

    def _limit(self) -> str | None:
        if len(self.probes) >= self.max_runs:
            return "max_runs"
        if self.seconds is not None and time.perf_counter() - self.t0 >= self.seconds:
            return "seconds"
        return None

    def run(self, sets: Sequence[Sequence[int]]) -> None:
        todo = list(dict.fromkeys(k for k in map(frozenset, sets) if k not in self.known))
        while todo and self._limit() is None:
            n = min(self.batch, self.max_runs - len(self.probes))
            chunk, todo = todo[:n], todo[n:]
            t = time.perf_counter()
            got = [bool(ok) for ok in self.many(chunk)]
            if len(got) != len(chunk):
                raise ValueError(f"test_many answered {len(got)} of {len(chunk)} sets; it must answer each")
            self.calls += 1
            share = (time.perf_counter() - t) / len(chunk)
            for key, ok in zip(chunk, got):
                self.known[key] = ok
                self.probes.append(Probe(tuple(sorted(key, key=self.order.__getitem__)), ok, share))

    def __call__(self, subset: Sequence[int]) -> bool:
        key = frozenset(subset)
        if key not in self.known:
            self.run([key])
        if key not in self.known:
            raise _Stop(self._limit() or "max_runs")
        return self.known[key]

    def first(self, sets: Sequence[Sequence[int]]) -> int | None:
        """The index of the first set of ``sets`` that passes, in order (None: none does); a set not
        known yet is evaluated together with the next unknown ones, ``batch`` in all."""
        for i, s in enumerate(sets):
            if frozenset(s) not in self.known:
                self.run([t for t in sets[i:] if frozenset(t) not in self.known][: self.batch])
            if self(s):
                return i
        return None


def _splits(a: int, b: int, n: int) -> list[int]:
    """The split points of ``j`` levels of a binary bisection of ``(a, b)`` at once, the most levels
    whose ``2^j - 1`` points fit in ``n`` (``n < 3``: the midpoint alone); only those strictly inside."""
    j = 1
    while 2 ** (j + 1) - 1 <= n:
        j += 1
    k = 2**j
    return sorted({m for m in (a + (b - a) * i // k for i in range(1, k)) if a < m < b})


def _shrink(passing: list[int], test: _Tests, lo: int = 0) -> list[int]:
    """A passing set (in ranking order) cut down to a 1-minimal one, by adaptive group testing.

    Each round finds the shortest prefix of the remaining positions that passes together with the
    positions already kept (``lo``: a prefix length known to fail, for the first round), by a
    bisection (binary; with ``splits`` above 2, several of its levels' split points at once); its last
    position is needed and is kept, the positions after it are dropped. The rounds end when the
    kept positions pass alone: about ``k · log2(n)`` tests for ``k`` culprits among ``n``. A final
    check removes each kept position in turn (the test need not be monotone): the first whose
    removal still passes is dropped and the check starts again.
    """
    kept: list[int] = []
    rest = list(passing)
    while rest and not (kept and test(kept)):
        a, b = lo, len(rest)  # kept + rest[:a] fails, kept + rest[:b] passes
        while b - a > 1:
            points = _splits(a, b, test.splits)
            test.run([kept + rest[:m] for m in points])
            for m in points:
                if test(kept + rest[:m]):
                    b = m
                    break
                a = m
        kept.append(rest[b - 1])
        rest, lo = rest[: b - 1], 0
    while len(kept) > 1:
        withouts = [[q for q in kept if q != p] for p in kept]
        i = test.first(withouts)
        if i is None:
            break
        kept = withouts[i]
    return kept


def _sizes(top: int) -> list[int]:
    """The prefix sizes the search grows through, below ``top``, then ``top``: 1, 2, 4, 8, then
    steps of about 1.5 (12, 16, 24, 32, 48 ...: the powers of two and the midpoints 3 · 2^j).

    A prefix passes when it holds every culprit (its last at rank ``r``) and pins few enough
    positions that what they push out of the heavy slots does not break the answer some other way
    (at most ``t``): some size must fall in ``(r, t]``. Doubling steps past a window narrower than
    a factor of 2, which short prompts with few heavy slots have; steps of 1.5 halve the factor the
    window needs for one more prefix per doubling (DESIGN.md §19)."""
    sizes, k = [], 1
    while k < top:
        sizes.append(k)
        if k >= 8 and k + k // 2 < top:
            sizes.append(k + k // 2)
        k *= 2
    return sizes + ([top] if top else [])


def search_culprits(
    ranked: Sequence[int],
    test: Callable[[frozenset[int]], bool] | None = None,
    *,
    test_many: Callable[[list[frozenset[int]]], Sequence[bool]] | None = None,
    batch: int = 1,
    splits: int = 1,
    max_runs: int = MAX_RUNS,
    seconds: float | None = SECONDS,
    max_size: int | None = None,
) -> CulpritSearch:
    """A 1-minimal set of ``ranked`` candidates whose restoring passes the test (DESIGN.md §19).

    Parameters
    ----------
    ranked : candidate positions, the most likely culprit first (distinct)
    test : set of positions -> whether the answer comes back with them restored; the empty set
        (the parent run) is taken to fail. Called at most once per set.
    test_many : list of sets -> whether each passes (one batched evaluation); given, it is used
        instead of ``test``, with at most ``batch`` sets per call
    batch : the most probes evaluated together (1: one at a time, the sequential search)
    splits : split points each bisection step tests together, at most ``batch``: ``2^j - 1`` of them
        run ``j`` levels of the binary bisection at once (1 or 2: the binary bisection)
    max_runs : the most sets tested (each row of a batch counts)
    seconds : time budget of the search (None: none), checked before each evaluation
    max_size : the largest set tested (the slots the pins may take)

    The search is deterministic in ``ranked``, the test and ``batch``: prefixes of the ranking of
    1, 2, 4 ... positions up to ``max_size`` until one passes, then adaptive group testing on it
    down to a 1-minimal set (:func:`_shrink`). With ``batch > 1`` the prefixes and the last check's
    sets (and the bisection's split points with ``splits``) are evaluated ``batch`` at a time and
    read in the order the one-at-a-time search reads them, so the set found is that search's for a
    monotone test; probes evaluated ahead of need (prefixes beyond the first that passes, split
    points the binary bisection would not have reached) count as runs.
    """
    if test_many is None:
        if test is None:
            raise TypeError("search_culprits needs test or test_many")
        one = test
        test_many = lambda sets: [one(s) for s in sets]  # noqa: E731
    if int(batch) < 1 or int(splits) < 1:
        raise ValueError(f"batch={batch}, splits={splits}; expected at least 1 of each")
    ranked = list(dict.fromkeys(int(p) for p in ranked))
    order = {p: k for k, p in enumerate(ranked)}
    top = len(ranked) if max_size is None else max(0, min(int(max_size), len(ranked)))
    tests = _Tests(test_many, order, int(max_runs), seconds, int(batch), min(int(splits), int(batch)))
    passing: list[int] | None = None
    stopped = None
    sizes = _sizes(top)
    try:
        i = tests.first([ranked[:k] for k in sizes])
        if i is not None:
            passing = _shrink(ranked[: sizes[i]], tests, sizes[i - 1] if i else 0)
    except _Stop as stop:
        stopped = stop.why
        if any(tests.known.values()):  # the smallest passing set tested so far
            passing = min((list(s) for s, ok in tests.known.items() if ok), key=lambda s: (len(s), sorted(s)))
    done = dict(batch=int(batch), calls=tests.calls)
    if passing is None:
        tried = max((k for k in sizes if frozenset(ranked[:k]) in tests.known), default=0)
        return CulpritSearch(tuple(ranked[:tried]), False, False, stopped, tuple(tests.probes), len(ranked), **done)
    culprits = tuple(sorted(passing, key=order.__getitem__))
    minimal = stopped is None or all(tests.known.get(frozenset(culprits) - {p}) is False for p in culprits)
    return CulpritSearch(culprits, True, minimal, stopped, tuple(tests.probes), len(ranked), **done)
