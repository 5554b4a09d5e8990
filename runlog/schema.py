"""The log schema, declared once (DESIGN.md §5, log format v1).

Every table of a run is a pyarrow schema below; the segment writer, the
readers, the DuckDB views and the synthetic-run generator all derive from
these declarations. Columns are only ever added, nullable, in a later
version; a reader of version N opens files of any version <= N.

Integer widths: ``request`` int32, ``step``/``position`` int64, head and layer
indices int16, scores, margins and masses float32, flags bool. Timestamps of
the ``runs`` view are naive UTC.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from .errors import SchemaError

__all__ = [
    "SCHEMA_VERSION",
    "META_SCHEMA_VERSION",
    "META_CONFIG",
    "META_TABLE",
    "META_RUN_ID",
    "TABLES",
    "TABLE_NAMES",
    "REPLAY_TABLES",
    "RUNS",
    "VIEW_NAMES",
    "COUNTERFACTUAL_KINDS",
    "CULPRITS_KIND",
    "KEYS",
    "Range",
    "FLOAT_SLACK",
    "RANGES",
    "BOUNDED_BY",
    "SPAN_EXEMPT",
    "ROWS_PER_REQUEST",
    "UNIQUE",
    "unique_key",
    "table_schema",
    "duckdb_type",
    "empty_table",
    "to_arrow",
    "schema_mismatches",
]

#: 2 adds the speculative tables ``spec_segments`` and ``spec_undone`` (DESIGN.md §14);
#: 3 adds the guard's tables ``guard_steps`` and ``guard_events`` (DESIGN.md §18.5);
#: 4 adds ``guard_steps.prefill`` and ``canary`` and the prefill's row of each request (DESIGN.md §18.1);
#: 5 adds the culprit search's table ``culprits`` (DESIGN.md §19);
#: 6 adds the cold tier's table ``recalls`` (DESIGN.md §2.13)
SCHEMA_VERSION = 6

META_SCHEMA_VERSION = "h2o_lens.schema_version"
META_CONFIG = "h2o_lens.config"
META_TABLE = "h2o_lens.table"
META_RUN_ID = "h2o_lens.run_id"


def _f(name: str, type_: pa.DataType, doc: str, *, nullable: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=nullable, metadata={"doc": doc})


_RUN_ID = _f("run_id", pa.string(), "run folder name (non-numeric)")
_REQUEST = _f("request", pa.int32(), "request (batch row) index within the run")
_STEP = _f("step", pa.int64(), "query position being processed; prefill rows carry prompt_len - 1")
_LAYER = _f("layer", pa.int16(), "decoder layer index")
_KV_HEAD = _f("kv_head", pa.int16(), "KV head index")
_Q_HEAD_OPT = _f("q_head", pa.int16(), "query head, only when gqa='none' keeps one set per query head", nullable=True)

TABLES: dict[str, pa.Schema] = {
    "tokens": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _f("position", pa.int64(), "original input position"),
            _f("token_id", pa.int32(), "vocabulary id"),
            _f("text", pa.string(), "decoded text of the token", nullable=True),
            _f("is_prompt", pa.bool_(), "token belongs to the prompt"),
            _f("evidence", pa.string(), "evidence span label, or null", nullable=True),
        ]
    ),
    "evictions": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _STEP,
            _LAYER,
            _KV_HEAD,
            _f("position", pa.int64(), "original position of the evicted token"),
            _f(
                "score",
                pa.float32(),
                "score that chose the victim: cumulative attention for h2o and heavy; "
                "the seeded draw of this step for random; 0 for local and sink (position decides)",
            ),
            _f("margin", pa.float32(), "lowest surviving eligible score - victim score (>= 0), same scores"),
            _f("age", pa.int64(), "step - position"),
            _f("left_recent", pa.bool_(), "the victim is the token that left the recent window this step"),
            _f("phase", pa.string(), "'prefill' or 'decode'", nullable=True),
            _Q_HEAD_OPT,
        ]
    ),
    "steps": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _STEP,
            _LAYER,
            _KV_HEAD,
            _f("min_heavy_score", pa.float32(), "lowest score among the heavy slots after the step", nullable=True),
            _f("promoted", pa.bool_(), "the token leaving the recent window survived (null: none left)", nullable=True),
            _f("exiting_position", pa.int64(), "position that left the recent window (null: none)", nullable=True),
            _f("kept", pa.int32(), "slots held after the step", nullable=True),
            _f("heavy_age_mean", pa.float32(), "mean age (step - position) of the heavy slots", nullable=True),
            _Q_HEAD_OPT,
        ]
    ),
    "replay": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _STEP,
            _LAYER,
            _f("q_head", pa.int16(), "query head index"),
            _KV_HEAD,
            _f("dropped_mass", pa.float32(), "full-cache teacher weight on positions not in the cache"),
        ]
    ),
    "replay_steps": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _STEP,
            _f("kl", pa.float32(), "KL(teacher || run) of the next-token distributions"),
            _f("top1_agree", pa.bool_(), "teacher and run agree on the most likely next token"),
            _f("teacher_logprob", pa.float32(), "teacher log-probability of the run's next token"),
        ]
    ),
    "oracle": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _STEP,
            _LAYER,
            _KV_HEAD,
            _f("position", pa.int64(), "original position of the evicted token (one row per eviction)"),
            _f(
                "teacher_score",
                pa.float32(),
                "full-cache teacher weight on the position over steps position..step, aggregated like gqa",
            ),
            _f(
                "teacher_future_mass",
                pa.float32(),
                "full-cache teacher weight on the position over steps after its eviction (teacher-forced)",
            ),
            _Q_HEAD_OPT,
        ]
    ),
    "run_logits": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _STEP,
            _f("token_id", pa.int32(), "token the run produced from this step's logits"),
            _f("token_logit", pa.float32(), "the run's logit of that token"),
            _f("top1_id", pa.int32(), "the run's most likely next token"),
            _f("top1_logit", pa.float32(), "the run's largest logit"),
            _f("lse", pa.float32(), "log-sum-exp of the run's logits (the softmax normaliser)"),
        ]
    ),
    "requests": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _f("prompt_len", pa.int64(), "prompt tokens of this request (padding excluded)"),
            _f("new_tokens", pa.int64(), "tokens generated for this request"),
            _f("answer", pa.string(), "decoded generated text", nullable=True),
            _f("task", pa.string(), "task name, when the run comes from the task suite", nullable=True),
            _f("expected", pa.string(), "expected answer of the task", nullable=True),
            _f("correct", pa.bool_(), "answer checker verdict (null: no checker)", nullable=True),
            _f(
                "heavy",
                pa.int32(),
                "heavy slot count of this request (a keep ratio resolved on its own "
                "prompt_len; the policy splits heavy + recent as H2OConfig.split); null: full cache",
                nullable=True,
            ),
            _f("recent", pa.int32(), "recent slot count of this request (see heavy); null: full cache", nullable=True),
            _f(
                "prompt_index",
                pa.int32(),
                "prompt this sequence continues, numbered across the run's generate calls",
                nullable=True,
            ),
            _f(
                "sample_index",
                pa.int32(),
                "which of the num_return_sequences sequences of its prompt (0-based)",
                nullable=True,
            ),
        ]
    ),
    "spec_segments": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _f("segment", pa.int32(), "verification segment of the request, numbered from 0 in order"),
            _f("step", pa.int64(), "query position of the segment's first token"),
            _f("proposed", pa.int32(), "tokens of the verification forward (draft, plus the last confirmed token)"),
            _f("accepted", pa.int32(), "tokens of the segment that stood (its first ones)"),
            _f("rolled_back", pa.int32(), "tokens taken back: proposed - accepted"),
            _f("undone_evictions", pa.int64(), "evictions of the rolled-back tokens, all layers and KV sets"),
            _f("mode", pa.string(), "'rollback' (applied, then undone) or 'defer' (never applied)"),
        ]
    ),
    "spec_undone": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _f("step", pa.int64(), "query position of the rolled-back token whose step evicted"),
            _LAYER,
            _KV_HEAD,
            _f("position", pa.int64(), "original position of the victim that was put back (or never left)"),
            _f("score", pa.float32(), "its score at that step, as in evictions.score"),
            _f("segment", pa.int32(), "spec_segments.segment it belongs to"),
            _Q_HEAD_OPT,
        ]
    ),
    "guard_steps": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _f("step", pa.int64(), "decode step the guard scored; the prefill's row carries prompt_len - 1"),
            _f("risk", pa.float32(), "the guard's risk in [0, 1] after this step (DESIGN.md §18.3)"),
            _f("margin", pa.float32(), "guard signal margin in [0, 1] (DESIGN.md §18.1)"),
            _f("trend", pa.float32(), "guard signal trend in [0, 1] (DESIGN.md §18.1)"),
            _f("uniform", pa.float32(), "guard signal uniform in [0, 1] (DESIGN.md §18.1)"),
            _f("far", pa.float32(), "guard signal far in [0, 1] (DESIGN.md §18.1)"),
            _f("entropy", pa.float32(), "guard signal entropy in [0, 1] (DESIGN.md §18.1)"),
            _f("dropped", pa.float32(), "guard signal dropped in [0, 1] (DESIGN.md §18.1)"),
            _f("structure", pa.float32(), "guard signal structure in [0, 1] (DESIGN.md §18.1)"),
            _f("refer", pa.float32(), "guard signal refer in [0, 1] (DESIGN.md §18.1)"),
            _f(
                "prefill",
                pa.float32(),
                "guard signal prefill in [0, 1] (DESIGN.md §18.1), null before v4",
                nullable=True,
            ),
            _f(
                "canary", pa.float32(), "guard signal canary in [0, 1] (DESIGN.md §18.1), null before v4", nullable=True
            ),
        ]
    ),
    "guard_events": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _f("step", pa.int64(), "decode step after which the guard acted"),
            _f("risk", pa.float32(), "the risk that reached the threshold"),
            _f("action", pa.string(), "what the guard did: raise, refill, canary or recall (DESIGN.md §18.2)"),
            _f("slots_before", pa.int32(), "slots per layer and KV set before the action"),
            _f("slots_after", pa.int32(), "slots per layer and KV set after it"),
            _f("evicted", pa.float32(), "positions already evicted, mean per layer and KV set: a raise keeps them out"),
            _f("seconds", pa.float32(), "recompute time of a refill (0 for a raise)", nullable=True),
        ]
    ),
    "culprits": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _f("position", pa.int64(), "prompt position of a culprit token: restored, it brings the answer back"),
            _f("text", pa.string(), "decoded text of the token", nullable=True),
            _f("rank", pa.int32(), "its rank among the search's candidates (0: most attended after eviction)"),
            _f("step", pa.int64(), "step of its first eviction in the parent run"),
            _LAYER,
            _KV_HEAD,
            _f("sets", pa.int32(), "layer/KV sets of the parent that evicted it before the first wrong token"),
            _f("phase", pa.string(), "'prefill' or 'decode': when it first left", nullable=True),
            _f("held", pa.string(), "'recent' (it left the recent window) or 'heavy' (lost its heavy slot)"),
            _f("score", pa.float32(), "its score at that eviction (evictions.score)", nullable=True),
            _f("margin", pa.float32(), "lowest surviving score - its score at that eviction", nullable=True),
            _f(
                "future_mass",
                pa.float32(),
                "full-cache teacher weight on it after its evictions, summed over the sets (the ranking)",
                nullable=True,
            ),
        ]
    ),
    "recalls": pa.schema(
        [
            _RUN_ID,
            _REQUEST,
            _f("step", pa.int64(), "decode step whose queries chose the entry (it is in the window from this step)"),
            _LAYER,
            _KV_HEAD,
            _Q_HEAD_OPT,
            _f("position", pa.int64(), "original position of the cold entry in the recall window"),
            _f("score", pa.float32(), "the score it carries into the window (DESIGN.md §2.13)"),
            _f("tier", pa.string(), "the cold store it came from: cpu or disk"),
            _f("bytes_read", pa.int64(), "K/V bytes read for it at this refill (0: it stayed in the window)"),
        ]
    ),
}
TABLE_NAMES: tuple[str, ...] = tuple(TABLES)
#: the tables a replay writes, all three replaced at once (DESIGN.md §6.1)
REPLAY_TABLES: tuple[str, ...] = ("replay", "replay_steps", "oracle")

#: Row identity of each table (the order the writer and ``load_run`` sort by).
KEYS: dict[str, tuple[str, ...]] = {
    "tokens": ("run_id", "request", "position"),
    "evictions": ("run_id", "request", "step", "layer", "kv_head", "position"),
    "steps": ("run_id", "request", "step", "layer", "kv_head"),
    "replay": ("run_id", "request", "step", "layer", "q_head"),
    "replay_steps": ("run_id", "request", "step"),
    "oracle": ("run_id", "request", "step", "layer", "kv_head", "position"),
    "run_logits": ("run_id", "request", "step"),
    "requests": ("run_id", "request"),
    "spec_segments": ("run_id", "request", "segment"),
    "spec_undone": ("run_id", "request", "segment", "step", "layer", "kv_head", "position"),
    "guard_steps": ("run_id", "request", "step"),
    "guard_events": ("run_id", "request", "step", "action"),
    "culprits": ("run_id", "request", "position"),
    "recalls": ("run_id", "request", "step", "layer", "kv_head", "position"),
}


# -- the value contract (DESIGN.md §5.5) -----------------------------------------------------------


class Range(NamedTuple):
    """The values a column may hold: ``lo <= v <= hi`` (None: no bound on that side).

    ``slack`` is the rounding a float column may show past a bound (a KL computed in float32
    can come out a hair below 0); NaN is outside every range.
    """

    lo: float | None
    hi: float | None
    slack: float = 0.0


_INDEX = Range(0, None)  # requests, steps, positions, layers, heads: counted from 0
#: rounding a sum of float32 weights or log-probabilities may show past its bound
FLOAT_SLACK = 1e-4

#: The range of every column the contract bounds, per table. The catalog checks every file
#: against it at scan time (integer columns from the Parquet footer's statistics, float
#: columns while the file is read through) and marks the run of a file that breaks it.
RANGES: dict[str, dict[str, Range]] = {
    "tokens": {"request": _INDEX, "position": _INDEX, "token_id": _INDEX},
    "evictions": {
        "request": _INDEX,
        "step": _INDEX,
        "layer": _INDEX,
        "kv_head": _INDEX,
        "q_head": _INDEX,
        "position": _INDEX,
        "age": _INDEX,
    },
    "steps": {
        "request": _INDEX,
        "step": _INDEX,
        "layer": _INDEX,
        "kv_head": _INDEX,
        "q_head": _INDEX,
        "exiting_position": _INDEX,
        "kept": _INDEX,
    },
    "replay": {
        "request": _INDEX,
        "step": _INDEX,
        "layer": _INDEX,
        "q_head": _INDEX,
        "kv_head": _INDEX,
        "dropped_mass": Range(0.0, 1.0, FLOAT_SLACK),
    },
    "replay_steps": {
        "request": _INDEX,
        "step": _INDEX,
        "kl": Range(0.0, None, FLOAT_SLACK),
        "teacher_logprob": Range(None, 0.0, FLOAT_SLACK),
    },
    "oracle": {
        "request": _INDEX,
        "step": _INDEX,
        "layer": _INDEX,
        "kv_head": _INDEX,
        "q_head": _INDEX,
        "position": _INDEX,
        "teacher_score": Range(0.0, None, FLOAT_SLACK),
        "teacher_future_mass": Range(0.0, None, FLOAT_SLACK),
    },
    "run_logits": {"request": _INDEX, "step": _INDEX, "token_id": _INDEX, "top1_id": _INDEX},
    "requests": {"request": _INDEX, "prompt_len": _INDEX, "new_tokens": _INDEX, "heavy": _INDEX, "recent": _INDEX},
    "spec_segments": {
        "request": _INDEX,
        "segment": _INDEX,
        "step": _INDEX,
        "proposed": _INDEX,
        "accepted": _INDEX,
        "rolled_back": _INDEX,
        "undone_evictions": _INDEX,
    },
    "spec_undone": {
        "request": _INDEX,
        "step": _INDEX,
        "layer": _INDEX,
        "kv_head": _INDEX,
        "q_head": _INDEX,
        "position": _INDEX,
        "segment": _INDEX,
    },
    "guard_steps": {
        "request": _INDEX,
        "step": _INDEX,
        "risk": Range(0.0, 1.0, FLOAT_SLACK),
        "margin": Range(0.0, 1.0, FLOAT_SLACK),
        "trend": Range(0.0, 1.0, FLOAT_SLACK),
        "uniform": Range(0.0, 1.0, FLOAT_SLACK),
        "far": Range(0.0, 1.0, FLOAT_SLACK),
        "entropy": Range(0.0, 1.0, FLOAT_SLACK),
        "dropped": Range(0.0, 1.0, FLOAT_SLACK),
        "structure": Range(0.0, 1.0, FLOAT_SLACK),
        "refer": Range(0.0, 1.0, FLOAT_SLACK),
        "prefill": Range(0.0, 1.0, FLOAT_SLACK),
        "canary": Range(0.0, 1.0, FLOAT_SLACK),
    },
    "guard_events": {
        "request": _INDEX,
        "step": _INDEX,
        "risk": Range(0.0, 1.0, FLOAT_SLACK),
        "slots_before": _INDEX,
        "slots_after": _INDEX,
        "evicted": Range(0.0, None, FLOAT_SLACK),
        "seconds": Range(0.0, None),
    },
    "culprits": {
        "request": _INDEX,
        "position": _INDEX,
        "rank": _INDEX,
        "step": _INDEX,
        "layer": _INDEX,
        "kv_head": _INDEX,
        "sets": Range(1, None),
        "margin": Range(0.0, None, FLOAT_SLACK),
        "future_mass": Range(0.0, None, FLOAT_SLACK),
    },
    "recalls": {
        "request": _INDEX,
        "step": _INDEX,
        "layer": _INDEX,
        "kv_head": _INDEX,
        "q_head": _INDEX,
        "position": _INDEX,
        "bytes_read": _INDEX,
    },
}

#: Columns bounded by a quantity of their request or of the run's model: ``span`` is the
#: request's ``prompt_len + new_tokens`` (positions and steps lie below it); ``layers``,
#: ``kv_heads`` and ``q_heads`` are the model's, from the manifest.
BOUNDED_BY: dict[str, str] = {
    "position": "span",
    "exiting_position": "span",
    "step": "span",
    "layer": "layers",
    "kv_head": "kv_heads",
    "q_head": "q_heads",
}

#: Tables whose steps and positions may lie past a request's tokens: a rolled-back draft token of
#: speculative decoding can sit after the request's last kept token (DESIGN.md §14).
SPAN_EXEMPT: tuple[str, ...] = ("spec_segments", "spec_undone")

#: Rows of one request at most: its ``new_tokens`` (steps P - 1 .. P + new_tokens - 2) times
#: these model quantities (``sets``: the KV sets, query heads for ``gqa='none'``).
ROWS_PER_REQUEST: dict[str, tuple[str, ...]] = {
    "replay_steps": (),
    "run_logits": (),
    "replay": ("layers", "q_heads"),
    "steps": ("layers", "sets"),
    "guard_steps": (),
}

#: Tables whose key (:data:`KEYS`, with ``q_head`` where the table has one) never repeats in a run.
UNIQUE: tuple[str, ...] = (
    "tokens",
    "steps",
    "replay",
    "replay_steps",
    "run_logits",
    "requests",
    "guard_steps",
    "culprits",
    "recalls",
)


def unique_key(table: str) -> tuple[str, ...]:
    """The columns whose values identify one row of a :data:`UNIQUE` table (``run_id`` left out)."""
    key = tuple(c for c in KEYS[table] if c != "run_id")
    if "q_head" in TABLES[table].names and "q_head" not in key:
        key += ("q_head",)
    return key


#: The ``runs`` view: one row per run, built from the manifests.
RUNS = pa.schema(
    [
        _RUN_ID,
        _f("status", pa.string(), "running | complete | failed | interrupted | unknown"),
        _f("model", pa.string(), "model id or path", nullable=True),
        _f("policy", pa.string(), "h2o | full | local | heavy | sink | random", nullable=True),
        _f(
            "heavy",
            pa.int32(),
            "heavy slot count (null: full cache, or budgets differ per request: see requests.heavy)",
            nullable=True,
        ),
        _f("recent", pa.int32(), "recent slot count (null as heavy; see requests.recent)", nullable=True),
        _f("gqa", pa.string(), "sum | max | none", nullable=True),
        _f("prompt_len", pa.int64(), "prompt tokens (longest request)", nullable=True),
        _f("new_tokens", pa.int64(), "generated tokens (longest request)", nullable=True),
        _f("created_at", pa.timestamp("us"), "start of the run, UTC", nullable=True),
        _f("finished_at", pa.timestamp("us"), "end of the run, UTC", nullable=True),
        _f("name", pa.string(), "free-form run name", nullable=True),
        _f("sink", pa.int32(), "sink slot count (sink policy)", nullable=True),
        _f("seed", pa.int64(), "seed of the random policy / sampling", nullable=True),
        _f("backend", pa.string(), "auto | torch | triton | cpp", nullable=True),
        _f("requests", pa.int32(), "number of requests in the run", nullable=True),
        _f("source_run", pa.string(), "run this one is paired with (e.g. the full-cache teacher)", nullable=True),
        _f("max_logit_diff", pa.float64(), "implementation check: max |logit difference| of the replay", nullable=True),
        _f("seconds_per_token", pa.float64(), "median decode step time (wall clock) of the generation", nullable=True),
        _f("prefill_seconds", pa.float64(), "prefill time of the generation (wall clock)", nullable=True),
        _f("task", pa.string(), "task name when the run comes from the task suite", nullable=True),
        _f("keep_ratio", pa.float64(), "budget as a share of the prompt, when given as a ratio", nullable=True),
        _f("error", pa.string(), "error message of a failed run", nullable=True),
        _f("error_type", pa.string(), "exception type of a failed run", nullable=True),
        _f("schema_version", pa.int32(), "log format version of the manifest", nullable=True),
        _f("config", pa.string(), "run configuration, JSON", nullable=True),
        _f("path", pa.string(), "run folder", nullable=True),
        _f(
            "integrity",
            pa.string(),
            "'ok' when every file of the run was read in full and matches the "
            "manifest's row counts; otherwise what is wrong (details in the problems view)",
            nullable=True,
        ),
        _f(
            "logit_tolerance",
            pa.float64(),
            "implementation check: largest accepted |logit difference|, derived from the run's dtype",
            nullable=True,
        ),
        _f(
            "parent_run",
            pa.string(),
            "run a counterfactual re-run explains (null: not a counterfactual)",
            nullable=True,
        ),
        _f(
            "counterfactual_kind",
            pa.string(),
            "full | pinned | oracle | policy_budget | oracle_budget | recall (DESIGN.md §6.10) | culprits "
            "(DESIGN.md §19)",
            nullable=True,
        ),
        _f("counterfactual_request", pa.int32(), "request of the parent run re-run", nullable=True),
        _f("counterfactual_slots", pa.int32(), "slot count of the re-run (null: full cache)", nullable=True),
        _f(
            "cold",
            pa.string(),
            "the cold tier's manifest object as JSON: its settings, what it moved, its hit rate (DESIGN.md §2.13)",
            nullable=True,
        ),
        _f(
            "plan",
            pa.string(),
            "the budget plan the run's H2O ran under, as JSON: slots or shares per layer and KV set (DESIGN.md §2.14)",
            nullable=True,
        ),
    ]
)

VIEW_NAMES: tuple[str, ...] = ("runs",) + TABLE_NAMES

#: ``runs.counterfactual_kind``: the re-runs of a failed request (DESIGN.md §6.10), in the order they run
COUNTERFACTUAL_KINDS: tuple[str, ...] = (
    "full",
    "pinned",
    "oracle",
    "policy_budget",
    "oracle_budget",
    "recall",
    "plan",
)
#: ``runs.counterfactual_kind`` of the culprit search's re-run: the 1-minimal set restored (DESIGN.md §19)
CULPRITS_KIND = "culprits"

_DUCKDB_TYPES = {
    pa.bool_(): "BOOLEAN",
    pa.int8(): "TINYINT",
    pa.int16(): "SMALLINT",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float32(): "FLOAT",
    pa.float64(): "DOUBLE",
    pa.string(): "VARCHAR",
    pa.timestamp("us"): "TIMESTAMP",
}


def table_schema(table: str) -> pa.Schema:
    """Return the declared schema of ``table`` or raise :class:`SchemaError`."""
    if table == "runs":
        return RUNS
    try:
        return TABLES[table]
    except KeyError:
        raise SchemaError(f"unknown table {table!r}; expected one of {', '.join(TABLE_NAMES)}") from None


def duckdb_type(type_: pa.DataType) -> str:
    """DuckDB SQL type name of a declared pyarrow type."""
    try:
        return _DUCKDB_TYPES[type_]
    except KeyError:
        raise SchemaError(f"no DuckDB type declared for {type_}") from None


def empty_table(table: str) -> pa.Table:
    """A zero-row table with the declared schema of ``table``."""
    return table_schema(table).empty_table()


def _is_scalar(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, (str, bytes, bool, numbers.Number, np.generic))
        or (isinstance(value, np.ndarray) and value.ndim == 0)
    )


def repeat_string(value: str, n: int) -> pa.Array:
    """A string array of ``n`` copies of ``value``, built from buffers (no Python list)."""
    data = value.encode()
    if (n + 1) * len(data) >= 2**31:
        raise SchemaError(
            f"{n} copies of {value!r} exceed 2 GiB in one string column; append the rows in smaller batches"
        )
    offsets = np.arange(n + 1, dtype=np.int32) * np.int32(len(data))
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data * n))


def _column(table: str, field: pa.Field, value: Any, n: int) -> pa.Array:
    where = f"column {table}.{field.name}"
    if _is_scalar(value):
        if value is None:
            return pa.nulls(n, field.type)
        if pa.types.is_string(field.type):
            return repeat_string(str(value), n)
        value = np.full(n, value)
    try:
        if isinstance(value, pa.ChunkedArray):
            value = value.combine_chunks()
        if isinstance(value, pa.Array):
            arr = value
        elif isinstance(value, np.ndarray) and value.dtype != object:
            mask = np.ma.getmaskarray(value) if isinstance(value, np.ma.MaskedArray) else None
            arr = pa.array(np.ma.getdata(value), mask=mask if mask is not None and mask.any() else None)
        else:
            arr = pa.array(value, type=field.type)
        if arr.type != field.type:
            arr = arr.cast(field.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as exc:
        raise SchemaError(
            f"{where}: cannot store the values as {field.type}: {exc}; pass values of type {field.type}"
        ) from exc
    if len(arr) != n:
        raise SchemaError(
            f"{where} has {len(arr)} rows, expected {n} like the other columns; pass columns of equal length"
        )
    if not field.nullable and arr.null_count:
        raise SchemaError(f"{where} holds {arr.null_count} nulls but is not nullable; fill the missing values")
    return arr


def to_arrow(table: str, columns: Mapping[str, Any], *, run_id: str | None = None) -> pa.Table:
    """Convert one batch of rows into a table with the declared schema.

    Parameters
    ----------
    table : str
        One of :data:`TABLE_NAMES`.
    columns : mapping of column name to array-like, shape (n,), or scalar
        Scalars are broadcast to ``n`` rows. Missing nullable columns become
        nulls; ``run_id`` defaults to the ``run_id`` argument.
    run_id : str, optional
        Value of the ``run_id`` column when ``columns`` lacks it.

    Raises
    ------
    SchemaError
        Unknown table or column, missing required column, unequal lengths,
        values that do not fit the declared type (e.g. overflow) or nulls in
        a required column.
    """
    schema = table_schema(table)
    unknown = sorted(set(columns) - set(schema.names))
    if unknown:
        raise SchemaError(
            f"table {table!r} has no column(s) {', '.join(unknown)}; declared columns: {', '.join(schema.names)}"
        )
    lengths = {len(v) for v in columns.values() if not _is_scalar(v)}
    if not lengths:
        raise SchemaError(f"table {table!r}: at least one column must be an array, got only scalars")
    if len(lengths) > 1:
        sizes = {k: len(v) for k, v in columns.items() if not _is_scalar(v)}
        raise SchemaError(f"table {table!r}: columns have unequal lengths {sizes}; pass columns of equal length")
    n = lengths.pop()
    arrays = []
    for field in schema:
        value = columns.get(field.name)
        if value is None and field.name == "run_id":
            value = run_id
        if value is None and not field.nullable:
            raise SchemaError(
                f"table {table!r} requires column {field.name!r} ({field.type}); it is missing from the batch"
            )
        arrays.append(_column(table, field, value, n))
    return pa.Table.from_arrays(arrays, schema=schema)


def schema_mismatches(table: str, file_schema: pa.Schema) -> list[str]:
    """Differences between a file's schema and the declaration that a reader cannot bridge.

    Extra columns are allowed (added by a later version); declared columns
    must have the declared type, and required ones must be present.
    """
    declared = table_schema(table)
    problems = []
    for field in declared:
        idx = file_schema.get_field_index(field.name)
        if idx < 0:
            if not field.nullable:
                problems.append(f"required column {field.name!r} is missing")
            continue
        found = file_schema.field(idx).type
        if found != field.type:
            problems.append(f"column {field.name!r} is {found}, expected {field.type}")
    return problems
