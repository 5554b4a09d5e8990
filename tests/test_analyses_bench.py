"""The analyses benchmark runs end to end (at a small scale here; full scale: python -m analyses.bench)."""

from __future__ import annotations

from analyses.bench import SHAPE, bench_analyses


def test_bench_runs_every_report_analysis(tmp_path, capsys):
    out = bench_analyses(tmp_path, evictions=400_000, shape={"steps": 256, "prompt_len": 1024})
    sets = SHAPE["layers"] * SHAPE["kv_heads"]
    assert out["rows"] >= 400_000 and out["rows"] % sets == 0
    assert {"coverage per head", "freeze onset", "stale victims", "attribution"} <= set(out["analyses"])
    assert out["analyses_total_s"] > 0 and out["report_s"] > 0 and out["peak_rss_bytes"] > 0
    assert out["report_bytes"] > 4_000_000  # plotly.js inlined once
    printed = capsys.readouterr().out
    assert "analyses total" in printed and "peak RSS" in printed
