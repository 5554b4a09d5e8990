"""Every bad argument is one line, ``h2o-lens: error: ...`` (exit 2), before a model loads.

Sizes below 1, counts beyond what the machine can start, contexts past the model's positions or
past the machine's memory (estimated from the model's config alone), shares outside their range.
The model folders here hold a ``config.json`` and no weights: a command that loaded the model
before refusing would fail with "cannot load model" instead of naming the option.
"""

from __future__ import annotations

import json
import os

import pytest

from commands.cli import main


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 300,
    "max_position_embeddings": 8192,
}


def _config_only(path, **over) -> str:
    """A model folder with only a config: its shape and window can be read, it cannot be loaded."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, **over}))
    return str(path)


def _refused(capsys, argv: list[str], *says: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("h2o-lens: error: ") and err.count("\n") == 1, err
    assert "cannot load model" not in err and "Traceback" not in err, err
    for text in says:
        assert text in err, err
    return err


@pytest.mark.parametrize("runs", ["0", "-1"])
def test_bench_runs_refuses_no_runs(capsys, runs):
    _refused(capsys, ["bench", "runs", "--runs", runs, "--no-browser"], "bench runs: argument --runs")


def test_bench_decode_refuses_a_context_past_the_models_positions(capsys, tmp_path):
    model = _config_only(tmp_path / "m")
    _refused(
        capsys,
        ["bench", "decode", "--model", model, "--contexts", "3000000"],
        "--contexts 3000000 needs 3,000,027 positions",
        "past the model's 8,192 (config.max_position_embeddings)",
    )
    # the decode steps count too: 8192 + 3 + 3 rounds x 8 steps is past 8192
    _refused(capsys, ["bench", "decode", "--model", model, "--contexts", "8192"], "give at most 8165")


def test_bench_decode_refuses_a_context_past_the_machines_memory(capsys, tmp_path):
    """10^10 tokens: 80 GB of token ids alone, before any cache; estimated from the config and
    refused, never allocated."""
    model = _config_only(tmp_path / "m", max_position_embeddings=2**40)
    err = _refused(capsys, ["bench", "decode", "--model", model, "--contexts", "10000000000", "--batch", "1"])
    assert "--contexts 10000000000 needs at least" in err and "GiB this machine has available" in err, err


def test_bench_decode_guard_checks_its_contexts_too(capsys, tmp_path):
    model = _config_only(tmp_path / "m")
    _refused(capsys, ["bench", "decode", "--guard", "--model", model, "--contexts", "3000000"], "past the model's")


def test_the_decode_bytes_estimate_counts_ids_both_caches_and_the_hidden_states():
    from transformers import LlamaConfig

    from commands.benchmarks.decode import decode_bytes

    config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")})
    n, b = 1000, 2
    kv = 2 * 2 * 2 * 16 * n * b * 4  # K and V, layers, KV heads, head_dim, tokens, rows, float32
    assert decode_bytes(config, n, b, keep=0.5) == 8 * n * b + int(kv * 1.5) + 64 * n * b * 4


@pytest.mark.parametrize("keep", ["0", "5", "nan", "1"])
def test_bench_decode_refuses_a_keep_outside_0_1(capsys, keep):
    _refused(capsys, ["bench", "decode", "--model", "/nonexistent", "--keep", keep], "bench decode: argument --keep")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "record", "--rounds", "0"], "bench record: argument --rounds"),
        (["bench", "record", "--context", "1"], "bench record: argument --context"),
        (["bench", "sweep", "--count", "0"], "bench sweep: argument --count"),
        (["bench", "sweep", "--batch-size", "0"], "bench sweep: argument --batch-size"),
        (["bench", "sweep", "--keep", "1.5"], "bench sweep: argument --keep"),
        (["bench", "guard", "--count", "0"], "bench guard: argument --count"),
        (["bench", "guard", "--heads", "-1"], "bench guard: argument --heads"),
        (["bench", "press", "--contexts", "0"], "bench press: argument --contexts"),
        (["bench", "explain", "--rounds", "0"], "bench explain: argument --rounds"),
        (["bench", "explain", "--keep", "nan"], "bench explain: argument --keep"),
        (["generate", "--max-new-tokens", "0"], "generate: argument --max-new-tokens"),
        (["generate", "--top-p", "2"], "generate: argument --top-p"),
        (["generate", "--temperature", "-1"], "generate: argument --temperature"),
        (["tasks", "export", "builtin:needle", "--length", "0"], "tasks export: argument --length"),
    ],
)
def test_sizes_below_1_and_shares_out_of_range_are_refused_before_the_model_loads(capsys, argv, says):
    _refused(capsys, [*argv, "--model", "/nonexistent"], says)


def test_bench_workers_beyond_the_machines_cores_are_refused(capsys):
    many = str(cpu_count() + 1)
    _refused(
        capsys,
        ["bench", "sweep", "--executor", "ray", "--workers", many, "--model", "/nonexistent"],
        f"argument --workers: {many} workers on a machine of {cpu_count()} CPU core",
    )


def test_bench_explain_refuses_a_length_past_the_window_before_the_model_loads(capsys, tmp_path):
    model = _config_only(tmp_path / "m", max_position_embeddings=2048)
    _refused(
        capsys,
        ["bench", "explain", "--model", model, "--length", "3000"],
        "bench explain: --length 3000 is past the model's window of 2,048 positions",
    )


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--threads", "100000"], "sql: argument --threads: 100000 threads on a machine of"),
        (["--threads", "0"], "sql: argument --threads: expected a whole number >= 1"),
        (["--max-rows", "-1"], "sql: argument --max-rows"),
        (["--timeout", "-1"], "sql: argument --timeout"),
    ],
)
def test_sql_refuses_what_the_machine_cannot_run(capsys, tmp_path, argv, says):
    _refused(capsys, ["sql", str(tmp_path), "SELECT 1", *argv], says)


@pytest.mark.parametrize("rows", ["-1", "0"])
def test_runs_refuses_a_max_rows_below_1(capsys, tmp_path, rows):
    _refused(capsys, ["runs", str(tmp_path), "--max-rows", rows], "runs: argument --max-rows")


def test_other_commands_numbers(capsys, tmp_path):
    _refused(capsys, ["app", str(tmp_path), "--port", "70000"], "app: argument --port")
    _refused(capsys, ["check", "nothere", "--tolerance", "-1"], "check: argument --tolerance")


def test_sweep_refuses_a_page_size_below_1(capsys, tmp_path):
    out = tmp_path / "out"
    _refused(
        capsys, ["sweep", "--model", "/nonexistent", "--out", str(out), "--page-size", "0"], "argument --page-size"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--ratios", "0"], "--ratios: '0' is out of range; give keep ratios in (0, 1]"),
        (["--ratios", "0.2,1.5"], "--ratios: '1.5' is out of range"),
        (["--ratios", "nan"], "--ratios: 'nan' is out of range"),
        (["--ratios", "inf"], "--ratios: 'inf' is out of range"),
        (["--ratios", "-1"], "--ratios: '-1' is out of range"),
        (["--slots", "0"], "--slots: '0' is out of range; give whole slot counts >= 1"),
        (["--slots", "-1"], "--slots: '-1' is out of range"),
        (["--batch-size", "0"], "argument --batch-size: expected a whole number >= 1, got 0"),
        (["--batch-size", "-1"], "argument --batch-size"),
        (["--executor", "ray", "--workers", "0"], "argument --workers: expected a whole number >= 1, got 0"),
        (["--executor", "ray", "--workers", "1.5"], "argument --workers"),
        (["--executor", "ray", "--retries", "-1"], "argument --retries"),
        (["--executor", "ray", "--gpus-per-worker", "nan"], "argument --gpus-per-worker"),
    ],
)
def test_sweep_refuses_sizes_below_1_and_ratios_outside_0_1(capsys, tmp_path, argv, says):
    out = tmp_path / "out"
    _refused(capsys, ["sweep", "--model", "/nonexistent", "--out", str(out), *argv], says)
    assert not out.exists()


def test_sweep_workers_beyond_this_machines_cores_are_refused_for_a_local_cluster_only(capsys, tmp_path):
    many = str(cpu_count() + 1)
    argv = ["sweep", "--model", "/nonexistent", "--out", str(tmp_path / "out"), "--executor", "ray"]
    _refused(
        capsys,
        [*argv, "--workers", many],
        f"--workers {many}: the local Ray cluster runs on this machine of {cpu_count()} CPU core",
    )
    main([*argv, "--workers", many, "--address", "head:6379"])  # a remote cluster's count is its own
    assert "--workers" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["explain", "somerun", "--request", "-1"], "explain: argument --request"),
        (["explain", "somerun", "--request", "0.5"], "explain: argument --request"),
        (["explain", "somerun", "--resolution", "nan"], "explain: argument --resolution"),
        (["explain", "somerun", "--resolution", "-1"], "explain: argument --resolution"),
        (["explain", "somerun", "--resolution", "2"], "explain: argument --resolution"),
        (["replay", "somerun", "--tolerance", "nan"], "replay: argument --tolerance"),
        (["replay", "somerun", "--tolerance", "-1"], "replay: argument --tolerance"),
        (["replay", "somerun", "--tolerance", "inf"], "replay: argument --tolerance"),
        (["check", "somerun", "--tolerance", "nan"], "check: argument --tolerance"),
    ],
)
def test_a_runs_numbers_are_refused_before_the_run_is_looked_up(capsys, tmp_path, argv, says):
    _refused(capsys, [*argv, "--root", str(tmp_path)], says)


@pytest.mark.parametrize("command", ["record", "generate"])
@pytest.mark.parametrize(
    "option, value",
    [
        ("--heavy", "-1"),
        ("--recent", "1.5"),
        ("--ratio", "nan"),
        ("--ratio", "0"),
        ("--ratio", "1e12"),
        ("--sink", "-1"),
    ],
)
def test_policy_numbers_name_their_option(capsys, tmp_path, command, option, value):
    _refused(capsys, [command, "--model", "/nonexistent", option, value], f"{command}: argument {option}")


def test_bench_runs_refuses_a_model_that_is_not_there(capsys):
    _refused(capsys, ["bench", "runs", "--runs", "5", "--model", "/nonexistent"], "bench runs: --model '/nonexistent'")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--count", "0"], "argument --count"),
        (["--keep", "0"], "argument --keep"),
        (["--max-runs", "-1"], "argument --max-runs"),
        (["--tasks", "needle,nope"], "expected long families"),
    ],
)
def test_bench_culprits_refuses_bad_sizes_and_families(capsys, tmp_path, argv, says):
    _refused(capsys, ["bench", "culprits", "--model", _config_only(tmp_path / "m"), *argv], "bench culprits", says)


@pytest.mark.parametrize("command", ["record", "generate"])
def test_a_generation_length_past_the_models_positions_is_refused_before_the_model_loads(capsys, tmp_path, command):
    model = _config_only(tmp_path / "m", max_position_embeddings=2048)
    out = ["--out", str(tmp_path / "runs")] if command == "record" else []
    _refused(
        capsys,
        [command, "--model", model, "--max-new-tokens", str(10**12), "--prompt", "hi", *out],
        "--max-new-tokens 1,000,000,000,000 is past the model's 2,048 positions",
        "give at most 2,047",
    )
    assert not (tmp_path / "runs").exists()
