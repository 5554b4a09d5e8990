"""Helpers shared by the runtime tests: capture a run's own q/k and kept sets."""

from __future__ import annotations

import contextlib
from collections import defaultdict

import numpy as np
import torch

from h2o_lens import hooks, policies


class KeptRecorder:
    """A cache listener that keeps every layer's kept sets, step by step."""

    def __init__(self):
        self.kept = defaultdict(list)  # layer -> list of (b, Hs) lists of sorted positions

    def on_prefill(self, layer, ev):
        pos = torch.where(ev.keep, ev.positions, -1)
        self.kept[layer].append(_sets(pos))

    def on_decode(self, layer, ev):
        self.kept[layer].append(_sets(ev.kept))


def _sets(pos: torch.Tensor) -> list[list[list[int]]]:
    return [[sorted(p for p in row.tolist() if p >= 0) for row in req] for req in pos]


@contextlib.contextmanager
def capture_qk():
    """Record the post-RoPE queries and keys the H2O attention receives, per layer."""
    from transformers import AttentionInterface

    seen = defaultdict(lambda: {"q": [], "k": [], "scaling": None})

    def spy(module, query, key, value, attention_mask, **kw):
        rec = seen[module.layer_idx]
        rec["q"].append(query.detach().double().clone())
        rec["k"].append(key.detach().double().clone())
        rec["scaling"] = kw.get("scaling")
        return hooks.h2o_attention(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(hooks.ATTN_NAME, spy)
    try:
        yield seen
    finally:
        AttentionInterface.register(hooks.ATTN_NAME, hooks.h2o_attention)


def reference_sets(
    rec: dict,
    request: int,
    prefill: int,
    heavy: int,
    recent: int,
    gqa: str,
    offset: int = 0,
    policy: str = "h2o",
    pinned: tuple[int, ...] = (),
) -> list[list[list[int]]]:
    """Kept sets per step and KV set computed by the policy's FP64 reference from captured q/k.

    ``offset`` drops left-padding columns of the request; ``heavy, recent`` are the split
    the policy uses, ``pinned`` the positions it never evicts (DESIGN.md §2.11).
    """
    simulate = policies.get(policy).reference
    q = torch.cat(rec["q"], dim=2)[request, :, offset:]  # (Hq, N, d)
    k = torch.cat(rec["k"], dim=2)[request, :, offset:]  # (Hs, N, d)
    hq, hs = q.shape[0], k.shape[0]
    group = hq // hs
    scaling = rec["scaling"] or q.shape[-1] ** -0.5
    per_set = []
    for g in range(hs):
        logits = torch.einsum("hnd,md->hnm", q[g * group : (g + 1) * group], k[g]) * scaling
        per_set.append(simulate(logits.numpy(), prefill, heavy, recent, "sum" if gqa == "none" else gqa, pinned=pinned))
    steps = len(per_set[0])
    return [[per_set[g][s] for g in range(hs)] for s in range(steps)]


def assert_same_sets(runtime: list, expected: list, where: str) -> None:
    assert len(runtime) == len(expected), f"{where}: {len(runtime)} steps vs {len(expected)}"
    for s, (a, b) in enumerate(zip(runtime, expected)):
        assert a == b, f"{where}, step {s}: runtime kept {a} but the FP64 reference kept {b}"


def np_seed(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def slot_kept_sets(q, k, v, prefill: int, args, scores, keep, history=None) -> list[list[int]]:
    """Lay a prefill's kept set into ``args.capacity`` slots and decode the rest with the torch step.

    One request and one KV set: ``q (1, G, N, d)``, ``k, v (1, 1, N, d)``; ``scores`` and
    ``keep (1, 1, P)`` the prefill's ranking values and kept mask, ``history`` its per-position
    history (a policy that keeps one) or None. Returns the sorted kept positions after the
    prefill, then after each decode step (the contract of the FP64 references).
    """
    from h2o_lens import ops

    n, d = q.shape[2], q.shape[3]
    cap = args.capacity
    pos = torch.arange(prefill, dtype=torch.int32)[None, None]
    kept_pos = pos[keep].tolist()
    out = [sorted(kept_pos)]
    slots_pos = torch.full((1, 1, cap), -1, dtype=torch.int32)
    slots_pos[0, 0, : len(kept_pos)] = torch.tensor(kept_pos, dtype=torch.int32)
    keys = torch.zeros(1, 1, cap, d, dtype=torch.float64)
    values = torch.zeros_like(keys)
    sc = torch.zeros(1, 1, cap, dtype=torch.float64)
    slot_history = torch.zeros(1, 1, cap, dtype=torch.int64) if history is not None else None
    for j, p in enumerate(kept_pos):
        keys[0, 0, j], values[0, 0, j], sc[0, 0, j] = k[0, 0, p], v[0, 0, p], scores[0, 0, p]
        if slot_history is not None:
            slot_history[0, 0, j] = history[0, 0, p]
    fill = torch.tensor([len(kept_pos)])
    for t in range(prefill, n):
        ops.decode_step(
            q[:, :, t],
            k[:, :, t],
            v[:, :, t],
            keys,
            values,
            sc,
            slots_pos,
            torch.tensor([t], dtype=torch.int32),
            fill if fill.item() < cap else None,
            1.0,
            args,
            history=slot_history,
            protected=torch.tensor(args.pinned, dtype=torch.int64) if args.pinned else None,
        )
        fill = (fill + 1).clamp(max=cap)
        out.append(sorted(p for p in slots_pos[0, 0].tolist() if p >= 0))
    return out


def left_pad(seqs, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D token tensors as one left-padded batch: ``(ids, attention_mask)``, ``pad`` in the gaps."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :], mask[i, width - len(s) :] = s, 1
    return ids, mask
