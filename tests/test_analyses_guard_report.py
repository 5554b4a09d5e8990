"""The guard's log in the exported report and on the dashboard's Overview (DESIGN.md §18.5)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from tiny import local_attention, tiny_model

import analyses
import analyses._html
import recorders
from analyses.guard import guard_actions, guard_requests, guard_risk
from h2o_lens import H2OConfig
from h2o_lens.guard import GuardConfig, guarded
from runlog.store import load_run, open_runs

streamlit_testing = pytest.importorskip("streamlit.testing.v1")
MAIN = Path(__file__).resolve().parents[1] / "app" / "main.py"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[Path, str, str]:
    """A runs root with one guarded run (two requests, each raised once) and one plain run."""
    out = tmp_path_factory.mktemp("guard-root")
    model = local_attention(tiny_model("llama", layers=2))
    ids = torch.randint(3, 250, (2, 20), generator=torch.Generator().manual_seed(5))
    cfg = H2OConfig(heavy=4, recent=3)
    with guarded(GuardConfig(action="raise", threshold=0.0, raise_slots=9, tail=0)):
        with recorders.record(model, cfg, out=out, fsync=False, run_id="guarded") as run:
            model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with recorders.record(model, cfg, out=out, fsync=False, run_id="plain"):
        model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out, run.run_id, "plain"


def test_guard_relations_equal_pandas(root):
    out, run, _ = root
    con = open_runs(out)
    steps = load_run(out / run)["guard_steps"].to_pandas()
    events = load_run(out / run)["guard_events"].to_pandas()
    got = guard_requests(con, run).df().set_index("request")
    for request, g in steps.groupby("request"):
        row = got.loc[request]
        assert row["steps"] == len(g) and row["max_risk"] == pytest.approx(g.risk.max())
        assert row["peak_step"] == g.loc[g.risk.idxmax(), "step"]
        assert row["mean_risk"] == pytest.approx(g.risk.mean())
        assert row["actions"] == (events.request == request).sum()
    acts = guard_actions(con, run).df()
    assert acts[["request", "slots_before", "slots_after"]].values.tolist() == [[0, 7, 9], [1, 7, 9]]
    assert guard_requests(con, root[2]).df().empty
    risk = guard_risk(con, run).df()
    want = steps.sort_values(["request", "step"])[["request", "step", "risk"]].reset_index(drop=True)
    assert risk[["request", "step"]].values.tolist() == want[["request", "step"]].values.tolist()
    assert risk["risk"].tolist() == pytest.approx(want["risk"].tolist())


def test_report_has_the_guard_section(root):
    out, run, plain = root
    data = analyses.report_data(out, run)
    jsonschema.validate(json.loads(json.dumps(data)), analyses.report_schema())
    assert [a["action"] for a in data["guard"]["actions"]] == ["raise", "raise"]
    md = analyses.build_report(out, run, fmt="md")
    assert "## Guard" in md and "slots_before" in md
    html = analyses.build_report(out, run, fmt="html")
    assert "<h2>Guard</h2>" in html and 'id="fig-guard"' in html
    steps = load_run(out / run)["guard_steps"].to_pandas().sort_values(["request", "step"])
    assert [[r["request"], r["step"]] for r in data["guard"]["risk"]] == steps[["request", "step"]].values.tolist()
    fig = analyses._html.figures(data)["fig-guard"]
    assert [t["name"] for t in fig["data"]] == ["risk r0", "risk r1", "action"]
    assert fig["data"][2]["text"] == ["raise", "raise"]
    other = analyses.report_data(out, plain)
    assert other["guard"] == {"requests": [], "actions": [], "risk": [], "cost": None}
    assert data["guard"]["cost"]["steps_scored"] > 0 and "The guard's own computations took" in md
    assert "The guard&#x27;s own computations took" in html
    assert "## Guard" not in analyses.build_report(out, plain, fmt="md")


def _values(data) -> list:
    """A plotly JSON array: a list, or a typed array ``{"dtype", "bdata"}`` (base64)."""
    if isinstance(data, dict):
        return np.frombuffer(base64.b64decode(data["bdata"]), dtype=data["dtype"]).tolist()
    return list(data)


def test_overview_shows_the_guard(root, monkeypatch):
    out, run, plain = root
    monkeypatch.setenv("H2O_LENS_ROOT", str(out))
    at = streamlit_testing.AppTest.from_file(str(MAIN), default_timeout=120)
    at.query_params.update({"run": run, "page": "overview"})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Guard" in [s.value for s in at.subheader]
    frames = [d.value for d in at.dataframe]
    assert any("slots_after" in f.columns and f["slots_after"].tolist() == [9, 9] for f in frames)
    (chart,) = [c for c in at.get("plotly_chart") if "Guard: online risk" in c.proto.spec]
    traces = json.loads(chart.proto.spec)["data"]
    steps = load_run(out / run)["guard_steps"].to_pandas().sort_values(["request", "step"])
    lines = [t for t in traces if t["name"].startswith("request ")]
    marks = [t for t in traces if t["name"].startswith("action ")]
    assert [t["name"] for t in lines] == ["request 0", "request 1"]
    for t, (_, g) in zip(lines, steps.groupby("request")):
        assert _values(t["x"]) == g["step"].tolist() and _values(t["y"]) == pytest.approx(g["risk"].tolist())
    assert [m["text"] for m in marks] == [["raise"], ["raise"]]
    at = streamlit_testing.AppTest.from_file(str(MAIN), default_timeout=120)
    at.query_params.update({"run": plain, "page": "overview"})
    at.run()
    assert not at.exception and "Guard" not in [s.value for s in at.subheader]


def test_the_shipped_guarded_sample_shows_its_guard(monkeypatch):
    """``sample_runs/`` holds the guarded run :data:`SAMPLE_GUARDED` names, recorded under that
    config, and the Overview shows its Guard section out of the box."""
    from commands.jobs import SAMPLE_GUARDED

    name, ratio, target, rescue = SAMPLE_GUARDED
    run = f"{name}-h2o-{round(ratio * 100)}-guard".replace("_", "-")
    samples = Path(__file__).resolve().parents[1] / "sample_runs"
    manifest = json.loads((samples / run / "manifest.json").read_text())
    assert manifest["task"] == name and manifest["keep_ratio"] == ratio
    assert (manifest["guard"]["action"], manifest["guard"]["raise_ratio"], manifest["guard"]["rescue"]) == (
        "raise",
        target,
        rescue,
    )
    monkeypatch.setenv("H2O_LENS_ROOT", str(samples))
    at = streamlit_testing.AppTest.from_file(str(MAIN), default_timeout=120)
    at.query_params.update({"run": run, "page": "overview"})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Guard" in [s.value for s in at.subheader]
    assert any("Guard: online risk" in c.proto.spec for c in at.get("plotly_chart"))
    cost = manifest["guard_cost"]  # the guard's own time, logged by the recorder, under the tables
    assert 0 < cost["seconds"] <= cost["generate_seconds"] and cost["steps_scored"] > 0
    assert any(c.value.startswith("The guard's own computations took") for c in at.caption)
