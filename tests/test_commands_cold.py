"""The cold tier's options (DESIGN.md §2.13): ``record --cold``, ``sweep --cold``, ``bench decode
--cold`` and ``bench cold`` refuse a bad value in one ``h2o-lens: error:`` line (exit 2) before any
model loads."""

from __future__ import annotations

import pytest

from commands.cli import main


@pytest.mark.parametrize(
    "argv, says",
    [
        (["record", "--cold", "cpu"], "STORE:RECALL[:SELECTION[:EVERY]]"),
        (["record", "--cold", "tape:8"], "unknown cold store 'tape'"),
        (["record", "--cold", "cpu:8:fuzzy"], "unknown cold selection 'fuzzy'"),
        (["record", "--cold", "cpu:128", "--heavy", "64", "--recent", "64"], "recall window need 128 of the 128 slots"),
        (["record", "--cold", "cpu:8", "--policy", "full"], "--policy full keeps every token"),
        (["record", "--cold", "cpu:8", "--guard", "raise:0.35"], "drop --guard or --cold"),
        (["bench", "cold", "--window", "0.3"], "--window 0.3 must be below --ratio 0.2"),
        (["bench", "cold", "--stores", "tape"], "unknown store or selection ['tape']"),
        (["bench", "cold", "--window", "2"], "bench cold: argument --window"),
        (["bench", "decode", "--cold", "cpu"], "STORE:RECALL[:SELECTION[:EVERY]]"),
        (["bench", "decode", "--cold", "cpu:8", "--guard"], "--guard is another benchmark"),
        (["bench", "decode", "--cold", "cpu:8", "--assistant"], "--assistant is another benchmark"),
        (["bench", "decode", "--cold", "cpu:102", "--contexts", "512"], "context 512 (B=102)"),
    ],
)
def test_a_bad_cold_option_is_one_line_before_the_model_loads(capsys, argv, says):
    code = main([*argv, "--model", "/nonexistent"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("h2o-lens: error: ") and err.count("\n") == 1, err
    assert "cannot load model" not in err and says in err, err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--cold", "cpu"], "STORE:RECALL[:SELECTION[:EVERY]]"),
        (["--cold", "tape:8"], "unknown cold store 'tape'"),
        (["--cold", "cpu:8", "--policies", "full"], "no policy of the grid (full) takes a cold tier"),
        (["--cold", "cpu:64", "--slots", "64", "--policies", "h2o"], "--cold cpu:64 at --slots 64 (h2o)"),
    ],
)
def test_a_bad_sweep_cold_option_is_one_line_before_the_model_loads(capsys, tmp_path, argv, says):
    code = main(["sweep", "--out", str(tmp_path / "out"), *argv, "--model", "/nonexistent"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("h2o-lens: error: ") and err.count("\n") == 1, err
    assert "cannot load model" not in err and says in err, err
    assert not (tmp_path / "out").exists()


def test_bench_cold_runs_every_configuration_and_times_them_against_plain_h2o(capsys, tmp_path):
    """``bench cold`` on a user's model folder: a row per configuration, one per refill interval
    (``/K``), each with its accuracy over the tasks, and a decode time per batch size beside plain
    H2O's."""
    from tiny import save_tiny

    folder = save_tiny(tmp_path / "m")
    argv = ["bench", "cold", "--model", str(folder), "--tasks", "builtin:delayed_reference", "--count", "2"]
    argv += ["--stores", "cpu", "--every", "1", "3", "--new-tokens", "4", "--rounds", "1", "--time-tokens", "3"]
    assert main(argv + ["--time-batch", "1", "2"]) == 0
    out = capsys.readouterr().out
    accuracy, timing = out.split("decode ms per step")
    names = {"full", "h2o", "cold cpu exact", "cold cpu exact /3", "cold cpu pages", "cold cpu pages /3"}
    rows = {line[:20].strip(): line[20:].split() for line in accuracy.splitlines() if line[:20].strip() in names}
    assert set(rows) == names
    assert all(cells[0].endswith("/2") for cells in rows.values())  # accuracy over the two tasks
    times = {line[:20].strip(): line[20:].split() for line in timing.splitlines() if line[:20].strip() in names}
    assert set(times) == names
    for name, cells in times.items():  # b=1 ms, x h2o, b=2 ms, x h2o
        assert len(cells) == 4 and all(float(c) > 0 for c in cells), name
        if name == "h2o":
            assert cells[1] == cells[3] == "1.00"


def test_bench_cold_compares_each_round_with_plain_h2o_in_the_same_round():
    """The ``x h2o`` column is the median of per-round ratios: a machine that slows down between
    rounds slows both sides of a round, and a missing time leaves its round out."""
    from commands.benchmarks.cold import _round_ratio

    plain = [1.0, 2.0, 4.0]
    tier = [1.5, 3.0, 6.0]  # 1.5x plain in every round, while the machine's pace changes 4x
    assert _round_ratio(tier, plain) == 1.5
    assert _round_ratio([1.5, None, 8.0], plain) == 1.75  # rounds 0 and 2: 1.5 and 2.0
    assert _round_ratio([None, None], [1.0, 1.0]) is None
