"""The model a run was recorded with, and the check that another job uses the same (DESIGN.md §5.1).

The recorder stores the model's absolute path and its fingerprint
(:func:`h2o_lens.models.model_fingerprint`: config, tokenizer and weight files) in the
manifest. A job that reads a run and runs a model on it (``replay``, the counterfactuals of
``explain``, the lifecycle ``check``) loads :func:`model_source` and calls :func:`check_model`
before it writes anything: a model whose fingerprint differs is refused in one line naming
both, unless the caller allows it explicitly, and then the override is logged in the
manifest it writes (``model_overrides``). A manifest written before fingerprints were kept is
accepted as it is, and said once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from h2o_lens.fingerprint import is_partial, model_fingerprint

from .errors import ModelMismatchError
from .manifest import iso_utc, utc_now

__all__ = ["recorded_model", "model_source", "check_model", "log_override"]

_DEFAULT_NAMES = ("default", "smollm2-135m-instruct")
_said_unchecked = False
_said_partial: set[str] = set()


def recorded_model(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``model`` as a dict (a bare name becomes ``{"name": name}``; none: ``{}``)."""
    model = manifest.get("model")
    if isinstance(model, Mapping):
        return dict(model)
    return {"name": model} if isinstance(model, str) else {}


def model_source(manifest: Mapping[str, Any]) -> str | None:
    """What to load the run's model from: the packaged default by its name, else the recorded
    absolute folder when it exists, else the recorded name (None: the default model)."""
    info = recorded_model(manifest)
    name, path = info.get("name"), info.get("path")
    if isinstance(name, str) and name.lower() in _DEFAULT_NAMES:
        return name
    if isinstance(path, str) and os.path.isabs(path) and os.path.isdir(path):
        return path
    return name if isinstance(name, str) else path if isinstance(path, str) else None


def _describe(info: Mapping[str, Any]) -> str:
    fp = info.get("fingerprint")
    digest = fp.get("digest") if isinstance(fp, Mapping) else None
    where = info.get("path") or "no folder"
    return f"{info.get('name') or '?'} ({where}, fingerprint {digest or 'unknown'})"


def _differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    parts = [k for k in ("config", "tokenizer", "weights") if a.get(k) != b.get(k)]
    return ", ".join(parts) or "fingerprint"


def check_model(
    manifest: Mapping[str, Any],
    model: Any,
    *,
    run: str,
    command: str,
    allow_other: bool = False,
) -> dict[str, Any] | None:
    """Check that ``model`` (a model, or its :func:`h2o_lens.models.model_info`) is the run's.

    Returns None when it is (or when either side has no fingerprint: a manifest written before
    fingerprints were kept, said once on stderr; a model built in memory), else, with
    ``allow_other``, the override to log (:func:`log_override`). A run recorded with the older,
    partial fingerprint is compared with the partial fingerprint of the model in use, and said
    once per run on stderr.

    Raises
    ------
    ModelMismatchError
        The fingerprints differ and ``allow_other`` is false: one line naming both models.
    """
    global _said_unchecked
    recorded = recorded_model(manifest)
    if isinstance(model, Mapping):
        info = dict(model)
    else:
        from h2o_lens.models import model_info

        info = model_info(model)
    theirs, ours = recorded.get("fingerprint"), info.get("fingerprint")
    if not isinstance(theirs, Mapping) or not theirs.get("digest"):
        if not _said_unchecked:
            _said_unchecked = True
            print(
                f"h2o-lens: note: run {run} was recorded before model fingerprints were kept: "
                f"the model used ({info.get('name') or info.get('path') or '?'}) cannot be checked against it",
                file=sys.stderr,
            )
        return None
    if not isinstance(ours, Mapping):
        return None
    partial = is_partial(theirs)
    if partial:  # recorded before whole weight files were read: compare like with like
        ours = model_fingerprint(info.get("path"), partial=True) or ours
    if ours.get("digest") == theirs.get("digest"):
        if partial and run not in _said_partial:
            _said_partial.add(run)
            print(
                f"h2o-lens: note: run {run} was recorded with the older, partial model fingerprint (each weight "
                "file's size and first and last MiB): a change elsewhere in the weights cannot be told; record it "
                "again for a fingerprint of every byte",
                file=sys.stderr,
            )
        return None
    if allow_other:
        return {
            "command": command,
            "at": iso_utc(utc_now()),
            "recorded": {"name": recorded.get("name"), "path": recorded.get("path"), "digest": theirs.get("digest")},
            "used": {"name": info.get("name"), "path": info.get("path"), "digest": ours.get("digest")},
        }
    raise ModelMismatchError(
        f"run {run} was recorded with the model {_describe(recorded)}, but the model given is {_describe(info)}: "
        f"their {_differences(theirs, ours)} differ. Nothing was written. Pass the run's model with --model "
        "PATH, or add --allow-other-model to use this one anyway (the override is logged in the manifest)"
    )


def log_override(manifest: MutableMapping[str, Any], override: Mapping[str, Any] | None) -> None:
    """Append ``override`` (from :func:`check_model`) to the manifest's ``model_overrides``."""
    if override:
        manifest["model_overrides"] = [*(manifest.get("model_overrides") or []), dict(override)]
