"""What the toolkit may replace or remove: only what it can prove it wrote (DESIGN.md §5.1).

A run folder proves itself by its manifest: ``manifest.json`` naming the folder as its
``run_id`` (:func:`is_run_folder`). Every command that writes into an output folder it may
already hold output in (``samples``, ``demo``, ``sweep``) first calls :func:`check_output_root`:
a folder that holds anything besides runs and the files the toolkit writes next to them (a
``.git``, a source folder, a foreign file) is refused in one line unless ``force``. Every
removal of a run folder goes through :func:`remove_run`, which removes a run folder and nothing
else, force or not: never a ``.git`` (nor a folder holding one), never a folder without its
manifest. A file is replaced only when it is missing or the toolkit wrote it
(:func:`check_output_file`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from .errors import RecorderError
from .manifest import MANIFEST_NAME

__all__ = [
    "OutputFolderError",
    "NEVER_TOUCHED",
    "is_run_folder",
    "remove_run",
    "replace_runs",
    "foreign_entries",
    "check_output_root",
    "check_output_file",
]

#: version-control folders: never removed, never written into, whatever the options
NEVER_TOUCHED = frozenset({".git", ".hg", ".svn"})
#: what a folder left by a writer killed between creating it and writing its manifest can hold:
#: the manifest's temporary file (``manifest.json.<pid>.<hex>.tmp``, :func:`runlog.manifest.write_manifest`)
_LEFTOVER_PREFIX, _LEFTOVER_SUFFIX = MANIFEST_NAME + ".", ".tmp"


def _manifest_tmp(name: str) -> bool:
    return name.startswith(_LEFTOVER_PREFIX) and name.endswith(_LEFTOVER_SUFFIX)


class OutputFolderError(RecorderError):
    """An output folder holds what the toolkit did not write, or a removal was asked of a folder
    that is not one of its runs; nothing was removed."""


def is_run_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a run folder the toolkit wrote: a folder (not a link) whose readable
    ``manifest.json`` names it as its ``run_id``, holding no version-control folder."""
    path = Path(path)
    if path.name in NEVER_TOUCHED or path.is_symlink() or not path.is_dir():
        return False
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(manifest, dict)
        and manifest.get("run_id") == path.name
        and not any((path / name).exists() for name in NEVER_TOUCHED)
    )


def _leftover(path: Path) -> bool:
    """A folder a killed writer left before its manifest: empty, or its manifest's temporary file."""
    try:
        return path.is_dir() and not path.is_symlink() and all(_manifest_tmp(n) for n in os.listdir(path))
    except OSError:
        return False


def remove_run(path: str | os.PathLike) -> None:
    """Remove the run folder ``path`` (or the empty folder a killed writer left); anything else is
    refused with :class:`OutputFolderError` and left as it is. A missing folder is fine."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if is_run_folder(path) or _leftover(path):
        shutil.rmtree(path)
        return
    raise OutputFolderError(
        f"{path} is in the way but is not a run folder h2o-lens wrote (no manifest.json naming it); it was not "
        "removed. Move it away and run again"
    )


def replace_runs(root: str | os.PathLike) -> list[str]:
    """Remove the run folders directly under ``root`` (to write them afresh) and nothing else;
    return their names."""
    root = Path(root)
    if not root.is_dir():
        return []
    gone = []
    for entry in sorted(root.iterdir()):
        if is_run_folder(entry) or _leftover(entry):
            shutil.rmtree(entry)
            gone.append(entry.name)
    return gone


def _ours(entry: os.DirEntry, names: frozenset[str]) -> bool:
    name = entry.name
    if name in NEVER_TOUCHED:
        return False
    if name in names or (name.endswith(".tmp") and any(name.startswith(n + ".") for n in names)):
        return True  # one of the command's files, or a temporary file of one a killed writer left
    try:
        return entry.is_dir(follow_symlinks=False) and (
            os.path.isfile(os.path.join(entry.path, MANIFEST_NAME)) or _leftover(Path(entry.path))
        )
    except OSError:
        return False


def foreign_entries(root: str | os.PathLike, names: Iterable[str] = ()) -> list[str]:
    """The entries of ``root`` the toolkit did not write: not a run folder (a folder with its
    manifest), not one of ``names`` (files and folders the command writes beside its runs) nor
    the catalog's cache. A version-control folder is always foreign."""
    from .catalog import CACHE_NAME

    known = frozenset(names) | {CACHE_NAME}
    with os.scandir(root) as entries:
        return sorted(e.name for e in entries if not _ours(e, known))


def check_output_root(
    root: str | os.PathLike, *, names: Iterable[str] = (), force: bool = False, option: str = "--out"
) -> None:
    """Refuse, in one line, an output folder that holds anything the toolkit did not write
    (:func:`foreign_entries`), unless ``force``; a missing or empty folder, or one holding runs,
    is fine. ``force`` writes beside the foreign entries, which are never removed. A folder that
    is a version-control folder, or inside one, is refused even so."""
    root = Path(root)
    if NEVER_TOUCHED & set(root.absolute().parts):
        raise OutputFolderError(f"{option} {root} is inside a version-control folder; choose another folder")
    if not root.exists():
        return
    if not root.is_dir():
        raise OutputFolderError(f"{option} {root} is a file, not a folder; choose a folder for the runs")
    foreign = foreign_entries(root, names)
    if foreign and not force:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise OutputFolderError(
            f"{option} {root} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} h2o-lens did not write "
            f"({shown}); nothing was written. Choose a new or empty folder (or a runs root of h2o-lens), or add "
            "--force to write beside them (they are never removed)"
        )


def check_output_file(
    path: str | os.PathLike, *, markers: Iterable[bytes], force: bool = False, option: str = "-o"
) -> None:
    """Refuse, in one line, to replace the file ``path`` unless it is missing or the toolkit wrote
    it (its first 4 KiB hold one of ``markers``), or ``force``. A folder, or a path inside a
    version-control folder, is refused even so."""
    path = Path(path)
    if NEVER_TOUCHED & set(path.absolute().parts):
        raise OutputFolderError(f"{option} {path} is inside a version-control folder; choose another file")
    if path.is_dir():
        raise OutputFolderError(f"{option} {path} is a folder; give a file name")
    if not path.exists() or force:
        return
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        head = b""
    if not any(m in head for m in markers):
        raise OutputFolderError(
            f"{option} {path} exists and is not a file h2o-lens wrote; nothing was written. Choose another file, "
            "or add --force to replace it"
        )
