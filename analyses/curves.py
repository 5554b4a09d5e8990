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

import duckdb

from ._base import Source, check_positive, connect, relation

__all__ = ["kv_footprint", "run_curve_points"]


def kv_footprint(source: Source, run_id: str, *, page_size: int = 16) -> duckdb.DuckDBPyRelation:
    """Kept tokens and held pages after the last step, as shares of the full cache.

    Returns
    -------
    relation
        ``request, sets, positions, kept_share, page_share, pages_held, pages_total``:
        ``kept_share`` = kept positions / (positions × KV sets of the full cache),
        ``page_share`` = positions in held pages / the same (the physical share
        with pages of ``page_size``; a partly used last page counts whole).
    """
    con = connect(source)
    check_positive("page_size", page_size)
    sql = """
        WITH last AS (
            SELECT request, max(position) AS last FROM tokens WHERE run_id = $run GROUP BY request
        ), sets AS (
            SELECT DISTINCT request, layer, kv_head, q_head FROM steps WHERE run_id = $run
        ), kv AS (
            SELECT request, count(DISTINCT (layer, kv_head)) AS kv_sets, count(*) AS sets
            FROM sets GROUP BY request
        ), ev AS (
            SELECT e.request, e.layer, e.kv_head, e.q_head, e.position // $ps AS page, count(*) AS n
            FROM evictions e JOIN last l ON l.request = e.request
            WHERE e.run_id = $run AND e.position < l.last
            GROUP BY ALL
        ), freed AS (  -- pages whose every processed position was evicted
            SELECT ev.request, count(*) AS pages
            FROM ev JOIN last l ON l.request = ev.request
            WHERE ev.n = least($ps, l.last - ev.page * $ps)
            GROUP BY ev.request
        ), gone AS (
            SELECT e.request, count(*) AS n FROM evictions e JOIN last l ON l.request = e.request
            WHERE e.run_id = $run AND e.position < l.last GROUP BY e.request
        )
        SELECT l.request,
               coalesce(kv.sets, 0) AS sets,
               l.last AS positions,  -- processed positions 0 .. last-1 (the last token is never fed)
               CASE WHEN kv.sets IS NULL THEN 1.0
                    ELSE (l.last * kv.sets - coalesce(g.n, 0)) / (l.last * kv.kv_sets)::DOUBLE END AS kept_share,
               CASE WHEN kv.sets IS NULL THEN 1.0
                    ELSE least(1.0, ((ceil(l.last / $ps) * kv.sets - coalesce(f.pages, 0)) * $ps)
                                    / (ceil(l.last / $ps) * $ps * kv.kv_sets)::DOUBLE) END AS page_share,
               CASE WHEN kv.sets IS NULL THEN NULL
                    ELSE ceil(l.last / $ps) * kv.sets - coalesce(f.pages, 0) END AS pages_held,
               CASE WHEN kv.sets IS NULL THEN NULL ELSE ceil(l.last / $ps) * kv.sets END AS pages_total
        FROM last l LEFT JOIN kv ON kv.request = l.request
        LEFT JOIN freed f ON f.request = l.request LEFT JOIN gone g ON g.request = l.request
        ORDER BY l.request
    """
    return relation(con, sql, run=run_id, ps=int(page_size))


def run_curve_points(source: Source, run_ids: list[str], *, page_size: int = 16) -> duckdb.DuckDBPyRelation:
    """One row per run: policy, gqa, keep ratio, accuracy, mean KL, footprints and latency."""
    con = connect(source)
    check_positive("page_size", page_size)
    parts = []
    for i, run_id in enumerate(run_ids):
        fp = kv_footprint(con, run_id, page_size=page_size)
        parts.append(
            fp.aggregate("avg(kept_share) AS kept_share, avg(page_share) AS page_share").project(f"*, {i} AS idx")
        )
    if not parts:
        return relation(con, "SELECT NULL::VARCHAR AS run_id WHERE false")
    fp = parts[0]
    for p in parts[1:]:
        fp = fp.union(p)
    fp.create_view("_fp_points", replace=True)
    sql = """
        WITH ids AS (SELECT unnest($runs) AS run_id, generate_subscripts($runs, 1) - 1 AS idx)
        SELECT r.run_id, r.policy, r.gqa, r.heavy, r.recent, r.keep_ratio, r.task,
               (SELECT avg(correct::INT) FROM requests q WHERE q.run_id = r.run_id) AS accuracy,
               (SELECT avg(kl) FROM replay_steps s WHERE s.run_id = r.run_id) AS kl_mean,
               (SELECT avg(dropped_mass) FROM replay d WHERE d.run_id = r.run_id) AS dropped_mass,
               f.kept_share, f.page_share, r.seconds_per_token
        FROM ids JOIN runs r ON r.run_id = ids.run_id JOIN _fp_points f ON f.idx = ids.idx
        ORDER BY ids.idx
    """
    return relation(con, sql, runs=list(run_ids))
