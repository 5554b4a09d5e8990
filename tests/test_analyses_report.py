"""Exported reports: JSON against its schema, Markdown, self-contained HTML (and a real browser)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import jsonschema
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from markdown_it import MarkdownIt
from plotly.offline import get_plotlyjs

import analyses
from analyses import ParameterError, Thresholds, build_report, report_data, write_report
from runlog import open_runs, write_segment, write_synthetic_run
from runlog.manifest import read_manifest, write_manifest
from runlog.schema import TABLES

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("reports")
    write_synthetic_run(
        root, "syn", layers=4, kv_heads=2, steps=64, prompt_len=96, heavy=24, recent=24, requests=2, fsync=False
    )
    write_synthetic_run(root, "bare", steps=16, prompt_len=32, tables=["tokens", "evictions", "steps"], fsync=False)
    manifest = read_manifest(root / "syn")  # a synthetic replay has no implementation check: say it passed
    write_manifest(root / "syn", {**manifest, "max_logit_diff": 0.0})
    return root


@pytest.fixture(scope="module")
def html(root):
    return build_report(root, "syn", fmt="html", failed={0: True})


def test_json_report_validates_against_the_shipped_schema(root):
    schema = analyses.report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert analyses.SCHEMA_PATH.parent.name == "analyses"
    for run, failed in (("syn", {0: True}), ("syn", None), ("bare", True)):
        data = json.loads(build_report(root, run, fmt="json", failed=failed))
        jsonschema.validate(data, schema)
        assert data["report_schema_version"] == analyses.REPORT_SCHEMA_VERSION == 1
    data = json.loads(build_report(root, "syn", fmt="json", failed={0: True}))
    assert data["run"]["policy"] == "h2o" and data["run"]["heavy"] == 24 and data["run"]["config"]
    assert data["run"]["versions"]["report"]["duckdb"]
    (first, *_) = data["failures"]
    assert first["request"] == 0 and first["failed_by"][0] == "answer_checker" and first["rank"] == 1
    assert first["verdict"] in analyses.VERDICTS and "FROM evictions" in first["sql"]
    assert len(data["coverage"]["heads"]) == 4 * 6  # aggregated per (layer, query head)


def test_json_report_without_a_replay(root):
    data = report_data(root, "bare", failed=True)
    assert data["coverage"]["heads"] == [] and data["summary"]["kl_mean"] is None
    checks = {c["name"]: c for c in data["verdict"]["checks"]}
    assert checks["coverage_p5"]["status"] == "no data" and checks["coverage_p5"]["pass"] is False
    assert "not replayed" in checks["kl_mean"]["reason"] and data["verdict"]["pass"] is False
    assert data["failures"][0]["verdict"] == "unknown"  # nothing measured: the thresholds cannot tell
    assert "no teacher replay" in data["failures"][0]["summary"]


def test_gate_verdict_follows_ci_thresholds(root):
    lenient = {
        "gate_min_coverage_p5": 0.0,
        "gate_max_kl_mean": 10.0,
        "gate_min_top1_agreement": 0.0,
        "gate_max_failures": None,
        "gate_max_lifecycle_errors": None,
        "min_top1_agreement": 0.0,
        "kl_fail": None,
    }
    data = report_data(root, "syn", thresholds=lenient)
    assert data["verdict"]["pass"] is True and data["verdict"]["status"] == "pass"
    strict = dict(lenient, gate_min_coverage_p5=0.999)
    data = report_data(root, "syn", thresholds=strict)
    failed = [c["name"] for c in data["verdict"]["checks"] if c["pass"] is False]
    assert data["verdict"]["pass"] is False and failed == ["coverage_p5"]
    assert data["thresholds"]["gate_min_coverage_p5"] == 0.999
    with pytest.raises(ParameterError, match="unknown threshold"):
        report_data(root, "syn", thresholds={"gate_min_coverage": 0.5})
    assert Thresholds.from_mapping(Thresholds(lag_steps=2)).lag_steps == 2


def test_html_is_self_contained_with_plotly_once(html):
    assert html.count("plotly.js v") == 1  # the bundle's banner
    assert html.count(get_plotlyjs()[:2000]) == 1
    assert not re.search(r"<script[^>]+src=", html) and "<link" not in html
    figs = json.loads(
        re.search(r'<script type="application/json" id="h2o-figures">(.*?)</script>', html, re.S).group(1)
    )
    assert len(figs) >= 6
    for fid in figs:
        assert f'<div class="fig" id="{fid}"></div>' in html
    rest = html.replace(get_plotlyjs(), "")
    assert len(rest) < 400_000  # aggregated data only
    assert "SELECT e.step" in html and "H2O Lens report: syn" in html


def test_markdown_reads_as_a_summary(root):
    md = build_report(root, "syn", fmt="md", failed={0: True})
    for heading in (
        "# H2O Lens report: syn",
        "## Run",
        "## Summary",
        "## Where it goes wrong",
        "## Evidence",
        "## Cache dynamics",
        "## Oracle agreement",
        "## Failures",
    ):
        assert heading in md
    assert "**Verdict: FAIL**" in md and "```sql" in md
    assert "Not available" in md and "teacher\\_future\\_mass" in md  # Markdown-escaped, renders as is


def test_write_report_picks_the_format_from_the_suffix(root, tmp_path):
    for name in ("r.json", "r.md", "r.html"):
        path = write_report(root, "bare", tmp_path / name)
        assert path.stat().st_size > 0
    assert json.loads((tmp_path / "r.json").read_text())["run"]["run_id"] == "bare"
    with pytest.raises(ParameterError, match="format"):
        write_report(root, "bare", tmp_path / "r.txt")
    with pytest.raises(ParameterError):
        build_report(root, "bare", fmt="pdf")
    with pytest.raises(analyses.UnknownRunError):
        build_report(open_runs(root), "missing", fmt="json")


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason="Chromium is not installed at /usr/bin/chromium "
    "(apt-get install -y chromium); the offline rendering check needs a real browser",
)
def test_html_renders_offline_in_headless_chromium(html, tmp_path):
    page = tmp_path / "report.html"
    page.write_text(html, encoding="utf-8")
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--proxy-server=socks5://127.0.0.1:9",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--virtual-time-budget=20000",
        "--dump-dom",
        page.as_uri(),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    body = re.search(r"<body[^>]*>", out.stdout)
    assert body, out.stderr[-2000:]
    figs = len(json.loads(re.search(r'id="h2o-figures">(.*?)</script>', html, re.S).group(1)))
    assert f'data-plots-rendered="{figs}"' in body.group(0), body.group(0)
    assert "data-js-errors" not in body.group(0) and "data-plot-error" not in body.group(0)
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    assert out.stdout.count('class="main-svg"') >= figs  # plotly drew an SVG per figure
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)


# -- text from the logs is shown as text; damaged runs say so ------------------------------------------

HOSTILE_NAME = '<script>alert("name")</script> ![pixel](http://example.invalid/name.png)'
HOSTILE_LABEL = '<img src=x onerror=alert(1)>[click](http://example.invalid/label) ``` |'


@pytest.fixture(scope="module")
def hostile_root(tmp_path_factory):
    """A run whose name and evidence label carry HTML and Markdown, and a run missing a segment."""
    root = tmp_path_factory.mktemp("hostile")
    run = write_synthetic_run(
        root, "hostile", layers=2, kv_heads=2, steps=24, prompt_len=48, heavy=12, recent=12, fsync=False
    )
    manifest = read_manifest(run)
    manifest["name"] = HOSTILE_NAME
    write_manifest(run, manifest)
    seg = run / "tokens-00000.parquet"
    tokens = pq.read_table(seg)
    labels = pc.if_else(tokens["evidence"].is_valid(), HOSTILE_LABEL, pa.scalar(None, pa.string()))
    tokens = tokens.set_column(tokens.schema.get_field_index("evidence"), "evidence", labels)
    write_segment(
        seg, "tokens", tokens.replace_schema_metadata(None).cast(TABLES["tokens"]), run_id="hostile", fsync=False
    )
    short = write_synthetic_run(
        root, "short", layers=2, kv_heads=2, steps=24, prompt_len=48, heavy=12, recent=12, fsync=False
    )
    (short / "evictions-00000.parquet").unlink()
    return root


def _rendered(md: str) -> str:
    return MarkdownIt("commonmark").enable("table").render(md)


def test_markdown_report_shows_log_text_as_text(hostile_root):
    md = build_report(hostile_root, "hostile", fmt="md", failed={0: True})
    assert "example.invalid" in md and "evidence" in md  # the text is there...
    page = _rendered(md)
    for tag in ("<script", "<img", "<a "):  # ...but renders as no element at all
        assert tag not in page, tag
    assert "&lt;script&gt;" in page and "![pixel](http://example.invalid/name.png)" in page
    label = HOSTILE_LABEL.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert label in page  # table cells keep the label whole (its | and ``` included)
    html_page = build_report(hostile_root, "hostile", fmt="html", failed={0: True})
    assert "<script>alert" not in html_page and "<img src=x" not in html_page


def test_report_of_a_run_missing_a_segment_says_so_and_fails_the_gate(hostile_root):
    data = report_data(hostile_root, "short")
    jsonschema.validate(json.loads(json.dumps(data)), analyses.report_schema())
    assert data["run"]["integrity"].startswith("evictions: 0 of ")
    assert [p["table_name"] for p in data["run"]["problems"]] == ["evictions"]
    check = {c["name"]: c for c in data["verdict"]["checks"]}["problems"]
    assert check["status"] == "fail" and data["verdict"]["pass"] is False
    assert data["summary"]["evictions"] == 0  # what was read, flagged above
    md = build_report(hostile_root, "short", fmt="md")
    assert "this run's data is damaged or incomplete" in md and "manifest records" in md
    assert 'id="integrity"' in build_report(hostile_root, "short", fmt="html")
    assert report_data(hostile_root, "hostile")["run"]["integrity"] == "ok"
