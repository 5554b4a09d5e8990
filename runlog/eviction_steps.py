"""The step at which each position left the cache, rebuilt from evictions rows.

Shared by the replay (:mod:`recorders.replay`) and the policy-case writer
(:mod:`recorders.policy_cases`): both rebuild the run's kept sets from the
written ``evictions`` table. Position ``i`` is visible to the query of step
``t`` while ``evict_step[i] >= t`` (a position evicted at step ``t`` is still
seen at ``t``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["NEVER", "evict_steps"]

#: eviction step of a position that never left the cache
NEVER = np.iinfo(np.int64).max // 2


def evict_steps(ev: dict[str, np.ndarray], layers: int, sets: int, n: int, gqa_none: bool) -> np.ndarray:
    """``(L, Hs, N)`` step at which each position left the cache (:data:`NEVER` if kept).

    Parameters
    ----------
    ev : evictions columns ``layer``, ``kv_head`` (or ``q_head`` with ``gqa_none``),
        ``position``, ``step`` as int64 arrays of equal length
    layers, sets : the model's layers and KV sets (KV heads, or query heads with ``gqa_none``)
    n : positions fed to the model; rows of positions ``>= n`` are left out
    gqa_none : the run kept one set per query head (``gqa="none"``)
    """
    out = np.full((layers, sets, n), NEVER, dtype=np.int64)
    head = ev["q_head"] if gqa_none else ev["kv_head"]
    ok = ev["position"] < n
    np.minimum.at(out, (ev["layer"][ok], head[ok], ev["position"][ok]), ev["step"][ok])
    return out
