"""Counterfactual verdicts from given outcomes, the report's and the CLI's "Why" (DESIGN.md §6.10).

The rules are checked on outcomes given by hand; the report, the budget distribution and
``h2o-lens explain --cached --format json`` on counterfactual runs of FP64 policy cases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starvation import budget_starvation

from analyses import budget_distribution, build_report, connect, report_data
from analyses.causal import CausalVerdict, decide, variant_table
from commands.cli import main
from h2o_lens.tasks import policy_case
from recorders.counterfactual_cases import explain_case


def _o(correct, status="complete", run_id=None, error=None):
    return {"correct": correct, "status": status, "run_id": run_id, "error": error}


def test_decide_follows_the_rules_and_names_the_deciding_runs():
    full_ok, full_bad = _o(True, run_id="f"), _o(False, run_id="f")
    assert decide({"full": full_bad})[0] == "not_the_cache"
    assert decide({"full": full_bad})[2] == ("f",)
    got = decide({"full": full_ok, "pinned": _o(True, run_id="p"), "oracle": _o(False, run_id="o")})
    assert got[0] == "scoring" and got[2] == ("f", "p")
    got = decide({"full": full_ok, "pinned": _o(False, run_id="p"), "oracle": _o(True, run_id="o")})
    assert got[0] == "scoring" and got[2] == ("f", "o")
    both_fail = {"full": full_ok, "pinned": _o(False, run_id="p"), "oracle": _o(False, run_id="o")}
    assert decide(both_fail, dropped_mass=0.01)[0] == "not_the_cache"  # pinning does not help, little dropped
    assert decide(both_fail, dropped_mass=0.5)[0] == "budget"
    assert decide(both_fail, dropped_mass=0.5)[2] == ("f", "p", "o")
    assert decide(both_fail, implementation_error=True)[0] == "implementation_error"
    crashed = {"full": full_ok, "pinned": _o(False, run_id="p"), "oracle": _o(None, "failed", "o", "boom")}
    verdict, reason, _ = decide(crashed, dropped_mass=0.5)
    assert verdict == "undecided" and "oracle: boom" in reason
    assert decide({"full": _o(None, "failed", "f", "oom")})[0] == "undecided"


def test_a_row_showing_the_teachers_answer_is_never_marked_wrong():
    """The oracle row used to show the teacher-forced text with the all-top-1 verdict:
    ``The number is 7877 … right: NO`` next to a passing full-cache row with the same text."""
    from commands.explain import format_verdicts

    said = "The number is 7877."
    outcomes = {
        "full": {**_o(True, run_id="f"), "answer": said, "slots": None},
        "pinned": {**_o(False, run_id="p"), "answer": "The number is 1234.", "slots": 40},
        "oracle": {**_o(False, run_id="o"), "answer": said, "slots": 40, "teacher_agreement": [11, 12]},
    }
    table = variant_table(outcomes)
    right = {r["variant"]: r["right"] for r in table}
    assert right == {"full": True, "pinned": False, "oracle": None}
    assert table[2]["teacher_agreement"] == [11, 12]
    v = CausalVerdict("run", 0, "budget", None, "-", {}, {}, 40, 200, {}, {}, {}, {}, (), None, table)
    shown = [line.split() for line in format_verdicts([v]).splitlines()]
    lines = {cells[0]: cells for cells in shown if cells and cells[0] in right}
    assert lines["oracle"][-1] == "o" and "NO" not in lines["oracle"] and "11/12" in lines["oracle"]
    assert "NO" in lines["pinned"] and "yes" in lines["full"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("why")
    made = {c.name: explain_case(root, c) for c in (policy_case("delayed_reference"), budget_starvation())}
    return root, made


@pytest.mark.slow
def test_report_has_a_why_section_with_the_counterfactual_table(root):
    root, made = root
    run = made["delayed_reference"].parent_run
    data = report_data(root, run)
    (why,) = data["why"]
    assert why["verdict"] == "scoring" and why["sub_label"] == "delayed_reference"
    assert [r["variant"] for r in why["table"]] == ["full", "pinned", "oracle", "policy_budget", "oracle_budget"]
    html = build_report(root, run, fmt="html")
    md = build_report(root, run, fmt="md")
    for text in (html, md):
        assert "Why: counterfactual re-runs" in text
        assert all(r["run_id"] in text for r in why["table"])
        assert "Minimal passing budget" in text
    json.loads(build_report(root, run, fmt="json"))  # still valid JSON (no NaN)
    assert "fig-budgets" in html  # two explained requests under this root: the distribution


def test_budget_distribution_puts_the_oracle_above_every_policy(root):
    root, made = root
    dist = budget_distribution(connect(root))
    assert set(dist["curve"]) == {"h2o", "oracle"}
    assert (dist["requests"] == 2).all()
    wide = dist.pivot(index="keep_ratio", columns="curve", values="share")
    assert (wide["oracle"] >= wide["h2o"]).all()  # the oracle bounds the policy
    assert wide.iloc[0].tolist() == [0.0, 0.0] and wide.iloc[-1].tolist() == [1.0, 1.0]
    # a request passes at q exactly when its minimal budget is at most q
    ex = made["delayed_reference"]
    need = ex.outcomes["policy_budget"].slots / ex.prompt_len
    assert wide.loc[need, "h2o"] >= 0.5 and wide.loc[wide.index < need, "h2o"].max() < 1.0


def test_explain_cli_json_has_the_fields_per_failed_request(root, capsys):
    root, made = root
    run = made["budget_starvation"].parent_run
    assert main(["explain", run, "--root", str(root), "--cached", "--format", "json", "--quiet"]) == 0
    (got,) = json.loads(capsys.readouterr().out)
    assert got["request"] == 0 and got["verdict"] == "budget" and got["sub_label"] is None
    assert got["passes"] == {"full": True, "oracle": False, "policy_budget": True, "oracle_budget": True}
    assert set(got["min_slots"]) == {"policy", "oracle"} and got["min_slots"]["oracle"] > got["slots"]
    assert set(got["counterfactual_runs"]) == {"full", "pinned", "oracle", "policy_budget", "oracle_budget"}
    assert "pinned" in got["could_not_run"]
    assert got["estimate"] == "budget"  # the evidence is larger than the cache: no slots hold it
    assert main(["explain", run, "--root", str(root), "--cached", "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "request 0: budget" in table and "could not run: pinned" in table


def test_explain_all_covers_every_explained_run_of_a_root(root, capsys):
    root, made = root
    assert main(["explain", "--all", "--root", str(root), "--cached", "--format", "json", "--quiet"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {r["run_id"] for r in got["requests"]} == {ex.parent_run for ex in made.values()}
    assert {r["curve"] for r in got["budget_distribution"]} == {"h2o", "oracle"}


def test_explain_cli_names_a_missing_run(tmp_path, capsys):
    assert main(["explain", "nope", "--root", str(tmp_path), "--cached"]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


def test_dashboard_report_page_shows_why_and_the_budget_curves(root, monkeypatch):
    testing = pytest.importorskip("streamlit.testing.v1")

    root, made = root
    run = made["delayed_reference"].parent_run
    monkeypatch.setenv("H2O_LENS_ROOT", str(root))
    at = testing.AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app" / "main.py"), default_timeout=120)
    at.query_params.update({"run": run, "page": "report"})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    shown = "\n".join(str(e.value) for e in at.markdown)
    assert "Why: counterfactual re-runs" in "\n".join(str(e.value) for e in at.subheader)
    assert "Request 0:" in shown and "Scoring" in shown
    tables = [d.value for d in at.dataframe if "variant" in d.value.columns]
    assert tables and list(tables[0]["variant"]) == ["full", "pinned", "oracle", "policy_budget", "oracle_budget"]
    assert tables[0]["open"].str.contains(f"run={made['delayed_reference'].outcomes['pinned'].run_id}").any()
    assert any("budget" in str(c.proto.spec) for c in at.get("plotly_chart"))  # the distribution


def test_json_report_with_a_why_section_validates_against_the_schema(root):
    import jsonschema

    from analyses import report_schema

    root, made = root
    data = json.loads(build_report(root, made["budget_starvation"].parent_run, fmt="json"))
    assert data["why"] and data["budget_distribution"]
    jsonschema.validate(data, report_schema())


def test_a_non_monotone_budget_search_shows_every_count_it_tried(tmp_path, capsys):
    """At 8k on restated_fact_0 the policy passed at 2,451 slots, failed at 3,270 and passed at
    3,884, and explain said only that no minimal budget was stated. The search's probes of such a
    root (planted in the policy budget's manifest) are shown in explain's table, its JSON and the
    report's Why section."""
    from recorders.counterfactual_search import bisect_budget
    from runlog.manifest import read_manifest, write_manifest

    ex = explain_case(tmp_path, budget_starvation())
    bis = bisect_budget(
        lambda s: 20 <= s < 40 or s >= 60, ex.slots, 97, known={ex.slots: False}, checks=1, resolution=4
    )
    assert not bis.monotone
    run_dir = tmp_path / ex.outcomes["policy_budget"].run_id
    manifest = read_manifest(run_dir)
    manifest["counterfactual"]["bisection"] = bis.to_dict()
    write_manifest(run_dir, manifest)
    tried = [[s, p] for s, p in sorted(bis.probes.items())]
    assert any(p for s, p in tried if s < 40) and any(not p for s, p in tried if 40 <= s < 60)
    words = ", ".join(f"{s} {'pass' if p else 'fail'}" for s, p in tried)

    run = ex.parent_run
    assert main(["explain", run, "--root", str(tmp_path), "--cached", "--quiet"]) == 0
    table = capsys.readouterr().out
    assert f"policy: not monotone in the budget: the search tried (slots) {words}" in table
    assert "minimal passing budget: policy not monotone (below), oracle " in table
    assert main(["explain", run, "--root", str(tmp_path), "--cached", "--format", "json", "--quiet"]) == 0
    (got,) = json.loads(capsys.readouterr().out)
    assert got["monotone"]["policy"] is False and got["budget_probes"] == {"policy": tried}
    (why,) = report_data(tmp_path, run)["why"]
    assert why["budget_probes"] == {"policy": tried}
    for fmt in ("md", "html"):
        assert words in build_report(tmp_path, run, fmt=fmt)
