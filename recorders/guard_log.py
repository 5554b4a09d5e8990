"""The guard's rows of a recorded run: ``guard_steps`` and ``guard_events`` (DESIGN.md §18.5)."""

from __future__ import annotations

from typing import Any

import numpy as np

from h2o_lens.guard import SIGNALS

__all__ = ["write_guard_rows"]


def write_guard_rows(writer: Any, cache: Any, last_step: dict[int, int] | None = None) -> int:
    """Append what the guard of ``cache`` logged since the last call to ``writer``; returns the
    ``guard_steps`` rows written. ``last_step`` maps a request to its last decode step that made a
    token (``P + n − 2`` for ``n`` new tokens): the steps ``generate`` runs on a row after its EOS
    are padding and are left out. A cache without a guard writes nothing."""
    state = getattr(cache, "guard", None)
    if state is None:
        return 0
    done_steps, done_events = getattr(state, "written", (0, 0))
    rows = state.risk_rows(start=done_steps)
    if last_step:
        rows = [r for r in rows if r["step"] <= last_step.get(r["request"], r["step"])]
    if rows:
        cols: dict[str, Any] = {
            "request": np.array([r["request"] for r in rows], np.int32),
            "step": np.array([r["step"] for r in rows], np.int64),
            "risk": np.array([r["risk"] for r in rows], np.float32),
        }
        cols.update({name: np.array([r[name] for r in rows], np.float32) for name in SIGNALS})
        writer.append("guard_steps", cols)
    events = state.event_rows()[done_events:]
    if events:
        writer.append(
            "guard_events",
            {
                "request": np.array([e["request"] for e in events], np.int32),
                "step": np.array([e["step"] for e in events], np.int64),
                "risk": np.array([e["risk"] for e in events], np.float32),
                "action": np.array([e["action"] for e in events], object),
                "slots_before": np.array([e["slots_before"] for e in events], np.int32),
                "slots_after": np.array([e["slots_after"] for e in events], np.int32),
                "evicted": np.array([e["evicted"] for e in events], np.float32),
                "seconds": np.array([e.get("seconds", 0.0) for e in events], np.float32),
            },
        )
    state.written = (len(state.steps), len(state.events))
    return len(rows)
