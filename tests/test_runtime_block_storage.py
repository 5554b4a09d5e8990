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
    planned = block_storage(like, 1, 3, 410, 8)  # a budget plan's small layer: 38 padding slots of 410
    assert planned.untyped_storage().nbytes() == 3 * 448 * 8 * 4 and aligned_blocks(planned) is not None
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


def _tiny_cache(config, prompt: int = 900):
    """A tiny model's H2O cache after its prompt (torch backend, CPU) and the model."""
    from tiny import tiny_model

    from h2o_lens import h2o
    from h2o_lens.timing import Decoder

    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2, head_dim=16, vocab=256)
    ids = torch.randint(3, 256, (1, prompt), generator=torch.Generator().manual_seed(2))
    with h2o(model, config) as session:
        dec = Decoder(model, session.new_cache(), ids)
        dec.run(3)
    return dec.cache, model


def test_a_cold_tier_window_and_a_raised_budget_keep_the_block_storage():
    """Slots added past the storage (a cold tier's recall window, a guard's raise) are allocated
    in whole blocks again: the step still reads them as a view, not a copy every step."""
    from h2o_lens import H2OConfig
    from h2o_lens.cold_config import ColdTier
    from h2o_lens.guard_actions import grow_rows

    cache, _ = _tiny_cache(H2OConfig(heavy=410, recent=409, cold=ColdTier(recall=205)))  # 614 + a window of 205
    for layer in cache.layers:
        assert layer.keys.shape[2] == 819 and aligned_blocks(layer.keys) is not None
        assert aligned_blocks(layer.values) is not None
    cache, _ = _tiny_cache(H2OConfig(heavy=300, recent=300))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    grow_rows(cache, [0], [1000])
    for layer, (k, v) in zip(cache.layers, before):
        assert layer.keys.shape[2] == 1000 and aligned_blocks(layer.keys) is not None
        assert torch.equal(layer.keys[:, :, :600], k) and torch.equal(layer.values[:, :, :600], v)
        assert float(layer.keys[:, :, 600:].abs().sum()) == 0.0  # the new slots are empty


def test_moved_rows_and_a_restored_state_keep_the_block_storage():
    """A beam reorder moves each row with its padding (block storage, no second copy); a state
    saved and restored comes back in whole blocks; the numbers are the rows' own."""
    from tiny import tiny_model

    from h2o_lens import H2OConfig, h2o
    from h2o_lens.cache import H2OCache
    from h2o_lens.timing import Decoder

    model = tiny_model("llama", layers=2, q_heads=4, kv_heads=2, head_dim=16, vocab=256)
    ids = torch.randint(3, 256, (2, 900), generator=torch.Generator().manual_seed(3))
    cfg = H2OConfig(heavy=410, recent=409)
    with h2o(model, cfg) as session:
        dec = Decoder(model, session.new_cache(), ids)
        dec.run(2)
        cache = dec.cache
        before = [(layer.keys.clone(), layer.scores.clone()) for layer in cache.layers]
        cache.reorder_cache(torch.tensor([1, 0]))
        for layer, (k, s) in zip(cache.layers, before):
            assert aligned_blocks(layer.keys) is not None and aligned_blocks(layer.values) is not None
            assert torch.equal(layer.keys, k[[1, 0]]) and torch.equal(layer.scores, s[[1, 0]])
            assert float(aligned_blocks(layer.keys)[:, :, -1, 819 - 768 :].abs().sum()) == 0.0
        header, tensors = cache.export_state()
        fresh = H2OCache(cfg, model.config)
        fresh.import_state(header, tensors)
        for a, c in zip(cache.layers, fresh.layers):
            assert (
                aligned_blocks(c.keys) is not None and torch.equal(a.keys, c.keys) and torch.equal(a.values, c.values)
            )
