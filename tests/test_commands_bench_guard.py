"""The guard bench's harness on a tiny model (DESIGN.md §18.6): its onset of failure is the one a
separate teacher and H2O generation give, its warning score reads only the steps before it, and
its AUROC is the ROC area."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny import local_attention, tiny_model

import h2o_lens
from commands.benchmarks.decode import bench_decode_guard
from commands.benchmarks.guard import bench_guard
from commands.benchmarks.guard_eval import evaluate, format_report, run_request
from commands.benchmarks.guard_fit import (
    auroc,
    first_wrong,
    fit_threshold,
    fit_weights,
    matched_auroc,
    select_heads,
    warning_score,
    write_outcomes,
)
from h2o_lens import H2OConfig
from h2o_lens.errors import ConfigError
from h2o_lens.guard import SIGNALS, GuardConfig
from h2o_lens.tasks.taskfile import FileTask

WORDS = [f"w{i}" for i in range(256)]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


def _tasks(seed: int, n: int = 4, length: int = 40) -> list[FileTask]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, 256, (length,), generator=gen).tolist()
        out.append(FileTask(name=f"t{seed}-{i}", prompt=" ".join(WORDS[t] for t in ids), max_new_tokens=14))
    return out


@pytest.fixture(scope="module")
def model():
    return local_attention(tiny_model("llama", layers=2))


def test_auroc_is_the_roc_area():
    """Against the trapezoid area of the ROC curve swept over every threshold."""
    scores = [0.1, 0.4, 0.35, 0.8, 0.4, 0.9, 0.05, 0.4]
    labels = [False, True, False, True, False, True, False, True]
    pos, neg = sum(labels), len(labels) - sum(labels)
    pts = [(0.0, 0.0)]
    for t in sorted(set(scores), reverse=True):
        pts.append(
            (
                sum(1 for s, y in zip(scores, labels) if not y and s >= t) / neg,
                sum(1 for s, y in zip(scores, labels) if y and s >= t) / pos,
            )
        )
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(pts, pts[1:]))
    assert auroc(scores, labels) == pytest.approx(area)
    assert math.isnan(auroc([0.1, 0.2], [True, True]))
    assert fit_threshold([0.1, 0.2, 0.7, 0.9], [False, False, True, True], "lowest") == 0.7
    assert fit_threshold([0.9, 0.7, 0.2, 0.1], [False, False, True, True]) == 1.0  # worse than chance: never act


def test_the_fitted_threshold_sits_midway_in_the_gap_it_leaves():
    """The midpoint flags exactly the fit requests that the lowest flagged score does (the same
    TPR − FPR), halfway between that score and the highest score below it, whichever class that is;
    with one class or no better than chance, 1.0."""
    scores = [0.1, 0.2, 0.5, 0.7, 0.9, 0.55]
    labels = [False, False, False, True, True, True]
    low = fit_threshold(scores, labels, "lowest")
    mid = fit_threshold(scores, labels)
    assert low == 0.55 and mid == pytest.approx((0.5 + 0.55) / 2)
    flagged = [s >= low for s in scores]
    assert [s >= mid for s in scores] == flagged
    # a pass above the lowest failure: the best cut keeps it flagged, the gap below is a failure's
    scores, labels = [0.1, 0.3, 0.4, 0.6, 0.8], [False, True, False, True, True]
    best = fit_threshold(scores, labels, "lowest")
    assert best == 0.6 and fit_threshold(scores, labels) == pytest.approx(0.5)
    assert fit_threshold([0.7, 0.9, 0.2], [True, True, False]) == pytest.approx(0.45)
    assert fit_threshold([0.7, 0.7, 0.9], [True, False, True]) == pytest.approx(0.8)  # a tie at 0.7: below
    assert fit_threshold([0.3, 0.6], [True, True]) == 1.0
    with pytest.raises(ValueError, match="threshold rule 'edge'"):
        fit_threshold([0.1, 0.9], [False, True], "edge")


def test_first_wrong_and_warning_score():
    assert first_wrong([1, 2, 3], [1, 2, 3]) is None
    assert first_wrong([1, 2, 3], [1, 5, 3]) == 1
    assert first_wrong([1, 2, 3], [1, 2]) == 2
    risks = [(10, 0.1), (11, 0.9), (12, 0.3), (13, 0.95)]  # prompt of 10 tokens
    # token 4 follows the steps 10..13; one step before it, 10..12; four steps before, none
    assert warning_score(risks, 10, 4, 1) == 0.9
    assert warning_score(risks, 10, 4, 2) == 0.9
    assert warning_score(risks, 10, 4, 3) == 0.1
    assert warning_score(risks, 10, 4, 4) == 0.0
    assert warning_score(risks, 10, None, 4) == 0.95


def test_harness_onset_is_the_teacher_divergence(model):
    """The onset the harness finds is the first token where a separate H2O generation leaves a
    separate full-cache generation of the same prompt; the guard's risks cover each decode step."""
    tok = _tokenizer()
    seen_failure = False
    for task in _tasks(7, n=3):
        ids = tok(task.prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            full = model.generate(ids, max_new_tokens=14, do_sample=False, pad_token_id=0)[0, 40:].tolist()
            with h2o_lens.h2o(model, H2OConfig(ratio=0.2)):
                small = model.generate(ids, max_new_tokens=14, do_sample=False, pad_token_id=0)[0, 40:].tolist()
        onset = next((i for i, (a, b) in enumerate(zip(full, small)) if a != b), None)
        teacher = run_request(model, tok, task)
        base = run_request(model, tok, task, H2OConfig(ratio=0.2), GuardConfig())
        assert teacher.tokens == full and base.tokens == small and teacher.memory == 1.0
        assert first_wrong(teacher.tokens, base.tokens) == onset
        assert [r["step"] for r in base.risks] == list(range(39, 40 + len(small) - 1))  # the prefill's row first
        assert 0.0 < base.memory < 0.5  # 8 slots of a 40-token prompt, and growing
        seen_failure |= onset is not None
    assert seen_failure  # 20 % of the prompt makes the tiny model diverge


@pytest.mark.slow
def test_evaluate_end_to_end_on_a_tiny_model(model, tmp_path):
    """The full cache's row is the teacher (all right, all memory); at threshold 0 both actions
    act on every request at the prefill, before anything is evicted, so both keep the whole
    prompt (40 slots of 41 to 53 tokens) and recover every failure; every figure is a share."""
    tok = _tokenizer()
    messages = []
    report = evaluate(
        model,
        tok,
        _tasks(1),
        [],
        ratio=0.2,
        budgets=(0.2, 1.0),
        policies=(("raise", 1.0, 0.0), ("refill", 1.0, 0.0)),
        ks=(1, 4),
        threshold=0.0,
        progress=messages.append,
    )
    # the progress counts generations run: teacher and base per request, then the two policies (the
    # 20 % and full-cache rows are the base pass's own runs)
    assert messages == [f"{i}/16 generations" for i in range(1, 17)]
    rows = {r["policy"]: r for r in report.table}
    assert rows["fixed 100%"]["accuracy"] == 1.0 and rows["fixed 100%"]["memory"] == 1.0
    base = rows["fixed 20%"]
    raised, refilled = rows["guard raise->100% @0.000"], rows["guard refill->100% @0.000"]
    assert raised["raised"] == refilled["raised"] == 4
    assert base["memory"] < 0.5 and raised["memory"] > 0.7 and refilled["memory"] > 0.7
    assert raised["accuracy"] == refilled["accuracy"] == 1.0
    assert report.requests == 4 and report.left_out == 0
    assert [r["policy"] for r in report.recovered] == ["guard raise->100% @0.000", "guard refill->100% @0.000"]
    for rec in report.recovered:
        assert rec["failures"] == round((1 - base["accuracy"]) * 4) and rec["recovered"] == rec["failures"]
    # the tiny model has no end token: every wrong answer stopped at the limit, and the table says so
    assert base["cut"] == base["wrong"] == round((1 - base["accuracy"]) * 4) > 0 and raised["cut"] == 0
    line = next(x for x in format_report(report).splitlines() if x.strip().startswith("fixed 20%"))
    assert line.endswith(f"{base['wrong']}, {base['cut']}")
    for by_k in report.aurocs.values():
        assert set(by_k) == {1, 4} and all(math.isnan(v) or 0.0 <= v <= 1.0 for v in by_k.values())
    text = format_report(report)
    assert "recovered" in text and "fixed 20%" in text and set(report.matched) == set(report.aurocs)
    failing = sum(o.failed for o in report.outcomes)
    if 0 < failing < report.requests:
        assert "AUROC of the warning score" in text and "same horizon" in text
    else:  # one class: one line says why instead of a table of nan
        assert "AUROC: not defined (these requests: " in text and "nan" not in text and "same horizon" not in text
    dump = tmp_path / "outcomes.json"
    write_outcomes(str(dump), report)
    data = json.loads(dump.read_text())
    assert len(data["report"]) == report.requests and data["fit"] == []
    for o, got in zip(report.outcomes, data["report"]):
        assert (got["name"], got["failed"], got["wrong"]) == (o.name, o.failed, o.wrong)
        assert [r["risk"] for r in got["risks"]] == pytest.approx([r["risk"] for r in o.risks])
    # per policy, each request's verdict and memory: they add up to the table's rows
    assert list(data["policies"]) == [r["policy"] for r in report.table]
    for row in report.table:
        got = data["policies"][row["policy"]]
        assert [g["name"] for g in got] == [o.name for o in report.outcomes]
        assert sum(g["passed"] for g in got) / len(got) == pytest.approx(row["accuracy"])
        assert sum(g["memory"] for g in got) / len(got) == pytest.approx(row["memory"])
        assert sum(g["raised"] for g in got) == row.get("raised", 0)
        assert sum(g["cut"] and not g["passed"] for g in got) == row["cut"]
    (tmp_path / "a-folder").mkdir()
    with pytest.raises(OSError):  # the write fails at the rename: no half file is left behind
        write_outcomes(str(tmp_path / "a-folder"), report)
    assert not (tmp_path / "a-folder.tmp").exists()


def test_a_run_cut_at_the_limit_is_told_from_one_that_ended(model):
    """``cut``: the generation reached the request's limit without an end token. A run that ends
    with the end token, before the limit or exactly at it, is not cut."""
    import dataclasses

    tok = _tokenizer()
    task = _tasks(3, n=1)[0]
    free = run_request(model, tok, task)
    assert len(free.tokens) == task.max_new_tokens and free.cut  # no end token: runs to the limit
    stop = free.tokens[3]
    first = free.tokens.index(stop)
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = stop
    try:
        ended = run_request(model, tok, task)
        assert ended.tokens == free.tokens[: first + 1] and not ended.cut
        at_limit = run_request(model, tok, dataclasses.replace(task, max_new_tokens=first + 1))
        assert len(at_limit.tokens) == first + 1 and not at_limit.cut
        short = run_request(model, tok, dataclasses.replace(task, max_new_tokens=first))
        assert short.tokens == free.tokens[:first] and short.cut
    finally:
        model.generation_config.eos_token_id = old


def test_bench_guard_new_tokens_replace_each_task_limit(tmp_path, capsys, monkeypatch):
    """``--new-tokens N`` gives every request of both seeds the limit N; below 1 it is refused
    before any run."""
    from tiny import save_tiny

    import commands.benchmarks.guard as bg
    from commands.benchmarks.guard_eval import GuardReport

    save_tiny(tmp_path / "m", seed=0)
    for name in ("run", "fit"):
        (tmp_path / f"{name}.jsonl").write_text(
            json.dumps({"name": name, "prompt": "w1 w2 w3", "max_new_tokens": 2}) + "\n"
        )
    seen = []

    def fake(model, tokenizer, tasks, fit_tasks, **kw):
        seen.append([t.max_new_tokens for t in tasks + fit_tasks])
        return GuardReport(0.2, 1, 0, 1.0, {"risk": {4: 0.5}}, [], [])

    monkeypatch.setattr(bg, "evaluate", fake)
    args = dict(model_name=str(tmp_path / "m"), tasks=str(tmp_path / "run.jsonl"), policies=(), budgets=(0.2,))
    assert bench_guard(**args, fit_tasks=str(tmp_path / "fit.jsonl")) == 0
    assert bench_guard(**args, fit_tasks=str(tmp_path / "fit.jsonl"), new_tokens=7) == 0
    assert seen == [[2, 2], [7, 7]]
    with pytest.raises(ConfigError, match="--new-tokens 0"):
        bench_guard(**args, new_tokens=0)
    assert len(seen) == 2


def test_bench_decode_guard_rows(model, capsys):
    """One row per context, batch and stride, the guarded cache decoding the plain one's tokens."""
    assert bench_decode_guard(model=model, contexts=(96,), batches=(1, 3), steps=2, rounds=1, strides=(1, 2)) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["96"]]
    assert [(r[1], r[2]) for r in rows] == [("1", "1"), ("1", "2"), ("3", "1"), ("3", "2")]
    for r in rows:
        assert float(r[3]) > 0 and float(r[4]) > 0 and r[-1] == "yes"


def test_cli_refuses_a_bad_ratio_in_one_line(capsys):
    from commands.cli import main

    assert main(["bench", "guard", "--ratio", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("h2o-lens: error: bench guard: argument --ratio: ") and err.count("\n") == 1
    assert "in (0, 1), such as 0.2; got 1.5" in err
    assert main(["bench", "guard", "--threshold", "2"]) == 2
    assert "argument --threshold: expected a risk in [0, 1], such as 0.5; got 2" in capsys.readouterr().err


def test_warning_score_counts_the_prefill_for_an_early_onset():
    """The prefill's risk (step P - 1) counts at every k; a decode step counts only k steps early."""
    risks = [(9, 0.3), (10, 0.9), (11, 0.2)]  # P = 10: the prefill's row, then two decode steps
    assert warning_score(risks, 10, 1, 4) == 0.3  # onset 1 < k: the prefill alone
    assert warning_score(risks, 10, 6, 4) == 0.9  # steps <= 10 + 6 - 1 - 4 = 11
    assert warning_score(risks, 10, 2, 1) == 0.9
    assert warning_score(risks, 10, None, 4) == 0.9


def test_matched_auroc_scores_both_classes_over_the_same_horizon():
    """A signal that grows with every step and is the same for every request: the any-step AUROC
    calls it worse than chance (a passing request's whole generation holds its highest values),
    over the same horizon it is a coin toss (0.5); one that is higher on the failures at every
    step is perfect either way. Recomputed by brute force over the pairs."""
    growing = [[(9 + s, 0.1 * s) for s in range(12)] for _ in range(4)]
    lens, wrongs, labels = [10] * 4, [3, 5, None, None], [True, True, False, False]
    plain = auroc([warning_score(r, 10, w if y else None, 1) for r, w, y in zip(growing, wrongs, labels)], labels)
    assert plain == 0.0
    assert matched_auroc(growing, lens, wrongs, labels, 1) == 0.5
    higher = [[(s, v + (0.5 if y else 0.0)) for s, v in r] for r, y in zip(growing, labels)]
    assert matched_auroc(higher, lens, wrongs, labels, 1) == 1.0
    gen = torch.Generator().manual_seed(1)
    noisy = [[(9 + s, float(torch.rand(1, generator=gen))) for s in range(12)] for _ in range(6)]
    lens, wrongs, labels = [10] * 6, [2, 6, 9, None, None, 4], [True, True, True, False, False, False]
    pairs = [
        (warning_score(noisy[f], 10, wrongs[f], 4), warning_score(noisy[p], 10, wrongs[f], 4))
        for f in range(6)
        if labels[f]
        for p in range(6)
        if not labels[p]
    ]
    want = sum((a > b) + 0.5 * (a == b) for a, b in pairs) / len(pairs)
    assert matched_auroc(noisy, lens, wrongs, labels, 4) == pytest.approx(want)
    assert math.isnan(matched_auroc(noisy, lens, wrongs, [True] * 6, 4))


def test_sample_weights_count_a_row_that_many_times():
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(12, 3, generator=gen).tolist()
    y = [i % 3 == 0 for i in range(12)]
    twice = fit_weights(x + x[:4], y + y[:4])
    weighted = fit_weights(x, y, sample_weights=[2.0] * 4 + [1.0] * 8)
    assert twice[0] == pytest.approx(weighted[0], abs=1e-6) and twice[1] == pytest.approx(weighted[1], abs=1e-6)


def test_a_signal_that_moves_by_hundredths_is_not_shrunk_away():
    """The fit standardises its features: a signal whose values differ by 0.01 between the classes
    (as the prefill signal's do) ranks the requests perfectly once fitted, beside a noisy one of
    range 1."""
    gen = torch.Generator().manual_seed(3)
    y = [i % 2 == 0 for i in range(30)]
    x = [[0.12 + (0.005 if f else -0.005), float(torch.rand(1, generator=gen))] for f in y]
    weights, bias = fit_weights(x, y)
    assert weights[0] > 50 * abs(weights[1])
    assert auroc([bias + weights[0] * a + weights[1] * b for a, b in x], y) == 1.0


def test_matched_features_score_a_pass_at_each_failure_onset():
    """Two failures (onsets 2 and 6) and one pass: the pass gives two rows, each over the steps
    before one onset (k = 1) and weighted 1/2; every value is its signal's warning score there."""
    from commands.benchmarks.guard_fit import Outcome, matched_features
    from h2o_lens.guard import SIGNALS

    def risks(base):
        return [{"step": 9 + s, **{n: base + 0.01 * s + 0.1 * i for i, n in enumerate(SIGNALS)}} for s in range(9)]

    outs = [
        Outcome("a", 10, True, 2, risks(0.0)),
        Outcome("b", 10, True, 6, risks(0.2)),
        Outcome("c", 10, False, None, risks(0.1)),
    ]
    rows, labels, weights = matched_features(outs, 1)
    assert labels == [True, True, False, False] and weights == [1.0, 1.0, 0.5, 0.5]
    for row, (o, j) in zip(rows, [(outs[0], 2), (outs[1], 6), (outs[2], 2), (outs[2], 6)]):
        want = [warning_score([(r["step"], r[n]) for r in o.risks], 10, j, 1) for n in SIGNALS]
        assert row == pytest.approx(want)
    assert rows[2][0] == pytest.approx(0.1 + 0.01 * 1)  # steps <= 10 + 2 - 1 - 1 = 10: the prefill's and one


def test_fit_weights_finds_the_signal_that_separates():
    """Requests whose second feature is high fail: its weight comes out positive and largest, and
    the fitted logistic ranks the requests perfectly; one class alone gives None."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(40, 3, generator=gen)
    y = (x[:, 1] > 0.5).tolist()
    weights, bias = fit_weights(x.tolist(), y)
    assert weights[1] > 0 and abs(weights[1]) > max(abs(weights[0]), abs(weights[2]))
    z = [bias + sum(w * v for w, v in zip(weights, row)) for row in x.tolist()]
    assert auroc(z, y) == 1.0
    assert fit_weights(x.tolist(), [True] * 40) is None


@pytest.mark.slow
def test_evaluate_fits_weights_on_the_fit_seed(model):
    """With fit requests the weights and the threshold come from them: the report carries the
    fitted weights (or None when the fit seed has one class) and a ``fitted`` AUROC row then."""
    tok = _tokenizer()
    report = evaluate(
        model, tok, _tasks(1), _tasks(2), ratio=0.2, budgets=(0.2,), policies=(("raise", 0.35, 0.15),), ks=(4,)
    )
    assert report.fit_requests == 4
    assert 0.0 <= report.threshold <= 1.0
    if report.weights is not None:
        assert len(report.weights) == len(SIGNALS) and "fitted" in report.aurocs
        assert "weights fitted on the fit set" in format_report(report)
    else:
        assert "fitted" not in report.aurocs
    assert [r["policy"] for r in report.recovered] == [f"guard raise->35%+15% pinned @{report.threshold:.3f}"]


@pytest.mark.slow
def test_the_threshold_rule_reaches_the_fit_and_the_report(model, monkeypatch):
    """``threshold_rule`` is the rule :func:`fit_threshold` places the fitted threshold by, and the
    report's first line names it."""
    import commands.benchmarks.guard_eval as bg

    seen = []

    def spy(scores, labels, rule="midpoint"):
        seen.append(rule)
        return 0.25  # a threshold both classes of any fit set are printed against

    monkeypatch.setattr(bg, "fit_threshold", spy)
    tok = _tokenizer()
    for rule in ("lowest", "midpoint"):
        report = evaluate(
            model, tok, _tasks(1), _tasks(2), ratio=0.2, budgets=(0.2,), policies=(), ks=(4,), threshold_rule=rule
        )
        assert seen[-1] == rule and report.threshold == 0.25 and report.threshold_rule == rule
        first = format_report(report).splitlines()[0]
        assert "threshold 0.250 fitted on 4 other requests" in first
        assert f"the {rule} of its gap" in first or "none passes" in first or "none fails" in first


def test_cli_refuses_a_threshold_rule_with_nothing_to_fit(tmp_path, capsys):
    from commands.cli import main

    assert main(["bench", "guard", "--threshold", "0.5", "--threshold-rule", "lowest"]) != 0
    err = capsys.readouterr().err
    assert "--threshold-rule places a fitted threshold; with --threshold none is fitted" in err
    assert "Traceback" not in err
    assert main(["bench", "guard", "--fit", str(tmp_path / "fit.json"), "--threshold-rule", "midpoint"]) != 0
    assert "with --fit none is fitted" in capsys.readouterr().err
    assert main(["bench", "guard", "--threshold-rule", "edge"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("h2o-lens: error: bench guard: ") and "invalid choice: 'edge'" in err


def test_a_policy_with_its_own_threshold_acts_at_it(model):
    """``raise:1.0@0`` acts on every request whatever the fitted or given threshold; the same
    policy at the given threshold 1.0 acts only on a request whose risk reaches 1."""
    tok = _tokenizer()
    report = evaluate(
        model,
        tok,
        _tasks(1),
        [],
        ratio=0.2,
        budgets=(0.2,),
        policies=(("raise", 1.0, 0.0, 0.0), ("raise", 1.0, 0.0)),
        ks=(4,),
        threshold=1.0,
    )
    rows = {r["policy"]: r for r in report.table}
    assert rows["guard raise->100% @0.000"]["raised"] == 4
    assert rows["guard raise->100% @1.000"]["raised"] == 0
    assert rows["guard raise->100% @0.000"]["memory"] > rows["guard raise->100% @1.000"]["memory"]
    assert "; threshold 1.000 given; the weights by default" in format_report(report).splitlines()[0]


def test_guard_policies_parse_an_own_threshold():
    from commands.benchmarks.guard import guard_policies

    assert guard_policies(["raise:0.35:0.25@0", "refill:1.0", "raise:0.5@0.7"]) == (
        ("raise", 0.35, 0.25, 0.0),
        ("refill", 1.0, 0.0),
        ("raise", 0.5, 0.0, 0.7),
    )
    assert guard_policies(["none"]) == ()  # the AUROC alone


def test_cli_refuses_a_bad_guard_policy_in_one_line(capsys):
    from commands.cli import main

    assert main(["bench", "guard", "--guard-policies", "lift:0.5"]) == 2
    err = capsys.readouterr().err
    assert "--guard-policies 'lift:0.5'" in err and "ACTION:TARGET[:RESCUE]" in err and "Traceback" not in err
    assert main(["bench", "guard", "--guard-policies", "raise:1.5"]) == 2
    assert "target keep ratio must be in (0, 1]" in capsys.readouterr().err
    assert main(["bench", "guard", "--guard-policies", "raise:0.35@"]) == 2
    assert "ACTION:TARGET[:RESCUE][@THRESHOLD]" in capsys.readouterr().err
    assert main(["bench", "guard", "--guard-policies", "raise:0.35@1.5"]) == 2
    assert "threshold after @ must be in [0, 1]" in capsys.readouterr().err
    assert main(["bench", "guard", "--dump", "/nowhere/at/all.json"]) == 2
    assert "give a file path in an existing folder" in capsys.readouterr().err
    assert main(["bench", "guard", "--fixed", "0.2", "1.5"]) == 2
    assert "argument --fixed: expected a keep ratio in (0, 1], such as 0.2; got 1.5" in capsys.readouterr().err


@pytest.mark.slow
def test_a_task_file_is_fitted_on_the_fit_tasks_given(tmp_path, capsys):
    """A task file has no seeds: without ``--fit-tasks`` the bench says there is nothing to fit
    on and uses the defaults; with another file it fits there (the report says on how many
    requests) and reports on the first."""
    from tiny import save_tiny

    save_tiny(tmp_path / "m", seed=0)

    def write(path, seed):
        gen = torch.Generator().manual_seed(seed)
        with open(path, "w") as f:
            for i in range(4):
                text = "".join(chr(int(c)) for c in torch.randint(97, 123, (60,), generator=gen))
                f.write(json.dumps({"name": f"r{seed}-{i}", "prompt": text, "max_new_tokens": 8}) + "\n")

    write(tmp_path / "run.jsonl", 1)
    write(tmp_path / "fit.jsonl", 2)
    common = dict(model_name=str(tmp_path / "m"), tasks=str(tmp_path / "run.jsonl"), policies=(), budgets=(0.2,))
    assert bench_guard(**common) == 0
    out = capsys.readouterr()
    assert "nothing to fit on" in out.err and "(not fitted)" in out.out
    assert bench_guard(**common, fit_tasks=str(tmp_path / "fit.jsonl")) == 0
    out = capsys.readouterr()
    assert f"fit on {tmp_path / 'fit.jsonl'}" in out.out and "nothing to fit on" not in out.err
    assert "fitted on 4 other requests (the fit set" in out.out
    fit = tmp_path / "fit.json"
    code = bench_guard(**common, fit_tasks=str(tmp_path / "fit.jsonl"), save_fit=str(fit))
    out = capsys.readouterr()
    assert code == 1 and "nothing fitted" in out.err and not fit.exists()  # the fit set passes all 4
    with pytest.raises(ConfigError, match="--save-fit .*existing folder"):
        bench_guard(**common, save_fit=str(tmp_path / "no-such" / "fit.json"))
    with pytest.raises(ConfigError, match="with --threshold nothing is"):
        bench_guard(**common, save_fit=str(fit), threshold=0.5)
    with pytest.raises(ConfigError, match="--heads -1"):
        bench_guard(**common, heads=-1)


def _outcome(name, failed, heads, prefill=0.5):
    from commands.benchmarks.guard_fit import Outcome

    risks = [{"step": 9, "risk": 0.1, "prefill": prefill}, {"step": 10, "risk": 0.2, "prefill": prefill}]
    return Outcome(name, 10, failed, 3 if failed else None, risks, heads)


def test_select_heads_ranks_the_heads_that_read_back():
    """The head whose lost share separates the failures comes first, then the next best; among
    equal AUROCs the larger separation in pooled standard deviations; zero heads, no shares or one
    class choose nothing."""
    gen = torch.Generator().manual_seed(0)
    outs = []
    for i in range(12):
        failed = i % 3 == 0
        heads = torch.rand(3, 2, generator=gen)
        heads[2, 1] = 0.9 if failed else 0.1  # a perfect separator
        heads[1, 0] = (0.6 if failed else 0.4) + 0.3 * heads[1, 0] - 0.15  # a good one
        outs.append(_outcome(f"r{i}", failed, heads.tolist()))
    got = select_heads(outs, 2)
    assert got[0] == (2, 1)
    flat = [[v for layer in o.heads for v in layer] for o in outs]
    scores = [auroc([f[j] for f in flat], [o.failed for o in outs]) for j in range(6)]
    second = max((j for j in range(6) if j != 5), key=lambda j: (scores[j], -j))
    assert got[1] == (second // 2, second % 2)
    # three perfect separators: the classes furthest apart come first
    for o in outs:
        o.heads[0][0] = 0.7 if o.failed else 0.3
        o.heads[0][1] = 0.55 if o.failed else 0.45
    o = outs[1]
    o.heads[0][1] = 0.46  # some spread, so the two gaps differ in their units too
    assert select_heads(outs, 3) == ((2, 1), (0, 0), (0, 1))  # gaps 0.8, 0.4 without spread; 0.1 with
    assert select_heads(outs, 0) == ()
    assert select_heads([o for o in outs if o.failed], 2) == ()
    assert select_heads([_outcome("x", True, []), _outcome("y", False, [])], 2) == ()


def test_reprefill_gives_every_step_the_chosen_heads_signal():
    """Every step's ``prefill`` becomes the mean over the chosen heads; the logged value is kept
    as ``all heads`` (once: a second pass does not overwrite it)."""
    from commands.benchmarks.guard_fit import _reprefill

    o = _outcome("a", True, [[0.1, 0.2], [0.3, 0.8]], prefill=0.35)
    _reprefill([o], ((1, 1), (0, 1)))
    assert [r["prefill"] for r in o.risks] == pytest.approx([0.5, 0.5])
    assert [r["all heads"] for r in o.risks] == [0.35, 0.35]
    _reprefill([o], ((1, 0),))
    assert [r["prefill"] for r in o.risks] == pytest.approx([0.3, 0.3]) and o.risks[0]["all heads"] == 0.35


def _spy_guards(monkeypatch) -> list:
    """The GuardConfig (or None) of every request the bench runs from now on, in order."""
    import commands.benchmarks.guard_eval as bg

    seen = []
    real = bg.run_request

    def spy(model, tokenizer, task, config=None, guard=None):
        seen.append(guard)
        return real(model, tokenizer, task, config, guard)

    monkeypatch.setattr(bg, "run_request", spy)
    return seen


def test_the_fitted_heads_reach_the_report_and_the_guard(model, monkeypatch):
    """With a fit set whose failures a head ranks, the chosen heads are in the report, its
    printout and the GuardConfig of every policy the bench runs."""
    import commands.benchmarks.guard_eval as bg

    seen = _spy_guards(monkeypatch)
    monkeypatch.setattr(bg, "select_heads", lambda outcomes, count: ((1, 0), (0, 1))[:count])
    tok = _tokenizer()
    report = evaluate(
        model, tok, _tasks(1, n=2), _tasks(2, n=2), ratio=0.2, budgets=(0.2,), policies=(("raise", 0.35, 0.0),), ks=(4,)
    )
    assert report.heads == ((1, 0), (0, 1))
    acting = [g for g in seen if g is not None and g.action == "raise"]
    assert acting and all(g.heads == ((1, 0), (0, 1)) for g in acting)
    for o in report.outcomes:
        assert o.heads and len(o.heads) == 2
        want = (o.heads[1][0] + o.heads[0][1]) / 2
        assert all(r["prefill"] == pytest.approx(want) for r in o.risks)
        assert "all heads" in o.risks[0]
    assert "all heads" in report.aurocs
    assert "prefill heads (layer.KV set) chosen on the fit set: 1.0 0.1" in format_report(report)


def test_bench_saves_the_fit_it_printed(tmp_path, capsys, monkeypatch):
    """With fitted weights, ``--save-fit`` writes the weights, heads and threshold the printout
    shows, and ``record --guard-fit`` reads them back."""
    from tiny import save_tiny

    import commands.benchmarks.guard as bg
    from commands.benchmarks.guard_eval import GuardReport
    from commands.benchmarks.guard_fit import read_fit

    save_tiny(tmp_path / "m", seed=0)
    (tmp_path / "run.jsonl").write_text(json.dumps({"name": "a", "prompt": "w1 w2 w3", "max_new_tokens": 2}) + "\n")
    weights = tuple(0.5 for _ in SIGNALS)
    report = GuardReport(0.2, 1, 0, 0.625, {"risk": {4: 0.5}}, [], [], 2, weights, -2.0, heads=((1, 0), (0, 1)))
    monkeypatch.setattr(bg, "evaluate", lambda *a, **k: report)
    fit = tmp_path / "fit.json"
    args = dict(model_name=str(tmp_path / "m"), tasks=str(tmp_path / "run.jsonl"), policies=(), budgets=(0.2,))
    assert bench_guard(**args, fit_tasks=str(tmp_path / "run.jsonl"), save_fit=str(fit)) == 0
    out = capsys.readouterr().out
    assert "prefill heads (layer.KV set) chosen on the fit set: 1.0 0.1" in out and f"written to {fit}" in out
    got = read_fit(str(fit))
    assert got["weights"] == weights and got["bias"] == -2.0 and got["threshold"] == 0.625
    assert got["heads"] == ((1, 0), (0, 1))
    about = json.loads(fit.read_text())
    assert about["fit_tasks"] == str(tmp_path / "run.jsonl") and about["model"] == str(tmp_path / "m")


def test_a_saved_fit_is_measured_instead_of_fitting(tmp_path, capsys, monkeypatch):
    """``--fit FILE`` runs no fit pass: the base pass logs the prefill over the file's rows, every
    guard policy runs with the file's weights, bias, heads and threshold, and the printout says
    where they came from; heads outside the model, or --fit with --save-fit, are refused before
    any run."""
    from tiny import save_tiny

    save_tiny(tmp_path / "m", seed=0)
    (tmp_path / "run.jsonl").write_text(
        "".join(
            json.dumps({"name": f"a{i}", "prompt": f"w{i} w7 w9 w3 w4 " * 6, "max_new_tokens": 4}) + "\n"
            for i in range(2)
        )
    )
    weights = [0.0] * len(SIGNALS)
    fit = {"weights": weights, "bias": 4.0, "heads": [[1, 0]], "threshold": 0.9, "signal_rows": 3}
    fit["model"] = str(tmp_path / "m")
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    seen = _spy_guards(monkeypatch)
    args = dict(model_name=str(tmp_path / "m"), tasks=str(tmp_path / "run.jsonl"), budgets=(0.2,))
    assert bench_guard(**args, policies=(("raise", 1.0, 0.0),), fit_file=str(tmp_path / "fit.json")) == 0
    out = capsys.readouterr()
    assert "the fit of" in out.out and "threshold 0.900 from the saved fit" in out.out
    assert "prefill heads (layer.KV set) of the saved fit: 1.0" in out.out and "nothing to fit on" not in out.err
    logging = [g for g in seen if g is not None and g.action == "none"]
    acting = [g for g in seen if g is not None and g.action == "raise"]
    assert len(logging) == 2 and all(g.signal_rows == 3 for g in logging)  # no fit pass: the two base runs
    assert len(acting) == 2
    assert all((g.heads, g.bias, g.threshold, g.signal_rows) == (((1, 0),), 4.0, 0.9, 3) for g in acting)
    assert "raised 2" in out.out  # a bias of 4 puts every request over 0.9 at the prefill
    fit["heads"] = [[7, 0]]
    (tmp_path / "other.json").write_text(json.dumps(fit))
    seen.clear()
    with pytest.raises(ConfigError, match=r"outside this model's 2 layers"):
        bench_guard(**args, policies=(), fit_file=str(tmp_path / "other.json"))
    assert seen == []
    with pytest.raises(ConfigError, match="leave out --save-fit"):
        bench_guard(**args, fit_file=str(tmp_path / "fit.json"), save_fit=str(tmp_path / "x.json"))


def test_a_recall_arm_runs_beside_raise_at_the_same_added_memory(model):
    """``recall:0.2@0`` and ``raise:0.4@0`` at base 0.2 each add about 20 % of the prompt to every
    request at the prefill: the recall arm's open window counts in its mean KV, which lands near the
    raise's and above the base's; both act on every request and are named in the tables."""
    from commands.benchmarks.guard import guard_policies

    policies = guard_policies(["raise:0.4@0", "recall:0.2@0", "recall:4@1"])
    assert policies == (("raise", 0.4, 0.0, 0.0), ("recall", 0.2, 0.0, 0.0), ("recall", 4, 0.0, 1.0))
    tok = _tokenizer()
    report = evaluate(model, tok, _tasks(1), [], ratio=0.2, budgets=(0.2,), policies=policies, ks=(4,), threshold=0.5)
    rows = {r["policy"]: r for r in report.table}
    base, raised = rows["fixed 20%"], rows["guard raise->40% @0.000"]
    recalled, closed = rows["guard recall+20% @0.000"], rows["guard recall+4 @1.000"]
    assert raised["raised"] == recalled["raised"] == 4 and closed["raised"] == 0
    assert base["memory"] < recalled["memory"] and abs(recalled["memory"] - raised["memory"]) < 0.05
    assert closed["memory"] == base["memory"]  # a window never opened holds nothing
    text = format_report(report)
    assert "guard recall+20% @0.000: recovered" in text or "guard recall+20% @0.000: no H2O failure" in text


def test_cli_refuses_a_bad_recall_arm_in_one_line(capsys):
    from commands.cli import main

    assert main(["bench", "guard", "--guard-policies", "recall:0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'recall:0': the recall window must be a whole number of slots" in err
