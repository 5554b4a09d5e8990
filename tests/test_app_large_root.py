"""The Runs and Compare pages on a generated root of 300 runs (AppTest, then a real browser)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from app_runs import REPO

streamlit_testing = pytest.importorskip("streamlit.testing.v1")
MAIN = REPO / "app" / "main.py"


def _app(root: Path, monkeypatch: pytest.MonkeyPatch, **params: str):
    monkeypatch.setenv("H2O_LENS_ROOT", str(root))
    at = streamlit_testing.AppTest.from_file(str(MAIN), default_timeout=300)
    at.query_params.update(params)
    return at.run()


@pytest.mark.slow
def test_runs_page_lists_every_run_of_a_large_root(large_root, monkeypatch):
    at = _app(large_root, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    table = at.dataframe[0].value
    assert len(table) == 300 and sorted(table["run_id"]) == [f"syn-{i:05d}" for i in range(300)]
    assert (table["correct"].str.fullmatch(r"[0-2]/2")).all()
    assert set(table["status"]) == {"complete", "failed", "interrupted"}


@pytest.mark.slow
def test_compare_page_draws_two_runs_of_a_large_root(large_root, monkeypatch):
    at = _app(large_root, monkeypatch, page="compare", run="syn-00010", other="syn-00250")
    assert not at.exception, [e.value for e in at.exception]
    shown = "\n".join(str(e.value) for e in at.markdown)
    assert "syn-00010" in shown and "syn-00250" in shown


@pytest.mark.slow
def test_runs_page_in_the_browser_on_a_large_root(large_root, tmp_path):
    from app.bench import CHROMIUM, DONE, browser, serve

    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian package 'chromium')")
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("the Python package 'playwright' is not installed")
    with serve(large_root, log=tmp_path / "streamlit.log", timeout=300) as url, browser() as b:
        page = b.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(f"{url}/", wait_until="domcontentloaded")
        page.wait_for_selector(f"{DONE} [data-testid=stMain] h1:has-text('Runs')", timeout=300_000)
        page.wait_for_selector("[data-testid=stDataFrame]", state="visible", timeout=60_000)
        assert page.locator("[data-testid=stException]").count() == 0
        assert "300 run(s) under" in page.locator("[data-testid=stMain]").inner_text()
