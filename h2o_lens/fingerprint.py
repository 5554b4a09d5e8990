"""The identity of a model folder: a digest of every byte of its weights, its tokenizer and config
(DESIGN.md §5.1).

Each weight file is read whole once (SHA-256 in 8 MiB reads) and its digest kept in a small JSON
cache, ``digests.json`` next to the converted models (``$H2O_LENS_HOME``, else
``~/.cache/h2o_lens``), keyed by the file's absolute path and checked against its size,
modification and change times and inode: a later use of an unchanged file reads only the cache.
A write to the file, even one that puts its modification time back, changes its change time,
and the file is read again.

Runs recorded before the whole files were read carry the partial fingerprint (each weight
file's size and first and last MiB); ``model_fingerprint(path, partial=True)`` computes it so
that such a run is still checked against the model in use, as far as it can be.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

__all__ = ["model_fingerprint", "file_digest", "digest_cache_path", "is_partial", "DIGEST_STATS"]

#: config keys that say how a file was written, not what the model is
_VOLATILE_CONFIG = ("transformers_version", "dtype", "torch_dtype")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
)
_EDGE = 2**20  # bytes of each weight file's start and end that the partial fingerprint reads
_READ = 8 * 2**20  # bytes per read of a whole-file digest
#: the ``weights`` entry of a full fingerprint: what its per-file hashes cover
FULL = "sha256 of every byte"
_CACHE_FORMAT = 1

#: whole-file digests computed (``files_read``, ``bytes_read``) and taken from the cache
#: (``cache_hits``) by this process
DIGEST_STATS = {"files_read": 0, "bytes_read": 0, "cache_hits": 0}


def digest_cache_path() -> pathlib.Path:
    """``$H2O_LENS_HOME/digests.json``, else ``~/.cache/h2o_lens/digests.json``."""
    home = os.environ.get("H2O_LENS_HOME") or pathlib.Path.home() / ".cache" / "h2o_lens"
    return pathlib.Path(home).expanduser() / "digests.json"


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _read_cache(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT or not isinstance(data.get("files"), dict):
        return {}
    return data["files"]


def _write_cache(path: pathlib.Path, name: str, entry: dict[str, Any]) -> None:
    """Add ``entry`` to the cache (read again first: another process may have added its own),
    dropping the entries of files that are gone; a cache that cannot be written (a read-only
    home) only costs a read next time."""
    files = {k: v for k, v in _read_cache(path).items() if os.path.exists(k)}
    files[name] = entry
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": _CACHE_FORMAT, "files": files}), encoding="utf-8")
        os.replace(tmp, path)
    with contextlib.suppress(OSError):
        tmp.unlink()


def file_digest(path: str | os.PathLike[str], *, cache: bool = True) -> str:
    """SHA-256 of every byte of ``path`` (64 hex digits), from the cache when the file is unchanged
    (same size, modification and change times, inode and device), else read in 8 MiB blocks."""
    path = pathlib.Path(path).resolve()
    st = os.stat(path)
    where = digest_cache_path()
    if cache:
        hit = _read_cache(where).get(str(path))
        if isinstance(hit, dict) and hit.get("stat") == _stat_key(st) and isinstance(hit.get("sha256"), str):
            DIGEST_STATS["cache_hits"] += 1
            return hit["sha256"]
    h = hashlib.sha256()
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
            DIGEST_STATS["bytes_read"] += n
    DIGEST_STATS["files_read"] += 1
    digest = h.hexdigest()
    if cache and _stat_key(os.stat(path)) == _stat_key(st):  # not written to while it was read
        _write_cache(where, str(path), {"stat": _stat_key(st), "sha256": digest})
    return digest


def _edges(path: pathlib.Path, size: int) -> bytes:
    """The first and last MiB of a file (the whole file when it is at most 2 MiB)."""
    with open(path, "rb") as fh:
        edges = fh.read(_EDGE)
        if size > 2 * _EDGE:
            fh.seek(size - _EDGE)
        edges += fh.read()[-_EDGE:] if size > _EDGE else b""
    return edges


def is_partial(fingerprint: Any) -> bool:
    """Whether a recorded fingerprint is the older, partial one (weights read at their edges only)."""
    return isinstance(fingerprint, Mapping) and fingerprint.get("weights_read") != FULL


def model_fingerprint(name_or_path: str | os.PathLike[str] | None, *, partial: bool = False) -> dict[str, Any] | None:
    """The identity of a model folder (DESIGN.md §5.1).

    Parameters
    ----------
    name_or_path : a local model folder (relative to the working directory) or a Hugging Face
        id already in the local cache; what ``model.config._name_or_path`` holds
    partial : the fingerprint runs were recorded with before the whole weight files were read
        (each file's size and the SHA-256 of its first and last MiB), to check such a run

    Returns
    -------
    dict or None
        ``path`` (the folder, absolute), ``config`` (SHA-256 of ``config.json`` without the keys
        that say how it was written: ``transformers_version``, ``dtype``, private ``_`` keys),
        ``tokenizer`` (SHA-256 of the tokenizer's vocabulary files, None when it has none),
        ``weights`` (per weight file: name, size in bytes and the SHA-256 of every byte,
        :func:`file_digest`), ``weights_read`` (:data:`FULL`; absent from a partial fingerprint)
        and ``digest`` (SHA-256 of the others, what runs compare). Hashes are cut to 16 hex
        digits. None when no such folder is found (a model built in memory).
    """
    if not name_or_path:
        return None
    folder = pathlib.Path(name_or_path).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = pathlib.Path(snapshot_download(str(name_or_path), local_files_only=True))
        except Exception:  # noqa: BLE001 - not a cached id either: nothing to fingerprint
            return None
    folder = folder.resolve()
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        names = sorted(os.listdir(folder))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None

    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()[:16]

    kept = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG and not k.startswith("_")}
    tokenizer = hashlib.sha256()
    found = False
    weights = []
    for name in names:
        path = folder / name
        if name in _TOKENIZER_FILES and path.is_file():
            tokenizer.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
            found = True
        elif name.endswith(_WEIGHT_SUFFIXES) and path.is_file():
            size = path.stat().st_size
            weights.append([name, size, digest(_edges(path, size)) if partial else file_digest(path)[:16]])
    out: dict[str, Any] = {
        "config": digest(json.dumps(kept, sort_keys=True).encode()),
        "tokenizer": tokenizer.hexdigest()[:16] if found else None,
        "weights": weights,
    }
    if not partial:
        out["weights_read"] = FULL
    out["digest"] = digest(json.dumps(out, sort_keys=True).encode())
    return {"path": str(folder), **out}


def fingerprint_timings(folder: str | os.PathLike[str], *, repeats: int = 5) -> dict[str, float]:
    """Seconds of :func:`model_fingerprint` on ``folder``, measured side by side in one process:
    ``first`` (no cached digest, the weight files dropped from the page cache where the system
    allows: a read from disk), ``later`` (the median of ``repeats`` uses with the digests cached),
    ``partial`` (the median of the older, partial fingerprint) and ``bytes`` (of weights read)."""
    import statistics
    import time

    folder = pathlib.Path(folder).resolve()
    weights = [p for p in sorted(folder.iterdir()) if p.name.endswith(_WEIGHT_SUFFIXES) and p.is_file()]
    for path in weights:
        with open(path, "rb") as fh:  # a first use reads from the disk, not the page cache
            with contextlib.suppress(AttributeError, OSError):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    cache = digest_cache_path()
    files = {k: v for k, v in _read_cache(cache).items() if pathlib.Path(k).parent != folder}
    with contextlib.suppress(OSError):  # forget this folder's digests
        cache.write_text(json.dumps({"format": _CACHE_FORMAT, "files": files}), encoding="utf-8")
    t0 = time.perf_counter()
    model_fingerprint(folder)
    first = time.perf_counter() - t0

    def median(**kw: Any) -> float:
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            model_fingerprint(folder, **kw)
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    return {
        "first": first,
        "later": median(),
        "partial": median(partial=True),
        "bytes": float(sum(p.stat().st_size for p in weights)),
    }


if __name__ == "__main__":  # python -m h2o_lens.fingerprint MODEL_FOLDER: its fingerprint's timings
    import sys

    if len(sys.argv) != 2 or not pathlib.Path(sys.argv[1]).is_dir():
        sys.exit("usage: python -m h2o_lens.fingerprint MODEL_FOLDER (e.g. the converted default model's folder)")
    where = pathlib.Path(sys.argv[1])
    got = fingerprint_timings(where)
    print(
        f"model fingerprint of {where} ({got['bytes'] / 2**20:.0f} MiB of weights): first use {got['first']:.2f} s, "
        f"later uses {got['later'] * 1e3:.1f} ms (median of 5), the older partial one {got['partial'] * 1e3:.1f} ms"
    )
