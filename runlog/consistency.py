"""What the tables of one run and its manifest must agree on (DESIGN.md §5.5).

:mod:`runlog.contract` checks each column against its range; this module checks the run as a
whole, from the manifest and the facts the catalog keeps per file (row counts from the Parquet
footers, per-request rows and spans, the guard's events), never reading data again:

* the manifest's own fields: slot counts and ratios in their ranges, the guard's threshold,
  weights and cost; a version-4 manifest of a closed run lists its ``segments`` and ``rows``;
* counts that must agree: one ``oracle`` row per eviction, the requests' prompt and new tokens
  against the manifest and the ``tokens`` table, the model's layers and KV sets against the sets
  an evicting run's ``steps`` log, the raises of ``state_events`` against ``guard_events``;
* the tables a run of its kind cannot lack (an evicting policy's ``evictions``, a guarded run's
  ``guard_steps``);
* each guard event: a known action, a raise that grows, a risk at the threshold (a canary's
  event aside), a request the run has, a slot count no larger than its request's tokens;
* each recall of a cold tier: a position its request, layer and KV set evicted before the
  recall's step (the one check that reads data again, :mod:`runlog.recall_check`).

Every finding is a :class:`~runlog.contract.Violation` naming the run, the table or manifest
field and the value found.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from .recall_check import check_recalls
from .schema import FLOAT_SLACK

__all__ = ["Violation", "GUARD_ACTIONS", "NON_EVICTING", "check_consistency", "check_manifest_values"]

#: ``guard_events.action``: what the guard can log (DESIGN.md §18.2)
GUARD_ACTIONS = ("raise", "refill", "canary", "recall")
#: policies that never evict (every other policy's run logs ``evictions`` and ``steps``)
NON_EVICTING = ("full",)
_MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken fact: the file (or run folder), its table, the full reason and a short note."""

    path: str
    table: str | None
    reason: str
    note: str


def _violation(where: str, table: str | None, reason: str, note: str) -> Violation:
    return Violation(where, table, f"{where}: {reason}", note)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _run_of(manifest: Mapping[str, Any], run_dir: str) -> str:
    name = manifest.get("run_id")
    return name if isinstance(name, str) else run_dir.rstrip("/").rsplit("/", 1)[-1]


# -- the manifest's own values ------------------------------------------------------------------


def _range_issue(value: Any, lo: float | None, hi: float | None, *, open_lo: bool = False) -> str | None:
    if not _number(value):
        return None
    if not math.isfinite(value):
        return f"{value}, not a finite number"
    if lo is not None and (value <= lo if open_lo else value < lo):
        return f"{value}, below its range"
    if hi is not None and value > hi:
        return f"{value}, above its range"
    return None


def _manifest_fields(manifest: Mapping[str, Any]) -> list[tuple[str, Any, str, str | None]]:
    """``(field, value, range text, issue)`` of every ranged manifest field."""
    config = manifest.get("config") if isinstance(manifest.get("config"), Mapping) else {}
    out = []
    for where, mapping in (("", manifest), ("config.", config)):
        for key in ("heavy", "recent", "sink"):
            out.append((where + key, mapping.get(key), "[0, inf)", _range_issue(mapping.get(key), 0, None)))
    for field, value in (("keep_ratio", manifest.get("keep_ratio")), ("config.ratio", config.get("ratio"))):
        out.append((field, value, "(0, 1]", _range_issue(value, 0, 1, open_lo=True)))
    guard = manifest.get("guard")
    if isinstance(guard, Mapping):
        out.append(("guard.threshold", guard.get("threshold"), "[0, 1]", _range_issue(guard.get("threshold"), 0, 1)))
        weights = guard.get("weights")
        for i, w in enumerate(weights if isinstance(weights, list) else ()):
            issue = None if _number(w) and math.isfinite(w) else f"{w!r}, not a finite number"
            out.append((f"guard.weights[{i}]", w, "a finite number", issue))
        bias = guard.get("bias")
        out.append(("guard.bias", bias, "a finite number", _range_issue(bias, None, None)))
    cost = manifest.get("guard_cost")
    if isinstance(cost, Mapping):
        for key, value in sorted(cost.items()):
            out.append((f"guard_cost.{key}", value, "[0, inf)", _range_issue(value, 0, None)))
    return out


def check_manifest_values(manifest: Mapping[str, Any], run_dir: str) -> list[Any]:
    """The manifest's ranged fields, and the ``segments`` and ``rows`` a closed v4 manifest lists."""
    where = f"{run_dir}/{_MANIFEST}"
    run = _run_of(manifest, run_dir)
    out = [
        _violation(
            where,
            None,
            f"run {run}: manifest field {field} is {issue} (expected {rng}); the manifest was edited or "
            "written wrongly, so the run's configuration cannot be trusted",
            f"manifest {field} out of range",
        )
        for field, _, rng, issue in _manifest_fields(manifest)
        if issue is not None
    ]
    version = manifest.get("schema_version")
    if _number(version) and version >= 4 and manifest.get("status") == "complete":
        for key in ("segments", "rows"):
            if not isinstance(manifest.get(key), Mapping):
                out.append(
                    _violation(
                        where,
                        None,
                        f"run {run}: a version-{version} manifest of a complete run lacks its {key!r} list "
                        f"(found {manifest.get(key)!r}); without it no missing or added segment can be told, "
                        "so it is not read as a run of an older format",
                        f"manifest {key} missing",
                    )
                )
    return out


# -- the tables against each other ------------------------------------------------------------


def _rows(files: Mapping[str, Sequence[Any]], table: str) -> int | None:
    segs = files.get(table)
    return sum(s.rows for s in segs) if segs else None


def _facts(files: Mapping[str, Sequence[Any]], table: str) -> list[dict[str, Any]]:
    return [s.facts or {} for s in files.get(table, ())]


def _spans(files: Mapping[str, Sequence[Any]]) -> dict[int, tuple[int, int]]:
    """request -> (prompt_len, new_tokens) from the requests table's facts."""
    out = {}
    for facts in _facts(files, "requests"):
        for r, p, n in facts.get("spans", ()):
            if isinstance(p, int) and isinstance(n, int):
                out[r] = (p, n)
    return out


def _required(manifest: Mapping[str, Any], files: Mapping[str, Sequence[Any]], run: str, where: str) -> list[Any]:
    """Tables the run's kind cannot lack, in a closed run's manifest (``rows``) or its files."""
    rows = manifest.get("rows")
    if not isinstance(rows, Mapping):
        return []
    config = manifest.get("config") if isinstance(manifest.get("config"), Mapping) else {}
    policy = manifest.get("policy", config.get("policy"))
    needed = []
    if isinstance(policy, str) and policy not in NON_EVICTING:
        needed.append(("evictions", f"policy {policy!r} evicts"))
    if isinstance(manifest.get("guard"), Mapping):
        needed.append(("guard_steps", "the run is guarded (manifest field guard)"))
    return [
        _violation(
            where,
            table,
            f"run {run}: table {table} is missing: {why}, yet neither the manifest's rows nor the run's "
            f"files have a {table} table; it was deleted, and the run's numbers would read it as empty",
            f"{table} missing",
        )
        for table, why in needed
        if table not in rows and not files.get(table)
    ]


def _counts(manifest: Mapping[str, Any], files: Mapping[str, Sequence[Any]], run: str, where: str) -> list[Any]:
    out = []
    oracle, evictions = _rows(files, "oracle"), _rows(files, "evictions") or 0
    if oracle and oracle != evictions:
        out.append(
            _violation(
                str(files["oracle"][-1].path),
                "oracle",
                f"run {run}: table oracle holds {oracle} rows, one per eviction, but table evictions holds "
                f"{evictions}; one of them was edited or deleted",
                "oracle rows differ from evictions",
            )
        )
    spans = _spans(files)
    if spans:
        for field, i in (("prompt_len", 0), ("new_tokens", 1)):
            longest, said = max(s[i] for s in spans.values()), manifest.get(field)
            if _number(said) and said != longest:
                out.append(
                    _violation(
                        where,
                        "requests",
                        f"run {run}: manifest field {field} is {said}, but the longest request's requests.{field} "
                        f"is {longest}; the manifest was edited or belongs to another run",
                        f"manifest {field} differs from the requests",
                    )
                )
        said = manifest.get("requests")
        if _number(said) and said != len(spans):
            out.append(
                _violation(
                    where,
                    "requests",
                    f"run {run}: manifest field requests is {said}, but table requests holds {len(spans)} request(s)",
                    "manifest requests differs from the requests table",
                )
            )
        out += _tokens(files, spans, run)
    return out


def _tokens(files: Mapping[str, Sequence[Any]], spans: Mapping[int, tuple[int, int]], run: str) -> list[Any]:
    """The tokens table holds prompt_len + new_tokens rows per request."""
    per: Counter[int] = Counter()
    for facts in _facts(files, "tokens"):
        for r, rows, *_ in facts.get("requests", ()):
            per[r] += rows
    if not files.get("tokens"):
        return []
    path = str(files["tokens"][-1].path)
    return [
        _violation(
            path,
            "tokens",
            f"run {run}: request {r} has {per.get(r, 0)} tokens rows, but its requests row says prompt_len "
            f"{p} + new_tokens {n} = {p + n}",
            f"tokens rows differ from request {r}'s",
        )
        for r, (p, n) in sorted(spans.items())
        if per.get(r, 0) != p + n
    ]


def _shape(manifest: Mapping[str, Any], files: Mapping[str, Sequence[Any]], run: str, shape: Mapping[str, int]):
    """An evicting run's steps log every layer and KV set of the model the manifest names."""
    config = manifest.get("config") if isinstance(manifest.get("config"), Mapping) else {}
    policy = manifest.get("policy", config.get("policy"))
    facts = [f for f in _facts(files, "steps") if f.get("max")]
    if not facts or not isinstance(policy, str) or policy in NON_EVICTING:
        return []
    set_column = "q_head" if config.get("gqa", manifest.get("gqa")) == "none" else "kv_head"
    out = []
    for what, column, field in (("layers", "layer", "num_layers"), ("sets", set_column, "num_kv_heads")):
        tops = [f["max"][column] for f in facts if isinstance(f["max"].get(column), int)]
        if what not in shape or not tops:
            continue
        used = max(tops) + 1
        if used < shape[what]:
            field = "num_query_heads" if column == "q_head" else field
            out.append(
                _violation(
                    str(files["steps"][-1].path),
                    "steps",
                    f"run {run}: manifest field model.{field} is {shape[what]}, but the steps of this evicting "
                    f"run use {used} {what} (steps.{column} 0 .. {used - 1}); the manifest names another model",
                    f"manifest model has more {what} than the logs",
                )
            )
    return out


def _guard(manifest: Mapping[str, Any], files: Mapping[str, Sequence[Any]], run: str) -> list[Any]:
    """Each guard event against the known actions, the threshold, the requests; raises against state_events."""
    guard = manifest.get("guard") if isinstance(manifest.get("guard"), Mapping) else {}
    threshold = guard.get("threshold") if _number(guard.get("threshold")) else None
    raise_slots = guard.get("raise_slots") if _number(guard.get("raise_slots")) else 0
    spans = _spans(files)
    out: list[Any] = []
    acted: Counter[tuple[int, str]] = Counter()
    for seg in files.get("guard_events", ()):
        path = str(seg.path)
        for r, step, risk, action, before, after in (seg.facts or {}).get("events", ()):
            acted[r, action] += 1
            said = f"run {run}: guard_events row (request {r}, step {step})"
            issue = None
            if action not in GUARD_ACTIONS:
                issue = f"has action {action!r}, not one of {', '.join(GUARD_ACTIONS)}"
            elif action in ("raise", "recall") and after < before:
                issue = f"is a {action} that shrinks slots {before} -> {after} (slots_after {after}); a {action} grows"
            elif action != "canary" and threshold is not None and risk < threshold - FLOAT_SLACK:
                issue = f"acted ({action}) at risk {risk:.6g}, below the run's guard.threshold {threshold}"
            elif spans and r not in spans:
                issue = f"names request {r}, which the run does not have (requests: {len(spans)})"
            elif r in spans and (after - before if action == "recall" else after) > max(sum(spans[r]), raise_slots):
                what = f"a recall window of {after - before} slots" if action == "recall" else f"slots_after {after}"
                tokens = sum(spans[r])
                issue = f"has {what}, more than the request's {tokens} tokens (prompt_len + new_tokens) could fill"
            if issue:
                out.append(_violation(path, "guard_events", f"{said} {issue}", "guard_events value impossible"))
    out += _raises(manifest, files, run, acted)
    return out


def _raises(manifest: Mapping[str, Any], files: Mapping[str, Sequence[Any]], run: str, acted: Counter) -> list[Any]:
    """The state events' raises per request: at least the guard's raises, at most its raises and refills
    (a canary run's canaries are raised too)."""
    version = manifest.get("schema_version")
    events = manifest.get("state_events")
    if not (_number(version) and version >= 4) or not isinstance(events, list):
        return []
    logged: Counter[int] = Counter()
    for e in events:
        if isinstance(e, Mapping) and e.get("event") == "raise" and isinstance(e.get("requests"), list):
            logged.update(r for r in e["requests"] if isinstance(r, int))
    guard = manifest.get("guard") if isinstance(manifest.get("guard"), Mapping) else {}
    # a canary is a copy of a request run at raised slots: its raise has no raise event of its own
    canaries = guard.get("action") == "canary" or any(a == "canary" for _, a in acted)
    out = []
    for r in sorted(set(logged) | {r for r, _ in acted}):
        lo, hi = acted[r, "raise"], acted[r, "raise"] + acted[r, "refill"]
        if lo <= logged[r] and (logged[r] <= hi or canaries):
            continue
        where = str(files["guard_events"][-1].path) if files.get("guard_events") else "state_events"
        out.append(
            _violation(
                where,
                "guard_events",
                f"run {run}: the manifest's state_events hold {logged[r]} raise(s) of request {r}, table "
                f"guard_events {lo} raise(s) and {hi - lo} refill(s) of it; one of them was edited or deleted",
                "state_events raises differ from guard_events",
            )
        )
    return out


def check_consistency(
    manifest: Mapping[str, Any], files: Mapping[str, Sequence[Any]], run_dir: str, shape: Mapping[str, int]
) -> list[Any]:
    """Every cross-table and manifest finding of one run (``files``: table -> segments with facts); the
    tables' counts only of a ``complete`` run, whose tables are whole."""
    where = f"{run_dir}/{_MANIFEST}"
    run = _run_of(manifest, run_dir)
    out = [*check_manifest_values(manifest, run_dir), *_guard(manifest, files, run)]
    out += check_recalls(files, run, _violation)  # reads the two tables' keys (runlog/recall_check.py)
    if manifest.get("status") == "complete":  # a run that ended early has partial tables (its gate fails)
        out += [
            *_required(manifest, files, run, where),
            *_counts(manifest, files, run, where),
            *_shape(manifest, files, run, shape),
        ]
    return out
