"""The CPU prefill with scores (flash output and log-sum-exp, then a tiled column pass)
against the chunked softmax reference, padded and unpadded, in every GQA mode."""

import pytest
import torch

from h2o_lens import ops


def _qkv(b, hq, hs, p, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, p, d, generator=g) * 1.5 for h in (hq, hs, hs))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _left_pad(b, p, lens):
    valid = torch.zeros(b, p, dtype=torch.bool)
    for r, n in enumerate(lens):
        valid[r, p - n :] = True
    return valid


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 3 positions by 4 keys, so tiny prompts cross many tile borders and the diagonal."""
    monkeypatch.setattr(ops, "COLUMN_ROWS", 3)
    monkeypatch.setattr(ops, "KEY_BLOCK", 4)


@pytest.mark.parametrize("gqa", ["sum", "max", "none"])
@pytest.mark.parametrize("hq,hs", [(4, 2), (3, 3), (6, 1)])
@pytest.mark.parametrize("pad", [False, True])
def test_flash_prefill_equals_the_fp64_chunked_reference(small_tiles, gqa, hq, hs, pad):
    b, p, d = 3, 23, 8
    q, k, v = _qkv(b, hq, hs, p, d, seed=hq * 10 + hs)
    valid = _left_pad(b, p, [23, 9, 16]) if pad else None
    out, scores = ops.prefill_attention(q, k, v, valid, 0.3, gqa, chunk=5)
    ref_out, ref_scores = ops._prefill_masked(q.double(), k.double(), v.double(), valid, 0.3, gqa, 7)
    assert out.dtype == torch.float32 and scores.dtype == torch.float32
    assert out.shape == (b, p, hq, d) and scores.shape == (b, hs, p)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores.double(), ref_scores, rtol=1e-5, atol=1e-5)
    if pad:  # padding columns score 0, padding rows see only themselves
        assert (scores[1, :, : p - 9] == 0).all()
        assert torch.equal(out[1, 0], v[1, :, 0].repeat_interleave(hq // hs, 0))


def test_every_column_sum_is_a_softmax_share(small_tiles):
    """Σ_i score_i = number of real query rows × heads per set (each softmax row sums to 1)."""
    q, k, v = _qkv(2, 4, 2, 19, 8, seed=3)
    valid = _left_pad(2, 19, [19, 11])
    _, scores = ops.prefill_attention(q, k, v, valid, 0.5, "sum")
    torch.testing.assert_close(scores.sum(-1), torch.tensor([[38.0, 38.0], [22.0, 22.0]]))


def test_a_padded_row_has_the_bits_of_the_row_alone(small_tiles):
    q, k, v = _qkv(3, 4, 2, 21, 8, seed=5)
    lens = [21, 8, 13]
    valid = _left_pad(3, 21, lens)
    out, scores = ops.prefill_attention(q, k, v, valid, 0.4, "max")
    for r, n in enumerate(lens):
        s = 21 - n
        one, alone = ops.prefill_attention(
            q[r : r + 1, :, s:], k[r : r + 1, :, s:], v[r : r + 1, :, s:], None, 0.4, "max"
        )
        assert torch.equal(out[r, s:], one[0]), f"row {r}"
        assert torch.equal(scores[r, :, s:], alone[0]), f"row {r}"


def test_padding_with_holes_takes_the_chunked_path():
    q, k, v = _qkv(2, 4, 2, 12, 8, seed=7)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 4] = False  # a hole: no single real span
    assert ops._contiguous_spans(valid) is None
    out, scores = ops.prefill_attention(q, k, v, valid, 0.4, "sum")
    ref_out, ref_scores = ops._prefill_masked(q.double(), k.double(), v.double(), valid, 0.4, "sum", 5)
    torch.testing.assert_close(scores.double(), ref_scores, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    assert (scores[1, :, 4] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_prefill_scores_follow_the_reference(small_tiles, dtype):
    q, k, v = _qkv(2, 4, 2, 17, 16, seed=11, dtype=dtype)
    valid = _left_pad(2, 17, [17, 10])
    out, scores = ops.prefill_attention(q, k, v, valid, 0.25, "sum")
    ref_out, ref_scores = ops._prefill_masked(q.double(), k.double(), v.double(), valid, 0.25, "sum", 4)
    assert out.dtype == dtype and scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), ref_scores, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref_out, rtol=3e-2, atol=3e-2)


def test_default_tiles_on_a_longer_prompt():
    """The shipped tile sizes, a prompt longer than several tiles, against FP64."""
    q, k, v = _qkv(1, 6, 2, 700, 16, seed=13)
    out, scores = ops.prefill_attention(q, k, v, None, 0.25, "sum", chunk=512)
    ref_out, ref_scores = ops._prefill_masked(q.double(), k.double(), v.double(), None, 0.25, "sum", 128)
    torch.testing.assert_close(scores.double(), ref_scores, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
