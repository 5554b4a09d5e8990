"""Triton kernels against the torch contract, the FP64 reference and brute force.

Discrete outputs (kept positions, victims, slots) must match exactly; outputs
and scores must stay within twice the error of a same-dtype torch computation
relative to FP64 (flash-attention's rule). Without CUDA the kernels run in
Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported),
so the shapes are tiny.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from h2o_lens.kernels._checks import interpret_mode

CUDA = torch.cuda.is_available()
if not CUDA:
    if "triton" in sys.modules and not interpret_mode():
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 was set; run the kernel tests "
            "with TRITON_INTERPRET=1 in the environment",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from h2o_lens import ops  # noqa: E402
from h2o_lens.errors import ConfigError  # noqa: E402
from h2o_lens.kernels import (  # noqa: E402
    KernelInputError,
    decode_step_triton,
    prefill_scores_triton,
    replay_dropped_mass_torch,
    replay_dropped_mass_triton,
    resolve_backend,
    triton_available,
)
from h2o_lens.reference import simulate  # noqa: E402

pytestmark = pytest.mark.kernel
DEV = torch.device("cuda" if CUDA else "cpu")
NEVER = 2**62  # evict_step of a position that never left the cache


def _assert_within(name: str, got: torch.Tensor, same: torch.Tensor, ref: torch.Tensor) -> None:
    """``|got - ref| <= 2 |same - ref| + a few ulps``: ``same`` is torch in got's dtype, ``ref`` FP64."""
    ref = ref.double()
    err = (got.double() - ref).abs().max().item()
    base = (same.double() - ref).abs().max().item()
    floor = 4 * torch.finfo(got.dtype).eps * max(1.0, ref.abs().max().item())
    assert err <= 2 * base + floor, f"{name}: kernel error {err:.3g} > 2 x torch error {base:.3g} + {floor:.2g}"


# ---------------------------------------------------------------------------------------------
# decode step: multi-step runs against ops.decode_step (same dtype and FP64) and the reference


@dataclass(frozen=True)
class Case:
    args: ops.PolicyArgs
    lens: tuple[int, ...]  # real prompt tokens per request (left padding up to the longest)
    steps: int
    hq: int
    hs: int
    d: int
    block_n: int | None = None
    seed: int = 0


CASES = {
    # GQA group 3, B = 11 (not a power of two), request 1 starts 4 slots short of full
    "h2o-sum-G3-fills": Case(ops.PolicyArgs("h2o", 6, 5, 0, "sum"), (15, 7), 6, hq=6, hs=2, d=64),
    # gqa none: one KV set per query head, group of 1
    "h2o-none-G1": Case(ops.PolicyArgs("h2o", 3, 2, 0, "none"), (9,), 6, hq=2, hs=2, d=16, seed=1),
    "h2o-max-G8": Case(ops.PolicyArgs("h2o", 4, 3, 0, "max"), (12,), 6, hq=8, hs=1, d=16, seed=2),
    # B = 37 over three blocks of 16 slots, head_dim 24 padded to 32
    "h2o-sum-G4-blocks": Case(ops.PolicyArgs("h2o", 20, 17, 0, "sum"), (45,), 4, hq=8, hs=2, d=24, block_n=16, seed=3),
    # heavy-only: recent == 0, the new token competes and may be its own victim
    "heavy-recent0-G2": Case(ops.PolicyArgs("heavy", 7, 0, 0, "sum"), (10, 8), 6, hq=4, hs=2, d=16, seed=4),
    "local": Case(ops.PolicyArgs("local", 0, 6, 0, "sum"), (9, 4), 5, hq=2, hs=1, d=16, seed=5),
    "sink": Case(ops.PolicyArgs("sink", 0, 4, 2, "sum"), (10,), 5, hq=2, hs=1, d=16, seed=6),
}


def _streams(case: Case, dtype=torch.float32):
    """Per-request token streams ``q (b, Hq, N, d)``, ``k, v (b, Hs, N, d)``; request r's
    position j is index j (prompt first, then the decoded tokens).

    Keys drift along one direction that every query shares, more with each position
    (a recency bias), so that newer tokens can outscore old heavy hitters and the
    heavy slots change hands during the run instead of freezing.
    """
    g = torch.Generator().manual_seed(case.seed)
    b, n = len(case.lens), max(case.lens) + case.steps
    u = torch.full((case.d,), case.d**-0.5)  # unit vector
    ramp = torch.arange(n)[:, None] / n  # (N, 1)
    q = torch.randn(b, case.hq, n, case.d, generator=g) * 1.5 + 4.0 * u
    k = torch.randn(b, case.hs, n, case.d, generator=g) * 1.5 + 4.0 * ramp * u
    v = torch.randn(b, case.hs, n, case.d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _prefill_state(q, k, v, lens, args, scaling):
    """Left-pad the prompts, run the torch prefill and lay the kept set out in slots as
    :meth:`h2o_lens.cache.H2OCacheLayer.prefill` does. Returns (state dict, fill or None)."""
    b, hq, _, d = q.shape
    hs, p, cap = k.shape[1], max(lens), args.capacity
    lens_t = torch.tensor(lens)
    valid = torch.arange(p)[None] >= (p - lens_t)[:, None]  # (b, P)
    idx = (torch.arange(p)[None] - (p - lens_t)[:, None]).clamp(min=0)  # stream index per column

    def pad(x):  # (b, H, N, d) -> (b, H, P, d), padding columns zeroed
        out = x.gather(2, idx[:, None, :, None].expand(b, x.shape[1], p, d))
        return out * valid[:, None, :, None]

    _, scores = ops.prefill_attention(pad(q).to(DEV), pad(k).to(DEV), pad(v).to(DEV), valid.to(DEV), scaling, args.gqa)
    pos = (valid.cumsum(-1) - 1).to(torch.int32).masked_fill(~valid, -1).to(DEV)
    positions = pos[:, None, :].expand(b, hs, p)
    keep = ops.prefill_select(scores, positions, args)
    order = torch.where(keep, positions, torch.iinfo(torch.int32).max).argsort(-1)[..., :cap]
    kept_pos = torch.where(keep.gather(-1, order), positions.gather(-1, order), -1)
    n = order.shape[-1]
    kp, vp = pad(k).to(DEV), pad(v).to(DEV)
    state = dict(
        keys=kp.new_zeros(b, hs, cap, d),
        values=vp.new_zeros(b, hs, cap, d),
        scores=torch.zeros(b, hs, cap, device=DEV),
        positions=torch.full((b, hs, cap), -1, dtype=torch.int32, device=DEV),
    )
    gidx = order[..., None].expand(b, hs, n, d)
    state["keys"][:, :, :n] = kp.gather(2, gidx)
    state["values"][:, :, :n] = vp.gather(2, gidx)
    state["scores"][:, :, :n] = torch.where(kept_pos >= 0, scores.gather(-1, order), 0.0).float()
    state["positions"][:, :, :n] = kept_pos
    fill = lens_t.clamp(max=cap).to(DEV)
    return state, (None if bool((fill >= cap).all()) else fill)


def _kept(positions: torch.Tensor) -> list[list[list[int]]]:
    """``(b, Hs, B)`` → sorted kept positions per request and KV set."""
    return [[sorted(p for p in row.tolist() if p >= 0) for row in req] for req in positions.cpu()]


def _reference(case: Case, q, k, scaling):
    """FP64 reference kept sets per request and KV set: ``[r][h][step]``."""
    a = case.args
    heavy, recent = a.heavy, a.recent
    gqa = "sum" if a.gqa == "none" else a.gqa
    group = case.hq // case.hs
    out = []
    for r, p in enumerate(case.lens):
        n = p + case.steps
        per = []
        for h in range(case.hs):
            logits = (
                q[r, h * group : (h + 1) * group, :n].double() @ k[r, h, :n].double().T * scaling
            ).numpy()  # (G, N, N)
            per.append(simulate(logits, p, heavy, recent, gqa))
        out.append(per)
    return out


def _step_inputs(q, k, v, lens, i):
    """The decode-step inputs of step i: stream index lens[r] + i per request."""
    t = torch.tensor(lens) + i
    rows = torch.arange(len(lens))
    new = dict(query=q[rows, :, t].to(DEV), key=k[rows, :, t].to(DEV), value=v[rows, :, t].to(DEV))
    return new, t.to(torch.int32).to(DEV)


def _clone(state, dtype=None):
    return {n: (x.to(dtype) if dtype is not None and x.is_floating_point() else x).clone() for n, x in state.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_decode_multi_step_matches_torch_and_reference(name):
    case = CASES[name]
    args, cap = case.args, case.args.capacity
    scaling = case.d**-0.5
    q, k, v = _streams(case)
    state, fill = _prefill_state(q, k, v, case.lens, args, scaling)
    history = [_kept(state["positions"])]
    for i in range(case.steps):
        new, step = _step_inputs(q, k, v, case.lens, i)
        same, ref = _clone(state), _clone(state, torch.float64)
        r_same = ops.decode_step(**new, **same, step=step, fill=fill, scaling=scaling, args=args)
        r_ref = ops.decode_step(
            **{n: x.double() for n, x in new.items()}, **ref, step=step, fill=fill, scaling=scaling, args=args
        )
        r_k = decode_step_triton(**new, **state, step=step, fill=fill, scaling=scaling, args=args, block_n=case.block_n)
        for other in (r_same, r_ref):
            assert torch.equal(r_k.slot, other.slot), f"step {i}: slots {r_k.slot.tolist()} vs {other.slot.tolist()}"
            assert torch.equal(r_k.evicts, other.evicts), f"step {i}: evicts differ"
        for other in (same, ref):
            assert torch.equal(state["positions"], other["positions"]), f"step {i}: positions differ"
        assert torch.equal(state["keys"], same["keys"]) and torch.equal(state["values"], same["values"])
        _assert_within(f"step {i} out", r_k.out, r_same.out, r_ref.out)
        _assert_within(f"step {i} scores", state["scores"], same["scores"], ref["scores"])
        history.append(_kept(state["positions"]))
        if fill is not None:
            fill = (fill + 1).clamp(max=cap)
            fill = None if bool((fill >= cap).all()) else fill

    if args.policy == "sink":  # no FP64 reference for sinks: the invariant instead
        for r, p in enumerate(case.lens):
            seen = p + case.steps
            expect = sorted(set(range(args.sink)) | set(range(seen - args.recent, seen)))
            assert history[-1][r][0] == expect
        return
    expected = _reference(case, q, k, scaling)
    for r in range(len(case.lens)):
        for h in range(case.hs):
            got = [history[s][r][h] for s in range(case.steps + 1)]
            assert got == expected[r][h], f"request {r}, KV set {h}: kept sets differ from the FP64 reference"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision_long_row(dtype):
    """B = 150 over three blocks; outputs and scores within twice torch's error in that dtype,
    and the victim equals the FP64 torch victim from the same rounded inputs."""
    g = torch.Generator().manual_seed(7)
    b, hq, hs, cap, d = 1, 4, 2, 150, 64
    args = ops.PolicyArgs("h2o", 100, 50, 0, "sum")
    state = dict(
        keys=torch.randn(b, hs, cap, d, generator=g).to(dtype).to(DEV),
        values=torch.randn(b, hs, cap, d, generator=g).to(dtype).to(DEV),
        scores=(torch.rand(b, hs, cap, generator=g) * 40).to(DEV),
        positions=torch.stack([torch.randperm(cap, generator=g) for _ in range(hs)])[None].to(torch.int32).to(DEV),
    )
    for i in range(2):
        new = {
            n: torch.randn(b, h, d, generator=g).to(dtype).to(DEV)
            for n, h in (("query", hq), ("key", hs), ("value", hs))
        }
        step = torch.tensor([cap + i], dtype=torch.int32, device=DEV)
        same, ref = _clone(state), _clone(state, torch.float64)
        r_same = ops.decode_step(**new, **same, step=step, fill=None, scaling=d**-0.5, args=args)
        r_ref = ops.decode_step(
            **{n: x.double() for n, x in new.items()}, **ref, step=step, fill=None, scaling=d**-0.5, args=args
        )
        r_k = decode_step_triton(**new, **state, step=step, fill=None, scaling=d**-0.5, args=args, block_n=64)
        assert r_k.out.dtype == dtype
        _assert_within("out", r_k.out, r_same.out, r_ref.out)
        _assert_within("scores", state["scores"], same["scores"], ref["scores"])
        assert torch.equal(r_k.slot, r_ref.slot) and torch.equal(state["positions"], ref["positions"])


def test_decode_4096_slots():
    """One step over B = 4096 slots in shuffled physical order (32 blocks)."""
    g = torch.Generator().manual_seed(8)
    cap, d = 4096, 16
    args = ops.PolicyArgs("h2o", 2048, 2048, 0, "sum")
    state = dict(
        keys=torch.randn(1, 1, cap, d, generator=g).to(DEV),
        values=torch.randn(1, 1, cap, d, generator=g).to(DEV),
        scores=(torch.rand(1, 1, cap, generator=g) * 100).to(DEV),
        positions=torch.randperm(cap, generator=g).view(1, 1, cap).to(torch.int32).to(DEV),
    )
    new = {n: torch.randn(1, 1, d, generator=g).to(DEV) for n in ("query", "key", "value")}
    step = torch.tensor([cap], dtype=torch.int32, device=DEV)
    same, ref = _clone(state), _clone(state, torch.float64)
    r_same = ops.decode_step(**new, **same, step=step, fill=None, scaling=0.25, args=args)
    r_ref = ops.decode_step(
        **{n: x.double() for n, x in new.items()}, **ref, step=step, fill=None, scaling=0.25, args=args
    )
    r_k = decode_step_triton(**new, **state, step=step, fill=None, scaling=0.25, args=args)
    assert torch.equal(r_k.slot, r_same.slot) and torch.equal(r_k.slot, r_ref.slot)
    assert torch.equal(state["positions"], same["positions"])
    _assert_within("out", r_k.out, r_same.out, r_ref.out)
    _assert_within("scores", state["scores"], same["scores"], ref["scores"])


# ---------------------------------------------------------------------------------------------
# designed ties: exact in binary, so every implementation sees the same tie


def _tie_state(positions, scores, d=16):
    cap = len(positions)
    g = torch.Generator().manual_seed(cap)
    return dict(
        keys=torch.randn(1, 1, cap, d, generator=g).to(DEV),
        values=torch.randn(1, 1, cap, d, generator=g).to(DEV),
        scores=torch.tensor(scores, dtype=torch.float32).view(1, 1, cap).to(DEV),
        positions=torch.tensor(positions, dtype=torch.int32).view(1, 1, cap).to(DEV),
    )


def _tie_steps(state, args, hq, first, steps, d=16):
    """Decode with zero queries (uniform weights); returns the victim positions per step
    (-1 none) and checks slots, evicts and positions against ops.decode_step."""
    victims = []
    g = torch.Generator().manual_seed(first)
    for i in range(steps):
        new = dict(
            query=torch.zeros(1, hq, d, device=DEV),
            key=torch.randn(1, 1, d, generator=g).to(DEV),
            value=torch.randn(1, 1, d, generator=g).to(DEV),
        )
        step = torch.tensor([first + i], dtype=torch.int32, device=DEV)
        before = state["positions"].clone()
        twin = _clone(state)
        r_t = ops.decode_step(**new, **twin, step=step, fill=None, scaling=1.0, args=args)
        r_k = decode_step_triton(**new, **state, step=step, fill=None, scaling=1.0, args=args)
        assert torch.equal(r_k.slot, r_t.slot) and torch.equal(r_k.evicts, r_t.evicts)
        assert torch.equal(state["positions"], twin["positions"])
        assert torch.allclose(state["scores"], twin["scores"], atol=1e-6, rtol=0)
        slot = r_k.slot.item()
        if not r_k.evicts.item():
            victims.append(-1)
        elif slot == before.shape[-1]:
            victims.append(first + i)  # the new token evicted itself
            assert torch.equal(state["positions"], before)
        else:
            victims.append(before[0, 0, slot].item())
    return victims


@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_decode_ties_evict_the_older_position(gqa):
    """Four heavy slots tied at every step, in shuffled physical order: they leave oldest first;
    then the lowest (newest decoded) token goes. Zero queries give each of the 8 candidates the
    weight 1/8 per head (aggregated: 1/4 summed, 1/8 max): tied scores stay bitwise equal."""
    state = _tie_state([5, 30, 2, 29, 0, 31, 3], [-1.0, 0.5, -1.0, 0.5, -1.0, 0.5, -1.0])
    victims = _tie_steps(state, ops.PolicyArgs("h2o", 4, 3, 0, gqa), hq=2, first=32, steps=5)
    assert victims == [0, 2, 3, 5, 33]


def test_decode_recent0_tie_and_self_eviction():
    """recent == 0: at step 8 all five candidates tie and the oldest (1) goes; from step 9 on the
    new token has the lowest score and evicts itself (slot == B, nothing written)."""
    state = _tie_state([7, 1, 4, 2], [0.0, 0.0, 0.0, 0.0])
    keys = state["keys"].clone()
    victims = _tie_steps(state, ops.PolicyArgs("heavy", 4, 0, 0, "sum"), hq=1, first=8, steps=3)
    assert victims == [1, 9, 10]
    assert sorted(state["positions"].flatten().tolist()) == [2, 4, 7, 8]
    assert torch.equal(state["keys"][0, 0, [0, 2, 3]], keys[0, 0, [0, 2, 3]])


def test_decode_random_policy_runs_the_torch_path():
    g = torch.Generator().manual_seed(11)
    state = dict(
        keys=torch.randn(1, 1, 5, 16, generator=g),
        values=torch.randn(1, 1, 5, 16, generator=g),
        scores=torch.zeros(1, 1, 5),
        positions=torch.arange(5, dtype=torch.int32).view(1, 1, 5),
    )
    new = {n: torch.randn(1, 1, 16, generator=g) for n in ("query", "key", "value")}
    args = ops.PolicyArgs("random", 2, 2, 0, "sum")
    twin = _clone(state)
    step = torch.tensor([5], dtype=torch.int32)
    r_t = ops.decode_step(**new, **twin, step=step, fill=None, scaling=0.25, args=args, layer=3)
    r_k = decode_step_triton(**new, **state, step=step, fill=None, scaling=0.25, args=args, layer=3)
    assert torch.equal(r_k.slot, r_t.slot) and torch.equal(state["positions"], twin["positions"])


# ---------------------------------------------------------------------------------------------
# prefill scores


@pytest.mark.parametrize(
    "b, hq, hs, p, d, gqa, pads, dtype",
    [
        (2, 6, 2, 37, 64, "sum", ((0, 0), (5, 0)), torch.float32),  # G=3, odd P, left padding
        (1, 4, 1, 21, 16, "max", None, torch.float32),  # G=4
        (2, 2, 2, 19, 16, "none", ((3, 0), (0, 4)), torch.float32),  # G=1; right padding: pad rows see keys
        (1, 8, 1, 33, 16, "sum", None, torch.float32),  # G=8
        (1, 3, 1, 17, 32, "max", ((2, 1),), torch.bfloat16),
    ],
)
def test_prefill_scores_match_prefill_attention(b, hq, hs, p, d, gqa, pads, dtype):
    """``pads`` gives (left, right) padding columns per request."""
    g = torch.Generator().manual_seed(p)
    q = (torch.randn(b, hq, p, d, generator=g) * 1.5).to(dtype).to(DEV)
    k = (torch.randn(b, hs, p, d, generator=g) * 1.5).to(dtype).to(DEV)
    valid = None
    if pads is not None:
        cols = torch.arange(p)[None]
        left, right = torch.tensor(pads).T[..., None]  # (b, 1) each
        valid = ((cols >= left) & (cols < p - right)).to(DEV)
    scaling = d**-0.5
    got = prefill_scores_triton(q, k, valid, scaling, gqa, block_m=16, block_n=16)
    _, same = ops.prefill_attention(q, k, k, valid, scaling, gqa)
    _, ref = ops.prefill_attention(q.double(), k.double(), k.double(), valid, scaling, gqa)
    assert got.shape == (b, hs, p) and got.dtype == torch.float32
    _assert_within("prefill scores", got, same.float(), ref)
    if valid is not None:
        assert bool((got[~valid[:, None, :].expand_as(got)] == 0).all())  # padding columns get nothing


# ---------------------------------------------------------------------------------------------
# replay dropped mass


def _brute_dropped_mass(q, k, evict_step, scaling):
    """FP64 full matrix: softmax of the causal row, summed over keys evicted before step t."""
    b, hq, n, _ = q.shape
    group = hq // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    logits = q.double() @ kk.transpose(-1, -2) * scaling  # (b, Hq, N, N)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    w = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    gone = evict_step.repeat_interleave(group, 1)[:, :, None, :] < torch.arange(n, device=q.device)[:, None]
    return (w * gone).sum(-1)


@pytest.mark.parametrize("b, hq, hs, n, d", [(2, 6, 2, 37, 16), (1, 2, 2, 29, 64)])
def test_replay_kernel_torch_and_brute_force_agree(b, hq, hs, n, d):
    g = torch.Generator().manual_seed(n)
    q = (torch.randn(b, hq, n, d, generator=g) * 1.5).to(DEV)
    k = (torch.randn(b, hs, n, d, generator=g) * 1.5).to(DEV)
    pos = torch.arange(n)
    ev = pos + torch.randint(0, 8, (b, hs, n), generator=g)  # a position leaves at or after its own step
    ev = torch.where(torch.rand(b, hs, n, generator=g) < 0.3, torch.full_like(ev, NEVER), ev)
    ev[..., :3] = 10  # evicted at step 10: still visible to query 10, dropped from query 11 on
    ev = ev.to(DEV)
    scaling = d**-0.5
    brute = _brute_dropped_mass(q, k, ev, scaling)
    ref = replay_dropped_mass_torch(q.double(), k.double(), ev, scaling, chunk=5)
    assert torch.allclose(ref, brute, atol=1e-12, rtol=0)
    same = replay_dropped_mass_torch(q, k, ev, scaling, chunk=7)
    got = replay_dropped_mass_triton(q, k, ev, scaling, block_m=16, block_n=16)
    assert got.shape == (b, hq, n) and got.dtype == torch.float32
    _assert_within("dropped mass", got, same, brute)


@pytest.mark.parametrize(
    "b, hq, hs, n, m, agg, dtype",
    [
        (2, 6, 2, 45, 45, "sum", torch.float32),
        (1, 6, 2, 53, 19, "max", torch.float32),
        (2, 4, 4, 40, 23, "sum", torch.bfloat16),
        (1, 8, 1, 37, 37, "max", torch.float16),
    ],
)
def test_replay_kernel_oracle_and_query_suffix_match_torch(b, hq, hs, n, m, agg, dtype):
    """The replay's own call: the last M positions' queries, plus the oracle's per-key weights
    split at the eviction step, aggregated like the run's gqa (sum / max)."""
    g = torch.Generator().manual_seed(n + m)
    q = (torch.randn(b, hq, m, 32, generator=g) * 1.5).to(DEV)
    k = (torch.randn(b, hs, n, 32, generator=g) * 1.5).to(DEV)
    ev = torch.arange(n) + torch.randint(0, 8, (b, hs, n), generator=g)
    ev = torch.where(torch.rand(b, hs, n, generator=g) < 0.3, torch.full_like(ev, NEVER), ev).to(DEV)
    scaling = 32**-0.5
    ref = replay_dropped_mass_torch(q.double(), k.double(), ev, scaling, chunk=9, oracle=agg)
    same = replay_dropped_mass_torch(q.to(dtype), k.to(dtype), ev, scaling, chunk=9, oracle=agg)
    got = replay_dropped_mass_triton(q.to(dtype), k.to(dtype), ev, scaling, oracle=agg, block_m=16, block_n=16)
    assert [t.shape for t in got] == [(b, hq, m), (b, hs, n), (b, hs, n)]
    for name, x, y, r in zip(("dropped mass", "before", "after"), got, same, ref):
        _assert_within(name, x, y, r)
    # every row's weights sum to one, so the oracle columns hold G per row under sum and
    # between 1 and G per row under max
    total = (got[1] + got[2]).sum(-1).double()
    group = hq // hs
    if agg == "sum":
        assert torch.allclose(total, torch.full_like(total, float(m * group)), rtol=1e-3)
    else:
        assert ((total >= m * (1 - 1e-3)) & (total <= m * group * (1 + 1e-3))).all()
    plain = replay_dropped_mass_triton(q.to(dtype), k.to(dtype), ev, scaling, block_m=16, block_n=16)
    assert torch.equal(plain, got[0])


def test_replay_eviction_step_boundary():
    """Uniform attention over 3 keys; position 0 left the cache at step 1: visible to query 1,
    dropped for query 2 (mass 1/3)."""
    q, k = torch.zeros(1, 1, 3, 16, device=DEV), torch.randn(1, 1, 3, 16, device=DEV)
    ev = torch.tensor([[[1, NEVER, NEVER]]], device=DEV)
    expect = torch.tensor([[[0.0, 0.0, 1 / 3]]], device=DEV)
    for fn in (replay_dropped_mass_torch, replay_dropped_mass_triton):
        assert torch.allclose(fn(q, k, ev, 1.0), expect, atol=1e-6), fn.__name__


# ---------------------------------------------------------------------------------------------
# launcher checks, backend choice, import without triton


def _decode_inputs(cap=5, d=16, dtype=torch.float32):
    return dict(
        query=torch.randn(1, 2, d, dtype=dtype),
        key=torch.randn(1, 1, d, dtype=dtype),
        value=torch.randn(1, 1, d, dtype=dtype),
        keys=torch.randn(1, 1, cap, d, dtype=dtype),
        values=torch.randn(1, 1, cap, d, dtype=dtype),
        scores=torch.zeros(1, 1, cap),
        positions=torch.arange(cap, dtype=torch.int32).view(1, 1, cap),
        step=torch.tensor([cap], dtype=torch.int32),
        fill=None,
        scaling=0.25,
        args=ops.PolicyArgs("h2o", 2, 3, 0, "sum"),
    )


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(scores=torch.zeros(1, 1, 5, dtype=torch.float64)), "scores has dtype float64"),
        (dict(keys=torch.randn(1, 1, 16, 5).transpose(-1, -2)), "keys .* not contiguous"),
        (dict(values=torch.randn(1, 1, 4, 16)), r"values has shape \(1, 1, 4, 16\), expected \(1, 1, 5, 16\)"),
        (dict(query=torch.randn(1, 3, 16), keys=torch.randn(1, 2, 5, 16)), "multiple of the 2 KV sets"),
        (dict(args=ops.PolicyArgs("full", 2, 3, 0, "sum")), "policy 'full'"),
        (dict(step=torch.tensor([5.0])), "step has dtype float32"),
    ],
)
def test_decode_launcher_rejects_bad_inputs(change, needle):
    kw = _decode_inputs()
    kw.update(change)
    with pytest.raises(KernelInputError, match=needle):
        decode_step_triton(**kw)


def test_launchers_reject_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelInputError, match="need a CUDA device"):
        decode_step_triton(**_decode_inputs())
    with pytest.raises(KernelInputError, match="TRITON_INTERPRET=1"):
        prefill_scores_triton(torch.randn(1, 2, 4, 16), torch.randn(1, 1, 4, 16), None, 0.25, "sum")
    with pytest.raises(KernelInputError, match="Hq must be a multiple"):
        replay_dropped_mass_triton(
            torch.randn(1, 3, 4, 16), torch.randn(1, 2, 4, 16), torch.zeros(1, 2, 4, dtype=torch.int64), 0.25
        )


def test_resolve_backend(monkeypatch):
    assert triton_available()
    assert resolve_backend("torch", "cuda") == "torch"
    assert resolve_backend("auto", "cpu") == "torch"
    if CUDA:
        assert resolve_backend("auto", "cuda") == "triton"
    else:
        assert resolve_backend("triton", "cpu") == "triton"  # TRITON_INTERPRET=1 here
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(ConfigError, match="unknown backend"):
        resolve_backend("cuda", "cpu")


_NO_TRITON = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton blocked for this test")
sys.meta_path.insert(0, _Block())
import torch
import h2o_lens.kernels as K
from h2o_lens.kernels import decode_step_triton, prefill_scores_triton, replay_dropped_mass_torch
assert not K.triton_available()
assert K.resolve_backend("auto", "cuda") == "torch"
q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8)
m = replay_dropped_mass_torch(q, k, torch.full((1, 1, 6), 99), 0.3)
assert m.shape == (1, 2, 6) and float(m.abs().max()) == 0.0
assert not any(n == "triton" or n.startswith("triton.") for n in sys.modules)
print("ok")
"""


def test_package_imports_and_torch_replay_runs_without_triton():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_replay_torch_with_query_suffix_equals_full_rows():
    """Queries holding only the last M positions (the generated part) give the same rows."""
    from h2o_lens.kernels import replay_dropped_mass_torch

    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 6, 21, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 21, 16, generator=g, dtype=torch.float64)
    ev = torch.randint(5, 30, (1, 2, 21), generator=g)
    full = replay_dropped_mass_torch(q, k, ev, 0.25, chunk=4)
    tail = replay_dropped_mass_torch(q[:, :, 13:], k, ev, 0.25, chunk=3)
    assert torch.allclose(full[..., 13:], tail)
    assert tail.abs().sum() > 0


def test_end_to_end_bench_runs_every_path_on_a_tiny_model(capsys):
    """The 32k / batch-8 GPU benchmark's code path at toy size (timings here mean nothing):
    every path decodes, the H2O caches hold B slots per layer and KV head, and the table prints."""
    from h2o_lens.kernels.bench import bench_end_to_end

    shape = dict(
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=300,
    )
    batch, context, keep = 3, 60, 0.2
    out = bench_end_to_end(
        context=context, batch=batch, keep=keep, steps=3, rounds=1, device=DEV, dtype=torch.float32, shape=shape
    )
    budget = round(keep * context)
    slots = shape["num_hidden_layers"] * batch * shape["num_key_value_heads"] * budget
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    for name in ("h2o triton", "h2o torch"):
        assert out[f"{name} KV bytes"] == 2 * slots * head_dim * 4
        assert out[f"{name} tokens/s"] > 0
    assert out["full KV bytes"] > out["h2o triton KV bytes"] * (1 / keep) * 0.9
    assert max(out["full ÷ full"], out["full dynamic ÷ full"]) == pytest.approx(1.0)
    text = capsys.readouterr().out
    assert "batch 3 x 60 tokens" in text and text.count("h2o ") >= 2


def test_kernels_compile_ahead_of_time_for_sm90():
    """The interpreter does not compile: the quick launch set goes through Triton's whole pipeline
    (PTX, then the wheel's ptxas to a cubin) for sm_90 in a process without TRITON_INTERPRET."""
    code = (
        "from h2o_lens.kernels.aot import compile_kernels\n"
        "done = compile_kernels([('cuda', 90, 32)], level='quick')\n"
        "print(len(done), sorted({c.kernel for c in done}), min(c.cubin_bytes for c in done))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    count, kernels, smallest = res.stdout.strip().split(" ", 1)[0], res.stdout, res.stdout.split()[-1]
    assert int(count) == 13
    for name in ("decode_step", "prefill_col_sums", "prefill_row_lse", "replay_dropped_mass", "replay_oracle"):
        assert name in kernels
    assert int(smallest) > 1000  # a real cubin, not an empty placeholder
