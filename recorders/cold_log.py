"""The cold tier's rows of a recorded run: ``recalls``, and its numbers for the manifest (DESIGN.md §2.13, §5.3)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from h2o_lens.cold import ColdExtension, cold_summary
from runlog.errors import StorageError, storage_error
from runlog.recall_check import COLD_FOLDER

__all__ = ["cold_of", "window_start", "write_recall_rows", "cold_manifest", "COLD_FOLDER", "store_in_run", "drop_store"]


def store_in_run(config: Any, run_dir: Any) -> Any:
    """``config`` with a ``disk`` cold store given no directory written under the run's folder
    (:data:`COLD_FOLDER`): a run killed mid-write leaves its files with the run, never a stray
    temporary folder (DESIGN.md §2.13). Any other config is returned as it is."""
    tier = getattr(config, "cold", None)
    if tier is None or tier.store != "disk" or tier.directory is not None:
        return config
    return dataclasses.replace(config, cold=dataclasses.replace(tier, directory=str(Path(run_dir) / COLD_FOLDER)))


def drop_store(config: Any, run_dir: Any) -> None:
    """Remove the cold store :func:`store_in_run` put under the run's folder (the run has ended)."""
    if store_in_run(config, run_dir) is not config:
        shutil.rmtree(Path(run_dir) / COLD_FOLDER, ignore_errors=True)


def storage_failure(exc: BaseException) -> BaseException:
    """A cold store's failed write (an ``OSError`` naming its file) as the log's one-line
    :class:`~runlog.errors.StorageError` (a full disk says the space free); anything else as it is."""
    if isinstance(exc, OSError) and not isinstance(exc, StorageError) and "cold tier" in str(exc.strerror or ""):
        return storage_error(exc.filename or "the cold store", exc)
    return exc


def cold_of(cache: Any) -> ColdExtension | None:
    """The cache's cold tier, or None."""
    if cache is None:
        return None
    return next((e for e in cache.extensions if isinstance(e, ColdExtension)), None)


def window_start(cache: Any) -> int | None:
    """The first slot of the recall window (the same in every layer), or None without a cold tier
    (or before its prefill)."""
    ext = cold_of(cache)
    if ext is None or not ext.layers:
        return None
    return next(iter(ext.layers.values())).start


def write_recall_rows(writer: Any, cache: Any, ids: list[int], last_step: dict[int, int], gqa_none: bool) -> int:
    """Append the window occupants of every refill logged since the last call; returns the rows.

    ``ids`` the request of each batch row; ``last_step`` maps a request to its last decode step
    that made a token: refills of a row after its EOS are padding and are left out."""
    ext = cold_of(cache)
    if ext is None:
        return 0
    done = getattr(ext, "written", {})
    tier = ext.tier_of(cache).store
    group = cache.group
    parts: dict[str, list[np.ndarray]] = {}
    for layer, st in sorted(ext.layers.items()):
        entry = st.store.entry_bytes if st.store is not None else 0
        for step, pos, score, fresh in st.log[done.get(layer, 0) :]:
            b, hs, r = pos.shape
            req = torch.arange(b)[:, None, None].expand(b, hs, r)
            head = torch.arange(hs)[None, :, None].expand(b, hs, r)
            sel = pos >= 0
            last = torch.tensor([last_step.get(q, -1) for q in ids], dtype=torch.int64)
            sel &= (step.to(torch.int64) <= last)[:, None, None]
            n = int(sel.sum())
            if not n:
                continue
            h = head[sel].numpy().astype(np.int16)
            cols = {
                "request": np.asarray(ids, np.int32)[req[sel].numpy()],
                "step": step.to(torch.int64)[req[sel]].numpy(),
                "layer": np.full(n, layer, np.int16),
                "kv_head": h // group if gqa_none and group > 1 else h,
                "q_head": h if gqa_none and group > 1 else None,
                "position": pos[sel].numpy().astype(np.int64),
                "score": score[sel].float().numpy(),
                "bytes_read": np.where(fresh[sel].numpy(), entry, 0).astype(np.int64),
            }
            for k, v in cols.items():
                if v is not None:
                    parts.setdefault(k, []).append(v)
        done[layer] = len(st.log)
    ext.written = done
    if not parts:
        return 0
    cols = {k: np.concatenate(v) for k, v in parts.items()}
    cols["tier"] = tier
    writer.append("recalls", cols)
    return len(cols["request"])


def cold_manifest(cache: Any) -> dict[str, Any] | None:
    """The manifest's ``cold`` object: the tier's settings and what it moved (bytes, entries)."""
    numbers = cold_summary(cache) if cache is not None else None
    if numbers is None:
        return None
    ext = cold_of(cache)
    tier = ext.tier_of(cache)
    gated = {"gated": True} if ext.gated else {}  # the guard's recall: windows opened per request (DESIGN.md §18.2)
    return {
        **gated,
        "store": tier.store,
        "recall": ext.width if ext.gated else tier.recall,  # gated: the widest window opened (0: none)
        "every": tier.every,
        "select": tier.select,
        "scan": tier.pages_scanned,
        "evicted": numbers["evicted"],
        "recalled": numbers["recalled"],
        "bytes_written": numbers["written"],
        "bytes_read": numbers["read"],
    }
