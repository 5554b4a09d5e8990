"""The shipped ``sample_runs/`` out of the box in a real browser (Debian's Chromium, Playwright):
the Report page of an explained sample failure shows its Why section, one card per explained
request with its counterfactual re-runs, and the budget curves of the root's explained requests;
the Overview of a demo run and the three curves of the demo's runs draw, and are the README's
pictures (``make screenshots`` copies ``dashboard.png`` and ``curves.png`` to ``docs/img/``).

Screenshots go to ``$H2O_LENS_SCREENSHOTS`` when set, else to the test's temporary folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from pathlib import Path

import pytest
from app_runs import REPO

from analyses import causal_verdicts, connect
from app.bench import CHROMIUM, DONE, browser, serve
from commands.jobs import SAMPLE_EXPLAINED

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (Debian package 'chromium')", allow_module_level=True)
if importlib.util.find_spec("streamlit") is None:
    pytest.skip("streamlit is not installed", allow_module_level=True)
pytest.importorskip(
    "playwright.sync_api",
    reason="the Python package 'playwright' is not installed "
    "(pip install playwright; its own browser download is not needed)",
)

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _sample_page(tmp_path: Path, root: Path, path: str):
    """A Chromium page on ``path`` of the dashboard served over ``root``, drawn to the end (its
    ``h1``), with the folder screenshots go to."""
    shots = Path(os.environ.get("H2O_LENS_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with serve(root, log=tmp_path / "streamlit.log") as url, browser() as b:
        page = b.new_page(viewport={"width": 1500, "height": 1000})
        try:
            page.goto(f"{url}/{path}")
            page.wait_for_selector(f"{DONE} h1", timeout=120_000)
            yield page, shots
        finally:
            page.close()


def test_why_section_renders_on_the_shipped_sample_runs(tmp_path):
    root = tmp_path / "sample_runs"
    shutil.copytree(REPO / "sample_runs", root)
    run = SAMPLE_EXPLAINED[0]
    (verdict,) = causal_verdicts(connect(root), run)
    rerun_ids = [r["run_id"] for r in verdict.table if r["run_id"]]
    assert {r["variant"] for r in verdict.table} >= {"full", "pinned", "oracle", "policy_budget", "oracle_budget"}
    assert all((root / r).is_dir() for r in rerun_ids)  # the re-runs ship with the samples
    with _sample_page(tmp_path, root, f"report?run={run}") as (page, shots):
        main = page.locator("[data-testid=stMain]")
        main.get_by_text("Why: counterfactual re-runs").wait_for(timeout=60_000)
        assert page.locator("[data-testid=stException]").count() == 0
        text = main.inner_text()
        assert "No counterfactual re-runs yet" not in text
        assert f"Request {verdict.request}:" in text and verdict.reason in text
        assert "decided by: " + ", ".join(verdict.decided_by) in text
        # the variants table, a data grid, and the budget curves of the explained requests
        card = main.locator("h4", has_text=f"Request {verdict.request}:").first
        # Streamlit draws a data grid after the text around it: wait for it rather than count
        card.locator("xpath=following::*[@data-testid='stDataFrame']").first.wait_for(timeout=60_000)
        curves = main.locator(".js-plotly-plot").filter(has_text="Minimal passing budgets")
        curves.first.wait_for(timeout=60_000)
        assert "oracle" in curves.first.inner_text()
        page.get_by_text("Why: counterfactual re-runs").scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "report-why-samples.png"), full_page=True)


def test_guard_section_renders_on_the_shipped_guarded_sample(tmp_path):
    """The Overview of the shipped guarded run: its Guard section with the risk curve, the
    requests and actions tables, and the guard's cost as the manifest logged it."""
    from commands.jobs import SAMPLE_GUARDED

    name, ratio, _, _ = SAMPLE_GUARDED
    run = f"{name}-h2o-{round(ratio * 100)}-guard".replace("_", "-")
    root = tmp_path / "sample_runs"
    shutil.copytree(REPO / "sample_runs", root)
    with _sample_page(tmp_path, root, f"overview?run={run}") as (page, shots):
        main = page.locator("[data-testid=stMain]")
        main.get_by_text("The guard's own computations took").wait_for(timeout=60_000)
        assert page.locator("[data-testid=stException]").count() == 0
        chart = main.locator(".js-plotly-plot").filter(has_text="Guard: online risk")
        chart.first.wait_for(timeout=60_000)
        assert "raise" in chart.first.inner_text()
        main.get_by_text("The guard's own computations took").scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "overview-guard-sample.png"), full_page=False)


#: the demo run the README shows on the dashboard: H2O at 10 % fails delayed recall
README_RUN = "delayed-recall-0-h2o-10"


def test_readme_dashboard_the_overview_of_a_shipped_demo_run_draws(tmp_path):
    """The Overview of a failing demo run (its divergence curves): ``dashboard.png``."""
    root = tmp_path / "sample_runs"
    shutil.copytree(REPO / "sample_runs", root)
    with _sample_page(tmp_path, root, f"overview?run={README_RUN}") as (page, shots):
        main = page.locator("[data-testid=stMain]")
        main.locator("[data-testid=stPlotlyChart] .main-svg").first.wait_for(timeout=60_000)
        page.wait_for_function(
            "() => !document.querySelector('[data-testid=stSkeletonElement], .stSkeleton')", timeout=60_000
        )
        assert page.locator("[data-testid=stException]").count() == 0
        assert README_RUN in main.inner_text()
        page.wait_for_timeout(500)  # the charts' transitions
        page.screenshot(path=str(shots / "dashboard.png"), full_page=False)
    assert (shots / "dashboard.png").stat().st_size > 20_000


def test_readme_curves_the_three_curves_of_the_shipped_demo_runs_draw(tmp_path):
    """Quality, physical KV and latency over keep ratio of the shipped demo runs (full cache,
    H2O at 20 % and 10 %, ``local`` at 20 %; the guarded run is not on a curve): ``curves.png``."""
    from analyses.curves import curve_runs, curve_table
    from analyses.sweep_page import sweep_figure

    root = tmp_path / "sample_runs"
    shutil.copytree(REPO / "sample_runs", root)
    runs = curve_runs(root)
    assert runs and not any(r.endswith("-guard") for r in runs)
    table = curve_table(root, runs)
    assert set(zip(table["policy"], table["keep_ratio"])) == {
        ("full", 1.0),
        ("h2o", 0.2),
        ("h2o", 0.1),
        ("local", 0.2),
    }
    assert (table["runs"] == 3).all()  # three demo tasks
    fig = sweep_figure(
        table,
        16,
        table.attrs["policy_of"],
        title="The demo's three curves (sample_runs/, SmolLM2-135M-Instruct): quality, physical KV, latency",
    )
    page_file = tmp_path / "curves.html"
    page_file.write_text(fig.to_html(include_plotlyjs=True, full_html=True, div_id="fig"), encoding="utf-8")
    shots = Path(os.environ.get("H2O_LENS_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with browser() as b:
        page = b.new_page(viewport={"width": 1340, "height": 860})
        try:
            page.goto(page_file.as_uri())
            page.wait_for_selector("#fig .main-svg", timeout=60_000)
            # two evicting policies × four panels (the bytes panel twice: tokens and pages)
            assert page.evaluate("document.getElementById('fig').data.length") == 2 * 5
            assert "H2O" in page.locator("#fig").inner_text() or "h2o" in page.locator("#fig").inner_text()
            page.locator("#fig").screenshot(path=str(shots / "curves.png"))
        finally:
            page.close()
    assert (shots / "curves.png").stat().st_size > 20_000
