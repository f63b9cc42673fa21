"""Triton kernels of the quantized KV cache (format spec 6): the store (quantize on write, RoPE and
quantize in one launch) and the device functions attention kernels read the pages with.

Reference: :mod:`exl3_core.reference.kv_quant`. The store repeats its fp32 operations in the same order
(the H32 butterfly widths 1, 2, 4, 8, 16, then the scale; IEEE division), so codes and scales are equal
bit for bit. Readers never undo the rotation per key: H32/sqrt(32) is orthonormal, so scores are taken
between the rotated query and the rotated keys (:func:`hadamard_cols` on the query) and the output is
rotated back once (:func:`hadamard_cols` on the accumulator); :func:`dequant_tile` yields keys and values
in the rotated basis. Imported lazily (needs Triton) by :mod:`exl3_core.cache.kv_quant` and the Triton
attention backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3_core.kernels.fused import _check_rope, _rope_heads
from exl3_core.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_opts
from exl3_core.reference.kv_quant import GROUP, INV_SQRT_GROUP, SCALE_EPS, SCALE_MAX, check_bits
from exl3_core.attention.spec import RecentRows
from exl3_core.reference.kv_recent import RecentWrite, extra_bits

# the reference's constants, as the kernels' compile-time values
_INV_SQRT_GROUP = tl.constexpr(INV_SQRT_GROUP)
_SCALE_EPS = tl.constexpr(SCALE_EPS)
_SCALE_MAX = tl.constexpr(SCALE_MAX)


# -- the H32 rotation ---------------------------------------------------------------------------------


@triton.jit
def _butterfly(y, A: tl.constexpr, H: tl.constexpr):
    # one stage over [A, 32]: pairs (i, i + H) inside blocks of 2H become (a + b, a - b)
    y = tl.reshape(y, [A * 16 // H, 2, H])
    a, b = tl.split(tl.permute(y, (0, 2, 1)))
    y = tl.permute(tl.join(a + b, a - b), (0, 2, 1))
    return tl.reshape(y, [A, 32])


@triton.jit
def hadamard_groups(x, A: tl.constexpr):
    """fp32 ``[A, 32]``: every row times H32 / sqrt(32), in the reference's order."""
    y = _butterfly(x, A, 1)
    y = _butterfly(y, A, 2)
    y = _butterfly(y, A, 4)
    y = _butterfly(y, A, 8)
    y = _butterfly(y, A, 16)
    return y * _INV_SQRT_GROUP


@triton.jit
def hadamard_cols(x, R: tl.constexpr, C: tl.constexpr):
    """fp32 ``[R, C]`` (C a power of two >= 32): every group of 32 columns of every row rotated."""
    return tl.reshape(hadamard_groups(tl.reshape(x, [R * C // 32, 32]), R * C // 32), [R, C])


# -- reading pages ------------------------------------------------------------------------------------


@triton.jit
def _halves(x, h: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, n: tl.constexpr):
    # uint32 [BLOCK_N, BLOCK_G, n] of 2h-bit fields (zeros above) -> [BLOCK_N, BLOCK_G, 2n] of their h-bit
    # halves, low half first
    return tl.reshape(tl.join(x & ((1 << h) - 1), x >> h), [BLOCK_N, BLOCK_G, 2 * n])


@triton.jit
def _plane_words(Codes, base, ok, W: tl.constexpr, FIRST: tl.constexpr):
    # uint32 [BLOCK_N, BLOCK_G, W]: the W words of the W-bit plane of the groups at word offsets base
    x = tl.load(Codes + base[:, :, None] + FIRST + tl.arange(0, W)[None, None, :], mask=ok[:, :, None], other=0)
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def _plane(x, W: tl.constexpr, LOW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    # uint32 [BLOCK_N, BLOCK_G, 32]: the plane's words x split into the W-bit fields of the groups' codes, moved to
    # bits LOW .. LOW + W - 1. Each word is halved into its fields (16, 8, ... W bits) by joins, which keep the
    # values in the threads that loaded them, in value order (a field's low half holds the earlier values).
    if W < 32:
        x = _halves(x, 16, BLOCK_N, BLOCK_G, W)
    if W < 16:
        x = _halves(x, 8, BLOCK_N, BLOCK_G, 2 * W)
    if W < 8:
        x = _halves(x, 4, BLOCK_N, BLOCK_G, 4 * W)
    if W < 4:
        x = _halves(x, 2, BLOCK_N, BLOCK_G, 8 * W)
    if W < 2:
        x = _halves(x, 1, BLOCK_N, BLOCK_G, 16 * W)
    return x << LOW


@triton.jit
def _absent(BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    # the stand-in of a plane a width does not have (never read)
    return tl.zeros([BLOCK_N, BLOCK_G, 1], tl.uint32)


@triton.jit
def load_tile(Codes, Scales, code_row, scale_row, n_ok, G0, NG, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_G: tl.constexpr):
    """The memory reads of :func:`dequant_tile`: ``(w8, w4, w2, w1, s)``, each plane's words (a one-wide stand-in
    for planes ``BITS`` lacks) and the fp32 scales ``[BLOCK_N, BLOCK_G]``; :func:`decode_tile` makes the values.
    Apart so that a loop can issue the next chunk's reads before it decodes this one."""
    g = tl.arange(0, BLOCK_G)
    ok = n_ok[:, None] & (g < NG)[None, :]
    s = tl.load(Scales + scale_row[:, None] + (G0 + g)[None, :], mask=ok, other=0.0).to(tl.float32)
    base = code_row[:, None] + (G0 + g)[None, :] * BITS
    w8 = _absent(BLOCK_N, BLOCK_G)
    w4 = _absent(BLOCK_N, BLOCK_G)
    w2 = _absent(BLOCK_N, BLOCK_G)
    w1 = _absent(BLOCK_N, BLOCK_G)
    if BITS & 8:
        w8 = _plane_words(Codes, base, ok, 8, 0)
    if BITS & 4:
        w4 = _plane_words(Codes, base, ok, 4, BITS & 8)
    if BITS & 2:
        w2 = _plane_words(Codes, base, ok, 2, BITS & 12)
    if BITS & 1:
        w1 = _plane_words(Codes, base, ok, 1, BITS & 14)
    return w8, w4, w2, w1, s


@triton.jit
def decode_tile(w8, w4, w2, w1, s, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """fp32 ``[BLOCK_N, BLOCK_G * 32]`` from :func:`load_tile`'s reads: the values in the rotated basis (zeros where
    the reads were masked: their scale is 0)."""
    # 2 * code + 1 as the low bits of the fp32 2^23 (exponent bits 0x4B000000, whose units are 1), so the float is
    # 2^23 + 2 * code + 1: integer ops instead of the slower int-to-float conversion; the midpoint grid's
    # (code + 1/2 - M) / M * scale is then (float - 2^23 - 2M) / 2M * scale, the subtraction exact
    code = tl.full([BLOCK_N, BLOCK_G, 32], 0x4B000001, tl.uint32)
    if BITS & 8:
        code = code | _plane(w8, 8, (BITS & 7) + 1, BLOCK_N, BLOCK_G)
    if BITS & 4:
        code = code | _plane(w4, 4, (BITS & 3) + 1, BLOCK_N, BLOCK_G)
    if BITS & 2:
        code = code | _plane(w2, 2, (BITS & 1) + 1, BLOCK_N, BLOCK_G)
    if BITS & 1:
        code = code | _plane(w1, 1, 1, BLOCK_N, BLOCK_G)
    M: tl.constexpr = 1 << (BITS - 1)
    v = (code.to(tl.float32, bitcast=True) - (8388608.0 + 2 * M)) * (s * (0.5 / M))[:, :, None]
    return tl.reshape(v, [BLOCK_N, BLOCK_G * 32])


@triton.jit
def dequant_tile(Codes, Scales, code_row, scale_row, n_ok, G0, NG, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_G: tl.constexpr):
    """fp32 ``[BLOCK_N, BLOCK_G * 32]``: groups ``G0 .. G0 + NG - 1`` of the rows at element offsets
    ``code_row``/``scale_row`` ``[BLOCK_N]`` (int64) of the code words and scales, dequantized in the rotated
    basis; zeros for rows not ``n_ok`` and groups past NG."""
    w8, w4, w2, w1, s = load_tile(Codes, Scales, code_row, scale_row, n_ok, G0, NG, BITS, BLOCK_N, BLOCK_G)
    return decode_tile(w8, w4, w2, w1, s, BITS, BLOCK_N, BLOCK_G)


@triton.jit
def _read_rows_kernel(Codes, Scales, Slots, Out, NG: tl.constexpr, BITS: tl.constexpr, BLOCK_G: tl.constexpr,
                      PDL: tl.constexpr):
    if PDL:  # a programmatic dependent of the store: wait for it, let the next start
        gdc_wait()
        gdc_launch_dependents()
    # one program per token: its groups dequantized and rotated back, as the reference in the same order
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    one = tl.full([1], 1, tl.int1)
    v = dequant_tile(Codes, Scales, tl.full([1], 0, tl.int64) + slot * (NG * BITS),
                     tl.full([1], 0, tl.int64) + slot * NG, one, 0, NG, BITS, 1, BLOCK_G)
    v = hadamard_cols(v, 1, BLOCK_G * 32)
    cols = tl.arange(0, BLOCK_G * 32)
    tl.store(Out + t * (NG * 32) + cols[None, :], v.to(Out.dtype.element_ty), mask=(cols < NG * 32)[None, :])


# -- writing pages ------------------------------------------------------------------------------------


@triton.jit
def _store_plane(Codes, base, g_ok, code, W: tl.constexpr, LOW: tl.constexpr, FIRST: tl.constexpr,
                 BLOCK_G: tl.constexpr):
    # the W-bit plane (code bits LOW .. LOW + W - 1) of [BLOCK_G, 32] codes as W words per group at base + FIRST
    PER: tl.constexpr = 32 // W
    v = ((code >> LOW) & ((1 << W) - 1)).to(tl.uint32)
    v = tl.reshape(v, [BLOCK_G, W, PER]) << (tl.arange(0, PER) * W).to(tl.uint32)[None, None, :]
    words = tl.sum(v, 2).to(tl.uint32)  # disjoint bits: the sum is the bitwise or
    tl.store(Codes + base[:, None] + FIRST + tl.arange(0, W)[None, :], words.to(tl.int32, bitcast=True),
             mask=g_ok[:, None])


@triton.jit
def _store_low(Low, base, g_ok, low, EXTRA: tl.constexpr, BLOCK_G: tl.constexpr):
    # an EXTRA-bit low code's planes (widths 4, 2, 1, widest first) as EXTRA words per group at base
    if EXTRA & 4:
        _store_plane(Low, base, g_ok, low, 4, EXTRA & 3, 0, BLOCK_G)
    if EXTRA & 2:
        _store_plane(Low, base, g_ok, low, 2, EXTRA & 1, EXTRA & 4, BLOCK_G)
    if EXTRA & 1:
        _store_plane(Low, base, g_ok, low, 1, 0, EXTRA & 6, BLOCK_G)


@triton.jit
def _quant_row(X, x_row, stride_h, Codes, Scales, slot, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
               BLOCK_G: tl.constexpr, G0, ROW: tl.constexpr, Low, low_row, Ring, ring_row, EXTRA: tl.constexpr,
               RING: tl.constexpr):
    # quantize NG groups of one token's flattened [heads, D] row (head stride stride_h) into groups G0 .. G0 + NG - 1
    # of cache slot `slot`, whose rows hold ROW groups; with EXTRA > 0 the 8-bit codes' low EXTRA bits also go to row
    # low_row of Low (the forward's rows) and, with RING, to row ring_row of Ring (the sequence's recent rows)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < NG
    c = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(X + x_row + (c // D) * stride_h + c % D, mask=g_ok[:, None], other=0.0).to(tl.float32)
    r = hadamard_groups(x, BLOCK_G)
    s = tl.minimum(tl.max(tl.abs(r), 1) + _SCALE_EPS, _SCALE_MAX)
    if EXTRA > 0:
        # the page's code is the top BITS bits of the 8-bit code (kv_recent's split), the rest the low bits
        q8 = tl.floor(tl.div_rn(r, s[:, None]) * 128.0 + 128.0)
        code8 = tl.minimum(tl.maximum(q8, 0.0), 255.0).to(tl.int32)
        code = code8 >> EXTRA
        low = code8 & ((1 << EXTRA) - 1)
        _store_low(Low, low_row * (ROW * EXTRA) + (G0 + g) * EXTRA, g_ok, low, EXTRA, BLOCK_G)
        if RING:
            _store_low(Ring, ring_row * (ROW * EXTRA) + (G0 + g) * EXTRA, g_ok, low, EXTRA, BLOCK_G)
    else:
        M: tl.constexpr = 1 << (BITS - 1)
        q = tl.floor(tl.div_rn(r, s[:, None]) * M + M)
        code = tl.minimum(tl.maximum(q, 0.0), (1 << BITS) - 1).to(tl.int32)
    tl.store(Scales + slot * ROW + G0 + g, s.to(tl.float16), mask=g_ok)
    base = slot * (ROW * BITS) + (G0 + g) * BITS
    if BITS & 8:
        _store_plane(Codes, base, g_ok, code, 8, BITS & 7, 0, BLOCK_G)
    if BITS & 4:
        _store_plane(Codes, base, g_ok, code, 4, BITS & 3, BITS & 8, BLOCK_G)
    if BITS & 2:
        _store_plane(Codes, base, g_ok, code, 2, BITS & 1, BITS & 12, BLOCK_G)
    if BITS & 1:
        _store_plane(Codes, base, g_ok, code, 1, 0, BITS & 14, BLOCK_G)


@triton.jit
def _ring_row(Positions, RingSlots, Tags, t, W: tl.constexpr, RING: tl.constexpr, TAG: tl.constexpr):
    # a one-row forward's ring row for token t (= its sequence), its tag set by the one program that passes TAG
    ring_row = tl.zeros([], tl.int64)
    if RING:
        p = tl.load(Positions + t)
        ring_row = tl.load(RingSlots + t).to(tl.int64) * W + p % W
        if TAG:
            tl.store(Tags + ring_row, p.to(tl.int32))
    return ring_row


@triton.jit
def _quant_write_kernel(K, V, KC, KS, VC, VS, Slots, stride_kt, stride_kh, stride_vt, stride_vh,
                        KLow, VLow, KRing, VRing, Tags, Positions, RingSlots,
                        D: tl.constexpr, DV: tl.constexpr, NGK: tl.constexpr, NGV: tl.constexpr,
                        K_BITS: tl.constexpr, V_BITS: tl.constexpr, BLOCK_GK: tl.constexpr, BLOCK_GV: tl.constexpr,
                        HAS_V: tl.constexpr, K_EXTRA: tl.constexpr, V_EXTRA: tl.constexpr, W: tl.constexpr,
                        RING: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent of the kernel that wrote k and v: wait for it, let the next start
        gdc_wait()
        gdc_launch_dependents()
    # one program per token: its key row and value row, each quantized into its slot
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    ring_row = _ring_row(Positions, RingSlots, Tags, t, W, RING, True)
    _quant_row(K, t * stride_kt, stride_kh, KC, KS, slot, D, NGK, K_BITS, BLOCK_GK, 0, NGK, KLow, t, KRing, ring_row,
               K_EXTRA, RING)
    if HAS_V:
        _quant_row(V, t * stride_vt, stride_vh, VC, VS, slot, DV, NGV, V_BITS, BLOCK_GV, 0, NGV, VLow, t, VRing,
                   ring_row, V_EXTRA, RING)


@triton.jit
def _rope_quant_kernel(Q, K, V, KC, KS, VC, VS, Slots, Cos, Sin,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
                       KLow, VLow, KRing, VRing, Tags, Positions, RingSlots,
                       HQ, D: tl.constexpr, DV: tl.constexpr, NGK: tl.constexpr, NGV: tl.constexpr,
                       K_BITS: tl.constexpr, V_BITS: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                       BLOCK_HQ: tl.constexpr, BLOCK_R: tl.constexpr, HPC: tl.constexpr, NCH: tl.constexpr,
                       BLOCK_HPC: tl.constexpr, BLOCK_GK: tl.constexpr, BLOCK_GV: tl.constexpr,
                       K_EXTRA: tl.constexpr, V_EXTRA: tl.constexpr, W: tl.constexpr, RING: tl.constexpr,
                       PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    # program (token, part): part 0 rotates q in place; parts 1 .. NCH rotate a chunk of HPC key heads in place (as
    # the unquantized store does) and quantize them as rotated into the token's slot; parts NCH + 1 .. 2 NCH quantize
    # a chunk of value heads. The parts touch disjoint data, so a decode step's store is as long as its longest part.
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if part <= NCH:
        i = tl.arange(0, BLOCK_R)
        c = tl.load(Cos + t * stride_ct + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        s = tl.load(Sin + t * stride_st + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        if part == 0:
            _rope_heads(Q, t, stride_qt, stride_qh, HQ, c, s, i, HALF, INTERLEAVED, BLOCK_HQ, BLOCK_R)
        else:
            h0 = (part - 1) * HPC
            _rope_heads(K + h0 * stride_kh, t, stride_kt, stride_kh, HPC, c, s, i, HALF, INTERLEAVED, BLOCK_HPC,
                        BLOCK_R)
            tl.debug_barrier()  # the rotated k stored above is read back below by other threads of the program
            slot = tl.load(Slots + t).to(tl.int64)
            ring_row = _ring_row(Positions, RingSlots, Tags, t, W, RING, part == 1)
            _quant_row(K, t * stride_kt + h0 * stride_kh, stride_kh, KC, KS, slot, D, HPC * D // 32, K_BITS,
                       BLOCK_GK, h0 * (D // 32), NGK, KLow, t, KRing, ring_row, K_EXTRA, RING)
    else:
        h0 = (part - 1 - NCH) * HPC
        slot = tl.load(Slots + t).to(tl.int64)
        ring_row = _ring_row(Positions, RingSlots, Tags, t, W, RING, False)
        _quant_row(V, t * stride_vt + h0 * stride_vh, stride_vh, VC, VS, slot, DV, HPC * DV // 32, V_BITS, BLOCK_GV,
                   h0 * (DV // 32), NGV, VLow, t, VRing, ring_row, V_EXTRA, RING)


#: the most (token, head chunk) programs a store splits its heads over: a decode step's few tokens get a program
#: per key head and per value head, a prefill chunk's many a program per side
SPLIT_HEAD_PROGRAMS = 512


def _groups(op: str, what: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int,
            channels: int) -> int:
    """Groups of ``channels`` quantized channels of each ``x`` row; checks the pages fit them."""
    check_bits(f"{op}: {what}_bits", bits)
    if x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] % GROUP:
        raise ValueError(f"{op}: {what} must be [T, H, D] with D a multiple of {GROUP} and a contiguous last dim, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    ng = channels // GROUP
    if (codes.dtype != torch.int32 or scales.dtype != torch.float16 or not codes.is_contiguous()
            or not scales.is_contiguous() or codes.shape[-1] != ng * bits or scales.shape[-1] != ng
            or codes.shape[:-1] != scales.shape[:-1]):
        raise ValueError(f"{op}: {what} pages must be contiguous int32 [..., {ng * bits}] and fp16 [..., {ng}] for "
                         f"{channels} channels at {bits} bits, got {codes.dtype} {tuple(codes.shape)} and "
                         f"{scales.dtype} {tuple(scales.shape)}")
    return ng


def _recent_args(recent: RecentWrite | None, k_bits: int, v_bits: int, like: torch.Tensor) -> tuple[list, dict]:
    """The store kernels' recent-row pointers and constexprs (placeholders and EXTRA 0 without recent rows)."""
    if recent is None:
        return [like] * 7, {"K_EXTRA": 0, "V_EXTRA": 0, "W": 1, "RING": False}
    ring = recent.ring_slots is not None
    ke = extra_bits(k_bits) if recent.k_rows is not None else 0
    ve = extra_bits(v_bits) if recent.v_rows is not None else 0
    ptrs = [recent.k_rows, recent.v_rows, recent.k_ring, recent.v_ring, recent.tags, recent.positions,
            recent.ring_slots]
    return ([like if t is None else t for t in ptrs],
            {"K_EXTRA": ke, "V_EXTRA": ve, "W": recent.tags.shape[1], "RING": ring})


def quant_write(k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor,
                k_codes: torch.Tensor, k_scales: torch.Tensor, v_codes: torch.Tensor | None,
                v_scales: torch.Tensor | None, k_bits: int, v_bits: int, k_channels: int | None = None,
                recent: RecentWrite | None = None) -> None:
    """Quantize ``k [T, Hk, D]`` (its first ``k_channels`` flattened channels, default all) and ``v [T, Hk, Dv]``
    (None: keys only) into the pages at the flat slots ``slot_mapping [T]``, one launch; with ``recent``, the
    8-bit codes' low bits also into its rows (and ring)."""
    T = k.shape[0]
    ngk = _groups("quant_write", "k", k, k_codes, k_scales, k_bits, k_channels or k.shape[1] * k.shape[2])
    ngv = 1
    if v is not None:
        assert v_codes is not None and v_scales is not None
        ngv = _groups("quant_write", "v", v, v_codes, v_scales, v_bits, v.shape[1] * v.shape[2])
    if slot_mapping.shape != (T,):
        raise ValueError(f"quant_write: slot_mapping {tuple(slot_mapping.shape)} needs one slot per token ({T})")
    if T == 0:
        return
    vv = v if v is not None else k
    ptrs, consts = _recent_args(recent, k_bits, v_bits, k_codes)
    _quant_write_kernel[(T,)](
        k, vv, k_codes, k_scales, v_codes if v_codes is not None else k_codes,
        v_scales if v_scales is not None else k_scales, slot_mapping,
        k.stride(0), k.stride(1), vv.stride(0), vv.stride(1), *ptrs,
        D=k.shape[2], DV=vv.shape[2], NGK=ngk, NGV=ngv, K_BITS=k_bits, V_BITS=v_bits if v is not None else k_bits,
        BLOCK_GK=triton.next_power_of_2(ngk), BLOCK_GV=triton.next_power_of_2(ngv), HAS_V=v is not None, **consts,
        num_warps=4 if max(ngk, ngv) >= 16 else 2, **launch_opts(k_codes),
    )


def rope_quant_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool,
                     k_codes: torch.Tensor, k_scales: torch.Tensor, v_codes: torch.Tensor, v_scales: torch.Tensor,
                     k_bits: int, v_bits: int, recent: RecentWrite | None = None) -> None:
    """RoPE on ``q``/``k`` in place (``cos``/``sin`` fp32 ``[T, rotary_dim/2]``), then :func:`quant_write` of
    the rotated k and v: one launch."""
    cos, sin = _check_rope("rope_quant_write", q, k, cos, sin, rotary_dim)
    ngk = _groups("rope_quant_write", "k", k, k_codes, k_scales, k_bits, k.shape[1] * k.shape[2])
    ngv = _groups("rope_quant_write", "v", v, v_codes, v_scales, v_bits, v.shape[1] * v.shape[2])
    T, hk, d = k.shape
    if slot_mapping.shape != (T,) or v.shape[0] != T:
        raise ValueError(f"rope_quant_write: slot_mapping {tuple(slot_mapping.shape)} and v {tuple(v.shape)} need "
                         f"one row per token ({T})")
    if T == 0:
        return
    half = rotary_dim // 2
    nch = hk if T * hk <= SPLIT_HEAD_PROGRAMS else 1
    hpc = hk // nch
    ptrs, consts = _recent_args(recent, k_bits, v_bits, k_codes)
    _rope_quant_kernel[(T, 1 + 2 * nch)](
        q, k, v, k_codes, k_scales, v_codes, v_scales, slot_mapping, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        *ptrs, q.shape[1], D=d, DV=v.shape[2], NGK=ngk, NGV=ngv, K_BITS=k_bits, V_BITS=v_bits,
        HALF=half, INTERLEAVED=interleaved, BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_R=triton.next_power_of_2(max(half, 1)), HPC=hpc, NCH=nch, BLOCK_HPC=triton.next_power_of_2(hpc),
        BLOCK_GK=triton.next_power_of_2(hpc * d // GROUP), BLOCK_GV=triton.next_power_of_2(hpc * v.shape[2] // GROUP),
        **consts, num_warps=4 if q.shape[1] * half >= 1024 else 2, **launch_opts(q),
    )


@triton.jit
def _ring_update_kernel(KRows, VRows, KRing, VRing, Tags, Slots, Positions, Cu, KW: tl.constexpr, VW: tl.constexpr,
                        W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a programmatic dependent of the attention that read the rings: wait for it, let the next start
        gdc_wait()
        gdc_launch_dependents()
    # program (b, i): the i-th of sequence b's last W rows of the forward (if it has that many), copied to its ring
    b = tl.program_id(0)
    q0 = tl.load(Cu + b)
    r = tl.load(Cu + b + 1) - q0 - W + tl.program_id(1)
    if r >= 0:
        t = (q0 + r).to(tl.int64)
        p = tl.load(Positions + t)
        row = tl.load(Slots + b).to(tl.int64) * W + p % W
        if KW > 0:
            j = tl.arange(0, BLOCK_K)
            tl.store(KRing + row * KW + j, tl.load(KRows + t * KW + j, mask=j < KW), mask=j < KW)
        if VW > 0:
            j = tl.arange(0, BLOCK_V)
            tl.store(VRing + row * VW + j, tl.load(VRows + t * VW + j, mask=j < VW), mask=j < VW)
        tl.store(Tags + row, p.to(tl.int32))


def ring_update(recent: RecentRows, positions: torch.Tensor, cu_seqlens_q: torch.Tensor,
                seq_lens_k: torch.Tensor) -> None:
    """After a forward's attention: each sequence's rows among its last ``window`` positions copied from the rows
    to its ring, tags set (:func:`exl3_core.reference.kv_recent.ring_update`): one launch, no host sync."""
    del seq_lens_k  # a forward's rows end at its sequences' last positions: its last W rows are the ones
    B = cu_seqlens_q.shape[0] - 1
    W = recent.size
    kw = recent.k_rows.shape[1] if recent.k_rows is not None else 0
    vw = recent.v_rows.shape[1] if recent.v_rows is not None else 0
    if B == 0:
        return
    like = recent.tags
    _ring_update_kernel[(B, W)](
        recent.k_rows if kw else like, recent.v_rows if vw else like, recent.k_ring if kw else like,
        recent.v_ring if vw else like, recent.tags, recent.slots, positions, cu_seqlens_q, KW=kw, VW=vw, W=W,
        BLOCK_K=triton.next_power_of_2(max(kw, 1)), BLOCK_V=triton.next_power_of_2(max(vw, 1)), num_warps=1,
        **launch_opts(like))


def read_rows(codes: torch.Tensor, scales: torch.Tensor, bits: int, slot_mapping: torch.Tensor,
              like: torch.Tensor) -> torch.Tensor:
    """The tokens at ``slot_mapping [T]`` of the pages dequantized and rotated back (bit for bit the reference's
    :func:`~exl3_core.reference.kv_quant.dequantize`), shaped and typed as ``like [T, ...]``: one launch."""
    T = slot_mapping.shape[0]
    out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if T == 0:
        return out
    channels = like[0].numel()
    ng = _groups("read_rows", "stored", out.view(T, 1, channels), codes, scales, bits, channels)
    _read_rows_kernel[(T,)](codes, scales, slot_mapping, out, NG=ng, BITS=bits, BLOCK_G=triton.next_power_of_2(ng),
                            num_warps=4 if ng >= 16 else 2, **launch_opts(out))
    return out
