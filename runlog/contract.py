"""The value contract, checked at scan time (DESIGN.md §5.5).

The contract itself is declared next to the schema (:data:`runlog.schema.RANGES`,
:data:`~runlog.schema.BOUNDED_BY`, :data:`~runlog.schema.ROWS_PER_REQUEST`,
:data:`~runlog.schema.UNIQUE`); this module applies it, in two steps:

* :func:`file_facts`, while the catalog reads a file through (once per file version: the
  facts are kept in the root's catalog cache): each bounded column's lowest and highest value
  (integer columns from the Parquet footer's statistics when every row group has them, the
  rest from the data the read-through decodes anyway), NaNs, per request its rows and its
  highest step and position, repeated keys, the requests' spans and the model the file was
  written for;
* :func:`check_run`, per run from those facts and the manifest: ranges, the model's layers and
  heads, positions and steps below each request's ``prompt_len + new_tokens``, rows per
  request, keys repeated across files, and a manifest that names another model than its files.

Every broken fact is a :class:`Violation` naming the file, the column and the values found;
the catalog turns it into a ``problems`` row and marks the run in ``runs.integrity``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .consistency import Violation, check_consistency
from .schema import BOUNDED_BY, RANGES, ROWS_PER_REQUEST, SPAN_EXEMPT, TABLES, UNIQUE, unique_key

__all__ = ["META_MODEL", "Violation", "file_facts", "model_tag", "model_shape", "check_run"]

#: key-value metadata of a segment naming the model it was written for (``model_tag``)
META_MODEL = "h2o_lens.model"
_SPAN_COLUMNS = ("step", "position", "exiting_position")


# -- per file ----------------------------------------------------------------------------------


def _footer_ranges(md: pq.FileMetaData | None, indices: Sequence[int]) -> list[tuple[Any, Any] | None]:
    """``(min, max)`` of each column of ``indices`` from the footer (None for a column unless every
    row group has them); each row group's metadata is built once for all the columns."""
    if md is None or md.num_row_groups == 0:
        return [None] * len(indices)
    found: list[tuple[Any, Any] | None] = [None] * len(indices)
    usable = [True] * len(indices)
    for g in range(md.num_row_groups):
        group = md.row_group(g)
        for k, index in enumerate(indices):
            if not usable[k]:
                continue
            chunk = group.column(index)
            stats = chunk.statistics
            if stats is None or not stats.has_min_max:
                if stats is None or stats.null_count != chunk.num_values:  # all null: nothing to bound
                    usable[k] = False
                continue
            lo, hi = stats.min, stats.max
            seen = found[k]
            found[k] = (lo, hi) if seen is None else (min(seen[0], lo), max(seen[1], hi))
    return [f if ok else None for f, ok in zip(found, usable)]


def _ints(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An integer column as int64, nulls as -1 (below every index)."""
    if column.null_count:
        column = column.fill_null(-1)
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.int64)


def _repeated(keys: Sequence[np.ndarray]) -> int:
    """Rows whose key (one array per key column, values >= -1) equals an earlier row's."""
    n = len(keys[0]) if keys else 0
    if n < 2:
        return 0
    code = np.zeros(n, np.int64)
    span = 1
    for k in keys:  # one integer per key when the columns' ranges allow it (they always do in a log)
        width = int(k.max()) + 2
        if span > 2**62 // width:
            break
        code = code * width + (k + 1)
        span *= width
    else:
        if (code[1:] > code[:-1]).all():  # rows in key order, each after the last: nothing repeats
            return 0
        code.sort()
        return int(np.count_nonzero(code[1:] == code[:-1]))
    order = np.lexsort(tuple(reversed(keys)))
    same = np.ones(n - 1, bool)
    for k in keys:
        s = k[order]
        same &= s[1:] == s[:-1]
    return int(same.sum())


#: per table, the columns :func:`file_facts` bounds (its ranges, then the ones bounded by the model),
#: each with whether the schema declares it a float column
_BOUNDED_COLUMNS: dict[str, tuple[tuple[str, bool], ...]] = {
    t: tuple(
        (c, pa.types.is_floating(TABLES[t].field(c).type))
        for c in dict.fromkeys([*RANGES.get(t, {}), *(c for c in BOUNDED_BY if c in TABLES[t].names)])
    )
    for t in TABLES
}


def _float_range(values: np.ndarray) -> tuple[float | None, float | None, int]:
    """``(min, max, NaN count)`` of a float column (NaN left out of the range)."""
    if not len(values):
        return None, None, 0
    lo, hi = values.min(), values.max()
    if lo == lo and hi == hi:  # no NaN (a NaN makes both NaN)
        return float(lo), float(hi), 0
    nan = np.isnan(values)
    n = int(nan.sum())
    values = values[~nan]
    if not len(values):
        return None, None, n
    return float(values.min()), float(values.max()), n


def _per_request(req: np.ndarray, steps: np.ndarray | None, positions: list[np.ndarray]) -> list[list[Any]]:
    """``[request, rows, highest step, highest position]`` per request of a file (None: no such column)."""
    n = len(req)
    change = req[1:] != req[:-1]
    ends = np.flatnonzero(change)  # the last row of each request but the last
    if n > 1 and (req[ends + 1] > req[ends]).all():  # rows grouped by request (as the writers append them)
        bounds = np.empty(len(ends) + 2, np.int64)
        bounds[0], bounds[1:-1], bounds[-1] = 0, ends + 1, n
        starts = bounds[:-1]
        ids = req[starts].tolist()
        rows = np.diff(bounds).tolist()
        steps_of = np.maximum.reduceat(steps, starts).tolist() if steps is not None else [None] * len(ids)
        if not positions:
            positions_of = [None] * len(ids)
        else:
            top = np.maximum.reduceat(positions[0], starts)
            for p in positions[1:]:
                top = np.maximum(top, np.maximum.reduceat(p, starts))
            positions_of = top.tolist()
        return [[r, k, st, po] for r, k, st, po in zip(ids, rows, steps_of, positions_of)]
    out = []
    for r in np.unique(req).tolist():
        sel = req == r
        item: list[Any] = [r, int(np.count_nonzero(sel))]
        item.append(int(steps[sel].max()) if steps is not None else None)
        item.append(max(int(p[sel].max()) for p in positions) if positions else None)
        out.append(item)
    return out


def file_facts(
    table: str,
    data: pa.RecordBatch | pa.Table,
    md: pq.FileMetaData | None = None,
    metadata: Mapping[bytes, bytes] | None = None,
) -> dict[str, Any]:
    """What :func:`check_run` needs of one file of ``table`` (JSON-ready, kept in the catalog cache).

    ``data`` is the file's content (every column it has), ``md`` its footer: integer ranges
    come from the footer's min/max statistics when every row group has them (the writer
    stores them for every integer column), float ranges and NaNs from the data, as do the
    per-request facts and repeated keys (a file of one request has them from the statistics
    too); the model the file was written for comes from its key-value ``metadata`` (the
    footer's, when not given).
    """
    if isinstance(data, pa.Table):
        data = data.combine_chunks().to_batches()[0] if data.num_rows else pa.RecordBatch.from_pylist([], data.schema)
    names = data.schema.names
    index = {name: i for i, name in enumerate(names)}
    rows = data.num_rows
    lows: dict[str, Any] = {}
    highs: dict[str, Any] = {}
    nans: dict[str, int] = {}
    ints: dict[str, np.ndarray] = {}

    def column(name: str) -> np.ndarray:
        if name not in ints:
            ints[name] = _ints(data.column(index[name]))
        return ints[name]

    bounded = [(col, is_float, index[col]) for col, is_float in _BOUNDED_COLUMNS.get(table, ()) if col in index]
    integers = [i for _, is_float, i in bounded if not is_float] if rows else []
    footer = dict(zip(integers, _footer_ranges(md, integers)))
    for col, is_float, i in bounded if rows else ():
        if is_float:  # from the data
            arr = data.column(i)
            if not pa.types.is_floating(arr.type):
                mm = pc.min_max(arr).as_py()
                lo, hi = mm["min"], mm["max"]
            else:
                lo, hi, n = _float_range(arr.to_numpy(zero_copy_only=False))
                if n:
                    nans[col] = n
        else:
            found = footer.get(i)
            if found is None:  # no statistics: from the data (nulls left out)
                mm = pc.min_max(data.column(i)).as_py()
                found = (mm["min"], mm["max"])
            lo, hi = found
        if lo is not None:
            lows[col], highs[col] = lo, hi
    facts: dict[str, Any] = {"min": lows, "max": highs}
    if nans:
        facts["nan"] = nans
    if "request" in names and rows and table != "requests":  # the requests table gives its spans below
        if lows.get("request") is not None and lows["request"] == highs["request"]:  # one request: the ranges say it
            tops = [highs.get(c) for c in ("position", "exiting_position") if c in names and highs.get(c) is not None]
            step = highs.get("step") if "step" in names else None
            facts["requests"] = [[int(lows["request"]), rows, step, max(tops) if tops else None]]
        else:
            positions = [column(c) for c in ("position", "exiting_position") if c in names]
            step_col = column("step") if "step" in names else None
            facts["requests"] = _per_request(column("request"), step_col, positions)
    if table in UNIQUE and rows > 1:
        facts["repeated"] = _repeated([column(c) for c in unique_key(table) if c in names])
    if table == "requests" and rows:
        facts["spans"] = [
            [int(r), p, n]
            for r, p, n in zip(
                column("request").tolist(),
                data.column(names.index("prompt_len")).to_pylist() if "prompt_len" in names else [None] * rows,
                data.column(names.index("new_tokens")).to_pylist() if "new_tokens" in names else [None] * rows,
            )
        ]
    if table == "guard_events" and rows:  # a few rows per request: kept whole for the run's checks
        facts["events"] = [
            [e["request"], e["step"], e["risk"], e["action"], e["slots_before"], e["slots_after"]]
            for e in data.select(["request", "step", "risk", "action", "slots_before", "slots_after"]).to_pylist()
        ]
    if metadata is None:
        metadata = (md.metadata or {}) if md is not None else {}
    written_for = metadata.get(META_MODEL.encode())
    if written_for is not None:
        facts["model"] = hashlib.sha256(written_for).hexdigest()[:12]
    return facts


def model_tag(model: Any) -> str | None:
    """The short identity of a manifest's ``model`` that every segment carries (``h2o_lens.model``):
    its name and, when known, its fingerprint digest, as JSON."""
    if isinstance(model, str):
        return json.dumps({"name": model}, sort_keys=True)
    if not isinstance(model, Mapping):
        return None
    name = model.get("name") or model.get("id")
    fingerprint = model.get("fingerprint")
    digest = fingerprint.get("digest") if isinstance(fingerprint, Mapping) else None
    if name is None and digest is None:
        return None
    tag: dict[str, Any] = {"name": name}
    if digest is not None:
        tag["digest"] = digest
    return json.dumps(tag, sort_keys=True)


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_shape(manifest: Mapping[str, Any]) -> dict[str, int]:
    """The model's ``layers``, ``kv_heads``, ``q_heads`` and ``sets`` (KV sets of the run's gqa)
    from a manifest; the quantities it does not record are left out."""
    model = manifest.get("model")
    if not isinstance(model, Mapping):
        return {}
    out: dict[str, int] = {}
    for name, keys in (
        ("layers", ("num_layers", "layers")),
        ("kv_heads", ("num_kv_heads", "kv_heads")),
        ("q_heads", ("num_query_heads", "q_heads")),
    ):
        value = next((_positive(model.get(k)) for k in keys if _positive(model.get(k)) is not None), None)
        if value is not None:
            out[name] = value
    config = manifest.get("config") if isinstance(manifest.get("config"), Mapping) else {}
    sets = out.get("q_heads") if config.get("gqa") == "none" else out.get("kv_heads")
    if sets is not None:
        out["sets"] = sets
    return out


# -- per run -------------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _range_text(lo: Any, hi: Any) -> str:
    return f"[{'-inf' if lo is None else _shown(lo)}, {'inf' if hi is None else _shown(hi)}]"


@functools.lru_cache(maxsize=256)
def _repeated_across(files: tuple[tuple[str, int, int], ...], key: tuple[str, ...]) -> int:
    """Rows of several files whose key repeats one of the others (in-process cache by file version)."""
    parts = [pq.read_table(path, columns=list(key)) for path, _, _ in files]
    data = pa.concat_tables(parts)
    return _repeated([_ints(data[c]) for c in key])


def _file_key(path: os.PathLike | str) -> tuple[str, int, int]:
    st = os.stat(path)
    return str(path), st.st_size, st.st_mtime_ns


def _range_violations(table: str, path: str, facts: Mapping[str, Any]) -> list[Violation]:
    """A file's columns outside their range, and NaNs where a number is due."""
    ranges = RANGES.get(table, {})
    lows, highs = facts.get("min", {}), facts.get("max", {})
    out = []
    for col, rng in ranges.items():
        lo, hi = lows.get(col), highs.get(col)
        if lo is None:
            continue
        if rng.lo is not None and lo < rng.lo - rng.slack:
            found = f"{_shown(lo)} (its lowest value)"
        elif rng.hi is not None and hi > rng.hi + rng.slack:
            found = f"{_shown(hi)} (its highest value)"
        else:
            continue
        out.append(
            Violation(
                path,
                table,
                f"{path}: column {table}.{col} holds {found}, outside its range "
                f"{_range_text(rng.lo, rng.hi)}; the file was edited or written wrongly, so this "
                "run's numbers cannot be trusted",
                f"{table}.{col} out of range",
            )
        )
    for col, n in facts.get("nan", {}).items():
        if col in ranges:
            out.append(
                Violation(
                    path,
                    table,
                    f"{path}: column {table}.{col} holds {n} NaN value(s); it must be a number in "
                    f"{_range_text(ranges[col].lo, ranges[col].hi)}",
                    f"{table}.{col} NaN",
                )
            )
    return out


@dataclasses.dataclass(frozen=True)
class _RunModel:
    """What the files of a run are checked against: the model's shape, name and segment tag."""

    shape: dict[str, int]
    name: str
    tag: str | None
    digest: str | None


def _model_violations(table: str, path: str, facts: Mapping[str, Any], model: _RunModel) -> list[Violation]:
    """Indices beyond the model's layers and heads, repeated keys, a file written for another model."""
    out = []
    highs = facts.get("max", {})
    for col, what in BOUNDED_BY.items():
        limit = model.shape.get(what)
        hi = highs.get(col)
        if what == "span" or limit is None or hi is None or hi < limit:
            continue
        out.append(
            Violation(
                path,
                table,
                f"{path}: column {table}.{col} reaches {hi}, but the run's model ({model.name}) has "
                f"{limit} {what.replace('_', ' ')}; the manifest names another model, or the file "
                "was edited",
                f"{table}.{col} beyond the model's {what.replace('_', ' ')}",
            )
        )
    if facts.get("repeated"):
        out.append(
            Violation(
                path,
                table,
                f"{path}: {facts['repeated']} row(s) of {table} repeat the key "
                f"({', '.join(unique_key(table))}) of another row; a row is logged once",
                f"{table} keys repeated",
            )
        )
    written_for = facts.get("model")
    if written_for is not None and model.digest is not None and written_for != model.digest:
        out.append(
            Violation(
                path,
                table,
                f"{path}: written for another model than the manifest names ({model.tag}); the manifest "
                "was edited or belongs to another run",
                "manifest names another model",
            )
        )
    return out


def _request_violations(
    table: str, totals: Mapping[int, list[Any]], spans: Mapping[int, tuple[int, int]], longest: int | None, shape
) -> list[Violation]:
    """Per request of a table: steps and positions inside its tokens, no more rows than it can have."""
    out = []
    for r, (rows, step, pos, path) in sorted(totals.items()):
        span = spans[r][0] if r in spans else (None if spans else longest)
        if table in SPAN_EXEMPT:
            span = None
        for col, value in (("step", step), ("position", pos)):
            if span is not None and value is not None and value >= span:
                out.append(
                    Violation(
                        path,
                        table,
                        f"{path}: request {r} has a {table} {col} of {value}, but its prompt and new "
                        f"tokens span {span} positions (0 .. {span - 1})",
                        f"{table}.{col} beyond request {r}'s tokens",
                    )
                )
        factors = ROWS_PER_REQUEST.get(table)
        if factors is None or r not in spans or any(f not in shape for f in factors):
            continue
        limit = spans[r][1] * math.prod(shape[f] for f in factors)
        if rows > limit:
            per = " x ".join(["new_tokens", *factors])
            out.append(
                Violation(
                    path,
                    table,
                    f"{path}: request {r} has {rows} {table} rows, more than its {per} = {limit}; "
                    "rows were added or repeated",
                    f"{table}: too many rows for request {r}",
                )
            )
    return out


def _across_files(table: str, segs: Sequence[Any]) -> list[Violation]:
    """Keys of a unique table repeated from one file of the run to another."""
    if table not in UNIQUE or len(segs) < 2:
        return []
    key = unique_key(table)
    try:
        repeated = _repeated_across(tuple(_file_key(s.path) for s in segs), key)
    except (OSError, pa.ArrowException, KeyError):
        repeated = 0  # a file that cannot be read again is reported by the catalog
    repeated -= sum((s.facts or {}).get("repeated", 0) for s in segs)  # each file's own: said above
    if not repeated:
        return []
    return [
        Violation(
            str(segs[-1].path),
            table,
            f"{segs[-1].path}: {repeated} row(s) of {table} repeat the key ({', '.join(key)}) of "
            "a row in another file of the run; a row is logged once",
            f"{table} keys repeated across files",
        )
    ]


def check_run(
    manifest: Mapping[str, Any] | None, files: Mapping[str, Sequence[Any]], run_dir: str | os.PathLike | None = None
) -> list[Violation]:
    """Check a run's files (``table -> [SegmentFile]``, each with its ``facts``) against the contract.

    ``manifest``: the run's (checked) manifest, or None; the model's shape, the longest request
    (when the requests table is missing) and the model's identity come from it. ``run_dir``: the
    run folder (default: the folder of its files), named in the findings on the run as a whole
    (:func:`runlog.consistency.check_consistency`).
    """
    manifest = manifest or {}
    shape = model_shape(manifest)
    spans: dict[int, tuple[int, int]] = {}
    for seg in files.get("requests", ()):
        for r, p, n in (seg.facts or {}).get("spans", ()):
            if isinstance(p, int) and isinstance(n, int):
                spans[r] = (p + n, n)
    longest = None
    if isinstance(manifest.get("prompt_len"), int) and isinstance(manifest.get("new_tokens"), int):
        longest = manifest["prompt_len"] + manifest["new_tokens"]
    tag = model_tag(manifest.get("model"))
    model = manifest.get("model")
    run_model = _RunModel(
        shape,
        (model.get("name") if isinstance(model, Mapping) else model) or "the model",
        tag,
        hashlib.sha256(tag.encode()).hexdigest()[:12] if tag is not None else None,
    )
    out: list[Violation] = []
    for table, segs in sorted(files.items()):
        totals: dict[int, list[Any]] = {}  # request -> [rows, highest step, highest position, file]
        for seg in segs:
            facts = seg.facts or {}
            path = str(seg.path)
            out += _range_violations(table, path, facts)
            out += _model_violations(table, path, facts, run_model)
            for r, rows, step, pos, *_ in facts.get("requests", ()):
                acc = totals.setdefault(r, [0, None, None, path])
                acc[0] += rows
                acc[1] = step if acc[1] is None or (step is not None and step > acc[1]) else acc[1]
                acc[2] = pos if acc[2] is None or (pos is not None and pos > acc[2]) else acc[2]
        out += _request_violations(table, totals, spans, longest, shape)
        out += _across_files(table, segs)
    if run_dir is None:
        first = next((s for segs in files.values() for s in segs), None)
        run_dir = os.path.dirname(str(first.path)) if first is not None else "."
    return out + check_consistency(manifest, files, str(run_dir), shape)
