"""What explaining a request can reuse from earlier runs, without a model (DESIGN.md §6.10).

* A full-cache run of the same prompt. The ``full`` counterfactual of a request is the full cache
  on its prompt tokens, greedy, with its ``max_new_tokens``. A sweep has usually recorded exactly
  that already (its full-cache cell of the request's batch; the demo, its full-cache run), so
  :func:`find_full_run` looks for it under the root, and :func:`copy_request` writes that request
  alone as the counterfactual's run folder (request 0, the source named in the manifest) instead
  of generating it again. A run matches when it is complete, keeps the full cache, was greedy with
  the same ``max_new_tokens``, on the same model (name, class and size) in the same dtype, and
  holds a request of exactly these prompt tokens; the first match in folder-name order is taken.
  A model without a name is never matched: nothing tells two of them apart.
* An earlier counterfactual, unless it is an oracle run judged teacher-forced
  (:func:`judged_teacher_forced`): earlier versions fed the oracle the full run's tokens and
  passed it only when every one was its top-1; it is judged by its own answer now, so such a
  run is recorded again, and read as not judged meanwhile.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from h2o_lens import policies

from .errors import RecorderError
from .manifest import MANIFEST_NAME, read_manifest
from .run import RunWriter
from .store import load_run, request_order

__all__ = ["find_full_run", "copy_request", "judged_teacher_forced"]

_TABLES = ("tokens", "run_logits", "requests")


def judged_teacher_forced(manifest: Mapping[str, Any]) -> bool:
    """An oracle run of an earlier version: recorded teacher-forced on the full run's tokens and
    judged by whether every one was its top-1, not by its own answer."""
    return bool(manifest.get("teacher_forced")) and isinstance(manifest.get("oracle"), dict)


def _model_key(manifest: Mapping[str, Any]) -> tuple[Any, ...]:
    """The model of a manifest as far as it can be told apart: name, dtype, class and size."""
    model = manifest.get("model")
    if isinstance(model, dict):
        return tuple(model.get(k) for k in ("name", "dtype", "architecture", "num_parameters"))
    return model, None, None, None


def _candidate(manifest: Mapping[str, Any], model: tuple[Any, ...], max_new_tokens: int, prompt_len: int) -> bool:
    """Whether a manifest can be a full-cache run of the prompt (the tokens decide)."""
    decoding = manifest.get("decoding")
    if (
        manifest.get("status") != "complete"
        or manifest.get("policy") != policies.FULL_CACHE
        or not isinstance(decoding, dict)
    ):
        return False
    if decoding.get("do_sample") or decoding.get("max_new_tokens") != max_new_tokens:
        return False
    return _model_key(manifest) == model and (manifest.get("prompt_len") or 0) >= prompt_len


def _request_of(run_dir: Path, prompt: Sequence[int]) -> int | None:
    """The request of a run whose prompt is ``prompt`` token for token (None: none is)."""
    tok = load_run(run_dir, tables=("tokens",))["tokens"].to_pydict()
    req = np.asarray(tok["request"])
    is_prompt = np.asarray(tok["is_prompt"], dtype=bool)
    ids = np.asarray(tok["token_id"])
    want = np.asarray(prompt)
    for r in np.unique(req[is_prompt]):
        order = request_order(tok, r)
        order = order[is_prompt[order]]  # the prompt comes first in position order
        if len(order) == len(want) and np.array_equal(ids[order], want):
            return int(r)
    return None


def find_full_run(
    root: str | os.PathLike,
    prompt: Sequence[int],
    *,
    model: Mapping[str, Any] | str | None,
    max_new_tokens: int,
    skip: Sequence[str] = (),
) -> tuple[Path, int] | None:
    """A complete greedy full-cache run under ``root`` with a request of these prompt tokens.

    ``model``: the manifest ``model`` of the run being explained (its name and dtype must match);
    ``skip``: run ids not to consider. Returns (its folder, the request) or None.
    """
    root = Path(root)
    key = _model_key({"model": model})
    if not root.is_dir() or key[0] is None:
        return None
    for run_dir in sorted(root.iterdir()):
        if run_dir.name in skip or not (run_dir / MANIFEST_NAME).is_file():
            continue
        try:
            manifest = read_manifest(run_dir)
            if not _candidate(manifest, key, int(max_new_tokens), len(prompt)):
                continue
            request = _request_of(run_dir, prompt)
        except (RecorderError, OSError, ValueError):
            continue  # a damaged or foreign folder is not a match
        if request is not None:
            return run_dir, request
    return None


def copy_request(
    src: str | os.PathLike,
    request: int,
    out: str | os.PathLike,
    run_id: str,
    *,
    info: Mapping[str, Any],
    correct: bool | None,
) -> Path:
    """Write ``request`` of the run ``src`` as request 0 of a new complete run ``out/run_id``.

    Its ``tokens``, ``run_logits`` and ``requests`` rows are copied (``correct`` replaces the
    request's verdict: the pass test of whoever copies it); the manifest keeps the source's config
    and model, adds ``info`` and ``copied_from`` ({run, request}). Returns the new run folder.
    """
    run = load_run(src, tables=_TABLES)
    manifest = run.manifest
    prompt_len = new_tokens = 0
    writer = RunWriter(
        out,
        run_id,
        config=manifest.get("config"),
        model=manifest.get("model"),
        fsync=False,
        copied_from={"run": run.run_id, "request": int(request)},
        **dict(info),
    )
    writer.start()
    try:
        for table in _TABLES:
            cols = run[table].to_pydict()
            keep = [i for i, r in enumerate(cols["request"]) if r == request]
            rows = {name: [values[i] for i in keep] for name, values in cols.items() if name != "run_id"}
            rows["request"] = [0] * len(keep)
            if table == "tokens":
                prompt_len = sum(bool(p) for p in rows["is_prompt"])
                new_tokens = len(keep) - prompt_len
            if table == "requests":
                rows["correct"] = [correct] * len(keep)
                rows["prompt_index"] = rows["sample_index"] = [0] * len(keep)
            writer.append(table, rows)
        writer.update(prompt_len=prompt_len, new_tokens=new_tokens, requests=1)
    except BaseException as exc:
        writer.close("failed", exc)
        raise
    writer.close("complete")
    return Path(writer.run_dir)
