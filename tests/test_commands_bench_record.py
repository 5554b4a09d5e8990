"""`h2o-lens bench record --context N --new-tokens T`: record and replay side by side, one run."""

from __future__ import annotations

import re
import tempfile

import pytest

from commands.cli import main

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_bench_record_context_prints_replay_over_generation_and_both_peaks(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    assert main(["bench", "record", "--context", "96", "--new-tokens", "4"]) == 0
    assert list(tmp_path.glob("h2o-lens-bench-*")) == []  # the measured runs are removed
    out = capsys.readouterr().out
    rec = re.search(r"record: generation \(recorded\) ([\d.]+) s, peak RSS ([\d.]+) GiB", out)
    rep = re.search(r"replay: replay ([\d.]+) s, peak RSS ([\d.]+) GiB .*max \|logit diff\|", out)
    assert rec and rep, out
    assert "IMPLEMENTATION CHECK FAILED" not in out
    last = re.search(
        r"replay ([\d.]+) s / generation ([\d.]+) s: ratio ([\d.]+); peak RSS record ([\d.]+) GiB, replay ([\d.]+) GiB",
        out,
    )
    assert last, out
    t_rep, t_gen, ratio = (float(x) for x in last.groups()[:3])
    # the seconds are printed to 0.01 s, the ratio to 0.001
    assert t_gen > 0 and abs(ratio - t_rep / t_gen) <= 0.005 * (1 + ratio) / t_gen + 5e-4
    assert last.group(4) == rec.group(2) and last.group(5) == rep.group(2)  # the same peaks, side by side
    assert float(rec.group(2)) > 0.1 and float(rep.group(2)) > 0.1  # the model alone is about 0.5 GiB
    # record --replay: the replay started from the recording's prompt pass of the one request
    handed = re.search(
        r"handed: record --replay: generation \(recorded\) ([\d.]+) s, then its replay from the prompt pass "
        r"of (\d+) request\(s\) ([\d.]+) s, peak RSS of both ([\d.]+) GiB .*max \|logit diff\| ([\d.e+-]+)",
        out,
    )
    assert handed and handed.group(2) == "1", out
    assert float(handed.group(5)) <= 2e-3  # the replay from the prompt pass reproduces the run in float32
    ratio = re.search(r"record --replay \(.*\): replay ([\d.]+) s / generation ([\d.]+) s: ratio ([\d.]+)", out)
    assert ratio and ratio.group(1) == handed.group(3) and ratio.group(2) == handed.group(1), out
