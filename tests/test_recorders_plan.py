"""Runs under a budget plan in the log (DESIGN.md §5.6): kept sets of unequal size per layer and
KV set, recorded exactly, replayed, and read back per set through the ``set_budgets`` view."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from runtime_utils import KeptRecorder, left_pad
from tiny import tiny_model

import h2o_lens
import recorders
from analyses import stale
from h2o_lens import H2OConfig
from h2o_lens.plan import BudgetPlan
from recorders.replay import replay
from runlog import open_runs, read_manifest

PLAN = BudgetPlan(ratios=[(0.15, 0.5), 0.3])
NEW = 12


def _batch():
    gen = [torch.Generator().manual_seed(s) for s in (1, 2)]
    return left_pad([torch.randint(3, 256, (n,), generator=g) for n, g in zip((30, 21), gen)])


def _victims_from_kept(rec: KeptRecorder, prompt_lens, width) -> set:
    """``(request, step, layer, kv_set, position)`` of every position that left a kept set, from the
    runtime's own kept sets step by step (the prefill's victims at step P − 1)."""
    out = set()
    for layer, steps in rec.kept.items():
        for r, plen in enumerate(prompt_lens):
            pad = width - plen
            before = None
            for k, per_row in enumerate(steps):
                step = plen - 1 + k
                for s, kept in enumerate(per_row[r]):
                    prev = set(range(plen)) if k == 0 else set(before[s]) | {step}
                    out |= {(r, step, layer, s, p) for p in prev - set(kept)}
                before = per_row[r]
            assert pad >= 0
    return out


def test_a_planned_run_logs_each_set_exactly_and_replays(tmp_path):
    """The evictions of a padded batch under a ragged ratio plan are the runtime's own, set by set;
    ``left_recent`` uses each set's own recent window; the steps' kept counts are the sets' sizes;
    the replay's implementation check passes; ``set_budgets`` resolves the plan per request."""
    model = tiny_model("llama")
    ids, mask = _batch()
    cfg = H2OConfig(plan=PLAN)
    with recorders.record(model, cfg, out=tmp_path, fsync=False) as run, torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    rec = KeptRecorder()
    with h2o_lens.h2o(model, cfg, listener=rec), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    con = open_runs(tmp_path)
    got = set(con.execute("SELECT request, step, layer, kv_head, position FROM evictions").fetchall())
    assert got == _victims_from_kept(rec, [30, 21], 30)

    budgets = con.execute("SELECT request, layer, kv_set, slots, recent FROM set_budgets ORDER BY ALL").fetchall()
    assert budgets == [
        (0, 0, 0, 4, 2), (0, 0, 1, 15, 8), (0, 1, 0, 9, 5), (0, 1, 1, 9, 5),
        (1, 0, 0, 3, 2), (1, 0, 1, 10, 5), (1, 1, 0, 6, 3), (1, 1, 1, 6, 3),
    ]  # fmt: skip
    kept = con.execute(
        "SELECT s.request, s.layer, s.kv_head, max(s.kept), any_value(b.slots) FROM steps s JOIN set_budgets b"
        " ON b.request = s.request AND b.layer = s.layer AND b.kv_set = s.kv_head GROUP BY ALL"
    ).fetchall()
    assert all(k == slots for *_, k, slots in kept)
    wrong = con.execute(
        "SELECT count(*) FROM evictions e JOIN set_budgets b ON b.request = e.request AND b.layer = e.layer"
        " AND b.kv_set = e.kv_head WHERE e.left_recent <> (e.position = e.step - b.recent)"
    ).fetchall()[0][0]
    flagged = con.execute("SELECT count(DISTINCT (layer, kv_head)) FROM evictions WHERE left_recent").fetchall()[0][0]
    assert wrong == 0 and flagged >= 3

    m = read_manifest(run.run_dir)
    assert m["heavy"] is None and m["recent"] is None and m["config"]["plan"] == PLAN.to_dict()
    assert con.execute("SELECT count(*) FROM requests WHERE heavy IS NOT NULL").fetchall()[0][0] == 0
    assert stale._window(con, run.run_id, None) == 8  # the widest set's recent window
    summary = replay(run.run_dir, model=model, progress=False)
    assert summary.implementation_ok
    con = open_runs(tmp_path)
    assert con.execute("SELECT integrity FROM runs").fetchall() == [("ok",)]
    assert con.execute("SELECT count(*) FROM problems").fetchall()[0][0] == 0
    (plan,) = con.execute("SELECT plan FROM runs WHERE plan IS NOT NULL").fetchone()
    assert BudgetPlan(**json.loads(plan)) == PLAN  # the runs view says which plan the run ran under


def test_the_runs_view_holds_the_plan_and_flags_one_that_is_not_an_object(tmp_path):
    """``runs.plan``: null for a run without a plan; a manifest whose plan is not an object is a
    problem of its run and reads null."""
    model = tiny_model("llama")
    ids, mask = _batch()
    for cfg in (H2OConfig(heavy=4, recent=4), H2OConfig(plan=PLAN)):
        with recorders.record(model, cfg, out=tmp_path, fsync=False), torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    con = open_runs(tmp_path)
    got = con.execute("SELECT heavy, plan IS NULL FROM runs ORDER BY heavy NULLS LAST").fetchall()
    assert got == [(4, True), (None, False)]
    (path,) = con.execute("SELECT path FROM runs WHERE plan IS NOT NULL").fetchone()
    manifest = Path(path) / "manifest.json"
    data = json.loads(manifest.read_text())
    data["config"]["plan"] = "half of it"
    manifest.write_text(json.dumps(data))
    con = open_runs(tmp_path, warn=False)
    assert con.execute("SELECT count(*) FROM runs WHERE plan IS NOT NULL").fetchone()[0] == 0
    reasons = [r for (r,) in con.execute("SELECT reason FROM problems").fetchall()]
    assert any("config.plan" in r and "expected an object" in r for r in reasons), reasons


def test_roots_without_plans_read_as_before():
    """sample_runs (format 5, no plan) opens with an empty ``set_budgets`` and its runs' budgets
    in ``requests``, unchanged."""
    root = Path(__file__).resolve().parents[1] / "sample_runs"
    con = open_runs(root, warn=False)
    assert con.execute("SELECT count(*) FROM set_budgets").fetchall()[0][0] == 0
    assert con.execute("SELECT count(*) FROM requests WHERE heavy IS NOT NULL").fetchall()[0][0] > 0
