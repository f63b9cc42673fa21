"""Triton device functions that read a quantized cache's recent rows (:mod:`exl3_core.reference.kv_recent`): each
sequence's newest ``window`` positions at 8 bits, from the pages' ``bits``-bit codes and the low bits that its ring
and the forward's rows keep.

An attention kernel calls them only for the key tiles that overlap a query's window (the sequence's last few, in a
loop of their own), so every other tile reads the pages as :func:`~exl3_core.kernels.kv_quant.dequant_tile` does:

* :func:`recent_keys`: which keys of a tile have low bits (the reading rule's "forward row, or ring row tagged with
  the key's position") and where they are;
* :func:`load_low`: those low bits' plane words, as :func:`~exl3_core.kernels.kv_quant.load_tile` loads the codes';
* :func:`decode_refined`: the tile's values from both, 8-bit ones where the low bits are held and elsewhere bit for
  bit :func:`~exl3_core.kernels.kv_quant.decode_tile`'s, in the rotated basis.
"""
from __future__ import annotations

import triton
import triton.language as tl

from exl3_core.kernels.kv_quant import _absent, _plane


@triton.jit
def recent_keys(Tags, RingSlots, b, n, n_ok, first, c0, q_start, WINDOW: tl.constexpr):
    """Keys at positions ``n [BLOCK_N]`` of sequence ``b`` (``n_ok``: they exist), for queries none of which reads a
    key below ``first`` at 8 bits; the forward's first position ``c0`` has row ``q_start`` of the rows.
    ``(held, fwd, low_row)``: whether the key's low bits are held (a forward row, or its ring row tagged with its
    position), whether they are the forward's (``low_row`` a row of the rows) or the ring's (a row of the ring)."""
    fwd = n >= c0
    near = n_ok & (n >= first)
    ring_row = tl.load(RingSlots + b).to(tl.int64) * WINDOW + n % WINDOW
    tag = tl.load(Tags + ring_row, mask=near & ~fwd, other=-1)
    held = near & (fwd | (tag == n))
    return held, fwd, tl.where(fwd, (q_start + n - c0).to(tl.int64), ring_row)


@triton.jit
def _low_words(P, ok, W: tl.constexpr, FIRST: tl.constexpr):
    # uint32 [BLOCK_N, BLOCK_G, W]: the W words of the low code's W-bit plane of the groups starting at pointers P
    x = tl.load(P[:, :, None] + FIRST + tl.arange(0, W)[None, None, :], mask=ok[:, :, None], other=0)
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def load_low(Ring, Rows, held, fwd, low_row, G0, NG, ROW: tl.constexpr, EXTRA: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_G: tl.constexpr):
    """``(l4, l2, l1)``: the words of the ``EXTRA``-bit low codes' planes (a one-wide stand-in for planes ``EXTRA``
    lacks) of groups ``G0 .. G0 + NG - 1`` of :func:`recent_keys`' low rows (``ROW`` groups each), zeros where not
    ``held``."""
    g = tl.arange(0, BLOCK_G)
    ok = held[:, None] & (g < NG)[None, :]
    base = tl.where(fwd, Rows, Ring) + low_row * (ROW * EXTRA)
    p = base[:, None] + (G0 + g)[None, :] * EXTRA
    l4 = _absent(BLOCK_N, BLOCK_G)
    l2 = _absent(BLOCK_N, BLOCK_G)
    l1 = _absent(BLOCK_N, BLOCK_G)
    if EXTRA & 4:
        l4 = _low_words(p, ok, 4, 0)
    if EXTRA & 2:
        l2 = _low_words(p, ok, 2, EXTRA & 4)
    if EXTRA & 1:
        l1 = _low_words(p, ok, 1, EXTRA & 6)
    return l4, l2, l1


@triton.jit
def decode_refined(w8, w4, w2, w1, s, l4, l2, l1, held, BITS: tl.constexpr, EXTRA: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """fp32 ``[BLOCK_N, BLOCK_G * 32]`` from :func:`~exl3_core.kernels.kv_quant.load_tile`'s reads (``w8`` unused:
    ``BITS`` < 8) and :func:`load_low`'s: the 8-bit values of the ``held`` keys, the others bit for bit
    :func:`~exl3_core.kernels.kv_quant.decode_tile`'s (rotated basis; zeros where the reads were masked)."""
    tl.static_assert(BITS + EXTRA == 8)
    # decode_tile's float trick at M = 128: a held key's 2 * code8 + 1 is (code << EXTRA + 1) | (2 * low + 1); another
    # key's (code << EXTRA + 1) | (1 << EXTRA) is 2^EXTRA (2 * code + 1), whose value at M = 128 is the BITS-bit
    # value exactly (the powers of two cancel in fp32)
    odd = tl.where(held, 1, 1 << EXTRA).to(tl.uint32)
    code = tl.full([BLOCK_N, BLOCK_G, 32], 0x4B000000, tl.uint32) | odd[:, None, None]
    if BITS & 4:
        code = code | _plane(w4, 4, (BITS & 3) + EXTRA + 1, BLOCK_N, BLOCK_G)
    if BITS & 2:
        code = code | _plane(w2, 2, (BITS & 1) + EXTRA + 1, BLOCK_N, BLOCK_G)
    if BITS & 1:
        code = code | _plane(w1, 1, EXTRA + 1, BLOCK_N, BLOCK_G)
    if EXTRA & 4:
        code = code | _plane(l4, 4, (EXTRA & 3) + 1, BLOCK_N, BLOCK_G)
    if EXTRA & 2:
        code = code | _plane(l2, 2, (EXTRA & 1) + 1, BLOCK_N, BLOCK_G)
    if EXTRA & 1:
        code = code | _plane(l1, 1, 1, BLOCK_N, BLOCK_G)
    v = (code.to(tl.float32, bitcast=True) - (8388608.0 + 256.0)) * (s * (0.5 / 128))[:, :, None]
    return tl.reshape(v, [BLOCK_N, BLOCK_G * 32])
