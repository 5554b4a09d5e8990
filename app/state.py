"""Session plumbing: the runs root, one DuckDB connection per process, selections in the URL.

Selections (run, page, layer, head, step, ...) live in a per-session memory
that every page reads and writes, and are mirrored into the URL query
parameters after each page run, so a copied link reproduces the view. When
a session starts, the link's parameters seed that memory; afterwards the
widgets drive it (Streamlit clears query parameters on page changes, and the
page writes them back).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import duckdb
import pyarrow as pa
import streamlit as st

import runlog
from analyses.errors import AnalysisError
from runlog.errors import RecorderError

from .launch import default_root
from .plain import code, md

__all__ = [
    "ROOT_ENV",
    "PARAMS",
    "MAX_ROWS",
    "Root",
    "resolve_root",
    "current_root",
    "connection",
    "cursor",
    "guard",
    "start_session",
    "initial_page",
    "remembered",
    "remember",
    "publish",
    "select",
    "slider",
    "number",
]

#: Environment variable naming the runs root when ``--root`` is not given.
ROOT_ENV = "H2O_LENS_ROOT"
#: Query parameters the app reads and writes.
PARAMS = ("run", "page", "other", "request", "layer", "head", "step", "token")
#: Rows a table sends to the browser at most.
MAX_ROWS = 5_000
#: Errors shown as a message instead of a traceback: bad or missing data, not bugs.
DATA_ERRORS = (AnalysisError, RecorderError, duckdb.Error, OSError, pa.ArrowException)

T = TypeVar("T")


class Root(NamedTuple):
    """A runs root and a version that changes when its runs change (a cache key)."""

    path: str
    version: str


def resolve_root(argv: Sequence[str] | None = None) -> Path:
    """The runs root: ``--root`` after ``--`` on the command line, else ``$H2O_LENS_ROOT``,
    else the repository's ``sample_runs/``."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--root", default=None)
    args, _ = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    value = args.root or os.environ.get(ROOT_ENV) or default_root()
    return Path(value).expanduser().resolve()


def _version(root: Path) -> str:
    """Digest of the run folders and their modification times (segments and manifests
    are renamed into place, which touches the folder)."""
    h = hashlib.sha1()
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return "missing"
    for entry in entries:
        try:
            if entry.is_dir():
                h.update(f"{entry.name}:{entry.stat().st_mtime_ns};".encode())
        except OSError:
            continue
    return h.hexdigest()[:16]


def current_root() -> Root:
    """The runs root of this session, with its current version."""
    path = resolve_root()
    return Root(str(path), _version(path))


#: connections opened by :func:`warm` before the first session, by root version
_WARM: dict[Root, duckdb.DuckDBPyConnection] = {}
_WARM_LOCK = threading.Lock()


def warm(path: str | os.PathLike) -> Root:
    """Open ``path``'s catalog and views, and import what the pages draw with, before any session.

    The server process (:mod:`app.serve`) calls it in a thread while Streamlit starts; the
    first :func:`connection` of the same root version takes the result (and waits for a
    warm-up still running instead of scanning the root a second time). The imports are the
    libraries of the shared page modules (:mod:`app.common`, :mod:`app.data` and
    :mod:`app.charts`: pandas, the analyses, plotly), not those modules, which import this one.
    """
    with _WARM_LOCK:
        root = Root(str(Path(path).expanduser().resolve()), _version(Path(path).expanduser().resolve()))
        _WARM[root] = runlog.open_runs(root.path, warn=False)
        import pandas  # noqa: F401 - imported once, here, not in the first session

        import analyses.views  # noqa: F401

        from . import charts  # noqa: F401
    return root


@st.cache_resource(max_entries=4, show_spinner=False)
def connection(root: Root) -> duckdb.DuckDBPyConnection:
    """One DuckDB connection with the views of ``root`` per process (and root version)."""
    with _WARM_LOCK:
        con = _WARM.pop(root, None)
    return con if con is not None else runlog.open_runs(root.path, warn=False)


@contextlib.contextmanager
def cursor(root: Root) -> Iterator[duckdb.DuckDBPyConnection]:
    """A fresh cursor of the shared connection: sessions run in threads, a connection is not shared."""
    cur = connection(root).cursor()
    try:
        yield cur
    finally:
        cur.close()


@contextlib.contextmanager
def guard(what: str, run: str | None = None) -> Iterator[None]:
    """Show a data error of the block as a message naming the run; the rest of the page goes on."""
    try:
        yield
    except DATA_ERRORS as exc:
        where = f" of run {code(run)}" if run else ""
        st.error(f"Cannot show {what}{where}: {md(exc)}", icon=":material/error:")


# -- selections ------------------------------------------------------------------------------


def _memory() -> dict[str, str]:
    return st.session_state.setdefault("_h2o_selection", {})


def start_session() -> None:
    """On a session's first run, seed the selections from the link's query parameters."""
    if "_h2o_started" in st.session_state:
        return
    st.session_state["_h2o_started"] = True
    memory = _memory()
    for name in PARAMS:
        value = st.query_params.get(name)
        if value not in (None, ""):
            memory[name] = str(value)
    st.session_state["_h2o_initial_page"] = memory.pop("page", None)


def initial_page() -> str | None:
    """The ``page`` parameter of the link that started the session, once."""
    return st.session_state.pop("_h2o_initial_page", None)


def remembered(name: str) -> str | None:
    """The remembered value of a selection (as text), or None."""
    return _memory().get(name)


def remember(name: str, value: Any) -> None:
    """Remember a selection; None forgets it."""
    if value is None:
        _memory().pop(name, None)
    else:
        _memory()[name] = str(value)


def publish(page: str, names: Sequence[str] = ()) -> None:
    """Write the page and its selections (plus the run) into the URL query parameters."""
    params = {"page": page}
    for name in ("run", *names):
        value = remembered(name)
        if value is not None:
            params[name] = value
    if st.query_params.to_dict() != params:
        st.query_params.from_dict(params)


def _parse(text: str | None, cast: Callable[[str], T]) -> T | None:
    if text is None:
        return None
    try:
        return cast(text)
    except (TypeError, ValueError):
        return None


def _initial(key: str, name: str, ok: Callable[[Any], bool], cast: Callable[[str], Any], default: Any) -> Any:
    """The value a widget starts from: its own state when valid, else the remembered value,
    else ``default``; returned so the widget also gets it as its default.

    A value not taken from the widget's own state is written into that state, which
    makes the browser show it. Passing the same value as the widget's default matters
    as much: the browser re-creates widgets from their default after a page switch,
    so a default that differs from the value shown silently replaced the selection
    (the sidebar's run picker used to jump back to the first run that way).
    """
    if key in st.session_state and ok(st.session_state[key]):
        return st.session_state[key]
    value = _parse(remembered(name), cast)
    value = value if value is not None and ok(value) else default
    st.session_state[key] = value
    return value


def select(
    label: str,
    options: Sequence[T],
    name: str,
    *,
    page: str,
    default: T | None = None,
    container: Any = None,
    cast: Callable[[str], Any] = str,
    **kwargs: Any,
) -> T:
    """A selectbox remembered under ``name`` (and so in the URL)."""
    options = list(options)
    key = f"w_{page}_{name}"
    start = _initial(key, name, lambda v: v in options, cast, options[0] if default is None else default)
    value = (container or st).selectbox(label, options, index=options.index(start), key=key, **kwargs)
    remember(name, value)
    return value


def slider(
    label: str, lo: int, hi: int, name: str, *, page: str, default: int, container: Any = None, **kwargs: Any
) -> int:
    """An integer slider remembered under ``name``; a one-value range shows as a caption."""
    key = f"w_{page}_{name}"
    if hi <= lo:
        remember(name, lo)
        (container or st).caption(f"{label}: {lo}")
        return lo
    start = _initial(key, name, lambda v: isinstance(v, int) and lo <= v <= hi, int, default)
    value = (container or st).slider(label, min_value=lo, max_value=hi, value=start, key=key, **kwargs)
    remember(name, value)
    return value


def number(
    label: str, lo: int, hi: int, name: str, *, page: str, default: int, container: Any = None, **kwargs: Any
) -> int:
    """An integer input remembered under ``name``."""
    key = f"w_{page}_{name}"
    start = _initial(key, name, lambda v: isinstance(v, int) and lo <= v <= hi, int, default)
    value = (container or st).number_input(
        label, min_value=lo, max_value=max(lo, hi), value=start, step=1, key=key, **kwargs
    )
    remember(name, int(value))
    return int(value)
