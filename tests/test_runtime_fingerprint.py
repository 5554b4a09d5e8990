"""A model's fingerprint covers every byte of its weights (DESIGN.md §5.1), read once: a later use
of an unchanged file takes its digest from the cache; the older, partial fingerprint is still
computed as it was, to check runs recorded with it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from h2o_lens.fingerprint import DIGEST_STATS, FULL, digest_cache_path, file_digest, is_partial, model_fingerprint

MIB = 2**20


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("H2O_LENS_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def folder_with_weights(path: Path, size: int = 5 * MIB) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "transformers_version": "5.0"}))
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(bytes(range(256)) * (size // 256))
    return path


def change_middle(path: Path, *, keep_times: bool = False) -> None:
    """Overwrite 64 KiB in the middle of a file (size, first and last MiB unchanged)."""
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(st.st_size // 2)
        fh.write(b"\xff" * 65536)
    if keep_times:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_change_in_the_middle_of_a_weight_file_changes_the_fingerprint(tmp_path, home):
    a = folder_with_weights(tmp_path / "a")
    full, partial = model_fingerprint(a), model_fingerprint(a, partial=True)
    assert full["weights_read"] == FULL and not is_partial(full) and is_partial(partial)
    change_middle(a / "model.safetensors")
    assert model_fingerprint(a)["digest"] != full["digest"]
    assert model_fingerprint(a)["weights"] != full["weights"]
    assert model_fingerprint(a, partial=True) == partial  # what the older fingerprint could not see


def test_the_partial_fingerprint_is_the_one_runs_were_recorded_with(tmp_path, home):
    """The older computation, written out: size and SHA-256 of the first and last MiB per file."""
    a = folder_with_weights(tmp_path / "a")
    data = (a / "model.safetensors").read_bytes()

    def h(b: bytes) -> str:
        return hashlib.sha256(b).hexdigest()[:16]

    tok = hashlib.sha256(b"tokenizer.json\0{}\0").hexdigest()[:16]
    old = {"config": h(json.dumps({"model_type": "llama"}).encode()), "tokenizer": tok}
    old["weights"] = [["model.safetensors", len(data), h(data[:MIB] + data[-MIB:])]]
    old["digest"] = h(json.dumps(old, sort_keys=True).encode())
    assert model_fingerprint(a, partial=True) == {"path": str(a.resolve()), **old}


def test_a_second_use_reads_the_cache_not_the_file(tmp_path, home):
    path = folder_with_weights(tmp_path / "a") / "model.safetensors"
    before = dict(DIGEST_STATS)
    first = file_digest(path)
    assert first == hashlib.sha256(path.read_bytes()).hexdigest()
    assert DIGEST_STATS["files_read"] == before["files_read"] + 1
    assert DIGEST_STATS["bytes_read"] == before["bytes_read"] + path.stat().st_size
    assert file_digest(path) == first and model_fingerprint(path.parent)["weights"][0][2] == first[:16]
    assert DIGEST_STATS["files_read"] == before["files_read"] + 1  # neither call read the file again
    assert DIGEST_STATS["cache_hits"] == before["cache_hits"] + 2
    assert str(path.resolve()) in json.loads(digest_cache_path().read_text())["files"]
    assert digest_cache_path().parent == home


def test_a_write_that_puts_the_modification_time_back_is_still_seen(tmp_path, home):
    path = folder_with_weights(tmp_path / "a") / "model.safetensors"
    first = file_digest(path)
    change_middle(path, keep_times=True)  # same size, same mtime, same inode: the change time moved
    reads = DIGEST_STATS["files_read"]
    assert file_digest(path) != first and DIGEST_STATS["files_read"] == reads + 1


def test_an_unwritable_cache_only_costs_a_read(tmp_path, monkeypatch):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    monkeypatch.setenv("H2O_LENS_HOME", str(blocked))  # its digests.json cannot be made
    path = folder_with_weights(tmp_path / "a") / "model.safetensors"
    assert file_digest(path) == file_digest(path) == hashlib.sha256(path.read_bytes()).hexdigest()
