"""The run writer: one run folder, its manifest and its segments, as a context manager.

>>> with RunWriter(root, config={"policy": "h2o", "heavy": 64, "recent": 64},
...                model="HuggingFaceTB/SmolLM2-135M-Instruct") as run:   # doctest: +SKIP
...     run.append("evictions", {"request": 0, "step": steps, ...})
...     run.update(prompt_len=512, new_tokens=128)

On a normal exit the manifest becomes ``complete``; on an exception the
buffered rows are still flushed and the manifest becomes ``failed`` with the
error message and type (the exception propagates). A killed process leaves
``running``, which readers report as ``interrupted``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from .contract import model_tag
from .errors import RunExistsError
from .manifest import (
    MANIFEST_NAME,
    config_dict,
    iso_utc,
    new_manifest,
    new_run_id,
    utc_now,
    validate_run_id,
    write_manifest,
)
from .schema import TABLE_NAMES as _RECORDED
from .segments import DEFAULT_ROWS_PER_SEGMENT, SegmentWriter

__all__ = ["RunWriter"]


class RunWriter:
    """Writes one run: ``<root>/<run_id>/manifest.json`` plus Parquet segments.

    Parameters
    ----------
    root : path-like
        Runs root; created if missing.
    run_id : str, optional
        Folder name; default ``new_run_id(policy)``. Numeric ids are refused.
    config : mapping or dataclass, optional
        Run configuration (policy, heavy, recent, gqa, sink, seed, backend, ...),
        stored in the manifest and in every file's metadata.
    model : str or mapping, optional
        Model id, or a dict with at least ``name`` (plus layers, heads, ...).
    rows_per_segment : int
        Buffered rows of one table that trigger a segment.
    fsync : bool
        Make segments and manifest durable before they become visible.
    **info
        Other fields of the ``runs`` view: ``name``, ``source_run``,
        ``prompt_len``, ``new_tokens``, ``requests``, ``max_logit_diff``.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        run_id: str | None = None,
        *,
        config: Any = None,
        model: Any = None,
        rows_per_segment: int = DEFAULT_ROWS_PER_SEGMENT,
        fsync: bool = True,
        **info: Any,
    ) -> None:
        self.config = config_dict(config)
        self.run_id = (
            validate_run_id(run_id) if run_id is not None else new_run_id(str(self.config.get("policy", "run")))
        )
        self.root = Path(root)
        self.run_dir = self.root / self.run_id
        self._model = model
        self._info = dict(info)
        self._rows_per_segment = rows_per_segment
        self._fsync = fsync
        self.manifest: dict[str, Any] | None = None
        self.segments: SegmentWriter | None = None
        self.status: str | None = None

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> RunWriter:
        """Create the run folder and write the ``running`` manifest."""
        if self.manifest is not None:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.run_dir.mkdir()
        except FileExistsError:
            if (self.run_dir / MANIFEST_NAME).exists() or any(self.run_dir.glob("*.parquet")):
                raise RunExistsError(
                    f"run folder {self.run_dir} already holds a run; pick another run_id "
                    "or leave run_id unset for a fresh one"
                ) from None
        self.manifest = new_manifest(self.run_id, config=self.config, model=self._model, **self._info)
        self.segments = SegmentWriter(
            self.run_dir,
            run_id=self.run_id,
            config=self.config,
            rows_per_segment=self._rows_per_segment,
            fsync=self._fsync,
            model=model_tag(self.manifest.get("model")),
        )
        write_manifest(self.run_dir, self.manifest)
        self.status = "running"
        return self

    def append(self, table: str, columns: Mapping[str, Any] | pa.Table) -> None:
        """Buffer rows of ``table`` (see :meth:`SegmentWriter.append`)."""
        self._started().append(table, columns)

    def write_table(self, table: str, data: pa.Table) -> None:
        """Write ``data`` (exactly the declared schema) as one segment now, unbuffered."""
        self._started().write_table(table, data)

    def flush(self) -> None:
        """Write every buffered row as segments now."""
        self._started().flush()

    def update(self, **info: Any) -> None:
        """Set fields of the ``runs`` view (``prompt_len``, ``new_tokens``, ...) for the final manifest."""
        self._info.update(info)
        if self.manifest is not None:
            self.manifest.update(info)

    def close(self, status: str = "complete", error: BaseException | str | None = None) -> None:
        """Flush and rewrite the manifest as ``complete`` or ``failed``.

        The manifest lists every segment written with its rows (``segments``) and the rows of
        each table (``rows``): a segment it does not list is not the run's (DESIGN.md §5.1). A
        flush that fails (a full disk) makes the run ``failed`` with that error, its temporary
        files removed, and raises it; closing as ``failed`` with an ``error`` raises nothing
        from the flush, the given error is the one that matters.
        """
        if status not in ("complete", "failed"):
            raise ValueError(f"status must be 'complete' or 'failed', got {status!r}")
        segments = self._started()
        flush_error = None
        try:
            segments.close()
        except Exception as exc:  # a failed flush turns the run into a failed one
            flush_error = exc
            segments.closed = True
            if status == "failed" and error is not None:
                flush_error = None  # the caller's error is the cause; the flush fails for the same reason
            status, error = "failed", error or exc
        assert self.manifest is not None
        self.manifest["status"] = status
        self.manifest["finished_at"] = iso_utc(utc_now())
        if error is not None:
            self.manifest["error"] = str(error) or repr(error)
            self.manifest["error_type"] = type(error).__name__ if isinstance(error, BaseException) else "Error"
        self.manifest["rows"] = {**dict.fromkeys(_RECORDED, 0), **segments.rows_written}
        self.manifest["segments"] = dict(segments.files)
        self.status = status
        write_manifest(self.run_dir, self.manifest, in_place_if_full=status == "failed")
        if flush_error is not None:
            raise flush_error

    def _started(self) -> SegmentWriter:
        if self.segments is None:
            raise RuntimeError(f"run {self.run_id} is not started; use `with RunWriter(...)` or call start()")
        if self.status not in (None, "running"):
            raise RuntimeError(f"run {self.run_id} is already {self.status}")
        return self.segments

    def __enter__(self) -> RunWriter:
        return self.start()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if self.status != "running":
            return
        if exc is None:
            self.close("complete")
        else:
            try:
                self.close("failed", exc)
            except Exception:
                pass  # the original exception matters more
