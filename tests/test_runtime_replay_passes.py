"""The replay's torch passes over the generated rows (DESIGN.md §6.1) against FP64 brute force.

``replay_teacher_torch``: full causal attention of the last M rows, with the dropped mass and the
oracle columns from the same tiles; ``replay_masked_torch``: the rows see only what the run kept.
"""

from __future__ import annotations

import pytest
import torch

from h2o_lens.kernels import KernelInputError, replay_dropped_mass_torch, replay_masked_torch, replay_teacher_torch

NEVER = 10**9


def _inputs(b, hq, hs, n, m, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, m, d, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(b, hs, n, d, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(b, hs, n, d + 3, generator=g, dtype=torch.float64)
    ev = torch.arange(n) + torch.randint(0, 8, (b, hs, n), generator=g)  # a position leaves at or after its step
    ev = torch.where(torch.rand(b, hs, n, generator=g) < 0.3, torch.full_like(ev, NEVER), ev)
    return q, k, v, ev


def _brute(q, k, v, ev, scaling, masked: bool):
    """Full ``(b, Hq, M, N)`` weights of the last M rows in FP64 and the attention output."""
    b, hq, m, _ = q.shape
    n = k.shape[2]
    group = hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    rows = torch.arange(n - m, n)[:, None]
    see = torch.arange(n)[None, :] <= rows  # (M, N)
    if masked:
        see = see & (ev.repeat_interleave(group, 1)[:, :, None, :] >= rows)  # (b, Hq, M, N)
    w = (q.double() @ kk.transpose(-1, -2) * scaling).masked_fill(~see, float("-inf")).softmax(-1)
    return w, w @ vv


@pytest.mark.parametrize("b, hq, hs, n, m, chunk", [(2, 6, 2, 41, 41, 7), (1, 4, 4, 37, 13, 5), (1, 8, 1, 30, 9, 64)])
@pytest.mark.parametrize("agg", [None, "sum", "max"])
def test_teacher_pass_equals_brute_force(b, hq, hs, n, m, chunk, agg):
    q, k, v, ev = _inputs(b, hq, hs, n, m, 16, seed=n + m)
    scaling = 16**-0.5
    w, want = _brute(q, k, v, ev, scaling, masked=False)
    got = replay_teacher_torch(q, k, v, ev, scaling, chunk=chunk, oracle=agg)
    assert len(got) == (2 if agg is None else 4)
    assert got[0].shape == (b, hq, m, 19) and torch.allclose(got[0], want, atol=1e-12, rtol=0)
    ref = replay_dropped_mass_torch(q, k, ev, scaling, chunk=3, oracle=agg)
    ref = (ref,) if agg is None else ref
    for name, x, y in zip(("dropped", "before", "after"), got[1:], ref):
        assert torch.allclose(x, y, atol=1e-12, rtol=0), name
    # dropped mass: the full row's weight on keys gone before the row's step
    gone = ev.repeat_interleave(hq // hs, 1)[:, :, None, :] < torch.arange(n - m, n)[:, None]
    assert torch.allclose(got[1], (w * gone).sum(-1), atol=1e-12, rtol=0)
    assert got[1].max() > 0.05


@pytest.mark.parametrize("b, hq, hs, n, m, chunk", [(2, 6, 2, 41, 41, 7), (1, 4, 4, 37, 13, 5), (1, 8, 1, 30, 9, 64)])
def test_masked_pass_equals_brute_force(b, hq, hs, n, m, chunk):
    q, k, v, ev = _inputs(b, hq, hs, n, m, 16, seed=3 * n + m)
    scaling = 16**-0.5
    _, want = _brute(q, k, v, ev, scaling, masked=True)
    _, full = _brute(q, k, v, ev, scaling, masked=False)
    got = replay_masked_torch(q, k, v, ev, scaling, chunk=chunk)
    assert got.shape == (b, hq, m, 19) and torch.allclose(got, want, atol=1e-12, rtol=0)
    assert not torch.allclose(got, full, atol=1e-3)  # the mask hid something


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_passes_compute_their_weights_in_fp32(dtype):
    """16-bit inputs: the logits are not rounded to the input dtype, so the outputs stay within
    the output dtype's rounding of the FP64 result (bf16 logits near 10 would be off by 0.03)."""
    q, k, v, ev = _inputs(1, 4, 2, 64, 20, 32, seed=5)
    q = q * 3  # large logits: rounding them to bf16 would move the weights visibly
    scaling = 32**-0.5
    cast = [t.to(dtype) for t in (q, k, v)]
    exact = [t.double() for t in cast]  # the same rounded inputs in FP64
    eps = torch.finfo(dtype).eps
    for masked, fn in ((False, replay_teacher_torch), (True, replay_masked_torch)):
        _, want = _brute(*exact[:2], exact[2], ev, scaling, masked=masked)
        got = fn(*cast, ev, scaling, chunk=8)
        out = got[0] if isinstance(got, tuple) else got
        assert out.dtype == dtype
        assert (out.double() - want).abs().max() <= 2 * eps * want.abs().max(), fn.__name__


def test_pass_inputs_are_checked():
    q, k, v, ev = _inputs(1, 4, 2, 10, 4, 8, seed=0)
    with pytest.raises(KernelInputError, match="value has shape"):
        replay_teacher_torch(q, k, v[:, :, :9], ev, 1.0)
    with pytest.raises(KernelInputError, match="value has dtype"):
        replay_masked_torch(q, k, v.float(), ev, 1.0)
    with pytest.raises(KernelInputError, match="chunk=0"):
        replay_masked_torch(q, k, v, ev, 1.0, chunk=0)
    with pytest.raises(KernelInputError, match="oracle='mean'"):
        replay_teacher_torch(q, k, v, ev, 1.0, oracle="mean")


def _largest_allocation(fn):
    """``fn()`` and the largest CPU allocation made while it ran, in bytes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return result, max(e.cpu_memory_usage for e in prof.events())


def _single_thread_largest_allocation(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fused kernel's scratch grows with the thread count
    try:
        return _largest_allocation(fn)
    finally:
        torch.set_num_threads(threads)


def _float_inputs(hq, hs, n, m, seed):
    """Float32 inputs whose value width is the key width (SDPA's fused CPU kernel, not its math path)."""
    q, k, v, _ = _inputs(1, hq, hs, n, m, 16, seed=seed)
    return q.float(), k.float(), v[..., :16].float().contiguous()


def test_masked_pass_builds_one_additive_mask_per_kv_set():
    """The G query heads of a KV set share its mask: no mask per query head is built, not even a
    boolean one (SDPA turns a boolean mask into a float mask of the same shape first)."""
    hq, hs, n, m, chunk = 8, 2, 4000, 64, 64
    q, k, v = _float_inputs(hq, hs, n, m, seed=7)
    g = torch.Generator().manual_seed(7)
    # every key is still held at the block's first row: all N keys take part
    ev = torch.randint(n - m, n, (1, hs, n), generator=g).maximum(torch.arange(n))
    ev = torch.where(torch.rand(1, hs, n, generator=g) < 0.5, torch.full_like(ev, NEVER), ev)
    got, largest = _single_thread_largest_allocation(lambda: replay_masked_torch(q, k, v, ev, 0.25, chunk=chunk))
    _, want = _brute(q, k, v, ev, 0.25, masked=True)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)
    assert largest >= chunk * n * 4  # the profiler saw one set's float mask over the N keys
    assert largest < hq * chunk * n, f"an allocation of {largest} bytes; a bool mask per query head is {hq * chunk * n}"


def test_masked_pass_leaves_out_the_keys_gone_for_the_whole_block():
    """Keys evicted before a block's first row take no part in its attention: with nine in ten of
    the prompt's keys gone, no mask over all N keys is built, and the output is the brute force's."""
    hq, hs, n, m, chunk = 8, 2, 4000, 64, 64
    q, k, v = _float_inputs(hq, hs, n, m, seed=9)
    g = torch.Generator().manual_seed(9)
    ev = torch.where(torch.rand(1, hs, n, generator=g) < 0.9, torch.arange(n), torch.full((1, hs, n), NEVER))
    ev[..., n - m :] = NEVER  # the generated rows are never evicted here
    got, largest = _single_thread_largest_allocation(lambda: replay_masked_torch(q, k, v, ev, 0.25, chunk=chunk))
    _, want = _brute(q, k, v, ev, 0.25, masked=True)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)
    over_all = chunk * n * 4  # one set's float mask over all N keys
    assert largest < over_all / 2, f"an allocation of {largest} bytes; a float mask over all keys is {over_all}"
    # in FP64 the same answer as the brute force, to rounding
    q, k, v = (t.double() for t in (q, k, v))
    _, want = _brute(q, k, v, ev, 0.25, masked=True)
    assert torch.allclose(replay_masked_torch(q, k, v, ev, 0.25, chunk=chunk), want, atol=1e-12, rtol=0)


def test_a_row_that_lost_nothing_has_the_teachers_bits():
    """The teacher's output is the masked pass with nothing evicted: a row that lost nothing has the
    same bits in both (its block leaves no key out), whatever later rows of its block lost."""
    hq, hs, n, m, chunk = 6, 3, 300, 90, 40
    q, k, v = _float_inputs(hq, hs, n, m, seed=13)
    first_loss = n - m + 50  # rows up to this step lose nothing; later rows lose most of the prompt
    ev = torch.full((1, hs, n), NEVER)
    ev[..., : n - m - 10] = first_loss
    ev[:, 1, 5:40] = first_loss + 7  # another set loses its keys later
    full = replay_masked_torch(q, k, v, torch.full_like(ev, NEVER), 0.25, chunk=chunk)
    got = replay_masked_torch(q, k, v, ev, 0.25, chunk=chunk)
    lossless = first_loss - (n - m) + 1  # rows t <= first_loss
    assert torch.equal(got[:, :, :lossless], full[:, :, :lossless])
    assert not torch.allclose(got[:, :, lossless:], full[:, :, lossless:], atol=1e-3)
    _, want = _brute(q, k, v, ev, 0.25, masked=True)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)


def test_teacher_tiles_hold_as_many_kv_sets_as_fit(monkeypatch):
    """Above ``TILE_BYTES`` the score tiles are split by KV set: the same bits as one tile of all
    the sets (the mixed columns are gathered per row block, not per tile), and no tile of two sets."""
    from h2o_lens.kernels import replay as kernels

    b, hq, hs, n, m, chunk = 1, 6, 3, 300, 50, 40
    q, k, v, ev = (t.float() if t.is_floating_point() else t for t in _inputs(b, hq, hs, n, m, 16, seed=11))
    whole = replay_teacher_torch(q, k, v, ev, 0.25, chunk=chunk, oracle="sum")  # one tile holds every set
    tile = b * (hq // hs) * chunk * n * 4  # one set's float32 tile
    monkeypatch.setattr(kernels, "TILE_BYTES", tile)
    split, largest = _largest_allocation(lambda: replay_teacher_torch(q, k, v, ev, 0.25, chunk=chunk, oracle="sum"))
    for name, x, y in zip(("out", "dropped", "before", "after"), whole, split):
        assert torch.equal(x, y), name
    assert largest < 2 * tile, f"an allocation of {largest} bytes; one set's tile is {tile}"


def test_masked_pass_gives_each_rows_log_sum_exp_on_cpu_float32():
    """``lse=True``: each row's log-sum-exp over the keys it saw, from the fused kernel that gave the
    output (the output's bits do not change); None where that kernel does not run."""
    hq, hs, n, m, chunk = 6, 3, 120, 40, 16
    q, k, v = _float_inputs(hq, hs, n, m, seed=17)
    ev = _inputs(1, hq, hs, n, m, 16, seed=17)[3]
    out, lse = replay_masked_torch(q, k, v, ev, 0.25, chunk=chunk, lse=True)
    assert torch.equal(out, replay_masked_torch(q, k, v, ev, 0.25, chunk=chunk))
    rows = torch.arange(n - m, n)[:, None]
    see = (torch.arange(n)[None, :] <= rows) & (ev.repeat_interleave(hq // hs, 1)[:, :, None, :] >= rows)
    logits = q.double() @ k.double().repeat_interleave(hq // hs, 1).transpose(-1, -2) * 0.25
    want = logits.masked_fill(~see, float("-inf")).logsumexp(-1)  # (1, Hq, M)
    assert lse.dtype == torch.float32 and torch.allclose(lse.double(), want, atol=1e-5, rtol=0)
    assert replay_masked_torch(q.double(), k.double(), v.double(), ev, 0.25, chunk=chunk, lse=True)[1] is None


@pytest.mark.parametrize("agg", ["sum", "max"])
def test_teacher_pass_with_the_rows_log_sum_exp(agg):
    """Given each row's log-sum-exp the tile pass takes its weights as exp(logit − lse): the same
    dropped mass and oracle columns as with a softmax, exactly so in FP64 and to rounding in FP32."""
    hq, hs, n, m, chunk = 6, 3, 90, 30, 8
    q, k, v, ev = _inputs(1, hq, hs, n, m, 16, seed=19)
    v = v[..., :16].contiguous()
    rows = torch.arange(n - m, n)[:, None]
    logits = q @ k.repeat_interleave(hq // hs, 1).transpose(-1, -2) * 0.25
    lse = logits.masked_fill(torch.arange(n)[None, :] > rows, float("-inf")).logsumexp(-1)  # (1, Hq, M)
    want = replay_teacher_torch(q, k, v, ev, 0.25, chunk=chunk, oracle=agg)
    got = replay_teacher_torch(q, k, v, ev, 0.25, chunk=chunk, oracle=agg, lse=lse)
    for name, x, y in zip(("out", "dropped", "before", "after"), got, want):
        assert torch.allclose(x, y, atol=1e-12, rtol=0), name
    # float32: the lse of the fused kernel that gives the teacher's output
    qf, kf, vf = q.float(), k.float(), v.float()
    _, lse32 = replay_masked_torch(qf, kf, vf, torch.full_like(ev, n), 0.25, chunk=chunk, lse=True)
    got = replay_teacher_torch(qf, kf, vf, ev, 0.25, chunk=chunk, oracle=agg, output=False, lse=lse32)
    for name, x, y in zip(("dropped", "before", "after"), got[1:], want[1:]):
        assert torch.allclose(x.double(), y, atol=2e-6 * max(1.0, float(y.abs().max())), rtol=0), name
    with pytest.raises(KernelInputError, match="lse has shape"):
        replay_teacher_torch(q, k, v, ev, 0.25, lse=lse[:, :, 1:])
