"""Culprit tokens: which evicted prompt tokens, restored, bring a failed answer back (DESIGN.md §19).

The counterfactual re-runs of :mod:`recorders.counterfactual` say whether the cache caused a
failure; pinning the evidence says it lost the evidence, when a task labels one. Without labels
the question stays: *which* deleted tokens broke the answer? The culprit search answers it from
the run alone:

* candidates: the prompt positions the policy evicted (in any layer or KV set) at any step of the
  request, ranked by the full-cache teacher's attention to them after their eviction
  (``oracle.teacher_future_mass`` of the replay, each row weighted by the share of the position's
  teacher attention that came after its eviction, :func:`rank_weights`, summed over the sets that
  evicted them);
* the test of a set: re-run the request with the set pinned (:func:`h2o_lens.config.pin`) inside
  the run's slot count, judged by the request's checker, else by agreement with the full cache's
  answer;
* the search (:func:`~recorders.culprit_search.search_culprits`, a pure function of the ranking
  and a test of one set or of a list of sets): growing prefixes of the ranking (1, 2, 4 ...
  positions) until one passes, the smallest passing prefix between the last two, then adaptive
  group testing (bisection for one needed position at a time) down to a 1-minimal set: it passes,
  and without any one of its positions it fails; its independent probes evaluated ``batch`` at a
  time;
* limits: ``max_runs`` re-runs (each row of a batched re-run counted) and ``seconds`` of search;
  a search stopped by either reports the passing set it holds (not proven 1-minimal), or, when
  nothing passed, the largest set it tried.

:func:`explain_culprits` runs it on a recorded run: every probe generates without writing, up to
``batch`` of them as the rows of one ``generate`` (:mod:`recorders.culprit_probes`), inside one
:func:`~h2o_lens.prompt_reuse.reuse_prompts` (one prompt forward for all of them), and
the set found is recorded as a counterfactual run of kind ``culprits`` (its manifest's
``counterfactual.search`` holds every probe) with a ``culprits`` table: one row per culprit with
when and why it left the parent's cache.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runlog.errors import RecorderError
from runlog.schema import CULPRITS_KIND

from .culprit_search import BATCH, MAX_RUNS, SECONDS, CulpritSearch, Probe, search_culprits, search_from_dict

__all__ = [
    "MAX_RUNS",
    "SECONDS",
    "BATCH",
    "Probe",
    "CulpritSearch",
    "search_culprits",
    "search_from_dict",
    "Candidate",
    "culprit_candidates",
    "rank_weights",
    "first_wrong_step",
    "explain_culprits",
]

# ----------------------------------------------------------------------------- the candidates


@dataclasses.dataclass(frozen=True)
class Candidate:
    """An evicted prompt position and when and why it left the parent's cache."""

    position: int
    text: str | None
    rank: int
    future_mass: float | None
    step: int
    layer: int
    kv_head: int
    sets: int
    phase: str | None
    held: str
    score: float | None
    margin: float | None

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def first_wrong_step(replay_steps: Any, request: int) -> int | None:
    """The first step whose teacher-forced top-1 departs from the run's token (None: none did)."""
    if replay_steps is None or not len(replay_steps):
        return None
    rows = replay_steps[(replay_steps["request"] == request) & ~replay_steps["top1_agree"].astype(bool)]
    return int(rows["step"].min()) if len(rows) else None


def rank_weights(future: Any, score: Any) -> Any:
    """The ranking weight of one eviction row: the teacher's attention to the position after its
    eviction (``future``), times the share of the position's whole teacher attention that came after
    it (``future / (future + score)``, ``score`` the attention from its own position up to the
    eviction). A position attended all along (a sink: punctuation, a newline) had its use in view
    of the policy's score and shares its attention with other sinks; one attended mostly after its
    eviction is a reference the score could not see coming (DESIGN.md §19)."""
    future = np.asarray(future, dtype=np.float64)
    total = future + np.asarray(score, dtype=np.float64)
    return np.where(total > 0, future * future / np.where(total > 0, total, 1.0), 0.0)


def culprit_candidates(run_dir: str | Path, request: int = 0) -> tuple[list[Candidate], int | None]:
    """The culprit candidates of one request of a replayed run, ranked (DESIGN.md §19).

    Returns the candidates (prompt positions evicted at any step of the request, in any layer or
    KV set; the most attended by the teacher after their eviction first, each eviction row's
    attention weighted by :func:`rank_weights`; ties by the sets that evicted it, then by
    position) and the first wrong step (None: no step departs).
    """
    from runlog.store import load_run

    run = load_run(run_dir, tables=("tokens", "evictions", "oracle", "replay_steps"))
    tok = run["tokens"].to_pandas()
    tok = tok[tok["request"] == request]
    prompt_len = int(tok["is_prompt"].sum())
    text = dict(zip(tok["position"].astype(int), tok["text"]))
    d = first_wrong_step(run["replay_steps"].to_pandas(), request)
    ev = run["evictions"].to_pandas()
    ev = ev[(ev["request"] == request) & (ev["position"] < prompt_len)]
    if not len(ev):
        return [], d
    orc = run["oracle"].to_pandas()
    orc = orc[(orc["request"] == request) & orc["position"].isin(ev["position"].unique())]
    mass = orc.groupby("position")["teacher_future_mass"].sum() if len(orc) else None
    weight = (
        orc.assign(w=rank_weights(orc["teacher_future_mass"], orc["teacher_score"])).groupby("position")["w"].sum()
        if len(orc)
        else None
    )
    set_cols = ["layer", "kv_head"] + (["q_head"] if ev["q_head"].notna().any() else [])
    ev = ev.sort_values(["position", "step", "layer", "kv_head"], kind="stable")
    first = ev.drop_duplicates("position", keep="first").set_index("position")
    sets = ev.drop_duplicates(["position", *set_cols]).groupby("position").size()
    positions = [int(p) for p in first.index]
    key = {p: (-(float(weight.get(p, 0.0)) if weight is not None else 0.0), -int(sets[p]), p) for p in positions}
    out = []
    for rank, p in enumerate(sorted(positions, key=key.__getitem__)):
        row = first.loc[p]
        out.append(
            Candidate(
                p,
                text.get(p),
                rank,
                float(mass.get(p, 0.0)) if mass is not None else None,
                int(row["step"]),
                int(row["layer"]),
                int(row["kv_head"]),
                int(sets[p]),
                None if row["phase"] is None or row["phase"] != row["phase"] else str(row["phase"]),
                "recent" if bool(row["left_recent"]) else "heavy",
                _num(row["score"]),
                _num(row["margin"]),
            )
        )
    return out, d


def _num(x: Any) -> float | None:
    return None if x is None or x != x else float(x)


# ----------------------------------------------------------------------------- on a recorded run


def _max_size(config: Any) -> int:
    """The most positions a set may pin: the heavy slots (pins give way there first, DESIGN.md §2.11),
    so the recent window stays whole; one slot less than the budget for a policy without heavy slots
    (a set whose pins leave the policy no usable split fails its test)."""
    heavy, recent = int(config.heavy or 0), int(config.recent or 0)
    return heavy if heavy > 0 else max(0, heavy + recent - 1)


def _refuse_unreplayed(run_dir: Path) -> None:
    from runlog.catalog import replay_complete

    if not replay_complete(run_dir):
        raise RecorderError(
            f"run {run_dir.name} has no complete replay: the culprit search ranks the evicted tokens by the "
            f"teacher's attention after their eviction, which the replay measures. Replay it first "
            f"(h2o-lens replay {run_dir})"
        )


def check_culprit_parent(run_dir: str | Path) -> None:
    """Refuse, in one line, a parent the culprit search cannot run on: not replayed, or a press run."""
    from runlog.manifest import read_manifest

    run_dir = Path(run_dir)
    _refuse_unreplayed(run_dir)
    config = read_manifest(run_dir).get("config") or {}
    if isinstance(config, dict) and isinstance(config.get("press"), dict):
        raise RecorderError(
            f"run {run_dir.name} is a kvpress press run: the culprit search pins positions of an evicting "
            "policy (DESIGN.md §19); explain it without --culprits"
        )


def explain_culprits(
    model: Any,
    tokenizer: Any,
    run_dir: str | Path,
    request: int = 0,
    *,
    out: str | Path | None = None,
    max_runs: int = MAX_RUNS,
    seconds: float | None = SECONDS,
    batch: int = BATCH,
    splits: int = 1,
    replay: bool = False,
    progress: Callable[[str], None] | None = None,
    allow_other_model: bool = False,
) -> CulpritSearch:
    """Search the culprit tokens of one failed request of a recorded run, and record the result.

    The full-cache counterfactual is reused when an earlier ``explain`` recorded it (else it is
    generated and recorded as ``explain`` would). Refused in one line (:class:`RecorderError`): a
    run without a complete replay, a press run, a request the full cache fails too, a request that
    passes. The set found (or the largest tried) is recorded as the ``culprits`` counterfactual
    (``<run>-r<request>-culprits``, replayed with ``replay``) with its ``culprits`` table; a
    complete one recorded earlier is read back instead of searched again. ``batch``: the most
    probes re-run together, as the rows of one ``generate`` (1: one at a time), ``splits``: the
    bisection's split points tested together (:func:`search_culprits`); for a monotone test the
    set found is the same.
    """
    from h2o_lens.prompt_reuse import reuse_prompts
    from runlog.recorded_model import check_model

    from .counterfactual import FULL, _answer_of, _fresh, _Runner, counterfactual_id, load_parent

    run_dir = Path(run_dir)
    check_culprit_parent(run_dir)
    parent = load_parent(run_dir, request)
    if not parent.config.spec.evicts:
        raise RecorderError(f"run {parent.run_id!r} keeps the full cache: no evicted token can be a culprit")
    override = check_model(parent.manifest, model, run=parent.run_id, command="explain", allow_other=allow_other_model)
    out = Path(out) if out is not None else run_dir.resolve().parent
    earlier = _earlier(out, counterfactual_id(parent.run_id, request, CULPRITS_KIND))
    if earlier is not None:
        return earlier
    say = progress or (lambda label: None)
    runner = _Runner(model, tokenizer, parent, out, replay=replay, override=override)
    with reuse_prompts(model, repeated=True):  # a batch of probes: one prompt forward of one row
        say("full cache")
        full = _fresh(out, counterfactual_id(parent.run_id, request, FULL))
        if full is None:
            from h2o_lens.config import H2OConfig

            full = runner.record_free(FULL, lambda: H2OConfig(policy="full", gqa=parent.config.gqa), None)
        if not full.ran:
            raise RecorderError(f"the full-cache re-run of request {request} could not run: {full.error}")
        runner.teacher_text = full.answer if full.answer is not None else _answer_of(out / full.run_id)
        judged = runner.judge(runner.teacher_text)
        if judged is False:
            raise RecorderError(
                f"request {request} of run {parent.run_id}: the full cache fails too "
                f"(answer {(runner.teacher_text or '')[:40]!r}): no evicted token is its culprit"
            )
        if parent.answer is not None and runner.passes(parent.answer):
            raise RecorderError(f"request {request} of run {parent.run_id} passes: there is no failure to explain")
        found = _search(runner, max_runs, seconds, say, batch, splits)
    return found


def _earlier(out: Path, run_id: str) -> CulpritSearch | None:
    """The search recorded by an earlier explain (complete), else None."""
    from runlog.manifest import read_manifest

    if not (out / run_id).exists():
        return None
    try:
        manifest = read_manifest(out / run_id)
    except RecorderError:
        return None
    search = (manifest.get("counterfactual") or {}).get("search")
    if manifest.get("status") != "complete" or not isinstance(search, dict):
        return None
    return search_from_dict(search)


def _search(
    runner: Any, max_runs: int, seconds: float | None, say: Callable[[str], None], batch: int = 1, splits: int = 1
) -> CulpritSearch:
    """The search on the runner's parent, ``batch`` probes per re-run, then the recorded ``culprits``
    re-run with its table."""
    from .culprit_probes import probe_sets

    parent = runner.parent
    cands, _ = culprit_candidates(parent.run_dir, parent.request)
    by_pos = {c.position: c for c in cands}
    result = search_culprits(
        [c.position for c in cands],
        test_many=probe_sets(runner, say),
        batch=batch,
        splits=splits,
        max_runs=max_runs,
        seconds=seconds,
        max_size=_max_size(parent.config),
    )
    _record(runner, result, [by_pos[p] for p in result.culprits if p in by_pos])
    return result


def _record(runner: Any, result: CulpritSearch, rows: list[Candidate]) -> None:
    """The ``culprits`` counterfactual: the set re-run and recorded, its rows in the ``culprits`` table."""
    from h2o_lens.config import pin

    parent = runner.parent
    positions = list(result.culprits)
    slots = int(parent.slots)
    got = runner.record_free(
        CULPRITS_KIND,
        lambda: pin(parent.config, sorted(positions)) if positions else parent.config,
        slots,
        pinned=sorted(positions),
        search=result.to_dict(),
    )
    if got.ran and rows and result.found:
        write_culprit_rows(runner.out / got.run_id, rows)


def write_culprit_rows(run_dir: Path, rows: Sequence[Candidate]) -> None:
    """Append the ``culprits`` table to a finished run folder (tagged segments, then the manifest)."""
    from runlog.contract import model_tag
    from runlog.manifest import read_manifest, write_manifest
    from runlog.segments import SegmentWriter

    manifest = read_manifest(run_dir)
    writer = SegmentWriter(
        run_dir,
        run_id=manifest.get("run_id") or run_dir.name,
        config=manifest.get("config") or {},
        fsync=False,
        tag=secrets.token_hex(4),
        model=model_tag(manifest.get("model")),
    )
    cols = {
        "request": np.zeros(len(rows), np.int32),
        "position": np.array([r.position for r in rows], np.int64),
        "text": np.array([r.text for r in rows], object),
        "rank": np.array([r.rank for r in rows], np.int32),
        "step": np.array([r.step for r in rows], np.int64),
        "layer": np.array([r.layer for r in rows], np.int16),
        "kv_head": np.array([r.kv_head for r in rows], np.int16),
        "sets": np.array([r.sets for r in rows], np.int32),
        "phase": np.array([r.phase for r in rows], object),
        "held": np.array([r.held for r in rows], object),
        "score": [r.score for r in rows],
        "margin": [None if r.margin is None else max(r.margin, 0.0) for r in rows],
        "future_mass": [r.future_mass for r in rows],
    }
    writer.append("culprits", cols)
    writer.close()
    manifest["segments"] = {**(manifest.get("segments") or {}), **writer.files}
    manifest["rows"] = {**(manifest.get("rows") or {}), "culprits": writer.rows_written.get("culprits", 0)}
    write_manifest(run_dir, manifest)
