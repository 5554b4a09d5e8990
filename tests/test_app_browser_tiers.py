"""The cold tier and the budget plan in a real browser (DESIGN.md §7.5): a ``record --cold cpu:4`` run
and a ``record --plan`` run of a tiny model, the Tokens, Overview and Heads pages drawn in Debian's
Chromium. Screenshots go to ``$H2O_LENS_SCREENSHOTS`` when set, else to the test's temporary folder.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from test_analyses_tiers import tier_root  # noqa: F401  (a module fixture)
from test_commands_sweep_grid import tiny_dir  # noqa: F401  (tier_root's fixture)

from app.bench import CHROMIUM, DONE, browser, serve

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (Debian package 'chromium')", allow_module_level=True)
if importlib.util.find_spec("streamlit") is None:
    pytest.skip("streamlit is not installed", allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="the Python package 'playwright' is not installed")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def page(tmp_path_factory, tier_root):  # noqa: F811
    root, runs = tier_root
    folder = os.environ.get("H2O_LENS_SCREENSHOTS")
    shots = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    with serve(root / "runs", log=tmp_path_factory.mktemp("server") / "streamlit.log") as url:
        with browser() as b:
            context = b.new_context(viewport={"width": 1500, "height": 1400})
            p = context.new_page()
            yield url, p, runs, shots
            context.close()


def _open(p, url: str, *texts: str) -> None:
    """Load ``url`` and wait until the main area holds every one of ``texts`` at once: the page
    reruns after it writes its query parameters, so a text seen once can be gone a moment later."""
    p.goto(url)
    p.wait_for_selector(f"{DONE} [data-testid=stMain] h1", timeout=120_000)
    p.wait_for_function(
        "(ts) => { const m = document.querySelector('[data-testid=stMain]');"
        " return m !== null && ts.every((t) => m.innerText.includes(t)); }",
        arg=list(texts),
        timeout=60_000,
    )
    p.wait_for_selector(DONE, timeout=60_000)
    assert p.locator("[data-testid=stException]").count() == 0


def test_tokens_page_marks_recalled_positions(page):
    url, p, runs, shots = page
    _open(p, f"{url}/tokens?run={runs['cold']}", "recalled from the cold tier")
    marked = p.locator("span[title*='recalled from cpu at step']")
    marked.first.wait_for(timeout=60_000)
    assert "layer/KV set" in marked.first.get_attribute("title")
    p.screenshot(path=str(shots / "tokens-cold.png"), full_page=True)


def test_overview_shows_the_cold_tier(page):
    url, p, runs, shots = page
    labels = ("Cold tier", "Hot slots", "Cold bytes written", "Cold bytes read", "Recalls")
    _open(p, f"{url}/overview?run={runs['cold']}", *labels)
    text = p.inner_text("[data-testid=stMain]")
    for label in labels:
        assert label in text
    p.locator("text=Cold tier").first.scroll_into_view_if_needed()
    p.screenshot(path=str(shots / "overview-cold.png"), full_page=True)


def test_heads_page_draws_the_plan_beside_its_concentration(page):
    url, p, runs, shots = page
    _open(p, f"{url}/heads?run={runs['plan']}", "Budget per layer and KV set")
    box = p.locator("input[aria-label='Plan file with its evidence (optional)']")
    box.fill(str(runs["plan_file"]))
    box.press("Enter")
    p.wait_for_function("() => document.body.innerText.includes('Tokens for 90 %')", timeout=60_000)
    p.wait_for_selector(DONE, timeout=60_000)
    assert p.locator("[data-testid=stException]").count() == 0
    assert p.locator(".stPlotlyChart, [data-testid=stPlotlyChart]").count() >= 3
    p.locator("text=Budget per layer and KV set").first.scroll_into_view_if_needed()
    p.screenshot(path=str(shots / "heads-plan.png"), full_page=True)
