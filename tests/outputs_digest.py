"""A digest of everything a runs root holds, stable across runs of the same command.

:func:`root_digest` reads every file under a root (Parquet segments, manifests, the
sweep's and the demo's tables, the reports) and reduces each to a hash of its content
with only what differs between two identical runs normalised away:

- run ids made of a time stamp and random digits (``20261203-145546-h2o-d73b``) become
  ``run00``, ``run01``, … in the order the runs were created; a replay's random segment
  suffix (``oracle-00000.901e26b7.parquet``) becomes ``oracle-00000.X.parquet``;
- the root's own path, ISO time stamps, process identities and package versions;
- measured durations (keys named ``*seconds*``, ``ms_per_token``, ``seconds_per_token``),
  also where a table or a plot prints them;
- the plotly library embedded in a self-contained HTML file, and the random ids of its plots.

Everything else (every row of every table, every verdict, every number computed from the
model) must be equal, so the digest guards a refactoring that should change nothing.

Numbers with a fractional part are compared within a tolerance, not bit for bit: the tiny model
runs in float64, but the logged scores, logits and measures are float32, whose last bits depend
on the CPU's vector width (a sum over 16 lanes adds in another order than over 8), and a KL of
two nearly equal distributions keeps only a few of its digits. Each file's digest is therefore
the hash of its content with every such number (a float, or a decimal number printed in a text)
replaced by ``F``, plus the count, the sum and the sum of magnitudes of those numbers
(:func:`file_digest`); :func:`same_digest` says whether two digests agree within
:data:`FLOAT_TOLERANCE`. Integers, strings, token ids, kept positions and verdicts stay exact.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

STAMPED_RUN = re.compile(r"^\d{8}-\d{6}-.+-[0-9a-f]{4}$")
SEGMENT_SUFFIX = re.compile(r"\.[0-9a-f]{8}\.parquet$")
ISO_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})?")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
PLOTLY_JS = re.compile(r"<script[^>]*>/\*\*\s*\* plotly\.js.*?</script>", re.S)
ELAPSED = re.compile(r"\bin \d+ s\b")
#: manifest and report keys whose values differ between two identical runs
VOLATILE_KEYS = {"writer", "versions", "boot_id", "pid", "hostname", "start_ticks"}


def _volatile_key(key: str) -> bool:
    return key in VOLATILE_KEYS or "seconds" in key or key == "ms_per_token" or key.endswith("_at")


def _collect_volatile(value: Any, out: set[float], key: str = "") -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _collect_volatile(v, out, str(k))
    elif isinstance(value, list):
        for v in value:
            _collect_volatile(v, out, key)
    elif isinstance(value, float) and _volatile_key(key) and value:
        out.add(value)


class Normaliser:
    """What to replace in the files of one root."""

    def __init__(self, root: Path, base: Path | None = None):
        self.root, self.base = root, base
        created = []
        volatile: set[float] = set()
        for manifest in root.rglob("manifest.json"):
            data = json.loads(manifest.read_text(encoding="utf-8"))
            _collect_volatile(data, volatile)
            if STAMPED_RUN.match(manifest.parent.name):
                created.append((data.get("created_at") or "", manifest.parent.name))
        self.runs = {run: f"run{i:02d}" for i, (_, run) in enumerate(sorted(created))}
        for table in root.rglob("*.csv"):
            import pandas as pd

            frame = pd.read_csv(table)
            for column in frame.columns:
                if _volatile_key(str(column)):
                    volatile |= {float(v) for v in frame[column] if isinstance(v, float) and not math.isnan(v)}
        texts = set()
        for v in volatile:
            texts.add(repr(v))
            # pandas' six decimals, only with five significant digits or more: a millisecond
            # duration's "0.001169" would also blank a measured 0.001169 (a KL printed to four
            # significant digits) when the two happen to agree
            six = f"{v:.6f}"
            if len(six.lstrip("-0.").replace(".", "")) >= 5:
                texts.add(six)
        # long forms only (a short one could equal a number computed from the model); the tables
        # that print durations rounded are handled by their column (:func:`_drop_columns`)
        self.volatile = sorted(volatile)
        self.numbers = sorted((t for t in texts if len(t) > 6), key=len, reverse=True)
        self._number_re = (
            re.compile("|".join(rf"(?<![\d.]){re.escape(t)}(?![\d])" for t in self.numbers)) if self.numbers else None
        )

    def text(self, s: str, *, numbers: bool = True) -> str:
        s = s.replace(str(self.root.resolve()), "ROOT").replace(str(self.root), "ROOT")
        if self.base is not None:
            s = s.replace(str(self.base.resolve()), "BASE").replace(str(self.base), "BASE")
        for run, label in sorted(self.runs.items(), key=lambda kv: -len(kv[0])):
            s = s.replace(run, label)
        s = SEGMENT_SUFFIX.sub(".X.parquet", s)
        s = ISO_TIME.sub("TIME", s)
        s = UUID.sub("UUID", s)
        s = ELAPSED.sub("in N s", s)
        if numbers and self._number_re is not None:
            s = self._number_re.sub("T", s)
        return _drop_columns(s) if numbers else s

    def plot_arrays(self, text: str) -> str:
        """Plotly's base64 arrays decoded, a duration in them (to a relative 1e-6: a plot may
        round) blanked."""
        import base64

        import numpy as np

        def array(m: re.Match) -> str:
            values = np.frombuffer(base64.b64decode(m.group(2).replace("\\u002f", "/")), dtype=m.group(1))
            out = []
            for v in values.tolist():
                hit = isinstance(v, float) and any(math.isclose(v, t, rel_tol=1e-6) for t in self.volatile)
                out.append("T" if hit else _round(v) if isinstance(v, float) else v)
            return json.dumps(out)

        return re.sub(r'\{"dtype":"([a-z]\d)","bdata":"([^"]*)"(?:,"shape":"[^"]*")?\}', array, text)

    def value(self, value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {self.text(str(k)): self.value(v, str(k)) for k, v in value.items() if not _volatile_key(str(k))}
        if isinstance(value, list):
            return [self.value(v, key) for v in value]
        if isinstance(value, str):
            return self.text(value, numbers=False)
        if isinstance(value, float):
            return _round(value)
        return value


def _drop_columns(text: str) -> str:
    """A printed table's duration columns (a header line naming one, then rows of as many or one
    more field, the index) blanked."""
    lines = text.split("\n")
    header: list[str] | None = None
    for i, line in enumerate(lines):
        piped = line.lstrip().startswith("|")  # a Markdown pipe table: cells between the bars
        fields = [f.strip() for f in line.strip().strip("|").split("|")] if piped else line.split()
        if any(_volatile_key(f) for f in fields):
            header = fields
            continue
        if header is None:
            continue
        extra = len(fields) - len(header)
        if extra not in (0, 1):
            header = None
            continue
        for j, name in enumerate(header):
            if _volatile_key(name):
                fields[j + extra] = "T"
        lines[i] = (" | " if piped else " ").join(fields)
    return "\n".join(lines)


def _drop_html_columns(text: str) -> str:
    """The same for an HTML table (a ``<thead>`` of ``<th>`` names, rows of ``<td>`` cells)."""

    def table(m: re.Match) -> str:
        head, body = m.group(1), m.group(2)
        names = re.findall(r"<th[^>]*>(.*?)</th>", head, re.S)
        blank = {i for i, name in enumerate(names) if _volatile_key(name.strip())}

        def row(r: re.Match) -> str:
            cells = re.findall(r"<t[dh][^>]*>.*?</t[dh]>", r.group(1), re.S)
            offset = len(cells) - len(names)
            return "<tr>" + "".join("<td>T</td>" if i - offset in blank else c for i, c in enumerate(cells)) + "</tr>"

        return head + re.sub(r"<tr[^>]*>(.*?)</tr>", row, body, flags=re.S)

    return re.sub(r"(<thead>.*?</thead>)(.*?</tbody>)", table, text, flags=re.S)


def _plot_shapes(text: str) -> str:
    """A sweep page's figure (``const f={...};``) with each trace's values reduced to their
    count: the values are the sweep table's, compared through sweep.csv and the page's own
    table, and the latency curve's are measured; names, axes, colours and layout stay."""
    m = re.search(r"const f=(\{.*?\});Plotly", text, re.S)
    if m is None:
        return text
    try:
        fig = json.loads(m.group(1))
    except ValueError:
        return text
    for trace in fig.get("data", []):
        for axis in ("x", "y"):
            if isinstance(trace.get(axis), list):
                trace[axis] = len(trace[axis])
            elif isinstance(trace.get(axis), dict):
                trace[axis] = "values"
    return text[: m.start(1)] + json.dumps(fig, sort_keys=True) + text[m.end(1) :]


def _round(v: float) -> Any:
    if math.isnan(v) or math.isinf(v):
        return repr(v)
    return float(f"{v:.9g}")


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


#: a decimal number in a text (a fractional part or an exponent), not part of a word or a version
DECIMAL = re.compile(r"(?<![\w.])-?(?:\d+\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)(?![\w.])")

#: two digests agree when their numbers' sums differ by at most ``RELATIVE`` of the sum of
#: magnitudes plus ``PER_NUMBER`` per number: float32's last bits are 6e-8 of a value, a KL near
#: 1e-4 loses up to 1e-6, a number printed to four digits moves by one unit in the last
FLOAT_TOLERANCE = {"RELATIVE": 1e-5, "PER_NUMBER": 1e-5}


def _split(obj: Any, found: list[float]) -> Any:
    """``obj`` with each float, and each decimal number inside a string, replaced by ``"F"``;
    the numbers appended to ``found``."""
    if isinstance(obj, float):
        found.append(obj)
        return "F"
    if isinstance(obj, str):

        def number(m: re.Match) -> str:
            found.append(float(m.group(0)))
            return "F"

        return DECIMAL.sub(number, obj)
    if isinstance(obj, dict):
        return {k: _split(v, found) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_split(v, found) for v in obj]
    return obj


def file_digest(content: Any) -> dict[str, Any]:
    """``{"hash", "n", "sum", "abs"}``: the hash of ``content`` with its decimal numbers replaced,
    and their count, sum and sum of magnitudes."""
    found: list[float] = []
    shape = _split(content, found)
    return {"hash": _hash(shape), "n": len(found), "sum": math.fsum(found), "abs": math.fsum(map(abs, found))}


def _joined(digests: list[dict[str, Any]]) -> dict[str, Any]:
    """The digest of several files that normalise to the same name (their order is not kept)."""
    if len(digests) == 1:
        return digests[0]
    return {
        "hash": _hash(sorted(d["hash"] for d in digests)),
        "n": sum(d["n"] for d in digests),
        "sum": math.fsum(d["sum"] for d in digests),
        "abs": math.fsum(d["abs"] for d in digests),
    }


def same_digest(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two :func:`file_digest` results agree: the same hash and count, sums within
    :data:`FLOAT_TOLERANCE`."""
    if a is None or b is None:
        return a is b
    if a["hash"] != b["hash"] or a["n"] != b["n"]:
        return False
    bound = FLOAT_TOLERANCE["RELATIVE"] * max(a["abs"], b["abs"]) + FLOAT_TOLERANCE["PER_NUMBER"] * a["n"]
    return abs(a["sum"] - b["sum"]) <= bound


def _parquet(path: Path, norm: Normaliser) -> Any:
    table = pq.read_table(path)
    meta = {}
    for k, v in (table.schema.metadata or {}).items():
        text = v.decode()
        try:
            meta[k.decode()] = norm.value(json.loads(text))
        except ValueError:
            meta[k.decode()] = norm.text(text, numbers=False)
    columns = {}
    for name in table.column_names:
        columns[name] = [norm.value(v) for v in table.column(name).to_pylist()]
    return {"meta": meta, "rows": table.num_rows, "columns": columns}


def _file(path: Path, norm: Normaliser) -> Any:
    if path.suffix == ".parquet":
        return _parquet(path, norm)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return norm.value(json.loads(text))
    if path.suffix == ".html":
        text = norm.plot_arrays(_drop_html_columns(PLOTLY_JS.sub("<script>PLOTLY</script>", text)))
        text = _plot_shapes(text)
    if path.suffix == ".csv":
        import pandas as pd

        frame = pd.read_csv(io.StringIO(text))
        frame = frame[[c for c in frame.columns if not _volatile_key(str(c))]]
        return {c: [norm.value(v) for v in frame[c].tolist()] for c in frame.columns}
    return norm.text(text)


def root_digest(
    root: str | Path, *, stdout: str | None = None, base: str | Path | None = None
) -> dict[str, dict[str, Any]]:
    """``{normalised relative path: file_digest}`` of every file under ``root`` (and ``stdout``);
    paths under ``base`` (the folder of the model) are written relative to it.

    The catalog cache the readers keep (``.h2o-lens-catalog.json``) is left out: it records file
    times and sizes, not outputs."""
    root = Path(root)
    norm = Normaliser(root, Path(base) if base is not None else None)
    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.name.startswith(".h2o-lens-catalog"):
            continue
        name = norm.text(path.relative_to(root).as_posix(), numbers=False)
        found.setdefault(name, []).append(file_digest(_file(path, norm)))
    out = {name: _joined(digests) for name, digests in found.items()}
    if stdout is not None:
        out["<stdout>"] = file_digest(norm.text(stdout))
    return dict(sorted(out.items()))
