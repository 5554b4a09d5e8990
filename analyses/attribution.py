"""Why did a request fail? One verdict per failed request (DESIGN.md §6, §8.2).

A request *fails* when the answer checker says so (the ``failed`` argument,
else ``requests.correct``, else the manifest's ``answer_correct``: a bool for
the whole run or a list with one entry per request), when its
teacher-forced top-1 agreement is below ``min_top1_agreement``, or when a
step's KL reaches ``kl_fail``. Its
*decision step* ``d`` is the first diverging step (top-1 disagreement or
KL >= ``kl_high``), else its last replayed step (without a replay: its last
token's position).

The verdict is the *fast estimate* of what ``h2o-lens explain``'s re-runs decide
(:mod:`.causal`): it names a cause only on the evidence that cause needs, read from
the logs, and says ``unknown (run explain)`` everywhere else. First match wins:

``implementation_error``
    the run's ``max_logit_diff`` exceeds ``logit_tolerance``: the masked
    parallel replay does not reproduce the run's logits, so no cache measure
    of it can be trusted (the re-runs' rule too).
``not_the_cache``
    the replay covers every generated token and the full-cache teacher's top-1
    is the run's token at each: the full cache, greedy, writes the same answer,
    which fails (the re-runs' first rule, read from the replay).
``budget``
    the teacher departs decisively (a step where its top-1 is not the run's token
    has KL >= ``kl_high``: not a near tie, which any change to the cache may flip
    either way), evidence was evicted before ``d`` and the labelled evidence has
    more tokens than the request's slots: no choice of slots holds it, so the
    oracle at the same slot count fails too.
``scoring_lag`` / ``scoring``
    the teacher departs decisively, evidence was evicted before ``d`` (at least
    ``evidence_lost_share`` of the KV sets lost a token of a span) and it takes
    less than ``evidence_pin_share`` of the request's heavy slots: the ``pinned``
    re-run restores it and leaves the policy most of its own choices, so
    pinning it should bring the answer back. ``scoring_lag`` when the policy is
    scored (``Policy.scored``, DESIGN.md §2.9) and at least ``lag_share`` of
    those evictions came within ``lag_steps`` of leaving the recent window
    with a score of at most ``low_score_ratio`` of the lowest surviving one.
``not_the_cache``
    the teacher departs, the evidence was held by every KV set up to ``d`` and
    the dropped mass around ``d`` is below ``dropped_mass_high``.
``unknown`` (shown as ``unknown (run explain)``)
    everything else: no replay of every step; a departure only near a tie; no
    evidence labelled (the dropped mass says what the run lost, not whether the
    oracle at the same slots would have kept enough); evidence evicted but
    taking ``evidence_pin_share`` or more of the heavy slots (pinned, it pushes
    out much of what the policy kept, and the re-run then differs in more than
    the evidence); evidence held with a high dropped mass (the oracle may still
    fix it). The re-runs decide (DESIGN.md §6.10, §19). The dropped mass does
    not name ``budget`` by itself: on short prompts it is high for failures the
    re-runs decide as ``scoring``, and on long recall prompts low for the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import duckdb
import pandas as pd

from ._base import Source, columns, connect, first_row, manifest_at, plain, relation, run_info, sql_literal
from .divergence import divergence_summary
from .evidence import evidence_evictions, evidence_held
from .policies import scored_policy
from .thresholds import Thresholds

__all__ = ["VERDICTS", "Fact", "Attribution", "failed_requests", "attribute", "evidence_sql"]

VERDICTS = ("budget", "scoring", "scoring_lag", "not_the_cache", "implementation_error", "unknown")
#: how the estimate's ``unknown`` is shown: it names no cause, the re-runs decide
UNKNOWN_TEXT = "unknown (run explain)"

FailedArg = bool | Mapping[int, bool] | Sequence[int] | None


@dataclasses.dataclass(frozen=True)
class Fact:
    """One fact behind a verdict; fields that do not apply are None."""

    kind: str
    value: float | None = None
    threshold: float | None = None
    step: int | None = None
    layer: int | None = None
    kv_head: int | None = None
    q_head: int | None = None
    position: int | None = None
    score: float | None = None
    margin: float | None = None
    dropped_mass: float | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Attribution:
    """The verdict on one failed request, the facts that decided it and the SQL of its evidence."""

    run_id: str
    request: int
    verdict: str
    failed_by: tuple[str, ...]
    decision_step: int | None
    summary: str
    facts: tuple[Fact, ...]
    evicted_evidence: tuple[dict[str, Any], ...]
    sql: str
    severity: tuple[float, ...] = dataclasses.field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "request": self.request,
            "verdict": self.verdict,
            "failed_by": list(self.failed_by),
            "decision_step": self.decision_step,
            "summary": self.summary,
            "facts": [f.to_dict() for f in self.facts],
            "evicted_evidence": [dict(e) for e in self.evicted_evidence],
            "sql": self.sql,
        }


def _recorded_checker(con: duckdb.DuckDBPyConnection, info: dict[str, Any], requests: list[int]) -> dict[int, bool]:
    """Checker failures the logs hold: ``requests.correct``, else the manifest's ``answer_correct``."""
    if "correct" in columns(con, "requests"):
        rows = relation(
            con, "SELECT request, correct FROM requests WHERE run_id = $run AND correct IS NOT NULL", run=info["run_id"]
        ).fetchall()
        if rows:
            return {int(r): not bool(c) for r, c in rows}
    correct = manifest_at(info.get("path")).get("answer_correct")
    if isinstance(correct, bool):
        return {r: not correct for r in requests}
    if isinstance(correct, list):
        return {r: correct[r] is False for r in requests if r < len(correct)}
    return {}


def _checker(
    con: duckdb.DuckDBPyConnection, info: dict[str, Any], failed: FailedArg, requests: list[int]
) -> dict[int, bool]:
    """Answer-checker failure per request: the ``failed`` argument, else what the logs hold."""
    if failed is None:
        return _recorded_checker(con, info, requests)
    if isinstance(failed, bool):
        return {r: failed for r in requests}
    if isinstance(failed, Mapping):
        return {int(r): bool(v) for r, v in failed.items()}
    return {int(r): True for r in failed}


def _requests(con: duckdb.DuckDBPyConnection, run_id: str) -> list[int]:
    sql = """
        SELECT request FROM replay_steps WHERE run_id = $run
        UNION SELECT request FROM tokens WHERE run_id = $run
        UNION SELECT request FROM steps WHERE run_id = $run
        ORDER BY request
    """
    return [r[0] for r in relation(con, sql, run=run_id).fetchall()]


def failed_requests(
    source: Source, run_id: str, *, failed: FailedArg = None, thresholds: Thresholds | Mapping[str, Any] | None = None
) -> pd.DataFrame:
    """Every request with its divergence summary and why it failed (empty ``failed_by``: it passed).

    Returns
    -------
    DataFrame
        :func:`divergence_summary` columns plus ``checker_failed`` and ``failed_by``.
    """
    con = connect(source)
    th = Thresholds.from_mapping(thresholds)
    info = run_info(con, run_id)
    summary = {
        int(r["request"]): r for r in divergence_summary(con, run_id, kl_high=th.kl_high).df().to_dict("records")
    }
    requests = sorted(set(_requests(con, run_id)) | set(summary))
    checker = _checker(con, info, failed, requests)
    rows = []
    for r in requests:
        row = {k: plain(v) for k, v in summary.get(r, {}).items() if k != "request"}
        reasons = []
        if checker.get(r):
            reasons.append("answer_checker")
        top1 = row.get("top1_agreement")
        if top1 is not None and pd.notna(top1) and top1 < th.min_top1_agreement:
            reasons.append("top1_agreement")
        kl_max = row.get("kl_max")
        if th.kl_fail is not None and kl_max is not None and pd.notna(kl_max) and kl_max >= th.kl_fail:
            reasons.append("kl")
        rows.append({"request": r, **row, "checker_failed": bool(checker.get(r, False)), "failed_by": tuple(reasons)})
    return pd.DataFrame(rows)


def evidence_sql(run_id: str, request: int, before_step: int | None) -> str:
    """SQL (for the SQL console) that selects the evidence evictions of one request."""
    before = f"\n  AND e.step < {int(before_step)}" if before_step is not None else ""
    return (
        "SELECT e.step, e.layer, e.kv_head, e.q_head, e.position, t.text, t.evidence,\n"
        "       e.score, e.margin, e.age, e.left_recent, e.phase\n"
        "FROM evictions e\n"
        "JOIN tokens t ON t.run_id = e.run_id AND t.request = e.request AND t.position = e.position\n"
        f"WHERE e.run_id = {sql_literal(run_id)} AND e.request = {int(request)}\n"
        f"  AND t.evidence IS NOT NULL{before}\n"
        "ORDER BY e.step, e.layer, e.kv_head, e.position"
    )


def _dropped_at(
    con: duckdb.DuckDBPyConnection, run_id: str, request: int, step: int, lookback: int
) -> tuple[float | None, dict[str, Any] | None]:
    """Mean dropped mass over heads and steps ``[step - lookback, step]``, and the worst row."""
    sql = """
        SELECT avg(dropped_mass) AS mean, max(dropped_mass) AS worst,
               arg_max(step, dropped_mass) AS step, arg_max(layer, dropped_mass) AS layer,
               arg_max(q_head, dropped_mass) AS q_head, arg_max(kv_head, dropped_mass) AS kv_head
        FROM replay WHERE run_id = $run AND request = $request
          AND step BETWEEN $step - $lookback AND $step
    """
    row = first_row(relation(con, sql, run=run_id, request=request, step=step, lookback=lookback))
    if row is None or row[0] is None:
        return None, None
    return float(row[0]), dict(zip(("dropped_mass", "step", "layer", "q_head", "kv_head"), row[1:]))


def _evidence_facts(
    ev: pd.DataFrame, held: pd.DataFrame, th: Thresholds, scored: bool = True
) -> tuple[bool, bool, float, list[Fact]]:
    """(evidence evicted, scoring lag, largest share of KV sets that lost a span, facts) for one
    request; no lag without scores."""
    facts: list[Fact] = []
    lost = 0.0
    for row in held.itertuples():
        share = 1.0 - float(row.held_all_share)
        lost = max(lost, share)
        facts.append(
            Fact(
                "evidence_lost_share",
                value=share,
                threshold=th.evidence_lost_share,
                step=plain(row.at_step),
                note=f"span {row.label!r}: share of KV sets that lost a token before the decision step",
            )
        )
    evicted = bool(len(held)) and lost >= th.evidence_lost_share and len(ev) > 0
    lag_share = float(ev["lag_eviction"].mean()) if len(ev) else 0.0
    if len(ev):
        facts.append(
            Fact(
                "lag_eviction_share",
                value=lag_share,
                threshold=th.lag_share,
                note="evidence evictions soon after leaving the recent window with a low score"
                + ("" if scored else "; not a scoring lag: this policy keeps no scores"),
            )
        )
        for row in ev.head(3).itertuples():
            facts.append(
                Fact(
                    "evidence_evicted",
                    step=plain(row.step),
                    layer=plain(row.layer),
                    kv_head=plain(row.kv_head),
                    q_head=plain(row.q_head),
                    position=plain(row.position),
                    score=plain(row.score),
                    margin=plain(row.margin),
                    note=f"{row.label!r} age {row.age}{', lag eviction' if row.lag_eviction else ''}",
                )
            )
    return evicted, scored and evicted and lag_share >= th.lag_share, lost, facts


@dataclasses.dataclass(frozen=True)
class _Evidence:
    """What the logs say about a request's labelled evidence before its decision step."""

    labelled: bool  # the request labels evidence
    evicted: bool  # at least ``evidence_lost_share`` of the KV sets lost a token of a span
    lag: bool  # ... and the evictions are mostly lag evictions of a scored policy
    held: bool  # no KV set lost a token of any span
    tokens: int  # labelled tokens
    heavy: int | None  # the request's heavy slots
    slots: int | None  # the request's slots (heavy + recent)

    @property
    def fits(self) -> bool:
        """The evidence can be pinned inside the slots (it takes no more than the heavy slots)."""
        return self.heavy is not None and 0 < self.tokens <= self.heavy


def _verdict(
    info: dict[str, Any],
    ev: _Evidence,
    departs: bool | None,
    kl_departs: float | None,
    dm: float | None,
    th: Thresholds,
) -> tuple[str, str]:
    """The verdict and one sentence saying why (rules in the module docstring, DESIGN.md §6.10)."""
    diff = info.get("max_logit_diff")
    tolerance = th.logit_bound(info.get("logit_tolerance"))
    high_dm = dm is not None and dm >= th.dropped_mass_high
    dm_text = (
        f"dropped mass {dm:.3g} {'>=' if high_dm else '<'} {th.dropped_mass_high:g}"
        if dm is not None
        else "no teacher replay"
    )
    if diff is not None and diff > tolerance:
        return "implementation_error", (
            f"the masked replay differs from the run's logits by {diff:.3g} > {tolerance:g}"
        )
    if departs is False:
        return "not_the_cache", (
            "the full-cache teacher picks the run's token at every step of the answer: the full cache "
            "writes the same answer"
        )
    share = ev.tokens / ev.heavy if ev.heavy else None
    decisive = bool(departs) and kl_departs is not None and kl_departs >= th.kl_high
    if decisive and ev.evicted and ev.slots is not None and ev.tokens > ev.slots:
        return "budget", (
            f"the evidence ({ev.tokens} tokens) is larger than the cache ({ev.slots} slots): no choice of "
            "slots holds it"
        )
    if decisive and ev.evicted and ev.fits and share is not None and share < th.evidence_pin_share:
        pinned = (
            f"the teacher departs decisively (KL {kl_departs:.3g} >= {th.kl_high:g}), the evidence was "
            f"evicted before the decision step and takes {ev.tokens} of the {ev.heavy} heavy slots "
            f"({share:.0%} < {th.evidence_pin_share:.0%}): pinned, it leaves the policy most of its own choices"
        )
        if ev.lag:
            return "scoring_lag", (
                f"{pinned}; it was evicted right after leaving the recent window with a low score, "
                f"before anything attended to it ({dm_text})"
            )
        return "scoring", f"{pinned} ({dm_text})"
    if departs and ev.held and dm is not None and not high_dm:
        return "not_the_cache", f"the evidence was still in every KV set and little was dropped ({dm_text})"
    return "unknown", _unknown_reason(ev, departs, kl_departs, share, dm_text, th)


def _unknown_reason(
    ev: _Evidence, departs: bool | None, kl_departs: float | None, share: float | None, dm_text: str, th: Thresholds
) -> str:
    """Why the thresholds cannot name a cause (one sentence, ending with what decides)."""
    if departs is None:
        why = f"the replay does not cover every step of the answer ({dm_text})"
    elif not ev.labelled:
        why = f"no evidence is labelled ({dm_text})"
    elif ev.evicted and (kl_departs is None or kl_departs < th.kl_high):
        why = (
            f"the teacher departs from the run only near a tie (KL {kl_departs or 0.0:.3g} < {th.kl_high:g}): "
            "any change to the cache, pinned or not, may flip it either way"
        )
    elif ev.evicted and not ev.fits:
        why = f"the evidence ({ev.tokens} tokens) does not fit the {ev.heavy} heavy slots"
    elif ev.evicted and share is not None:
        why = (
            f"the evidence takes {share:.0%} of the heavy slots (not < {th.evidence_pin_share:.0%}): "
            "pinned, it pushes out much of what the policy kept"
        )
    elif ev.held:
        why = f"the evidence was still held, but the teacher needed evicted positions ({dm_text})"
    else:
        why = f"some KV sets lost evidence, fewer than {th.evidence_lost_share:.0%} ({dm_text})"
    return f"{why}; the thresholds cannot tell, h2o-lens explain decides"


def _teacher_departs(
    con: duckdb.DuckDBPyConnection, run_id: str, request: int, row: dict[str, Any], kl_high: float
) -> tuple[bool | None, float | None]:
    """Whether the teacher-forced top-1 departs from the run's token at some step (None when the
    replay does not cover every generated token: then the full cache's answer is not known), and
    the largest KL at a step where it departs (None: it never does)."""
    disagreements, steps = plain(row.get("disagreements")), plain(row.get("steps"))
    if disagreements is None or steps is None:
        return None, None
    if disagreements > 0:
        sql = "SELECT max(kl) FROM replay_steps WHERE run_id = $run AND request = $r AND NOT top1_agree"
        found = first_row(relation(con, sql, run=run_id, r=request))
        return True, (float(found[0]) if found and found[0] is not None else None)
    sql = "SELECT count(*) FROM tokens WHERE run_id = $run AND request = $r AND NOT is_prompt"
    found = first_row(relation(con, sql, run=run_id, r=request))
    generated = int(found[0]) if found and found[0] is not None else None
    return (None if not generated or steps < generated else False), None


@dataclasses.dataclass(frozen=True)
class _SLOT_COLUMNS:
    """The ``requests`` columns that hold a request's slot split."""

    heavy: int
    recent: int


def _slots(con: duckdb.DuckDBPyConnection, info: dict[str, Any], request: int) -> tuple[int | None, int | None]:
    """(heavy, heavy + recent) of one request: ``requests``, else the run's config."""
    heavy, recent = info.get("heavy"), info.get("recent")
    if {f.name for f in dataclasses.fields(_SLOT_COLUMNS)} <= set(columns(con, "requests")):
        sql = "SELECT heavy, recent FROM requests WHERE run_id = $run AND request = $r"
        found = first_row(relation(con, sql, run=info["run_id"], r=request))
        if found is not None and found[0] is not None:
            heavy, recent = found
    if heavy is None or heavy != heavy:
        return None, None
    recent = 0 if recent is None or recent != recent else int(recent)
    return int(heavy), int(heavy) + recent


def _evidence_tokens(con: duckdb.DuckDBPyConnection, run_id: str, request: int) -> int:
    """The request's labelled evidence tokens."""
    sql = "SELECT count(*) FROM tokens WHERE run_id = $run AND request = $r AND evidence IS NOT NULL"
    found = first_row(relation(con, sql, run=run_id, r=request))
    return int(found[0]) if found and found[0] is not None else 0


def _decision_step(
    con: duckdb.DuckDBPyConnection, run_id: str, request: int, row: dict[str, Any]
) -> tuple[int | None, str]:
    """The first diverging step, else the last replayed step, else the last token's position."""
    first = plain(row.get("first_divergence_step"))
    if first is not None:
        return int(first), "first diverging step"
    sql = """
        SELECT coalesce((SELECT max(step) FROM replay_steps WHERE run_id = $run AND request = $r),
                        (SELECT max(position) FROM tokens WHERE run_id = $run AND request = $r))
    """
    found = first_row(relation(con, sql, run=run_id, r=request))
    if found is None or found[0] is None:
        return None, "no replay and no tokens"
    return int(found[0]), "last step of the request (no divergence)"


def _replay_facts(
    con: duckdb.DuckDBPyConnection,
    info: dict[str, Any],
    request: int,
    d: int | None,
    why_d: str,
    kl_d: float | None,
    th: Thresholds,
) -> tuple[float | None, list[Fact]]:
    """(dropped mass around ``d``, facts about ``d``, the replay check, dropped mass and KL)."""
    facts = [Fact("decision_step", step=d, note=why_d)]
    if info.get("max_logit_diff") is not None:
        facts.append(
            Fact(
                "max_logit_diff",
                value=float(info["max_logit_diff"]),
                threshold=th.logit_bound(info.get("logit_tolerance")),
            )
        )
    dm, worst = (None, None) if d is None else _dropped_at(con, info["run_id"], request, d, th.dropped_mass_lookback)
    if dm is not None:
        facts.append(
            Fact(
                "dropped_mass",
                value=dm,
                threshold=th.dropped_mass_high,
                step=d,
                note=f"mean over heads, steps {d - th.dropped_mass_lookback}..{d}",
            )
        )
        facts.append(Fact("worst_head_dropped_mass", **{k: plain(v) for k, v in worst.items()}))
    if kl_d is not None:
        facts.append(Fact("kl", value=kl_d, threshold=th.kl_high, step=d))
    return dm, facts


def _attribute_one(
    con: duckdb.DuckDBPyConnection, info: dict[str, Any], row: dict[str, Any], th: Thresholds
) -> Attribution:
    run_id, request = info["run_id"], int(row["request"])
    d, why_d = _decision_step(con, run_id, request, row)
    ev = evidence_evictions(
        con, run_id, request=request, before_step=d, lag_steps=th.lag_steps, low_score_ratio=th.low_score_ratio
    ).df()
    held = evidence_held(con, run_id, at_step=d).df() if d is not None else pd.DataFrame()
    held = held[held["request"] == request] if len(held) else held
    scored = scored_policy(info.get("policy"))
    evicted, lag, lost, evidence_facts = _evidence_facts(ev, held, th, scored)
    kl_d = plain(row.get("kl_at_divergence"))
    dm, facts = _replay_facts(con, info, request, d, why_d, kl_d, th)
    departs, kl_departs = _teacher_departs(con, run_id, request, row, th.kl_high)
    heavy, slots = _slots(con, info, request)
    n_ev = _evidence_tokens(con, run_id, request) if len(held) else 0
    evidence = _Evidence(len(held) > 0, evicted, lag, len(held) > 0 and lost == 0.0, n_ev, heavy, slots)
    facts.append(
        Fact(
            "teacher_departs",
            value=kl_departs if departs else (0.0 if departs is False else None),
            threshold=th.kl_high,
            note="the full-cache teacher's top-1 departs from the run's token; value: the largest KL where it does"
            if departs
            else ("it never departs: the full cache writes the same answer" if departs is False else "not replayed"),
        )
    )
    if evidence.labelled:
        facts.append(
            Fact(
                "evidence_pin_share",
                value=n_ev / heavy if heavy else None,
                threshold=th.evidence_pin_share,
                note=f"{n_ev} evidence tokens over {heavy} heavy slots ({slots} slots)",
            )
        )
    verdict, why = _verdict(info, evidence, departs, kl_departs, dm, th)
    top1 = plain(row.get("top1_agreement"))
    severity = (
        0.0 if row["checker_failed"] else 1.0,
        top1 if top1 is not None else 1.0,
        -(plain(row.get("kl_mean")) or 0.0),
    )
    evicted_rows = tuple({k: plain(v) for k, v in r.items()} for r in ev.head(50).to_dict("records"))
    return Attribution(
        run_id,
        request,
        verdict,
        tuple(row["failed_by"]),
        d,
        why,
        tuple(facts + evidence_facts),
        evicted_rows,
        evidence_sql(run_id, request, d),
        severity,
    )


def attribute(
    source: Source, run_id: str, *, failed: FailedArg = None, thresholds: Thresholds | Mapping[str, Any] | None = None
) -> list[Attribution]:
    """Verdicts for every failed request of a run, most severe first.

    Parameters
    ----------
    failed : bool, mapping request → bool, or sequence of failed requests, optional
        The answer checker's result; default the manifest's ``answer_correct``.
    thresholds : Thresholds or mapping, optional

    Severity: answer-checker failures first, then lower top-1 agreement, then
    higher mean KL.
    """
    con = connect(source)
    th = Thresholds.from_mapping(thresholds)
    info = run_info(con, run_id)
    table = failed_requests(con, run_id, failed=failed, thresholds=th)
    out = [_attribute_one(con, info, row, th) for row in table.to_dict("records") if row["failed_by"]]
    return sorted(out, key=lambda a: (a.severity, a.request))
