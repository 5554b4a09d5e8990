"""Counterfactuals of the synthetic policy cases, on the FP64 path (DESIGN.md §6.10).

The model-free analogue of :func:`recorders.counterfactual.explain_request`: a
policy case (:mod:`h2o_lens.tasks.attention_cases`) is its own teacher (full
attention over its logits), its answer is judged by its toy output model, and
every re-run is written by :func:`recorders.policy_cases.write_policy_case`
through the runtime's own cache, linked to the parent like a model re-run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from h2o_lens.config import H2OConfig
from runlog.manifest import read_manifest

from .counterfactual import _pinned
from .counterfactual_outcomes import Explanation, Outcome, _failed_run, _link, counterfactual_id
from .counterfactual_parent import ParentRequest, load_parent
from .counterfactual_search import bisect_budget, split_slots

__all__ = ["case_teacher_table", "case_passes", "explain_case"]


def case_teacher_table(case: Any, gqa: str = "sum") -> Any:
    """The oracle's teacher table of a policy case: its own logits are the full-cache teacher."""
    from h2o_lens.hindsight import TeacherTable
    from h2o_lens.policies.oracle import remaining

    p, n = case.prompt_len, case.n
    layers = []
    for layer in range(case.layers):
        sets = []
        for h in range(case.kv_heads):
            groups = (
                [case.logits[layer, h]]
                if gqa != "none"
                else [case.logits[layer, h, g][None] for g in range(case.group)]
            )
            for x in groups:
                sets.append(remaining(x, p, gqa if gqa != "none" else "sum")[p - 1 : n])  # (N - P + 1, N)
        layers.append(torch.as_tensor(np.stack(sets), dtype=torch.float64))
    return TeacherTable(tuple(layers), p, gqa)


def case_passes(case: Any, config: H2OConfig) -> bool:
    """Whether ``config`` gets a policy case's answer right (its top-1 equals the teacher's at the
    answer step), on the FP64 runtime path, nothing written."""
    from contextlib import nullcontext

    from h2o_lens.hindsight import teacher_scores

    from .policy_cases import case_kept_sets

    a = case.answer_step
    scope = teacher_scores(case_teacher_table(case, config.gqa)) if config.spec.teacher else nullcontext()
    with scope:
        cand = case_kept_sets(case, config)
    if a < case.prompt_len:
        visible = None
    else:
        d = cand[a][..., : a + 1]  # (L, Hs, a + 1)
        if config.gqa == "none":
            visible = d.reshape(case.layers, case.kv_heads, case.group, a + 1)
        else:
            visible = d[:, :, None, :]
    run = case.output_logits(case.attention(a, visible))
    teacher = case.output_logits(case.attention(a))
    return int(np.argmax(run)) == int(np.argmax(teacher))


def _link_case_run(run_dir: Path, parent: ParentRequest, kind: str, slots: int | None, **extra: Any) -> None:
    from runlog.manifest import write_manifest

    manifest = read_manifest(run_dir)
    link = _link(parent, kind, slots, **extra)
    link.pop("task_spec"), link.pop("decoding")
    manifest.update(link)
    write_manifest(run_dir, manifest)


def explain_case(
    root: str | Path,
    case: Any,
    *,
    policy: str = "h2o",
    gqa: str = "sum",
    heavy: int | None = None,
    recent: int | None = None,
    checks: int = 1,
) -> Explanation:
    """The counterfactuals of a policy case, written as linked runs on the FP64 path.

    The parent is the case under ``policy`` at its own budget
    (:func:`~recorders.policy_cases.write_policy_case`); the re-runs are the
    full cache, the evidence pinned, the oracle at the same slot count (the
    case's logits are the teacher) and the two minimal budgets (bisection
    to the slot, the pass test :func:`case_passes`). All are teacher-forced
    on the case's fixed tokens, as every policy case is.
    """
    from h2o_lens.hindsight import teacher_scores

    from .policy_cases import write_policy_case

    t0 = time.perf_counter()
    root = Path(root)
    heavy = case.heavy if heavy is None else heavy
    recent = case.recent if recent is None else recent
    parent_dir = write_policy_case(root, case, heavy, recent, gqa, policy)
    parent = load_parent(parent_dir, 0)
    slots = heavy + recent
    cfg = H2OConfig(policy=policy, heavy=heavy, recent=recent, gqa=gqa, backend="torch")
    outcomes: dict[str, Outcome] = {}

    def write(kind: str, s: int | None, make: Callable[[str], Path], passed: bool, **extra: Any) -> Outcome:
        run_id = counterfactual_id(parent.run_id, 0, kind, s)
        try:
            run_dir = make(run_id)
        except Exception as exc:
            _failed_run(root, run_id, parent, cfg.to_dict(), _link(parent, kind, s, **extra), exc)
            return Outcome(kind, s, run_id, False, error=f"{type(exc).__name__}: {exc}")
        _link_case_run(run_dir, parent, kind, s, passed=passed, **extra)
        return Outcome(kind, s, run_id, True, passed)

    full = H2OConfig(policy="full", gqa=gqa, backend="torch")
    outcomes["full"] = write(
        "full",
        None,
        lambda rid: write_policy_case(root, case, gqa=gqa, policy="full", run_id=rid),
        case_passes(case, full),
    )
    pins = parent.evidence_positions

    def pinned(rid: str) -> Path:
        return write_policy_case(root, case, heavy, recent, gqa, policy, rid, pinned=pins)

    try:
        pin_ok = case_passes(case, _pinned(parent))
    except Exception:
        pin_ok = False
    outcomes["pinned"] = write("pinned", slots, pinned, pin_ok, pinned=pins)

    def oracle_config(s: int) -> H2OConfig:
        return H2OConfig(policy="oracle", heavy=s, recent=0, gqa=gqa, backend="torch")

    def oracle_run(s: int) -> Callable[[str], Path]:
        def make(rid: str) -> Path:
            with teacher_scores(case_teacher_table(case, gqa)):
                return write_policy_case(root, case, s, 0, gqa, "oracle", rid)

        return make

    outcomes["oracle"] = write("oracle", slots, oracle_run(slots), case_passes(case, oracle_config(slots)))
    searches = (
        (
            "policy_budget",
            lambda s: dataclasses.replace(cfg, **dict(zip(("heavy", "recent"), split_slots(heavy, recent, s)))),
            lambda s: lambda rid: write_policy_case(root, case, *split_slots(heavy, recent, s), gqa, policy, rid),
            parent.correct,
        ),
        ("oracle_budget", oracle_config, oracle_run, outcomes["oracle"].passed),
    )
    for kind, make_cfg, make_run, same in searches:
        if not outcomes["full"].passed:
            outcomes[kind] = Outcome(kind, None, None, False, error="the full cache does not pass: no budget does")
            continue
        outcomes[kind] = _case_budget(case, kind, slots, bool(same), make_cfg, make_run, write, checks)
    return Explanation(parent.run_id, 0, slots, parent.prompt_len, outcomes, time.perf_counter() - t0)


def _case_budget(
    case: Any,
    kind: str,
    slots: int,
    same: bool,
    make_cfg: Callable[[int], H2OConfig],
    make_run: Callable[[int], Callable[[str], Path]],
    write: Callable[..., Outcome],
    checks: int,
) -> Outcome:
    """One minimal-budget search of a policy case: bisection to the slot, the found count recorded."""
    lo, top = (1, slots) if same else (slots, case.n + 1)
    bis = bisect_budget(lambda s: case_passes(case, make_cfg(s)), lo, top, known={slots: same}, checks=checks)
    at = bis.min_slots if bis.min_slots is not None else bis.smallest_pass
    if at is None:
        return Outcome(kind, None, None, True, False, bisection=bis)
    got = write(kind, at, make_run(at), True, bisection=bis.to_dict(), min_slots=bis.min_slots)
    got.bisection = bis
    return got
