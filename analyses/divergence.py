"""Teacher-forced divergence and free-generation comparison (DESIGN.md §6).

``replay_steps`` holds, per step, KL(teacher ‖ run) of the next-token
distributions, whether the two agree on the most likely token and the
teacher's log-probability of the run's token. Teacher forcing makes both
read the same tokens, so it measures the cache approximation itself. Free
generation (the paired full-cache run's own tokens) shows whether small
errors were amplified; it is reported separately, never mixed in.
"""

from __future__ import annotations

import duckdb

from ._base import Source, check_positive, connect, relation, run_info

__all__ = ["replay_series", "divergence_summary", "paired_runs", "free_generation"]


def replay_series(source: Source, run_id: str) -> duckdb.DuckDBPyRelation:
    """KL, top-1 agreement and teacher log-probability per (request, step)."""
    sql = """
        SELECT request, step, kl, top1_agree, teacher_logprob FROM replay_steps
        WHERE run_id = $run ORDER BY request, step
    """
    return relation(connect(source), sql, run=run_id)


def divergence_summary(source: Source, run_id: str, *, kl_high: float | None = None) -> duckdb.DuckDBPyRelation:
    """Per request: KL statistics, top-1 agreement and the first divergence step.

    The first divergence step is the first step whose top-1 token differs
    from the teacher's, or whose KL reaches ``kl_high`` when given.

    Returns
    -------
    relation
        ``request, steps, kl_mean, kl_max, kl_p95, top1_agreement, disagreements,
        first_divergence_step, kl_at_divergence, teacher_nll_mean``.
    """
    if kl_high is not None:
        check_positive("kl_high", kl_high)
    sql = """
        WITH s AS (
            SELECT request, step, kl, top1_agree, teacher_logprob,
                   (NOT top1_agree) OR ($kl_high IS NOT NULL AND kl >= $kl_high) AS diverged
            FROM replay_steps WHERE run_id = $run
        )
        SELECT request, count(*) AS steps, avg(kl) AS kl_mean, max(kl) AS kl_max,
               quantile_cont(kl, 0.95) AS kl_p95, avg(top1_agree::INT) AS top1_agreement,
               count(*) FILTER (WHERE NOT top1_agree) AS disagreements,
               min(step) FILTER (WHERE diverged) AS first_divergence_step,
               arg_min(kl, step) FILTER (WHERE diverged) AS kl_at_divergence,
               -avg(teacher_logprob) AS teacher_nll_mean
        FROM s GROUP BY request ORDER BY request
    """
    return relation(connect(source), sql, run=run_id, kl_high=kl_high)


def paired_runs(source: Source, run_id: str) -> list[str]:
    """Runs linked to ``run_id`` through ``runs.source_run`` (either direction), full-cache first."""
    con = connect(source)
    run_info(con, run_id)
    sql = """
        SELECT run_id FROM runs
        WHERE run_id <> $run AND (run_id = (SELECT source_run FROM runs WHERE run_id = $run)
                                  OR source_run = $run)
        ORDER BY policy IS DISTINCT FROM 'full', run_id
    """
    return [r[0] for r in relation(con, sql, run=run_id).fetchall()]


def free_generation(source: Source, run_id: str, other: str | None = None) -> duckdb.DuckDBPyRelation | None:
    """Compare the generated tokens of ``run_id`` with a paired run's, per request.

    ``other`` defaults to the first of :func:`paired_runs`; None when there is none.

    Returns
    -------
    relation or None
        ``request, other_run, prompt_mismatches, compared, agreement,
        first_diff_position, generated, other_generated``: ``agreement`` is the
        share of equal token ids over generated positions both runs hold.
    """
    con = connect(source)
    if other is None:
        pairs = paired_runs(con, run_id)
        if not pairs:
            return None
        other = pairs[0]
    run_info(con, other)
    sql = """
        WITH a AS (SELECT request, position, token_id, is_prompt FROM tokens WHERE run_id = $run),
             b AS (SELECT request, position, token_id, is_prompt FROM tokens WHERE run_id = $other),
             j AS (SELECT request, position, a.token_id AS ta, b.token_id AS tb,
                          a.is_prompt AS pa, b.is_prompt AS pb
                   FROM a FULL OUTER JOIN b USING (request, position))
        SELECT request, $other AS other_run,
               count(*) FILTER (WHERE pa AND pb AND ta <> tb) AS prompt_mismatches,
               count(*) FILTER (WHERE NOT pa AND NOT pb) AS compared,
               avg((ta = tb)::INT) FILTER (WHERE NOT pa AND NOT pb) AS agreement,
               min(position) FILTER (WHERE NOT coalesce(pa, false) AND ta IS DISTINCT FROM tb)
                   AS first_diff_position,
               count(*) FILTER (WHERE NOT pa) AS generated,
               count(*) FILTER (WHERE NOT pb) AS other_generated
        FROM j GROUP BY request ORDER BY request
    """
    return relation(con, sql, run=run_id, other=other)
