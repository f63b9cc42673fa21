"""Pure-torch reference of the quantized KV cache's storage format (format spec 6).

A token's keys (or values), flattened over its KV heads, are cut into groups of 32 consecutive
channels. Each group is

1. rotated by the Sylvester Hadamard matrix H32 and scaled by 1/sqrt(32) (an orthonormal rotation,
   which spreads outliers over the group),
2. given the scale ``s = max|x| + 1e-10`` (stored as fp16; at most 65504, fp16's largest finite value),
3. quantized on the midpoint grid: ``code = clamp(floor(x / s * m + m), 0, 2^bits - 1)`` with
   ``m = 2^(bits - 1)``, and dequantized as ``(code - m + 0.5) * s / m`` followed by the inverse
   rotation (the same matrix: H32 / sqrt(32) is symmetric and orthonormal),
4. packed into ``bits`` 32-bit words as power-of-two bit planes, widest first (8, 4, 2, 1): a plane of
   width ``w`` holds bits ``[lo, lo + w)`` of every code in ``w`` words, value ``j`` at bits
   ``[j * w, (j + 1) * w)`` of the plane read as one little-endian integer.

This module is the oracle of the Triton write kernels (bit-exact codes and scales: every fp32
operation here has a fixed order, which the kernels repeat) and of the attention kernels reading the
pages in place. The Hadamard transform is the butterfly of :func:`hadamard32`, stage widths 1, 2, 4,
8, 16 in that order, so its fp32 sums are reproducible.
"""
from __future__ import annotations

import torch

#: values per group (one scale each)
GROUP = 32
#: H32 / sqrt(32) normalisation, as the fp32 constant the kernels multiply by
INV_SQRT_GROUP = 32 ** -0.5
#: added to a group's max |x| so that an all-zero group has a nonzero scale
SCALE_EPS = 1e-10
#: the largest scale stored (fp16's largest finite value): a scale past it would be stored as inf
SCALE_MAX = 65504.0
#: bit widths a quantized cache side may have
BITS = range(2, 9)


def check_bits(name: str, bits: object) -> int:
    """``bits`` as an int in 2..8, else a ValueError naming ``name`` (the option) and the fix."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"{name}={bits!r}: a quantized cache stores 2 to 8 bits per value; use an int in 2..8 "
                         f"(16, unquantized, is the 'fp16' cache variant)")
    return bits


def planes(bits: int) -> list[tuple[int, int, int]]:
    """The bit planes of a ``bits``-wide code, widest first: ``(width, low bit in the code, first word)``.

    E.g. 7 bits: a 4-bit plane of bits 3..6 in words 0-3, a 2-bit plane of bits 1..2 in words 4-5 and
    a 1-bit plane of bit 0 in word 6."""
    check_bits("bits", bits)
    out = []
    word = 0
    low = bits
    for w in (8, 4, 2, 1):
        if bits & w:
            low -= w
            out.append((w, low, word))
            word += w
    return out


def hadamard32(x: torch.Tensor) -> torch.Tensor:
    """``x [..., C]`` (fp32, C a multiple of 32) with every group of 32 channels multiplied by H32 / sqrt(32).

    The butterfly in a fixed order (widths 1, 2, 4, 8, 16, then the scale), so results are the same
    bit for bit wherever the same order runs. It is its own inverse up to rounding."""
    if x.dtype != torch.float32 or x.shape[-1] % GROUP:
        raise ValueError(f"hadamard32: want fp32 [..., 32n], got {x.dtype} {tuple(x.shape)}")
    lead = x.shape[:-1]
    y = x.reshape(-1, GROUP)
    h = 1
    while h < GROUP:
        y = y.view(-1, GROUP // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).view(-1, GROUP)
        h *= 2
    return (y * torch.tensor(INV_SQRT_GROUP, dtype=torch.float32)).view(*lead, x.shape[-1])


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) as int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int codes ``[..., G, 32]`` in 0..2^bits-1 -> int32 words ``[..., G * bits]`` (the planes of each group)."""
    c = codes.to(torch.int64)
    words = []
    for w, low, _ in planes(bits):
        per = GROUP // w  # values per word
        v = ((c >> low) & ((1 << w) - 1)).view(*c.shape[:-1], w, per)
        shifts = torch.arange(per, device=c.device, dtype=torch.int64) * w
        words.append((v << shifts).sum(-1))  # disjoint bits: the sum is the bitwise or
    return _to_int32(torch.cat(words, dim=-1)).reshape(*codes.shape[:-2], -1)


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words ``[..., G * bits]`` -> int32 codes ``[..., G, 32]`` (inverse of :func:`pack`)."""
    w32 = words.view(*words.shape[:-1], -1, bits)
    code: torch.Tensor | None = None
    for w, low, first in planes(bits):
        per = GROUP // w
        shifts = torch.arange(per, device=words.device, dtype=torch.int32) * w
        # an arithmetic shift of the top value drags the sign bit along: the mask drops it
        v = ((w32[..., first:first + w, None] >> shifts) & ((1 << w) - 1)).reshape(*w32.shape[:-1], GROUP)
        code = v << low if code is None else code | (v << low)
    assert code is not None
    return code


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., C]`` (any float dtype, C a multiple of 32) -> ``(words int32 [..., C/32 * bits], scales
    fp16 [..., C/32])``."""
    check_bits("bits", bits)
    if x.shape[-1] % GROUP:
        raise ValueError(f"quantize: the last dim {x.shape[-1]} is not a multiple of {GROUP}")
    m = float(1 << (bits - 1))
    r = hadamard32(x.float()).view(*x.shape[:-1], -1, GROUP)
    s = (r.abs().amax(-1, keepdim=True) + SCALE_EPS).clamp_max(SCALE_MAX)
    codes = torch.floor(r / s * m + m).clamp(0, (1 << bits) - 1)
    return pack(codes, bits), s.squeeze(-1).to(torch.float16)


def dequantize_rotated(words: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 ``[..., C]``: the dequantized values still in the rotated (H32) basis, as kernels that rotate
    the query instead of the keys read them."""
    m = float(1 << (bits - 1))
    code = unpack(words, bits).to(torch.float32)
    return ((code - (m - 0.5)) * (scales.float()[..., None] / m)).reshape(*scales.shape[:-1], -1)


def dequantize(words: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 ``[..., C]``: what :func:`quantize` stored, rotated back by :func:`hadamard32`, whose fixed order makes
    each token's values the same bit for bit however many tokens are read together (a matrix product's
    rounding may depend on its row count)."""
    return hadamard32(dequantize_rotated(words, scales, bits))


def bytes_per_value_group(bits: int) -> int:
    """Bytes one group of 32 values takes: ``bits`` words and an fp16 scale."""
    return 4 * check_bits("bits", bits) + 2


def quant_write(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor,
                bits: int) -> None:
    """Quantize ``x [T, H, D]`` (flattened to ``[T, H * D]``) into the paged ``codes [pages, page_size, W]``
    and ``scales [pages, page_size, G]`` at the flat slots ``slot_mapping [T]``."""
    w, s = quantize(x.reshape(x.shape[0], -1), bits)
    codes.view(-1, codes.shape[-1]).index_copy_(0, slot_mapping, w)
    scales.view(-1, scales.shape[-1]).index_copy_(0, slot_mapping, s)


def gather_dequantized(codes: torch.Tensor, scales: torch.Tensor, bits: int, page_table_row: torch.Tensor,
                       length: int, heads: int) -> torch.Tensor:
    """fp32 ``[length, heads, C / heads]``: tokens ``0..length-1`` of one sequence, dequantized."""
    page_size = codes.shape[1]
    n_pages = (length + page_size - 1) // page_size
    rows = page_table_row[:n_pages].long()
    w = codes[rows].reshape(-1, codes.shape[-1])[:length]
    s = scales[rows].reshape(-1, scales.shape[-1])[:length]
    return dequantize(w, s, bits).view(length, heads, -1)
