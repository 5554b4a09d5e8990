"""The three deployment curves over keep ratio (DESIGN.md §6, §8.2).

* quality: answer accuracy and KL(teacher ‖ run) per run;
* physical KV footprint, token- and page-granular: a page of ``page_size``
  positions can be freed only once every position in it has been evicted,
  so scattered heavy hitters keep pages alive;
* per-token latency (the recorder's ``seconds_per_token``).

Footprints are ratios to the full cache of the same tokens (multiply by the
full cache's bytes to get bytes); they count the state after the last
processed step, per request, layer and KV set.
"""

from __future__ import annotations

from typing import Any

import duckdb

from ._base import Source, check_positive, connect, manifest_at, relation

__all__ = ["kv_footprint", "run_curve_points", "curve_runs", "curve_table"]

#: bytes of one element of each dtype a manifest names
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def kv_footprint(source: Source, run_id: str, *, page_size: int = 16) -> duckdb.DuckDBPyRelation:
    """Kept tokens and held pages after the last step, as shares of the full cache.

    Returns
    -------
    relation
        ``request, sets, positions, kept_share, page_share, pages_held, pages_total``:
        ``kept_share`` = kept positions / (positions × KV sets of the full cache),
        ``page_share`` = positions in held pages / the same (the physical share
        with pages of ``page_size``; a partly used last page counts whole). A cold tier's
        recall window counts as held: the entries it holds after the last refill (its own
        pages in ``page_share``), since its slots are part of the hot budget.
    """
    rel = _footprints(connect(source), [run_id], page_size)
    return rel.project("request, sets, positions, kept_share, page_share, pages_held, pages_total").order("request")


_FOOTPRINTS = """
    WITH ids AS MATERIALIZED (SELECT DISTINCT unnest($runs) AS run_id),
    last AS MATERIALIZED (
        SELECT run_id, request, max(position) AS last FROM tokens
        WHERE run_id IN (SELECT run_id FROM ids) GROUP BY run_id, request
    ), sets AS (
        SELECT DISTINCT run_id, request, layer, kv_head, q_head FROM steps WHERE run_id IN (SELECT run_id FROM ids)
    ), kv AS (
        SELECT run_id, request, count(DISTINCT (layer, kv_head)) AS kv_sets, count(*) AS sets
        FROM sets GROUP BY run_id, request
    ), ev AS MATERIALIZED (
        SELECT e.run_id, e.request, e.layer, e.kv_head, e.q_head, e.position // $ps AS page, count(*) AS n
        FROM evictions e JOIN last l ON l.run_id = e.run_id AND l.request = e.request
        WHERE e.position < l.last
        GROUP BY ALL
    ), freed AS (  -- pages whose every processed position was evicted
        SELECT ev.run_id, ev.request, count(*) AS pages
        FROM ev JOIN last l ON l.run_id = ev.run_id AND l.request = ev.request
        WHERE ev.n = least($ps, l.last - ev.page * $ps)
        GROUP BY ev.run_id, ev.request
    ), gone AS (  -- every eviction of a processed position, counted once in ev
        SELECT run_id, request, sum(n) AS n FROM ev GROUP BY run_id, request
    ), last_refill AS (  -- a cold tier's last refill per request (DESIGN.md §2.13)
        SELECT run_id, request, max(step) AS step FROM recalls WHERE run_id IN (SELECT run_id FROM ids)
        GROUP BY run_id, request
    ), win AS (  -- the window's entries after it, per set: hot slots inside B that evictions do not count
        SELECT w.run_id, w.request, count(*) AS n
        FROM recalls w JOIN last_refill m ON m.run_id = w.run_id AND m.request = w.request AND m.step = w.step
        GROUP BY w.run_id, w.request, w.layer, w.kv_head, w.q_head
    ), held AS (
        SELECT run_id, request, sum(n) AS n, sum(ceil(n / $ps)) AS pages FROM win GROUP BY run_id, request
    )
    SELECT l.run_id, l.request,
           coalesce(kv.sets, 0) AS sets,
           l.last AS positions,  -- processed positions 0 .. last-1 (the last token is never fed)
           CASE WHEN kv.sets IS NULL THEN 1.0
                ELSE (l.last * kv.sets - coalesce(g.n, 0) + coalesce(h.n, 0))
                     / (l.last * kv.kv_sets)::DOUBLE END AS kept_share,
           CASE WHEN kv.sets IS NULL THEN 1.0
                ELSE least(1.0, ((ceil(l.last / $ps) * kv.sets - coalesce(f.pages, 0) + coalesce(h.pages, 0)) * $ps)
                                / (ceil(l.last / $ps) * $ps * kv.kv_sets)::DOUBLE) END AS page_share,
           CASE WHEN kv.sets IS NULL THEN NULL
                ELSE ceil(l.last / $ps) * kv.sets - coalesce(f.pages, 0) + coalesce(h.pages, 0) END AS pages_held,
           CASE WHEN kv.sets IS NULL THEN NULL ELSE ceil(l.last / $ps) * kv.sets END AS pages_total
    FROM last l LEFT JOIN kv ON kv.run_id = l.run_id AND kv.request = l.request
    LEFT JOIN freed f ON f.run_id = l.run_id AND f.request = l.request
    LEFT JOIN gone g ON g.run_id = l.run_id AND g.request = l.request
    LEFT JOIN held h ON h.run_id = l.run_id AND h.request = l.request
    ORDER BY l.run_id, l.request
"""


def _footprints(con: duckdb.DuckDBPyConnection, run_ids: list[str], page_size: int) -> duckdb.DuckDBPyRelation:
    """:func:`kv_footprint` of many runs in one query: ``run_id`` first, then its columns."""
    check_positive("page_size", page_size)
    return relation(con, _FOOTPRINTS, runs=list(run_ids), ps=int(page_size))


def run_curve_points(source: Source, run_ids: list[str], *, page_size: int = 16) -> duckdb.DuckDBPyRelation:
    """One row per run: policy, gqa, keep ratio, accuracy, mean KL, footprints and latency."""
    con = connect(source)
    check_positive("page_size", page_size)
    if not run_ids:
        return relation(con, "SELECT NULL::VARCHAR AS run_id WHERE false")
    # one query over all the runs (not one per run): a sweep's curve may span thousands
    fp = _footprints(con, run_ids, page_size).aggregate(
        "run_id, avg(kept_share) AS kept_share, avg(page_share) AS page_share", "run_id"
    )
    fp.create_view("_fp_points", replace=True)
    sql = """
        WITH ids AS (SELECT unnest($runs) AS run_id, generate_subscripts($runs, 1) - 1 AS idx),
        t AS (  -- sums and counts the scan took per segment (recorders.create_views)
            SELECT run_id, table_name || '.' || column_name AS col, sum(total) / nullif(sum(n), 0) AS mean
            FROM h2o_lens_catalog.totals WHERE run_id IN (SELECT run_id FROM ids) GROUP BY ALL
        ),
        q AS (SELECT run_id, mean AS accuracy FROM t WHERE col = 'requests.correct'),
        s AS (SELECT run_id, mean AS kl_mean FROM t WHERE col = 'replay_steps.kl'),
        d AS (SELECT run_id, mean AS dropped_mass FROM t WHERE col = 'replay.dropped_mass')
        SELECT r.run_id, r.policy, r.gqa, r.heavy, r.recent, r.keep_ratio, r.task,
               q.accuracy, s.kl_mean, d.dropped_mass,
               f.kept_share, f.page_share, r.seconds_per_token
        FROM ids JOIN runs r ON r.run_id = ids.run_id LEFT JOIN _fp_points f ON f.run_id = ids.run_id
        LEFT JOIN q ON q.run_id = ids.run_id LEFT JOIN s ON s.run_id = ids.run_id
        LEFT JOIN d ON d.run_id = ids.run_id
        ORDER BY ids.idx
    """
    return relation(con, sql, runs=list(run_ids))


def curve_runs(source: Source) -> list[str]:
    """The runs of a root that lie on its curves: complete, not a re-run of another, of a task,
    without the guard (a guarded run holds another slot count than its keep ratio says)."""
    con = connect(source)
    rows = relation(
        con,
        "SELECT run_id, path FROM runs WHERE status = 'complete' AND parent_run IS NULL AND task IS NOT NULL "
        "ORDER BY run_id",
    ).fetchall()
    return [run_id for run_id, path in rows if not manifest_at(path).get("guard")]


def curve_table(source: Source, run_ids: list[str], *, page_size: int = 16) -> Any:
    """The three curves of recorded runs (a demo root's, :func:`curve_runs`) as the sweep page
    draws them (:func:`analyses.sweep_figure`): one row per policy and keep ratio (the full cache
    at 1), with the means over its runs of accuracy, KL, dropped mass, kept and page shares,
    their physical KV bytes per token (the full cache's from each run's model shape and dtype)
    and the median per-token latency in ms.

    Returns a pandas DataFrame, ``attrs["policy_of"]`` mapping each curve label to its policy.
    """
    con = connect(source)
    points = run_curve_points(con, run_ids, page_size=page_size).df()
    paths = dict(
        relation(con, "SELECT run_id, path FROM runs WHERE list_contains($ids, run_id)", ids=run_ids).fetchall()
    )
    per_token = [_kv_bytes_per_token(manifest_at(paths.get(r)).get("model")) for r in points["run_id"]]
    points = points.assign(
        keep_ratio=points["keep_ratio"].fillna(1.0),  # the full cache keeps every position
        kv_bytes=points["kept_share"] * per_token,
        paged_bytes=points["page_share"] * per_token,
    )
    table = points.groupby(["policy", "keep_ratio"], as_index=False).agg(
        accuracy=("accuracy", "mean"),
        kl_mean=("kl_mean", "mean"),
        dropped_mass=("dropped_mass", "mean"),
        kv_share=("kept_share", "mean"),
        page_share=("page_share", "mean"),
        ms_per_token=("seconds_per_token", lambda s: 1e3 * s.median()),
        kv_bytes_per_token=("kv_bytes", "mean"),
        paged_bytes_per_token=("paged_bytes", "mean"),
        runs=("run_id", "count"),
    )
    table = table.sort_values(["policy", "keep_ratio"], ascending=[True, False]).reset_index(drop=True)
    table.attrs["policy_of"] = {p: p for p in table["policy"]}
    return table


def _kv_bytes_per_token(model: Any) -> float:
    """K and V bytes of one position in a full cache, all layers, from a manifest's ``model``."""
    if not isinstance(model, dict):
        return float("nan")
    try:
        size = _ITEMSIZE[str(model.get("dtype"))]
        return 2.0 * int(model["num_layers"]) * int(model["num_kv_heads"]) * int(model["head_dim"]) * size
    except (KeyError, TypeError, ValueError):
        return float("nan")
