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

import contextlib
import os
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from .cold_config import PAGE

__all__ = ["ColdStore"]


class _Made:
    """What a disk store made on disk: its current file and, when no folder was given, its own
    temporary folder. Kept apart from the store, so that the finalizer which removes them (when the
    store is dropped unclosed, or at the interpreter's exit) holds no reference to the store."""

    def __init__(self) -> None:
        self.file: Path | None = None
        self.folder: str | None = None

    def remove(self) -> None:
        if self.file is not None:
            self.file.unlink(missing_ok=True)
            self.file = None
        if self.folder is not None:  # made by mkdtemp for this store alone; kept if anything else is in it
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)
            self.folder = None


class ColdStore:
    """One layer's cold entries ``(b, Hs, N)``; ``kind`` ``cpu`` or ``disk`` (files under ``directory``);
    ``summaries``: keep the page summaries (only the ``pages`` selection reads them)."""

    def __init__(
        self,
        kind: str,
        b: int,
        hs: int,
        d: int,
        dtype: torch.dtype,
        *,
        pin: bool,
        directory,
        name: str,
        summaries: bool = True,
    ):
        self.summaries = summaries
        self.kind, self.b, self.hs, self.d, self.dtype = kind, b, hs, d, dtype
        self.pin = pin and kind == "cpu"
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.acc = torch.promote_types(dtype, torch.float32)  # what scores and page bounds are kept in
        self.directory, self.name, self.generation = directory, name, 0
        self.temporary = directory is None  # a folder of its own, removed with the store
        self.made = _Made()
        weakref.finalize(self, _Made.remove, self.made)
        self.count = torch.zeros(b, hs, dtype=torch.int64)
        self.most = self.least = self.total = 0  # the largest, smallest and summed count (host ints)
        self.positions = torch.full((b, hs, 0), -1, dtype=torch.int64)
        self.scores = torch.zeros(b, hs, 0, dtype=self.acc)
        self.low = torch.zeros(b, hs, 0, d, dtype=self.acc)  # (b, Hs, pages, d)
        self.high = torch.zeros(b, hs, 0, d, dtype=self.acc)
        self.kv = self._alloc(0)  # (2, b, Hs, N, d): the keys, then the values, each contiguous
        self._rows: torch.Tensor | None = None
        self._page_rows: torch.Tensor | None = None
        self.written = self.read_bytes = 0

    # -- storage -------------------------------------------------------------------------------
    def _alloc(self, n: int) -> torch.Tensor:
        shape = (2, self.b, self.hs, n, self.d)
        if n == 0:
            return torch.zeros(shape, dtype=self.dtype)
        if self.kind == "cpu":
            t = torch.zeros(shape, dtype=self.dtype)
            return t.pin_memory() if self.pin else t
        if self.temporary and self.made.folder is None:
            self.directory = self.made.folder = tempfile.mkdtemp(prefix="h2o-lens-cold-")
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
        old, self.made.file = self.made.file, path
        if old is not None:
            old.unlink(missing_ok=True)
        return torch.from_numpy(mm).view(self.dtype).view(shape)

    def _grow(self, need: int) -> None:
        have = self.kv.shape[3]
        if need <= have:
            return
        n = max(need + need // 8, 2 * have, PAGE)  # room for the decode steps' victims past a prefill
        n = -(-n // PAGE) * PAGE
        kv = self._alloc(n)
        kv[:, :, :, :have] = self.kv
        self.kv = kv
        pad = n - have
        self.positions = torch.cat([self.positions, self.positions.new_full((self.b, self.hs, pad), -1)], 2)
        self.scores = torch.cat([self.scores, self.scores.new_zeros(self.b, self.hs, pad)], 2)
        pages = n // PAGE - self.low.shape[2]
        inf = float("inf")  # an empty page: the min and max over no key, which the first key replaces
        self.low = torch.cat([self.low, self.low.new_full((self.b, self.hs, pages, self.d), inf)], 2)
        self.high = torch.cat([self.high, self.high.new_full((self.b, self.hs, pages, self.d), -inf)], 2)
        self._rows = self._page_rows = None

    @property
    def file(self) -> Path | None:
        """A disk store's current file (None for a ``cpu`` store or an empty one)."""
        return self.made.file

    def close(self) -> None:
        """Drop the entries, a disk store's file, and the temporary folder it made."""
        self.kv = self._alloc(0)
        self.made.remove()

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
        if position.shape[-1] == 1:
            return self._append_one(key, value, score, position)
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
        self.kv[0, bi, hi, ti] = key.detach().to("cpu", self.dtype)[bi, hi, ni]
        self.kv[1, bi, hi, ti] = value.detach().to("cpu", self.dtype)[bi, hi, ni]
        self.positions[bi, hi, ti] = position[bi, hi, ni]
        self.scores[bi, hi, ti] = score.detach().to("cpu", self.acc)[bi, hi, ni]
        self.count += added
        self._counted()
        self.written += total * self.entry_bytes
        if self.summaries:
            self._summarise(first // PAGE, -(-self.most // PAGE))
        return total

    def append_fused(self, result, key: torch.Tensor, value: torch.Tensor, width: int) -> int:
        """:meth:`append` of a decode step's victims in one compiled call (the fused CPU step's
        caches, DESIGN.md §2.8): ``result`` the step's :class:`~h2o_lens.ops.DecodeResult` (its
        slot, candidate set and overwritten K/V), ``key, value (b, Hs, d)`` its new token's (the
        victim where the slot is ``width`` or past it). Returns the number appended."""
        from .kernels.cpu import cold_append_cpu

        self._grow(self.most + 1)
        total = cold_append_cpu(self, result, key, value, width)
        if total == self.b * self.hs:
            self.most, self.least, self.total = self.most + 1, self.least + 1, self.total + total
        elif total:
            self._counted()
        self.written += total * self.entry_bytes
        return total

    def count_read(self, keys: int, entries: int) -> None:
        """Count ``keys`` keys scored and ``entries`` keys and values brought back as bytes read."""
        self.read_bytes += keys * self.d * self.itemsize + entries * self.entry_bytes

    def _counted(self) -> None:
        self.most, self.least, self.total = int(self.count.max()), int(self.count.min()), int(self.count.sum())

    def _flat_rows(self) -> torch.Tensor:
        """``(b·Hs,)`` each row's first record in the flattened ``(b·Hs·N)`` record index (cached
        until the store grows or its rows move)."""
        if self._rows is None:
            self._rows = torch.arange(self.b * self.hs) * self.kv.shape[3]
        return self._rows

    def _append_one(self, key: torch.Tensor, value: torch.Tensor, score: torch.Tensor, position: torch.Tensor) -> int:
        """:meth:`append` of at most one entry per row and KV set (a decode step's victim): every
        record at ``count`` is written (a row with no entry writes position -1 there, which the next
        entry overwrites) and the page summaries of the written records are updated in place."""
        ok = position[..., 0] >= 0  # (b, Hs)
        total = int(ok.sum())
        if not total:
            return 0
        every = total == ok.numel()  # else a row without an entry keeps its count and summary
        self._grow(self.most + 1)
        at = self.count.flatten()
        flat = self._flat_rows() + at
        k = key.detach().to("cpu", self.dtype).reshape(-1, self.d)
        self.kv[0].view(-1, self.d).index_copy_(0, flat, k)
        self.kv[1].view(-1, self.d).index_copy_(0, flat, value.detach().to("cpu", self.dtype).reshape(-1, self.d))
        self.positions.view(-1).index_copy_(0, flat, position.flatten())
        self.scores.view(-1).index_copy_(0, flat, score.detach().to("cpu", self.acc).flatten())
        if self.summaries:  # an empty page holds (+inf, -inf): the first key's min and max is the key
            page = self._flat_rows() // PAGE + at // PAGE
            ka = k.to(self.acc)
            for bound, pick in ((self.low, torch.minimum), (self.high, torch.maximum)):
                flat_bound = bound.view(-1, self.d)
                was = flat_bound.index_select(0, page)
                now = pick(was, ka)
                flat_bound.index_copy_(0, page, now if every else torch.where(ok.flatten()[:, None], now, was))
        if every:
            self.count += 1
            self.most, self.least, self.total = self.most + 1, self.least + 1, self.total + total
        else:
            self.count += ok
            self._counted()
        self.written += total * self.entry_bytes
        return total

    def _summarise(self, p0: int, p1: int) -> None:
        """Recompute the page summaries of pages ``p0 … p1 - 1`` from the keys just written."""
        keys = self.kv[0, :, :, p0 * PAGE : p1 * PAGE].to(self.acc).unflatten(2, (p1 - p0, PAGE))
        ok = self.valid[:, :, p0 * PAGE : p1 * PAGE].unflatten(2, (p1 - p0, PAGE))[..., None]
        inf = torch.tensor(float("inf"), dtype=self.acc)
        low = torch.where(ok, keys, inf).amin(3)
        high = torch.where(ok, keys, -inf).amax(3)
        self.low[:, :, p0:p1] = low  # a page with no record: (+inf, -inf), what its first key replaces
        self.high[:, :, p0:p1] = high

    def write_scores(self, index: torch.Tensor, score: torch.Tensor, every: bool = False) -> None:
        """Write ``score (b, Hs, m)`` back to the records ``index (b, Hs, m)`` (-1: none; the
        records given are distinct; ``every``: the caller knows none is -1)."""
        score = score.detach().to("cpu", self.acc)
        if every or bool((index >= 0).all()):
            self.scores.scatter_(2, index, score)
            return
        ok = index >= 0
        bi, hi, mi = ok.nonzero(as_tuple=True)
        self.scores[bi, hi, index[bi, hi, mi]] = score[bi, hi, mi]

    # -- reading -------------------------------------------------------------------------------
    def keys(self) -> torch.Tensor:
        """Keys ``(b, Hs, n, d)`` of the first ``n`` records (``n`` the largest count); the valid
        ones count as bytes read."""
        self.read_bytes += self.total * self.d * self.itemsize
        return self.kv[0, :, :, : self.most]

    def page_keys(self, pages: torch.Tensor, records: int | None = None) -> torch.Tensor:
        """Keys ``(b, Hs, m·PAGE, d)`` of the whole pages ``pages (b, Hs, m)`` (each one of the
        row's pages), each page's records in order; the valid records of the pages count as bytes
        read (``records``: their number, when the caller has counted them)."""
        b, hs, m = pages.shape
        if records is None:
            held = (self.count[..., None] - pages * PAGE).clamp(0, PAGE)  # valid records of each page
            records = int(held.sum())
        self.read_bytes += records * self.d * self.itemsize
        if self._page_rows is None:
            self._page_rows = (self._flat_rows() // PAGE).view(b, hs, 1)
        flat = (pages + self._page_rows).flatten()
        out = self.kv[0].view(-1, PAGE * self.d).index_select(0, flat)
        return out.view(b, hs, m * PAGE, self.d)

    def entries_at(self, rows: torch.Tensor, records: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Key and value ``(m, d)``, score and position ``(m,)`` of the records ``records (m,)`` of
        the rows ``rows (m,)`` (a row: ``batch · Hs + KV set``); the K/V count as bytes read."""
        flat = self._flat_rows()[rows] + records
        self.read_bytes += int(flat.numel()) * self.entry_bytes
        return (
            self.kv[0].view(-1, self.d).index_select(0, flat),
            self.kv[1].view(-1, self.d).index_select(0, flat),
            self.scores.view(-1).index_select(0, flat),
            self.positions.view(-1).index_select(0, flat),
        )

    # -- rows ----------------------------------------------------------------------------------
    def move_rows(self, move) -> None:
        """Apply a row reorder, selection or expansion to every per-row tensor (a disk store
        rewrites its file)."""
        keys, values = move(self.kv[0]), move(self.kv[1])
        self.b, self._rows, self._page_rows = keys.shape[0], None, None
        self.count, self.positions, self.scores = (
            move(t).contiguous() for t in (self.count, self.positions, self.scores)
        )
        self.low, self.high = move(self.low).contiguous(), move(self.high).contiguous()  # a fused call reads them flat
        self.kv = self._alloc(keys.shape[2])
        self.kv[0], self.kv[1] = keys, values
        self._counted()


def disk_bytes(path: str | os.PathLike) -> int:
    """Bytes the files of a disk store's folder hold (what a run's manifest reports)."""
    return sum(p.stat().st_size for p in Path(path).glob("*.bin"))
