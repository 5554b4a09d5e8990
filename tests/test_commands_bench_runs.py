"""``h2o-lens bench runs``: the model fingerprint's cost on one model folder, not loaded (first
use reading every byte, later uses from the digest cache, the older partial one), measured with a
digest cache of its own so that the user's is left as it is; no timing asserted."""

from __future__ import annotations

import re

import pytest
from tiny import save_tiny

from commands.benchmarks.record import replay_verdict
from commands.benchmarks.runs import fingerprint_cost, model_folder
from h2o_lens.errors import ConfigError
from h2o_lens.fingerprint import DIGEST_STATS, model_fingerprint


def test_the_fingerprints_cost_reads_every_byte_once_and_leaves_the_users_digest_cache(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("H2O_LENS_HOME", str(home))
    folder = save_tiny(tmp_path / "m")
    model_fingerprint(folder)  # the user's cache now holds the folder's digests
    cache = home / "digests.json"
    before = cache.read_bytes()
    read = DIGEST_STATS["bytes_read"]
    line = fingerprint_cost(model_folder(str(folder)))
    weights = sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".safetensors")
    assert DIGEST_STATS["bytes_read"] - read == weights  # a true first use: no cached digest was taken
    assert cache.read_bytes() == before  # the user's cache is as it was
    got = re.search(r"first use ([\d.]+) s .*later uses ([\d.]+) ms \(median of 5.*partial one ([\d.]+) ms", line)
    assert got and line.startswith(f"model fingerprint of {folder.resolve()}"), line
    assert "targets: first use <= 2 s, later uses <= 50 ms" in line


def test_a_model_that_is_not_a_folder_is_refused_and_an_unconverted_default_is_skipped(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="holds no config.json"):
        model_folder(str(tmp_path))
    monkeypatch.setenv("H2O_LENS_HOME", str(tmp_path / "empty"))
    assert model_folder(None) is None
    assert fingerprint_cost(None).startswith("model fingerprint: skipped, the default model is not converted")


def test_a_failed_replay_blames_neither_the_code_nor_the_model_alone():
    assert replay_verdict({"implementation_ok": True}) == replay_verdict({}) == ""
    said = replay_verdict({"implementation_ok": False})
    assert "the model, the code or the log differ" in said and "IMPLEMENTATION" not in said
