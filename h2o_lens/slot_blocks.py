"""The torch decode step's blocks of slots (DESIGN.md §2.7): their width, the storage that holds
them whole, and the view or copy the step reads them from."""

from __future__ import annotations

import torch

__all__ = [
    "ALIGN_SHARE",
    "BLOCK_BACKENDS",
    "DECODE_BLOCK",
    "aligned_blocks",
    "block_storage",
    "blocks",
    "moved",
    "rebased",
    "widened",
]

#: Slots per block of the torch decode step. Every matmul and reduction over slots works on
#: blocks of this fixed width and the block results are added in order, so a row's result does
#: not depend on how wide the storage is (a request equals itself alone, DESIGN.md §2.7).
DECODE_BLOCK = 64


#: the backends whose caches hold block storage: the torch step's, and the compiled CPU step's (which
#: reads any layout, and falls back to the torch step for a recorder's weights or a rollback)
BLOCK_BACKENDS = ("torch", "cpp")

#: :func:`block_storage` pads a row to whole blocks only when the padding is at most 1/ALIGN_SHARE of it:
#: a layer left plain copies its slots into blocks at every step (a budget plan's small layers, 410
#: slots at 4k, took 5 % longer per step than uniform H2O at 1/16, the same time at 1/4)
ALIGN_SHARE = 4


def block_storage(like: torch.Tensor, b: int, hs: int, cap: int, d: int) -> torch.Tensor:
    """Zeroed slot storage ``(b, Hs, cap, d)`` whose rows are allocated :data:`DECODE_BLOCK`-aligned:
    a view of ``(b, Hs, ⌈cap / K⌉ · K, d)`` zeros. The torch decode step then reads every block,
    the last partial one with its zero padding, as one view of the storage (:func:`_blocks`): the
    same numbers it would pad and copy, without the copies (DESIGN.md §2.7). Where the padding
    would exceed 1/:data:`ALIGN_SHARE` of the slots (small caches, whose copies cost little), or
    ``cap`` is a whole number of blocks, plain zeros."""
    wide = -(-cap // DECODE_BLOCK) * DECODE_BLOCK
    if wide == cap or (wide - cap) * ALIGN_SHARE > cap:  # aligned already, or the padding would cost too much
        return like.new_zeros(b, hs, cap, d)
    view = like.new_zeros(b, hs, wide, d)[:, :, :cap]
    view._h2o_blocks = True  # its padding past cap stays zero: nothing writes past a row's slots
    return view


def widened(t: torch.Tensor, extra: int, empty: float | int, blocks: bool) -> torch.Tensor:
    """``t (b, Hs, B, ...)`` with ``extra`` slots holding ``empty`` appended on the slot axis (an
    extension's slots, a raised budget). Slot storage (4-D keys or values) of a torch-step cache
    (``blocks``) is allocated again by :func:`block_storage`, so a widened layer still reads its
    blocks as a view (a concatenation would leave plain storage, copied every step)."""
    if blocks and t.dim() == 4:
        b, hs, w, d = t.shape
        out = block_storage(t, b, hs, w + extra, d)
        out[:, :, :w] = t
        if empty:
            out[:, :, w:] = empty
        return out
    shape = list(t.shape)
    shape[2] = extra
    return torch.cat([t, t.new_full(shape, empty)], 2)


def moved(t: torch.Tensor, move) -> torch.Tensor:
    """``move`` (a reorder, repeat or selection of the batch axis) applied to ``t``; on
    :func:`block_storage` it moves each row with its zero padding, so the result is block
    storage too, without a second copy."""
    if aligned_blocks(t) is None:
        return move(t)
    b, hs, w, d = t.shape
    whole = t.as_strided((b, hs, -(-w // DECODE_BLOCK) * DECODE_BLOCK, d), t.stride())
    out = move(whole)
    if not out.is_contiguous():
        return out[:, :, :w].contiguous()
    view = out[:, :, :w]
    view._h2o_blocks = True
    return view


def rebased(t: torch.Tensor) -> torch.Tensor:
    """Slot storage ``t (b, Hs, B, d)`` copied into :func:`block_storage` where that pads it to
    whole blocks (a restored state's tensors), else ``t`` itself."""
    if t.dim() != 4 or aligned_blocks(t) is not None:
        return t
    out = block_storage(t, *t.shape)
    if not getattr(out, "_h2o_blocks", False):
        return t
    out.copy_(t)
    return out


def aligned_blocks(x: torch.Tensor) -> torch.Tensor | None:
    """``x``'s slots and their zero padding as ``(b, Hs, n, K, d)`` blocks when ``x`` is a
    :func:`block_storage` view (the same object), else None."""
    if not getattr(x, "_h2o_blocks", False) or x.dim() != 4:
        return None
    b, hs, w, d = x.shape
    n = -(-w // DECODE_BLOCK)
    s0, s1, s2, s3 = x.stride()
    if s3 != 1 or s2 != d or s1 != n * DECODE_BLOCK * d or (b > 1 and s0 != hs * s1):
        return None
    return x.as_strided((b, hs, n, DECODE_BLOCK, d), (s0, s1, DECODE_BLOCK * d, d, 1))


def blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots of ``x (b, Hs, B, ...)`` in blocks of :data:`DECODE_BLOCK`: the full blocks
    ``(b, Hs, n, K, ...)`` (a view of the storage; a matmul copies it unless ``B`` is a multiple
    of ``K``) and the last partial block zero-padded to ``(b, Hs, 1, K, ...)``, or None when
    ``B`` is a multiple of ``K``. Storage from :func:`block_storage` comes whole: every block,
    the last one with its zero padding, one view, no tail."""
    aligned = aligned_blocks(x)
    if aligned is not None:
        return aligned, None
    w = x.shape[2]
    n = w // DECODE_BLOCK
    full = x[:, :, : n * DECODE_BLOCK].unflatten(2, (n, DECODE_BLOCK))
    b, hs = x.shape[:2]
    viewable = x.stride(1) == n * DECODE_BLOCK * x.stride(2) and (b == 1 or x.stride(0) == hs * x.stride(1))
    if not viewable:  # blocks a matmul cannot batch as a view: the copy it would make, made here in the
        full = full.contiguous()  # slots' own layout, which a view of aligned storage has (the same bits)
    if w == n * DECODE_BLOCK:
        return full, None
    pad = [0, 0] * (x.dim() - 3) + [0, (n + 1) * DECODE_BLOCK - w]
    return full, torch.nn.functional.pad(x[:, :, n * DECODE_BLOCK :], pad)[:, :, None]
