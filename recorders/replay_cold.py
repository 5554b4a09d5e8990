"""The replay of a run with a cold tier (DESIGN.md §2.13, §6.1): a recalled position is present
at the steps it was in the window.

The ``recalls`` table gives, per request, layer and refill step, the window's occupants; they are
in the window from that step to the layer's next refill. The masked forward lets a row see them
(so it reproduces the run's logits), and the dropped mass does not count the teacher's weight on
them. Both are computed densely over the generated rows (``O(Hq · M · N)`` per layer, ``M`` the
generated rows): a cold-tier run is replayed at that cost.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runlog import load_run

__all__ = ["load_recalls", "request_windows", "masked_attention", "window_mass"]


def load_recalls(run_dir: Path, manifest: dict) -> dict[str, np.ndarray] | None:
    """The run's recalls columns (request, step, layer, set, position), or None without a cold tier."""
    if not manifest.get("cold"):
        return None
    table = load_run(run_dir, tables=("recalls",))["recalls"]
    gqa_none = (manifest.get("config") or {}).get("gqa") == "none"
    head = "q_head" if gqa_none else "kv_head"
    names = ("request", "step", "layer", "position")
    cols = {k: table[k].to_numpy(zero_copy_only=False).astype(np.int64) for k in names}
    cols["set"] = table[head].fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return cols


def request_windows(rec: dict[str, np.ndarray], request: int, layers: int, sets: int, p: int, n: int):
    """Per layer ``(Hs, M, N)`` bool: position ``i`` was in the window of set ``h`` at step ``p + j``
    (``M = n - p`` generated rows fed, ``N = n`` positions); a layer with no recall is left out."""
    sel = rec["request"] == request
    out: dict[int, torch.Tensor] = {}
    m = n - p
    for layer in range(layers):
        on = sel & (rec["layer"] == layer) & (rec["position"] < n)
        if not on.any() or m <= 0:
            continue
        steps, sets_, pos = rec["step"][on], rec["set"][on], rec["position"][on]
        refills = np.unique(steps)
        present = np.zeros((sets, m, n), bool)
        for a, s in enumerate(refills):
            end = refills[a + 1] if a + 1 < len(refills) else n
            j0, j1 = max(s - p, 0), min(end - p, m)
            if j0 >= j1:
                continue
            here = steps == s
            for h, i in zip(sets_[here], pos[here]):
                present[h, j0:j1, i] = True
        out[layer] = torch.from_numpy(present)
    return out


def _visible(ev: torch.Tensor, present: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``(Hs, M, N)`` what each generated row saw: held (not yet evicted), recalled, and causal."""
    n = ev.shape[-1]
    cols = torch.arange(n)
    held = ev[:, None, :] >= rows[None, :, None]
    causal = cols[None, None, :] <= rows[None, :, None]
    return (held | present) & causal


def _logits(query, key, scaling):
    acc = torch.promote_types(query.dtype, torch.float32)
    hq, hs = query.shape[1], key.shape[1]
    k = key[0].repeat_interleave(hq // hs, 0).to(acc)  # (Hq, N, d)
    return torch.matmul(query[0].to(acc), k.transpose(-1, -2)) * scaling  # (Hq, M, N)


def masked_attention(query, key, value, ev, present, scaling):
    """The masked forward's attention of the generated rows ``query (1, Hq, M, d)`` over ``key,
    value (1, Hs, N, d)``: ``(1, Hq, M, d)``; ``ev (1, Hs, N)`` eviction steps, ``present`` the
    window (:func:`request_windows`)."""
    hq, m, n = query.shape[1], query.shape[2], key.shape[2]
    g = hq // key.shape[1]
    rows = torch.arange(n - m, n)
    seen = _visible(ev[0].cpu(), present, rows).repeat_interleave(g, 0).to(query.device)  # (Hq, M, N)
    logits = _logits(query, key, scaling).masked_fill(~seen, float("-inf"))
    w = torch.softmax(logits, -1)
    v = value[0].repeat_interleave(g, 0).to(w.dtype)
    return torch.matmul(w, v)[None].to(query.dtype)


def window_mass(query, key, ev, present, scaling):
    """``(Hq, M)`` the teacher's weight on positions that had left the policy's slots but were in
    the window at that step: what the dropped mass must not count."""
    hq, m, n = query.shape[1], query.shape[2], key.shape[2]
    g = hq // key.shape[1]
    rows = torch.arange(n - m, n)
    logits = _logits(query, key, scaling)
    causal = torch.arange(n)[None, :] <= rows[:, None]
    w = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
    gone = ev[0].cpu()[:, None, :] < rows[None, :, None]  # (Hs, M, N) left before the row's step
    back = (present & gone).repeat_interleave(g, 0).to(w.device)
    return (w * back).sum(-1)
