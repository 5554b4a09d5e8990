"""A guard fit file (``bench guard --save-fit``, read by ``record --guard-fit`` and ``bench guard
--fit``) is checked before a model loads: finite weights and bias, a threshold in [0, 1], heads that
are pairs of whole numbers inside the model, at most its layers x KV sets of them, and the fit's
model the one in use unless ``--allow-other-model``; each refusal one line, nothing written."""

from __future__ import annotations

import json

import pytest
from tiny import save_tiny

from commands.cli import main
from h2o_lens.errors import ConfigError
from h2o_lens.guard import SIGNALS

PROMPT = "Read the notes. The lab code is 4419. The printer is out of toner. What is the lab code?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    base = tmp_path_factory.mktemp("fit_model")
    save_tiny(base / "m", seed=0)  # 2 layers, 2 KV heads
    return base


def _fit(path, **over) -> str:
    fit = {
        "weights": [0.0] * len(SIGNALS),
        "bias": 3.0,
        "heads": [[1, 0]],
        "threshold": 0.9,
        "signal_rows": 4,
        "model": "./m",
    }
    fit.update(over)
    path.write_text(json.dumps({k: v for k, v in fit.items() if v is not ...}))
    return str(path)


def _record(folder, tmp_path, monkeypatch, fit: str, *extra: str):
    monkeypatch.chdir(folder)
    out = tmp_path / "runs"
    argv = ["record", "--model", "./m", "--out", str(out), "--prompt", PROMPT, "--raw", "--max-new-tokens", "3"]
    code = main([*argv, "--heavy", "4", "--recent", "4", "--guard", "raise:1.0", "--guard-fit", fit, *extra])
    return code, out


CASES = [
    ({"weights": [float("nan")] * len(SIGNALS)}, "the weights and bias must be finite numbers"),
    ({"bias": float("inf")}, "the weights and bias must be finite numbers"),
    ({"threshold": 7}, "the threshold is a risk in [0, 1], got 7"),
    ({"heads": [[1.5, 0]]}, "heads are [layer, KV set] pairs of whole numbers >= 0, got [1.5, 0]"),
    ({"heads": [[1, -1]]}, "pairs of whole numbers >= 0, got [1, -1]"),
    ({"heads": [[i, 0] for i in range(200_000)]}, "200,000 heads, more than this model's 2 layers x 2 KV sets = 4"),
    ({"heads": [[7, 0]]}, "head [7, 0] is outside this model's 2 layers and 2 KV sets"),
    ({"heads": [[1, 0], [1, 0]]}, "a head is listed twice"),
    ({"signal_rows": 0}, "signal_rows is a whole number >= 1, got 0"),
    ({"model": "/elsewhere/other-model"}, "the fit was made for '/elsewhere/other-model', not for the model in use"),
    ({"model": ...}, "the fit names no model"),
]


@pytest.mark.parametrize("over, says", CASES, ids=[says.split(",")[0][:40] for _, says in CASES])
def test_record_refuses_a_bad_fit_in_one_line_and_writes_nothing(folder, tmp_path, monkeypatch, capsys, over, says):
    code, out = _record(folder, tmp_path, monkeypatch, _fit(tmp_path / "fit.json", **over))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("h2o-lens: error: --guard-fit ") and err.count("\n") == 1 and says in err, err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.compat
def test_a_fit_of_another_model_is_used_with_allow_other_model(folder, tmp_path, monkeypatch, capsys):
    fit = _fit(tmp_path / "fit.json", model="/elsewhere/other-model")
    code, out = _record(folder, tmp_path, monkeypatch, fit, "--allow-other-model")
    assert code == 0, capsys.readouterr().err
    assert len(list(out.iterdir())) == 1


def test_the_same_model_spelled_another_way_is_the_same_model(folder, tmp_path, monkeypatch):
    from commands.benchmarks.guard_fit import model_key, read_fit

    monkeypatch.chdir(folder)
    fit = _fit(tmp_path / "fit.json", model=str(folder / "m"))
    assert read_fit(fit, model="./m")["heads"] == ((1, 0),)
    assert model_key(None) == model_key("default") == model_key("SmolLM2-135M-Instruct")


@pytest.mark.parametrize("over, says", CASES[:3] + CASES[9:10])
def test_bench_guard_refuses_a_bad_fit_before_the_model_loads(tmp_path, over, says):
    from commands.benchmarks.guard import bench_guard

    fit = _fit(tmp_path / "fit.json", **{"model": "/nonexistent/m", **over})
    with pytest.raises(ConfigError) as err:
        bench_guard(model_name="/nonexistent/m", tasks="builtin:demo", fit_file=fit, policies=())
    assert says in str(err.value)
    assert "cannot load model" not in str(err.value)


def test_bench_guard_allow_other_model_passes_the_model_check(tmp_path, capsys):
    fit = _fit(tmp_path / "fit.json", model="/elsewhere/other-model")
    argv = ["bench", "guard", "--model", "/nonexistent/m", "--fit", fit, "--guard-policies", "none"]
    assert main(argv) == 2
    assert "not for the model in use" in capsys.readouterr().err
    assert main([*argv, "--allow-other-model"]) == 2
    assert "cannot load model '/nonexistent/m'" in capsys.readouterr().err  # refused no earlier than the load
