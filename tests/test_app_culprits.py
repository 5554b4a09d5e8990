"""The Tokens page shows a request's culprit tokens (DESIGN.md §19): boxed in the prompt, with when
and why each left in its hover, and the search's line under the text."""

from __future__ import annotations

import pytest
from test_recorders_culprits import _tiny_parent

from app.textview import token_html

streamlit_testing = pytest.importorskip("streamlit.testing.v1")


def test_token_html_boxes_the_culprits_with_their_reason():
    import pandas as pd

    df = pd.DataFrame(
        {
            "position": [0, 1, 2],
            "text": ["a", "b", "c"],
            "is_prompt": [True, True, True],
            "evicted_step": [None, 5, 6],
            "evidence": [None, None, None],
        }
    )
    out = token_html(df, mode="step", step_range=(0, 10), at_step=10, selected=None, culprits={1: "left at step 5"})
    assert out.count("culprit: left at step 5") == 1 and out.count("box-shadow") == 1
    assert "culprit" not in token_html(df, mode="step", step_range=(0, 10), at_step=10, selected=None)


@pytest.mark.slow
def test_the_tokens_page_highlights_a_searched_requests_culprits(tmp_path, monkeypatch):
    from app_runs import REPO

    from recorders.culprits import explain_culprits

    model, tok, parent = _tiny_parent(tmp_path)
    got = explain_culprits(model, tok, parent, 0)
    assert got.found
    monkeypatch.setenv("H2O_LENS_ROOT", str(tmp_path))
    at = streamlit_testing.AppTest.from_file(str(REPO / "app" / "main.py"), default_timeout=120)
    at.query_params.update({"page": "tokens", "run": parent.name})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    bodies = " ".join(e.proto.body for e in at.get("html"))
    assert bodies.count("culprit: left ") == len(got.culprits)
    assert any("Culprit tokens" in c.value and "1-minimal" in c.value for c in at.caption)
