"""``h2o-lens record --guard``: a request run guarded from the command line, its risk and actions in
the run's log (DESIGN.md §18.5), and every refusal one line before anything is written."""

from __future__ import annotations

import json

import pytest
from tiny import save_tiny

from commands.cli import main
from runlog.store import check_run, load_run

PROMPT = "Read the notes. The lab code is 4419. The printer is out of toner. What is the lab code?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    base = tmp_path_factory.mktemp("guard_model")
    save_tiny(base / "m", seed=0)
    return base


def _record(folder, tmp_path, monkeypatch, *extra):
    monkeypatch.chdir(folder)
    out = tmp_path / "runs"
    args = ["record", "--model", "./m", "--out", str(out), "--prompt", PROMPT, "--raw", "--max-new-tokens", "6"]
    code = main([*args, "--heavy", "4", "--recent", "4", *extra])
    return code, out


@pytest.mark.compat
def test_a_raise_at_threshold_0_acts_at_the_prefill_and_is_logged(folder, tmp_path, monkeypatch, capsys):
    """Every request reaches threshold 0: raised at the prefill (step P - 1, nothing evicted) to the
    whole prompt; one ``guard_steps`` row per step scored (the prefill's and 5 decode steps); the
    strict check passes and the summary line names the action."""
    code, out = _record(folder, tmp_path, monkeypatch, "--guard", "raise:1.0@0")
    assert code == 0
    (run_dir,) = out.iterdir()
    check_run(run_dir)
    run = load_run(run_dir)
    prompt_len = run["requests"].to_pandas()["prompt_len"].iloc[0]
    events = run["guard_events"].to_pandas()
    assert events[["request", "step", "action", "slots_before", "slots_after", "evicted"]].values.tolist() == [
        [0, prompt_len - 1, "raise", 8, prompt_len, 0.0]
    ]
    steps = run["guard_steps"].to_pandas()
    assert steps["step"].tolist() == list(range(prompt_len - 1, prompt_len + 5))
    assert ((steps["risk"] >= 0) & (steps["risk"] <= 1)).all()
    evicted_at = run["evictions"].to_pandas()["step"]
    assert evicted_at.min() >= prompt_len  # the prompt fits in the raised slots; only new tokens push out
    err = capsys.readouterr().err
    assert f"raise at step {prompt_len - 1} (8 -> {prompt_len} slots, 0 positions already evicted)" in err


def test_log_only_logs(folder, tmp_path, monkeypatch, capsys):
    code, out = _record(folder, tmp_path, monkeypatch, "--guard", "log")
    assert code == 0
    (run_dir,) = out.iterdir()
    run = load_run(run_dir)
    assert run["guard_events"].num_rows == 0 and run["guard_steps"].num_rows == 6
    assert run["evictions"].to_pandas()["step"].min() == run["requests"].to_pandas()["prompt_len"].iloc[0] - 1
    err = capsys.readouterr().err
    assert "(threshold 0.50); no action; its own computations " in err
    cost = json.loads((run_dir / "manifest.json").read_text())["guard_cost"]
    assert f"its own computations {cost['seconds']:.3f} s over 5 decode steps" in err and cost["steps_scored"] == 5


@pytest.mark.compat
def test_refill_runs_with_its_processor(folder, tmp_path, monkeypatch, capsys):
    """``refill`` needs the refill processor in ``generate``: the command passes it (at threshold 0
    the row gets its target at the prefill, before anything is evicted: logged as the ``refill``
    it is, with nothing recomputed)."""
    code, out = _record(folder, tmp_path, monkeypatch, "--guard", "refill:0.5@0")
    assert code == 0
    (run_dir,) = out.iterdir()
    events = load_run(run_dir)["guard_events"].to_pandas()
    assert events["action"].tolist() == ["refill"] and events["seconds"].tolist() == [0.0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--guard", "lift:0.5"], "--guard 'lift:0.5': expected ACTION:TARGET[:RESCUE][@THRESHOLD]"),
        (["--guard", "raise:0.35@2"], "the threshold after @ must be in [0, 1]"),
        (["--guard", "log", "--policy", "full"], "--guard watches evictions; --policy full keeps every token"),
    ],
)
def test_bad_guard_options_are_one_line_and_write_nothing(folder, tmp_path, monkeypatch, capsys, extra, message):
    code, out = _record(folder, tmp_path, monkeypatch, *extra)
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


def test_guard_and_teacher_force_are_refused(folder, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(folder)
    code = main(["record", "--teacher-force", "x", "--out", str(tmp_path), "--guard", "log"])
    assert code == 2
    assert "cannot be combined with --teacher-force" in capsys.readouterr().err


def _fit_file(path, **over):

    from h2o_lens.guard import SIGNALS

    fit = {
        "weights": [0.0] * len(SIGNALS),
        "bias": 3.0,  # a risk of 0.95 at every step
        "heads": [[1, 0]],
        "threshold": 0.9,
        "signal_rows": 4,
        "model": "./m",
    }
    fit.update(over)
    path.write_text(json.dumps(fit))
    return str(path)


@pytest.mark.compat
def test_a_fit_file_sets_the_guards_weights_heads_and_threshold(folder, tmp_path, monkeypatch, capsys):
    """``--guard-fit`` takes the fitted weights, bias, heads, threshold and rows: a bias of 3 puts
    every step at risk 0.953 >= the fit's threshold 0.9, so the raise acts at the prefill; the
    manifest keeps the fitted config; an ``@`` threshold wins over the fit's."""

    fit = _fit_file(tmp_path / "fit.json")
    code, out = _record(folder, tmp_path, monkeypatch, "--guard", "raise:1.0", "--guard-fit", fit)
    assert code == 0
    (run_dir,) = out.iterdir()
    check_run(run_dir)
    run = load_run(run_dir)
    assert run["guard_events"].to_pandas()["action"].tolist() == ["raise"]
    assert run["guard_steps"].to_pandas()["risk"].tolist() == pytest.approx([1 / (1 + 2.718281828**-3)] * 6)
    guard = json.loads((run_dir / "manifest.json").read_text())["guard"]
    assert (guard["bias"], guard["heads"], guard["threshold"], guard["signal_rows"]) == (3.0, [[1, 0]], 0.9, 4)
    code, out2 = _record(folder, tmp_path / "b", monkeypatch, "--guard", "raise:1.0@0.99", "--guard-fit", fit)
    assert code == 0
    (run_dir,) = out2.iterdir()
    assert load_run(run_dir)["guard_events"].num_rows == 0


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file; write one with h2o-lens bench guard --save-fit"),
        ("{not json", "not a readable JSON fit file"),
        ('{"weights": [1, 2]}', "the fit file lacks bias, heads, threshold, signal_rows"),
        (
            '{"weights": [1], "bias": 0, "heads": [], "threshold": 0.5, "signal_rows": 8, "model": "./m"}',
            "guard weights has 1 values",
        ),
        ('{"weights": "ab", "bias": 0, "heads": [[1]], "threshold": 0.5, "signal_rows": 8}', "malformed values"),
    ],
)
def test_a_bad_fit_file_is_one_line_and_writes_nothing(folder, tmp_path, monkeypatch, capsys, content, message):
    path = tmp_path / "fit.json"
    if content is not None:
        path.write_text(content)
    code, out = _record(folder, tmp_path, monkeypatch, "--guard", "log", "--guard-fit", str(path))
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


def test_a_fit_file_without_a_guard_is_refused(folder, tmp_path, monkeypatch, capsys):
    code, _ = _record(folder, tmp_path, monkeypatch, "--guard-fit", _fit_file(tmp_path / "fit.json"))
    assert code == 2
    assert "give --guard too" in capsys.readouterr().err


def test_bench_writes_a_fit_file_record_reads():
    """``write_fit`` then ``read_fit`` gives back the report's fitted weights, bias, heads and
    threshold, and the rows the prefill signal read."""
    import tempfile

    from commands.benchmarks.guard_eval import GuardReport
    from commands.benchmarks.guard_fit import read_fit, write_fit
    from h2o_lens.guard import SIGNALS, GuardConfig

    weights = tuple(0.1 * i for i in range(len(SIGNALS)))
    report = GuardReport(0.2, 4, 0, 0.66, {}, [], [], fit_requests=4, weights=weights, bias=-1.5, heads=((3, 1),))
    with tempfile.TemporaryDirectory() as d:
        write_fit(f"{d}/fit.json", report, {"model": "m"})
        got = read_fit(f"{d}/fit.json")
    assert got == {
        "weights": pytest.approx(weights),
        "bias": -1.5,
        "heads": ((3, 1),),
        "threshold": 0.66,
        "signal_rows": GuardConfig().signal_rows,
    }
    assert GuardConfig(**got).heads == ((3, 1),)
