"""Why did a request fail? One verdict per failed request (DESIGN.md §6, §8.2).

A request *fails* when the answer checker says so (the ``failed`` argument,
else ``requests.correct``, else the manifest's ``answer_correct``: a bool for
the whole run or a list with one entry per request), when its
teacher-forced top-1 agreement is below ``min_top1_agreement``, or when a
step's KL reaches ``kl_fail``. Its
*decision step* ``d`` is the first diverging step (top-1 disagreement or
KL >= ``kl_high``), else its last replayed step (without a replay: its last
token's position).

Verdicts, first match wins:

``implementation_error``
    the run's ``max_logit_diff`` exceeds ``logit_tolerance``: the masked
    parallel replay does not reproduce the run's logits, so no cache measure
    of it can be trusted.
``scoring_lag``
    a scored policy (attention drives its choices: ``Policy.scored`` in the
    registry, DESIGN.md §2.9) evicted evidence before ``d`` (at
    least ``evidence_lost_share`` of the KV sets lost a token of a span) and
    at least ``lag_share`` of those evictions came within ``lag_steps`` of
    leaving the recent window with a score of at most ``low_score_ratio`` of
    the lowest surviving one: a delayed first reference the score could not
    see coming. Unscored policies (``local``, ``sink``, ``random``) evict
    without looking at attention, so their evicted evidence is never a
    scoring lag: it falls to the rules below.
``budget``
    evidence was evicted before ``d`` and the dropped mass around ``d`` is
    high; or the run labels no evidence and the dropped mass is high.
``unknown`` (shown as ``unknown (run explain)``)
    the thresholds cannot tell: evidence was evicted before ``d`` but the
    dropped mass around ``d`` is low (a few evicted tokens can carry an answer
    with little of the heads' mass: the long recall failures that the re-runs
    decide as ``scoring``), or no evidence is labelled and neither the dropped
    mass nor the KL points anywhere. ``h2o-lens explain`` decides (DESIGN.md
    §6.10, §19).
``not_the_cache``
    everything else: low dropped mass with high KL and no evidence evicted (a
    value direction, positions or an earlier divergence), or evidence still held.
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

VERDICTS = ("budget", "scoring_lag", "not_the_cache", "implementation_error", "unknown")
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
) -> tuple[bool, bool, list[Fact]]:
    """(evidence evicted, scoring lag, facts) for one request; no lag without scores."""
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
    return evicted, scored and evicted and lag_share >= th.lag_share, facts


def _verdict(
    info: dict[str, Any],
    evicted: bool,
    lag: bool,
    has_evidence: bool,
    dm: float | None,
    kl_d: float | None,
    th: Thresholds,
) -> tuple[str, str]:
    """The verdict and one sentence saying why (rules in the module docstring)."""
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
    if lag:
        return "scoring_lag", (
            "the evidence was evicted right after leaving the recent window with a "
            f"low score, before anything attended to it ({dm_text})"
        )
    if evicted and high_dm:
        return "budget", f"the evidence was evicted and the teacher needed evicted positions ({dm_text})"
    if not has_evidence and high_dm:
        return "budget", f"no evidence is labelled; the teacher needed evicted positions ({dm_text})"
    if evicted:
        return "unknown", (
            f"evidence was evicted, but the teacher put little attention on evicted positions ({dm_text}): "
            "the thresholds cannot tell whether it mattered; h2o-lens explain decides"
        )
    if dm is not None and not high_dm and kl_d is not None and kl_d >= th.kl_high:
        return "not_the_cache", (
            f"low dropped mass but high KL ({kl_d:.3g} >= {th.kl_high:g}): value "
            "direction, positions or an earlier divergence"
        )
    if has_evidence:
        return "not_the_cache", f"the evidence was still in the cache ({dm_text})"
    return "unknown", (
        f"no evidence is labelled and no cache fact explains the failure ({dm_text}); h2o-lens explain decides"
    )


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
    evicted, lag, evidence_facts = _evidence_facts(ev, held, th, scored)
    kl_d = plain(row.get("kl_at_divergence"))
    dm, facts = _replay_facts(con, info, request, d, why_d, kl_d, th)
    verdict, why = _verdict(info, evicted, lag, len(held) > 0, dm, kl_d, th)
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
