"""The model that made a run (DESIGN.md §5.1): its absolute folder and fingerprint are recorded,
and ``replay``, ``explain`` and ``check`` refuse another model in one line, writing nothing.

Two tiny random llamas of the same shape are saved as ``./m`` in two folders, as a user's model
would be; the run is recorded with ``--model ./m`` in the first and read from the second.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tiny import save_tiny

from commands.cli import main
from h2o_lens.models import model_fingerprint
from runlog import read_manifest
from runlog import recorded_model as recorded_model_module
from runlog.manifest import write_manifest


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    a, b = base / "a", base / "b"
    save_tiny(a / "m", seed=0)
    save_tiny(b / "m", seed=1)  # same shape, other weights
    return a, b


def _record(folders, tmp_path, monkeypatch, *, replay: bool = False) -> Path:
    a, _ = folders
    monkeypatch.chdir(a)
    out = tmp_path / "runs"
    args = ["record", "--model", "./m", "--out", str(out), "--max-new-tokens", "5", "--heavy", "4", "--recent", "4"]
    assert main([*args, "--replay"] if replay else args) == 0
    (run_dir,) = out.iterdir()
    return run_dir


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line.strip() for line in err.splitlines() if line.strip().startswith("h2o-lens: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_relative_model_is_recorded_as_its_folder_with_a_fingerprint(folders, tmp_path, monkeypatch):
    a, _ = folders
    run_dir = _record(folders, tmp_path, monkeypatch)
    model = read_manifest(run_dir)["model"]
    assert model["path"] == str((a / "m").resolve())
    assert model["fingerprint"]["digest"] == model_fingerprint(a / "m")["digest"]
    assert model["fingerprint"]["weights"][0][0] == "model.safetensors"


def test_a_replay_from_another_folder_uses_the_recorded_model(folders, tmp_path, monkeypatch, capsys):
    run_dir = _record(folders, tmp_path, monkeypatch)
    monkeypatch.chdir(folders[1])  # its ./m is another model
    assert main(["replay", str(run_dir)]) == 0  # the recorded folder's model: the masked replay reproduces the run
    assert read_manifest(run_dir)["replay"]["implementation_ok"] is True


@pytest.mark.parametrize("command", ["replay", "explain", "check"])
def test_another_model_is_refused_in_one_line_naming_both_and_nothing_is_written(
    folders, tmp_path, monkeypatch, capsys, command
):
    a, b = folders
    run_dir = _record(folders, tmp_path, monkeypatch, replay=True)
    before = _digest(run_dir.parent)
    monkeypatch.chdir(b)
    extra = ["--request", "0"] if command == "explain" else []
    capsys.readouterr()
    assert main([command, str(run_dir), "--model", "./m", *extra]) == 2
    line = _one_error(capsys.readouterr().err)
    assert f"({(a / 'm').resolve()}, fingerprint" in line and f"({(b / 'm').resolve()}, fingerprint" in line
    assert "weights differ" in line and "--allow-other-model" in line
    assert _digest(run_dir.parent) == before  # no file written, none changed


def test_a_model_folder_moved_away_is_not_replaced_by_the_one_found_there(folders, tmp_path, monkeypatch, capsys):
    run_dir = _record(folders, tmp_path, monkeypatch)
    manifest = read_manifest(run_dir)
    manifest["model"]["path"] = str(tmp_path / "gone" / "m")  # the recorded folder no longer exists
    write_manifest(run_dir, manifest)
    before = _digest(run_dir)
    monkeypatch.chdir(folders[1])
    assert main(["replay", str(run_dir)]) == 2  # its name ./m finds another model here: refused
    assert "was recorded with the model ./m" in _one_error(capsys.readouterr().err)
    assert _digest(run_dir) == before


def test_an_explicit_override_runs_and_is_logged(folders, tmp_path, monkeypatch):
    _, b = folders
    run_dir = _record(folders, tmp_path, monkeypatch)
    monkeypatch.chdir(b)
    main(["replay", str(run_dir), "--model", "./m", "--allow-other-model"])
    manifest = read_manifest(run_dir)
    (override,) = manifest["model_overrides"]
    assert override["command"] == "replay" and override["used"]["path"] == str((b / "m").resolve())
    assert override["recorded"]["digest"] == manifest["model"]["fingerprint"]["digest"] != override["used"]["digest"]


def test_a_manifest_without_a_fingerprint_still_works_and_says_so_once(folders, tmp_path, monkeypatch, capsys):
    run_dir = _record(folders, tmp_path, monkeypatch)
    manifest = read_manifest(run_dir)
    del manifest["model"]["fingerprint"]
    manifest["model"]["path"] = "./m"  # as an earlier version stored it
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(recorded_model_module, "_said_unchecked", False)
    capsys.readouterr()
    for _ in range(2):
        assert main(["replay", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert err.count("recorded before model fingerprints were kept") == 1, err


@pytest.fixture(scope="module")
def changed(tmp_path_factory):
    """A tiny model with weight files past 2 MiB, and a copy whose weights differ only in a block in
    the middle of the file: the same size, the same first and last MiB."""
    import shutil

    from tiny import byte_tokenizer, tiny_model

    base = tmp_path_factory.mktemp("changed")
    tok = byte_tokenizer()
    model = tiny_model("llama", vocab=len(tok), head_dim=64)  # two layers, 5 MiB of weights
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 0, 1, 2
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    model.save_pretrained(base / "a" / "m")
    tok.save_pretrained(base / "a" / "m")
    shutil.copytree(base / "a" / "m", base / "b" / "m")
    weights = base / "b" / "m" / "model.safetensors"
    size = weights.stat().st_size
    assert size > 3 * 2**20
    with open(weights, "r+b") as fh:  # 256 KiB of float32 0.5 where the file's middle tensors were
        fh.seek((size // 2) & ~7)
        fh.write(b"\x00\x00\x00\x3f" * 65536)
    edges = [model_fingerprint(base / x / "m", partial=True)["digest"] for x in ("a", "b")]
    assert edges[0] == edges[1]  # the older, partial fingerprint cannot tell them apart
    return base / "a" / "m", base / "b" / "m"


def _record_at(model: Path, out: Path) -> Path:
    args = ["record", "--model", str(model), "--out", str(out), "--max-new-tokens", "5", "--heavy", "4"]
    assert main([*args, "--recent", "4", "--replay"]) == 0
    (run_dir,) = out.iterdir()
    return run_dir


@pytest.mark.parametrize("command", ["replay", "explain"])
def test_a_model_changed_in_the_middle_of_its_weights_is_refused(changed, tmp_path, capsys, command):
    a, b = changed
    run_dir = _record_at(a, tmp_path / "runs")
    before = _digest(run_dir.parent)
    capsys.readouterr()
    extra = ["--request", "0"] if command == "explain" else []
    assert main([command, str(run_dir), "--model", str(b), *extra]) == 2
    assert "weights differ" in _one_error(capsys.readouterr().err)
    assert _digest(run_dir.parent) == before


def _recorded_before(model: Path, out: Path, monkeypatch) -> Path:
    """A run recorded as the older recorder did, with the partial fingerprint (manifest and
    segments)."""
    import functools

    from h2o_lens import models

    with monkeypatch.context() as m:
        m.setattr(models, "model_fingerprint", functools.partial(models.model_fingerprint, partial=True))
        args = ["record", "--model", str(model), "--out", str(out), "--max-new-tokens", "5"]
        assert main([*args, "--heavy", "4", "--recent", "4"]) == 0
    (run_dir,) = out.iterdir()
    assert "weights_read" not in read_manifest(run_dir)["model"]["fingerprint"]
    return run_dir


def test_a_run_with_the_older_partial_fingerprint_replays_with_a_note(changed, tmp_path, capsys, monkeypatch):
    a, _ = changed
    run_dir = _recorded_before(a, tmp_path / "runs", monkeypatch)
    capsys.readouterr()
    assert main(["replay", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert err.count("older, partial model fingerprint") == 1 and "h2o-lens: error" not in err, err
    assert read_manifest(run_dir)["replay"]["implementation_ok"] is True


def test_a_replay_that_fails_its_check_keeps_the_earlier_good_one(changed, tmp_path, capsys, monkeypatch):
    """A run with the partial fingerprint cannot tell the changed copy: its replay runs, fails the
    check, says what may differ without blaming the code, exits non-zero and writes nothing."""
    a, b = changed
    run_dir = _recorded_before(a, tmp_path / "runs", monkeypatch)
    assert main(["replay", str(run_dir)]) == 0
    before = _digest(run_dir)
    assert read_manifest(run_dir)["replay"]["implementation_ok"] is True
    capsys.readouterr()
    assert main(["replay", str(run_dir), "--model", str(b)]) == 3
    out, err = capsys.readouterr()
    assert "IMPLEMENTATION ERROR" not in out + err
    line = _one_error(err)
    assert "the model, the code or the log differ" in line and "the earlier replay, which passed, was kept" in line
    assert _digest(run_dir) == before
