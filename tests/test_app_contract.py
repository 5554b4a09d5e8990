"""A run whose values break the contract is flagged on the dashboard's Overview (DESIGN.md §5.5)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

streamlit_testing = pytest.importorskip("streamlit.testing.v1")

REPO = Path(__file__).resolve().parents[1]
RUN = "delayed-recall-0-h2o-20"


def test_the_overview_names_an_impossible_kl(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    shutil.copytree(REPO / "sample_runs" / RUN, root / RUN)
    (seg,) = (root / RUN).glob("replay_steps-*.parquet")
    table = pq.read_table(seg)
    i = table.schema.get_field_index("kl")
    kl = pa.array(np.full(table.num_rows, -5.0, np.float32))
    pq.write_table(table.set_column(i, table.schema.field(i), kl), seg)
    monkeypatch.setenv("H2O_LENS_ROOT", str(root))
    at = streamlit_testing.AppTest.from_file(str(REPO / "app" / "main.py"), default_timeout=120)
    at.query_params.update(run=RUN, page="overview")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    warning = "\n".join(str(w.value) for w in at.warning).replace("\\", "")  # markdown escapes
    assert "column replay_steps.kl holds -5 (its lowest value), outside its range [0, inf]" in warning
    assert "damaged or incomplete data" in "\n".join(str(c.value) for c in at.caption)
