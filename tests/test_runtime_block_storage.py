"""Slot storage in whole blocks (DESIGN.md §2.7): the torch decode step reads an aligned layer's
blocks as one view of its storage, with the same bits as padding and copying them."""

from __future__ import annotations

import pytest
import torch

from h2o_lens import ops
from h2o_lens.ops import DECODE_BLOCK, PolicyArgs, block_storage
from h2o_lens.slot_blocks import aligned_blocks


def _state(b, hs, cap, d, dtype, aligned, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(b, hs, cap, d, generator=g).to(dtype) for _ in range(2))
    if aligned:
        k, v = block_storage(keys, b, hs, cap, d), block_storage(values, b, hs, cap, d)
        k.copy_(keys)
        v.copy_(values)
        keys, values = k, v
    scores = torch.rand(b, hs, cap, generator=g)
    positions = torch.arange(cap, dtype=torch.int32).expand(b, hs, cap).clone()
    return keys, values, scores, positions


def test_block_storage_pads_rows_to_whole_blocks_only_where_it_is_cheap():
    like = torch.zeros(1)
    wide = block_storage(like, 2, 3, 819, 8)
    assert wide.shape == (2, 3, 819, 8) and wide.untyped_storage().nbytes() == 2 * 3 * 832 * 8 * 4
    assert aligned_blocks(wide).shape == (2, 3, 13, DECODE_BLOCK, 8)
    assert float(aligned_blocks(wide)[:, :, -1, 819 - 768 :].abs().sum()) == 0.0  # the padding is zeros
    small = block_storage(like, 2, 3, 100, 8)  # 28 padding slots of 100: not worth it
    assert small.is_contiguous() and small.untyped_storage().nbytes() == 2 * 3 * 100 * 8 * 4
    assert aligned_blocks(small) is None
    assert aligned_blocks(wide[:, :, :800]) is None  # another view of it: not the storage's own


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("b, cap", [(1, 819), (3, 1100), (2, 1024)])
def test_decode_steps_on_aligned_storage_have_the_bits_of_plain_storage(dtype, b, cap):
    hs, hq, d = 2, 6, 16
    args = PolicyArgs("h2o", cap // 2, cap - cap // 2, 0, "sum")
    plain = _state(b, hs, cap, d, dtype, aligned=False)
    aligned = _state(b, hs, cap, d, dtype, aligned=True)
    assert getattr(aligned[0], "_h2o_blocks", False) == (cap % DECODE_BLOCK != 0)
    g = torch.Generator().manual_seed(1)
    step = torch.full((b,), cap, dtype=torch.int64)
    for i in range(4):
        q, k, v = (torch.randn(b, h, d, generator=g).to(dtype) for h in (hq, hs, hs))
        r_plain = ops.decode_step(q, k, v, *plain, step + i, None, d**-0.5, args)
        r_aligned = ops.decode_step(q, k, v, *aligned, step + i, None, d**-0.5, args)
        assert torch.equal(r_plain.out, r_aligned.out) and torch.equal(r_plain.weights, r_aligned.weights)
        assert torch.equal(r_plain.slot, r_aligned.slot)
        for a, c in zip(plain, aligned):
            assert torch.equal(a, c)  # keys, values, scores and positions after the step
