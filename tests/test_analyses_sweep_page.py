"""The sweep's HTML page does not depend on what else the process has loaded: importing Streamlit
switches plotly's default template process-wide, and the page names its own."""

from __future__ import annotations

import pandas as pd
import pytest

from analyses import sweep_html

pio = pytest.importorskip("plotly.io")


def _table() -> pd.DataFrame:
    table = pd.DataFrame(
        {
            "policy": ["full", "h2o", "h2o"],
            "keep_ratio": [1.0, 0.5, 0.25],
            "accuracy": [1.0, 0.5, 0.0],
            "checked": [2, 2, 2],
            "kl_mean": [0.0, 0.01, 0.2],
            "dropped_mass": [0.0, 0.3, 0.6],
            "kv_share": [1.0, 0.5, 0.25],
            "page_share": [1.0, 0.75, 0.5],
            "ms_per_token": [10.0, 9.0, 8.5],
            "runs": [1, 1, 1],
            "requests": [2, 2, 2],
            "kv_bytes_per_token": [1024.0, 512.0, 256.0],
            "paged_bytes_per_token": [1024.0, 768.0, 512.0],
        }
    )
    table.attrs["policy_of"] = {"full": "full", "h2o": "h2o"}
    table.attrs["x"] = "keep_ratio"
    return table


def test_the_page_is_the_same_whatever_plotly_template_the_process_defaults_to():
    table = _table()
    before = pio.templates.default
    try:
        pio.templates.default = "plotly"
        plain = sweep_html(table, 16, table.attrs["policy_of"], x="keep_ratio")
        pio.templates.default = "plotly_dark"  # what Streamlit's import does, with its own template
        other = sweep_html(table, 16, table.attrs["policy_of"], x="keep_ratio")
    finally:
        pio.templates.default = before
    assert plain == other
