"""The guard's tables round-trip through a recorded run (DESIGN.md §18.5)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import local_attention, tiny_model

import recorders
from h2o_lens import H2OConfig
from h2o_lens.guard import SIGNALS, GuardConfig, guarded
from runlog.schema import TABLES
from runlog.store import check_run, load_run, open_runs


def test_guard_rows_round_trip_with_manifest_counts(tmp_path):
    """Two requests, 10 new tokens: 9 scored decode steps each in ``guard_steps``, equal to what the
    guard computed; the raise of each request in ``guard_events``; the manifest counts both
    tables' rows, the strict check passes and the SQL views read them."""
    model = local_attention(tiny_model("llama", layers=2))
    ids = torch.randint(3, 250, (2, 20), generator=torch.Generator().manual_seed(4))
    gcfg = GuardConfig(action="raise", threshold=0.0, raise_slots=10, tail=0)
    with guarded(gcfg) as g, recorders.record(model, H2OConfig(heavy=4, recent=3), out=tmp_path, fsync=False) as run:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    state = g.last
    loaded = load_run(tmp_path / run.run_id)
    steps = loaded["guard_steps"].to_pandas().sort_values(["request", "step"]).reset_index(drop=True)
    assert loaded["guard_steps"].schema.names == TABLES["guard_steps"].names
    expected = sorted(state.risk_rows(), key=lambda r: (r["request"], r["step"]))
    assert len(steps) == len(expected) == 2 * 9
    for got, want in zip(steps.to_dict("records"), expected):
        assert (got["request"], got["step"]) == (want["request"], want["step"])
        for name in ("risk", *SIGNALS):
            assert got[name] == pytest.approx(want[name], rel=1e-6, abs=1e-7)
    events = loaded["guard_events"].to_pandas().sort_values("request")
    assert events[["request", "step", "action", "slots_before", "slots_after"]].values.tolist() == [
        [0, 20, "raise", 7, 10],
        [1, 20, "raise", 7, 10],
    ]
    # the requests table holds each request's split at the end of the run: the raised one
    assert loaded["requests"].to_pandas().sort_values("request")[["heavy", "recent"]].values.tolist() == [[7, 3]] * 2
    manifest = json.loads((tmp_path / run.run_id / "manifest.json").read_text())
    assert manifest["rows"]["guard_steps"] == 18 and manifest["rows"]["guard_events"] == 2
    assert manifest["guard"]["action"] == "raise" and manifest["guard"]["threshold"] == 0.0
    assert manifest["guard"]["raise_slots"] == 10 and len(manifest["guard"]["weights"]) == len(SIGNALS)
    checked = check_run(tmp_path / run.run_id)
    assert checked.rows["guard_steps"] == 18 and checked.rows["guard_events"] == 2
    con = open_runs(tmp_path)
    assert con.execute("SELECT count(*), max(slots_after) FROM guard_events").fetchone() == (2, 10)
    assert con.execute("SELECT count(*) FROM guard_steps WHERE risk BETWEEN 0 AND 1").fetchone() == (18,)


def test_a_run_without_guard_has_empty_guard_views(tmp_path):
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    with recorders.record(model, H2OConfig(heavy=3, recent=3), out=tmp_path, fsync=False) as run:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    manifest = json.loads((tmp_path / run.run_id / "manifest.json").read_text())
    assert manifest["rows"]["guard_steps"] == 0 and manifest["rows"]["guard_events"] == 0
    con = open_runs(tmp_path)
    assert con.execute("SELECT count(*) FROM guard_events").fetchone() == (0,)


def test_a_raise_at_the_prefill_is_logged_with_its_requests(tmp_path):
    """A raise at the prefill, before the recorder has named the rows: the manifest's state event
    and the guard's events name the requests of this generate call (the second call's rows are
    requests 2 and 3), and the requests table holds the raised split."""
    model = local_attention(tiny_model("llama", layers=2))
    ids = torch.randint(3, 250, (2, 20), generator=torch.Generator().manual_seed(4))
    gcfg = GuardConfig(action="raise", threshold=0.0, raise_slots=10)
    with recorders.record(model, H2OConfig(heavy=4, recent=3), out=tmp_path, fsync=False) as run:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
            with guarded(gcfg):
                model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    manifest = json.loads((tmp_path / run.run_id / "manifest.json").read_text())
    raises = [e for e in manifest["state_events"] if e["event"] == "raise"]
    assert [(e["requests"], e["slots"]) for e in raises] == [([2, 3], [10, 10])]
    loaded = load_run(tmp_path / run.run_id)
    events = loaded["guard_events"].to_pandas().sort_values("request")
    assert events[["request", "step", "slots_after", "evicted"]].values.tolist() == [[2, 19, 10, 0.0], [3, 19, 10, 0.0]]
    heavy = loaded["requests"].to_pandas().sort_values("request")["heavy"].tolist()
    assert heavy == [4, 4, 7, 7]
    checked = check_run(tmp_path / run.run_id)  # every file read in full, the counts as the manifest says
    assert checked.status == "complete" and checked.rows["guard_events"] == 2 and not checked.leftover_temp_files


def test_a_row_that_ends_early_logs_no_steps_after_its_last_token(tmp_path):
    """generate keeps stepping a row after its EOS (padding): those steps are not the request's,
    so ``guard_steps`` holds at most one row per new token (the prefill's and one per decode step
    that made a token) and the run checks intact."""
    model = local_attention(tiny_model("llama", layers=2))
    ids = torch.randint(3, 250, (2, 20), generator=torch.Generator().manual_seed(4))
    import h2o_lens

    with torch.no_grad(), h2o_lens.h2o(model, H2OConfig(heavy=4, recent=3)):
        free = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    eos = int(free[1, 22])  # row 1's third new token ends it
    with (
        guarded(GuardConfig()),
        recorders.record(model, H2OConfig(heavy=4, recent=3), out=tmp_path, fsync=False) as run,
    ):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos)
    loaded = load_run(tmp_path / run.run_id)
    new = dict(loaded["requests"].to_pandas()[["request", "new_tokens"]].values.tolist())
    assert min(new.values()) < 10  # a row ended early
    steps = loaded["guard_steps"].to_pandas()
    for request, n in new.items():
        got = steps[steps["request"] == request]["step"].tolist()
        assert got == list(range(19, 19 + n)), (request, n, got)
    assert check_run(tmp_path / run.run_id).status == "complete"


def test_the_guard_cost_is_logged_summed_over_calls_and_reported(tmp_path):
    """Two guarded ``generate`` calls in one run: the manifest's ``guard_cost`` is the sum of the two
    guard states' own seconds and scored steps (each counted once), a share of the timed prefill and
    decode seconds that hold it; the report carries it and says it in one sentence. A run without
    the guard, or with a malformed entry, has none (nothing made up)."""
    from analyses.guard import guard_cost
    from analyses.report import build_report, report_data

    model = local_attention(tiny_model("llama", layers=2))
    ids = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(4))
    with (
        guarded(GuardConfig()) as g,
        recorders.record(model, H2OConfig(heavy=4, recent=3), out=tmp_path, fsync=False) as run,
    ):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert len(g.states) == 2
    manifest_path = tmp_path / run.run_id / "manifest.json"
    cost = json.loads(manifest_path.read_text())["guard_cost"]
    assert cost["steps_scored"] == 5 + 3 == sum(s.scored for s in g.states)
    assert cost["seconds"] == pytest.approx(sum(s.seconds for s in g.states)) and cost["seconds"] > 0
    assert cost["refill_seconds"] == 0.0 and cost["seconds"] <= cost["generate_seconds"]
    assert cost["share"] == pytest.approx(cost["seconds"] / cost["generate_seconds"])
    con = open_runs(tmp_path)
    assert guard_cost(con, run.run_id) == pytest.approx(cost)
    assert report_data(con, run.run_id)["guard"]["cost"] == pytest.approx(cost)
    md = build_report(con, run.run_id, fmt="md")
    assert f"The guard's own computations took {cost['seconds']:.3f} s over 8 scored steps, {cost['share']:.1%}" in md

    bad = json.loads(manifest_path.read_text())
    bad["guard_cost"]["seconds"] = -1.0
    manifest_path.write_text(json.dumps(bad))
    assert guard_cost(open_runs(tmp_path), run.run_id) is None

    plain = tmp_path / "plain"
    with recorders.record(model, H2OConfig(heavy=4, recent=3), out=plain, fsync=False) as run2:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert "guard_cost" not in json.loads((plain / run2.run_id / "manifest.json").read_text())
    assert guard_cost(open_runs(plain), run2.run_id) is None
