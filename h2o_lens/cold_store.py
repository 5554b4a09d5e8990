"""Where the cold tier keeps evicted K/V: host tensors or a memory-mapped file (DESIGN.md §2.13).

A :class:`ColdStore` holds one layer's cold entries, per batch row and KV set, in the order they
were evicted (append only: an entry recalled into the window keeps its record; only its score is
written back when it leaves the window). Keys and values live in the store (``cpu``: host
tensors, pinned when the layer is on a GPU; ``disk``: a memory-mapped file); the positions,
scores and page summaries (element-wise min/max of the keys of each :data:`PAGE` records, built
as the keys are written) live in host memory. The store counts the bytes of K/V it writes and
reads.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from .cold_config import PAGE

__all__ = ["ColdStore"]


class ColdStore:
    """One layer's cold entries ``(b, Hs, N)``; ``kind`` ``cpu`` or ``disk`` (files under ``directory``)."""

    def __init__(self, kind: str, b: int, hs: int, d: int, dtype: torch.dtype, *, pin: bool, directory, name: str):
        self.kind, self.b, self.hs, self.d, self.dtype = kind, b, hs, d, dtype
        self.pin = pin and kind == "cpu"
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.acc = torch.promote_types(dtype, torch.float32)  # what scores and page bounds are kept in
        self.directory, self.name, self.generation = directory, name, 0
        self.file: Path | None = None
        self.count = torch.zeros(b, hs, dtype=torch.int64)
        self.positions = torch.full((b, hs, 0), -1, dtype=torch.int64)
        self.scores = torch.zeros(b, hs, 0, dtype=self.acc)
        self.low = torch.zeros(b, hs, 0, d, dtype=self.acc)  # (b, Hs, pages, d)
        self.high = torch.zeros(b, hs, 0, d, dtype=self.acc)
        self.kv = self._alloc(0)  # (b, Hs, N, 2, d): key, value
        self.written = self.read_bytes = 0

    # -- storage -------------------------------------------------------------------------------
    def _alloc(self, n: int) -> torch.Tensor:
        shape = (self.b, self.hs, n, 2, self.d)
        if n == 0:
            return torch.zeros(shape, dtype=self.dtype)
        if self.kind == "cpu":
            t = torch.zeros(shape, dtype=self.dtype)
            return t.pin_memory() if self.pin else t
        if self.directory is None:
            self.directory = tempfile.mkdtemp(prefix="h2o-lens-cold-")
        raw = self.b * self.hs * n * 2 * self.d * self.itemsize
        path, made = Path(self.directory), False
        try:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
            while True:  # a new file of its own: one that exists (a user's, another store's) is never opened
                self.generation += 1
                path = Path(self.directory) / f"{self.name}-{self.generation}.bin"
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                    made = True
                    break
                except FileExistsError:
                    continue
            try:  # every block now: a full disk is an OSError here, never a SIGBUS at a write into the map
                os.posix_fallocate(fd, 0, raw)
            finally:
                os.close(fd)
            mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(raw,))  # the file just made
        except OSError as exc:
            if made:  # only the file this call created: never a user's (the directory given may be a file)
                path.unlink(missing_ok=True)
            # the system's error, naming the file: a recorder turns it into its storage error (DESIGN.md §2.13)
            raise OSError(exc.errno, f"the cold tier's disk store: {exc.strerror or exc}", str(path)) from exc
        old, self.file = self.file, path
        if old is not None:
            old.unlink(missing_ok=True)
        return torch.from_numpy(mm).view(self.dtype).view(shape)

    def _grow(self, need: int) -> None:
        have = self.kv.shape[2]
        if need <= have:
            return
        n = max(need, 2 * have, PAGE)
        n = -(-n // PAGE) * PAGE
        kv = self._alloc(n)
        kv[:, :, :have] = self.kv
        self.kv = kv
        pad = n - have
        self.positions = torch.cat([self.positions, self.positions.new_full((self.b, self.hs, pad), -1)], 2)
        self.scores = torch.cat([self.scores, self.scores.new_zeros(self.b, self.hs, pad)], 2)
        pages = n // PAGE - self.low.shape[2]
        self.low = torch.cat([self.low, self.low.new_zeros(self.b, self.hs, pages, self.d)], 2)
        self.high = torch.cat([self.high, self.high.new_zeros(self.b, self.hs, pages, self.d)], 2)

    def close(self) -> None:
        """Drop the entries (and a disk store's file)."""
        self.kv = self._alloc(0)
        if self.file is not None:
            self.file.unlink(missing_ok=True)
            self.file = None

    @property
    def valid(self) -> torch.Tensor:
        """``(b, Hs, N)`` True for records that hold an entry."""
        return self.positions >= 0

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry's key and value."""
        return 2 * self.d * self.itemsize

    # -- writing -------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor, score: torch.Tensor, position: torch.Tensor) -> int:
        """Append the entries whose ``position (b, Hs, n)`` is >= 0, in their order along n, with
        their ``key, value (b, Hs, n, d)`` and ``score``. Returns the number appended."""
        position = position.to("cpu", torch.int64)
        ok = position >= 0
        added = ok.sum(-1)  # (b, Hs)
        total = int(added.sum())
        if not total:
            return 0
        first = int(self.count.min())
        self._grow(int((self.count + added).max()))
        target = (self.count[..., None] + ok.cumsum(-1) - 1).clamp(min=0)  # (b, Hs, n)
        bi, hi, ni = ok.nonzero(as_tuple=True)
        ti = target[bi, hi, ni]
        self.kv[bi, hi, ti, 0] = key.detach().to("cpu", self.dtype)[bi, hi, ni]
        self.kv[bi, hi, ti, 1] = value.detach().to("cpu", self.dtype)[bi, hi, ni]
        self.positions[bi, hi, ti] = position[bi, hi, ni]
        self.scores[bi, hi, ti] = score.detach().to("cpu", self.acc)[bi, hi, ni]
        self.count += added
        self.written += total * self.entry_bytes
        self._summarise(first // PAGE, -(-int(self.count.max()) // PAGE))
        return total

    def _summarise(self, p0: int, p1: int) -> None:
        """Recompute the page summaries of pages ``p0 … p1 - 1`` from the keys just written."""
        keys = self.kv[:, :, p0 * PAGE : p1 * PAGE, 0].to(self.acc).unflatten(2, (p1 - p0, PAGE))
        ok = self.valid[:, :, p0 * PAGE : p1 * PAGE].unflatten(2, (p1 - p0, PAGE))[..., None]
        inf = torch.tensor(float("inf"), dtype=self.acc)
        low = torch.where(ok, keys, inf).amin(3)
        high = torch.where(ok, keys, -inf).amax(3)
        live = ok.any(3)
        self.low[:, :, p0:p1] = torch.where(live, low, 0.0)
        self.high[:, :, p0:p1] = torch.where(live, high, 0.0)

    def write_scores(self, index: torch.Tensor, score: torch.Tensor) -> None:
        """Write ``score (b, Hs, m)`` back to the records ``index (b, Hs, m)`` (-1: none)."""
        ok = index >= 0
        bi, hi, mi = ok.nonzero(as_tuple=True)
        self.scores[bi, hi, index[bi, hi, mi]] = score.detach().to("cpu", self.acc)[bi, hi, mi]

    # -- reading -------------------------------------------------------------------------------
    def keys(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Keys of the records ``index (b, Hs, m)`` (-1: a zero key), or of every record; the
        valid ones count as bytes read."""
        if index is None:
            self.read_bytes += int(self.count.sum()) * self.d * self.itemsize
            return self.kv[:, :, :, 0]
        self.read_bytes += int((index >= 0).sum()) * self.d * self.itemsize
        return self._gather(index, 0)

    def entries(self, index: torch.Tensor, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value ``(b, Hs, m, d)`` of the records ``index (b, Hs, m)`` (-1: zeros); the
        ones marked ``fresh`` count as bytes read (an entry already in the window is not read)."""
        self.read_bytes += int(((index >= 0) & fresh).sum()) * self.entry_bytes
        return self._gather(index, 0), self._gather(index, 1)

    def _gather(self, index: torch.Tensor, part: int) -> torch.Tensor:
        idx = index.clamp(min=0)
        bi = torch.arange(self.b)[:, None, None]
        hi = torch.arange(self.hs)[None, :, None]
        out = self.kv[bi, hi, idx, part]
        return torch.where((index >= 0)[..., None], out, torch.zeros((), dtype=out.dtype))

    # -- rows ----------------------------------------------------------------------------------
    def move_rows(self, move) -> None:
        """Apply a row reorder, selection or expansion to every per-row tensor (a disk store
        rewrites its file)."""
        kv = move(self.kv)
        self.b = kv.shape[0]
        self.count, self.positions, self.scores = move(self.count), move(self.positions), move(self.scores)
        self.low, self.high = move(self.low), move(self.high)
        if self.kind == "disk":
            fresh = self._alloc(kv.shape[2])
            fresh[:] = kv
            kv = fresh
        self.kv = kv


def disk_bytes(path: str | os.PathLike) -> int:
    """Bytes the files of a disk store's folder hold (what a run's manifest reports)."""
    return sum(p.stat().st_size for p in Path(path).glob("*.bin"))
