"""Triton attention over the packed/paged layout of ``exl3_core.attention.spec``.

``_attn_fwd`` serves prefill, mixed steps and cache-less calls, GQA/MQA and the latent (MLA)
cache. A program owns one sequence, one KV head and a block of BLOCK_M *rows*, where a row is a
(query token, head-within-group) pair: for GQA decode the whole head group shares every
key/value load, and for prefill rows are consecutive tokens. Keys are streamed in BLOCK_N
chunks through the page table with an online softmax (fp32 accumulators).

Decode steps over a paged cache (``spec.phase == "decode"``: one query per sequence, or the same few in
every sequence, causal, as a speculative verification has) take the split-KV ("flash-decoding") path
instead: with only batch x kv_heads programs the single-pass kernel leaves most of a large GPU idle at
b=1 and long contexts. Its rows are (query, head-within-group) pairs as in ``_attn_fwd``. ``_decode_split`` adds a grid
axis over ``num_splits`` key ranges; each program computes the partial softmax state
(max, sum, unnormalised acc) of its head block over its range in fp32, and the last of a head
block's programs to finish merges the splits (an arrival counter; with several sequences only the
splits a sequence uses arrive). ``num_splits`` comes from host-side static values only (batch size, heads, the
``max_seqlen_k`` bound, SM count); each sequence's key range per split is derived on the device
from its own length, so a CUDA graph captured at the cache capacity replays correctly at any
length, and splits past a sequence's end write neutral partials without touching the cache.
Nothing reads sequence lengths back to the host.

Both kernels read a ``"kv/quant"`` view's recent rows (each sequence's newest positions at 8 bits,
:mod:`exl3_core.reference.kv_recent`) in a loop of their own over the key chunks that overlap a query's window (a
sequence's last one or two), after the loops over the older chunks, which are those compiled without recent rows.
"""
from __future__ import annotations

import os
from typing import ClassVar

import torch
import triton
import triton.language as tl

from exl3_core.attention.spec import AttnArgs, AttnSpec
from exl3_core.kernels.counters import arrival_counters
from exl3_core.kernels.kv_quant import decode_tile, dequant_tile, hadamard_cols, load_tile
from exl3_core.kernels.kv_recent import decode_refined, load_low, recent_keys
from exl3_core.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_opts


#: keys per chunk in the loop over the chunks that overlap the window of recent rows: their refined decode (and, for
#: several queries, both readings) in small chunks needs about the registers the older chunks' loop does
RECENT_BLOCK_N = tl.constexpr(16)


@triton.jit
def _quant_keys(K, KS, RP, row, n_ok, kvh, HK: tl.constexpr, NGK: tl.constexpr, K_BITS: tl.constexpr,
                QK_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # keys [BLOCK_D, BLOCK_N] (fp32, rotated basis) of the cache rows `row` (page * PAGE_SIZE + slot) of a
    # quantized view: KV head kvh's groups of the code words and scales; for "mla/quant" (QK_DIM < HEAD_DIM)
    # channels from QK_DIM on are the unquantized rotary key
    kt = dequant_tile(K, KS, row * (HK * NGK * K_BITS), row * (HK * NGK), n_ok, kvh * NGK, NGK, K_BITS, BLOCK_N,
                      BLOCK_D // 32)
    return tl.trans(_rope_channels(kt, RP, row, n_ok, QK_DIM, HEAD_DIM, BLOCK_D))


@triton.jit
def _rope_channels(kt, RP, row, n_ok, QK_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    # keys [BLOCK_N, BLOCK_D] with channels QK_DIM .. HEAD_DIM - 1 from the unquantized rotary keys of "mla/quant"
    if QK_DIM < HEAD_DIM:
        c = tl.arange(0, BLOCK_D)
        r_ok = n_ok[:, None] & ((c >= QK_DIM) & (c < HEAD_DIM))[None, :]
        rope = tl.load(RP + row[:, None] * (HEAD_DIM - QK_DIM) + (c - QK_DIM)[None, :], mask=r_ok, other=0.0)
        kt = tl.where((c < QK_DIM)[None, :], kt, rope.to(tl.float32))
    return kt


@triton.jit
def _split_reads(K, V, KS, VS, PageTable, b, kvh, start, hi, stride_pt, PAGE_SIZE: tl.constexpr, HK: tl.constexpr,
                 NGK: tl.constexpr, NGV: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    # a quantized view's reads for positions start .. start + BLOCK_N - 1 below hi: the cache rows, which exist,
    # and the key and value words and scales (load_tile), decoded later by _split_decode
    n_ok = start + tl.arange(0, BLOCK_N) < hi
    page, slot = _split_rows(PageTable, b, start, stride_pt, PAGE_SIZE, BLOCK_N, n_ok)
    row = page * PAGE_SIZE + slot
    kr = load_tile(K, KS, row * (HK * NGK * K_BITS), row * (HK * NGK), n_ok, kvh * NGK, NGK, K_BITS, BLOCK_N,
                   BLOCK_D // 32)
    vr = load_tile(V, VS, row * (HK * NGV * V_BITS), row * (HK * NGV), n_ok, kvh * NGV, NGV, V_BITS, BLOCK_N,
                   BLOCK_DV // 32)
    return row, n_ok, kr, vr


@triton.jit
def _split_decode(reads, Q, RP, K_BITS: tl.constexpr, V_BITS: tl.constexpr, QK_DIM: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    # keys [BLOCK_D, BLOCK_N] and values [BLOCK_N, BLOCK_DV] in q's dtype from _split_reads (rotated basis)
    row, n_ok, kr, vr = reads
    kt = decode_tile(kr[0], kr[1], kr[2], kr[3], kr[4], K_BITS, BLOCK_N, BLOCK_D // 32)
    k = tl.trans(_rope_channels(kt, RP, row, n_ok, QK_DIM, HEAD_DIM, BLOCK_D))
    v = decode_tile(vr[0], vr[1], vr[2], vr[3], vr[4], V_BITS, BLOCK_N, BLOCK_DV // 32)
    return k.to(Q.dtype.element_ty), v.to(Q.dtype.element_ty)


@triton.jit
def _quant_values(V, VS, row, n_ok, kvh, HK: tl.constexpr, NGV: tl.constexpr, V_BITS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr):
    # values [BLOCK_N, BLOCK_DV] (fp32, rotated basis) of the cache rows `row` of a quantized view
    return dequant_tile(V, VS, row * (HK * NGV * V_BITS), row * (HK * NGV), n_ok, kvh * NGV, NGV, V_BITS, BLOCK_N,
                        BLOCK_DV // 32)


@triton.jit
def _rotate_q(q, d, QK_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # the query in the keys' rotated basis: channels below QK_DIM rotated in groups of 32, the rest as they are
    qf = q.to(tl.float32)
    qr = hadamard_cols(qf, ROWS, BLOCK_D)
    return tl.where((d < QK_DIM)[None, :], qr, qf).to(q.dtype)


@triton.jit
def _chunk_probs(s, m_i, l_i, n, n_ok, q_pos, row_ok, scale, softcap, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    # the online softmax of one chunk's raw scores s [BLOCK_M, BLOCK_N] (keys n): (p, alpha, m_new, l_i) in base 2
    if SOFTCAP:
        s = s * (scale / softcap)
        s = softcap * (2.0 * tl.sigmoid(2.0 * s) - 1.0)  # tanh via sigmoid
        s = s * 1.4426950408889634  # log2(e): exp2 below
    else:
        s = s * (scale * 1.4426950408889634)
    if MASKED:
        ok = n_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            ok = ok & (n[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            ok = ok & (n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _attn_chunk(acc, m_i, l_i, q, start, hi, q_pos, row_ok, d, dv, b, kvh, q_start,
                K, V, PageTable, scale, softcap,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
                PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                PAGED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
                KS, VS, RP, HK: tl.constexpr, QUANT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                NGK: tl.constexpr, NGV: tl.constexpr, QK_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr):
    """One BLOCK_N chunk of keys into the online softmax (scores in base 2). MASKED=False is for
    chunks every row of the block may see in full (below the causal diagonal, inside seq_k). QUANT: the
    cache is a quantized view (dequantized here, in the rotated basis of q)."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    if PAGED:
        page = tl.load(PageTable + b * stride_pt + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % PAGE_SIZE
        k_off = page * stride_kp + slot * stride_ks
        v_off = page * stride_vp + slot * stride_vs
    else:
        k_off = (q_start + n).to(tl.int64) * stride_ks
        v_off = (q_start + n).to(tl.int64) * stride_vs
    if QUANT:
        k = _quant_keys(K, KS, RP, page * PAGE_SIZE + slot, n_ok, kvh, HK, NGK, K_BITS, QK_DIM, HEAD_DIM, BLOCK_N,
                        BLOCK_D).to(q.dtype)
    else:
        k = tl.load(K + k_off[None, :] + kvh * stride_kh + d[:, None],
                    mask=n_ok[None, :] & (d[:, None] < HEAD_DIM), other=0.0)
    s = tl.dot(q, k, input_precision=DOT_PREC)
    p, alpha, m_new, l_i = _chunk_probs(s, m_i, l_i, n, n_ok, q_pos, row_ok, scale, softcap, CAUSAL, WINDOW, SOFTCAP,
                                        MASKED)
    if QUANT:
        v = _quant_values(V, VS, page * PAGE_SIZE + slot, n_ok, kvh, HK, NGV, V_BITS, BLOCK_N, BLOCK_DV).to(q.dtype)
    else:
        v = tl.load(V + v_off[:, None] + kvh * stride_vh + dv[None, :],
                    mask=n_ok[:, None] & (dv[None, :] < HEAD_DIM_V), other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _refined_tile(r, Ring, Rows, held, fwd, low_row, G0, NG, ROW: tl.constexpr, BITS: tl.constexpr,
                  EXTRA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    # fp32 [BLOCK_N, BLOCK_G * 32] of load_tile's reads r: the held keys at 8 bits, the others at BITS (all of them on
    # an 8-bit side, which keeps no low bits); one return after a constexpr if/else
    if EXTRA > 0:
        l4, l2, l1 = load_low(Ring, Rows, held, fwd, low_row, G0, NG, ROW, EXTRA, BLOCK_N, BLOCK_G)
        x = decode_refined(r[0], r[1], r[2], r[3], r[4], l4, l2, l1, held, BITS, EXTRA, BLOCK_N, BLOCK_G)
    else:
        x = decode_tile(r[0], r[1], r[2], r[3], r[4], BITS, BLOCK_N, BLOCK_G)
    return x


@triton.jit
def _attn_chunk_recent(acc, m_i, l_i, q, start, hi, q_pos, row_ok, b, kvh, q_start, c0, first,
                       K, V, PageTable, scale, softcap, stride_pt,
                       PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                       SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, KS, VS, HK: tl.constexpr, K_BITS: tl.constexpr,
                       V_BITS: tl.constexpr, NGK: tl.constexpr, NGV: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DV: tl.constexpr, Tags, RingSlots, KRing, VRing, KRows, VRows, RECENT: tl.constexpr,
                       K_EXTRA: tl.constexpr, V_EXTRA: tl.constexpr, MIXED: tl.constexpr):
    """:func:`_attn_chunk` (masked) of a "kv/quant" chunk that overlaps some row's window of recent rows: a row reads
    key n at 8 bits where :mod:`~exl3_core.reference.kv_recent`'s rule says so (its low bits held, n <= the row's
    position < n + RECENT), else at the pages' bits; a side of 8 bits reads its pages as they are. MIXED: the rows
    differ on some held key (n <= one's position - RECENT, or past one's position without CAUSAL), so the chunk is
    decoded both ways and both products are selected per (row, key); else one tile, its held keys at 8 bits."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    page = tl.load(PageTable + b * stride_pt + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    row = page * PAGE_SIZE + n % PAGE_SIZE
    held, fwd, low_row = recent_keys(Tags, RingSlots, b, n, n_ok, first, c0, q_start, RECENT)
    kr = load_tile(K, KS, row * (HK * NGK * K_BITS), row * (HK * NGK), n_ok, kvh * NGK, NGK, K_BITS, BLOCK_N,
                   BLOCK_D // 32)
    k8 = tl.trans(_refined_tile(kr, KRing, KRows, held, fwd, low_row, kvh * NGK, NGK, HK * NGK, K_BITS, K_EXTRA,
                                BLOCK_N, BLOCK_D // 32)).to(q.dtype)
    s = tl.dot(q, k8, input_precision=DOT_PREC)
    if MIXED:
        fine = held[None, :] & (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - RECENT)
        if K_EXTRA > 0:
            k = tl.trans(decode_tile(kr[0], kr[1], kr[2], kr[3], kr[4], K_BITS, BLOCK_N, BLOCK_D // 32)).to(q.dtype)
            s = tl.where(fine, s, tl.dot(q, k, input_precision=DOT_PREC))
    p, alpha, m_new, l_i = _chunk_probs(s, m_i, l_i, n, n_ok, q_pos, row_ok, scale, softcap, CAUSAL, WINDOW, SOFTCAP,
                                        True)
    vr = load_tile(V, VS, row * (HK * NGV * V_BITS), row * (HK * NGV), n_ok, kvh * NGV, NGV, V_BITS, BLOCK_N,
                   BLOCK_DV // 32)
    v8 = _refined_tile(vr, VRing, VRows, held, fwd, low_row, kvh * NGV, NGV, HK * NGV, V_BITS, V_EXTRA, BLOCK_N,
                       BLOCK_DV // 32).to(q.dtype)
    if MIXED and V_EXTRA > 0:
        v = decode_tile(vr[0], vr[1], vr[2], vr[3], vr[4], V_BITS, BLOCK_N, BLOCK_DV // 32).to(q.dtype)
        p8 = tl.where(fine, p, 0.0)
        acc = acc * alpha[:, None] + tl.dot((p - p8).to(v.dtype), v, input_precision=DOT_PREC)
        acc = tl.dot(p8.to(v8.dtype), v8, acc, input_precision=DOT_PREC)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v8.dtype), v8, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _attn_fwd(
    Q, K, V, Out, PageTable, CuQ, SeqLensK,
    scale, softcap,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KS, VS, RP, HK: tl.constexpr, QUANT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    NGK: tl.constexpr, NGV: tl.constexpr, QK_DIM: tl.constexpr,
    Tags, RingSlots, KRing, VRing, KRows, VRows, RECENT: tl.constexpr, K_EXTRA: tl.constexpr, V_EXTRA: tl.constexpr,
):
    # QUANT: K/V are the code words of a quantized view, KS/VS their scales, RP the rotary keys of "mla/quant";
    # RECENT: the window of its recent rows (0: none), K_EXTRA/V_EXTRA their low bits per value (0: an 8-bit side)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    seq_k = tl.load(SeqLensK + b)
    if mblk * BLOCK_M >= q_len * GROUP:
        return

    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    if QUANT:
        q = _rotate_q(q, d, QK_DIM, BLOCK_M, BLOCK_D)
    q_pos = seq_k - q_len + tok  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    first_tok = (mblk * BLOCK_M) // GROUP
    hi = seq_k
    full = seq_k  # keys below this are visible to every row of the block: no mask needed
    if CAUSAL:
        last_tok = tl.minimum(mblk * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1) // GROUP
        hi = tl.minimum(seq_k, seq_k - q_len + last_tok + 1)
        full = tl.minimum(hi, seq_k - q_len + first_tok + 1)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(0, seq_k - q_len + first_tok - WINDOW + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
        full = lo
    full = lo + tl.maximum(full - lo, 0) // BLOCK_N * BLOCK_N
    if RECENT > 0:
        # The keys some row of the block reads at 8 bits (from first on) in a loop of their own, over small chunks
        # from mid on, after the others, which run the loops without recent rows (a branch in one loop costs every
        # chunk registers); below mid_n whole unmasked chunks, up to mid masked ones.
        c0 = seq_k - q_len
        first = c0 + first_tok - RECENT + 1
        mid = lo + tl.cdiv(tl.maximum(first + 1 - RECENT_BLOCK_N - lo, 0), RECENT_BLOCK_N) * RECENT_BLOCK_N
        mid_n = lo + (mid - lo) // BLOCK_N * BLOCK_N
        for start in range(lo, tl.minimum(full, mid_n), BLOCK_N):
            acc, m_i, l_i = _attn_chunk(acc, m_i, l_i, q, start, hi, q_pos, row_ok, d, dv, b, kvh, q_start,
                                        K, V, PageTable, scale, softcap,
                                        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
                                        PAGE_SIZE, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGED, CAUSAL, WINDOW, SOFTCAP,
                                        False, DOT_PREC, KS, VS, RP, HK, QUANT, K_BITS, V_BITS, NGK, NGV, QK_DIM,
                                        BLOCK_D, BLOCK_DV)
        below = tl.minimum(mid, hi)
        for start in range(tl.minimum(full, mid_n), below, BLOCK_N):
            acc, m_i, l_i = _attn_chunk(acc, m_i, l_i, q, start, below, q_pos, row_ok, d, dv, b, kvh, q_start,
                                        K, V, PageTable, scale, softcap,
                                        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
                                        PAGE_SIZE, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGED, CAUSAL, WINDOW, SOFTCAP,
                                        True, DOT_PREC, KS, VS, RP, HK, QUANT, K_BITS, V_BITS, NGK, NGV, QK_DIM,
                                        BLOCK_D, BLOCK_DV)
        # Causal: every row that sees a held key from band on reads it at 8 bits (the band below it, one key fewer than
        # the block's tokens, is read both ways); a few chunks, not software-pipelined (carried loads cost registers).
        band = hi
        if CAUSAL:
            band = c0 + tl.minimum(mblk * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1) // GROUP - RECENT + 1
        for start in tl.range(mid, hi, RECENT_BLOCK_N, num_stages=1):
            if start < band:
                acc, m_i, l_i = _attn_chunk_recent(acc, m_i, l_i, q, start, hi, q_pos, row_ok, b, kvh, q_start, c0,
                                                   first, K, V, PageTable, scale, softcap, stride_pt, PAGE_SIZE,
                                                   RECENT_BLOCK_N, CAUSAL, WINDOW, SOFTCAP, DOT_PREC, KS, VS, HK,
                                                   K_BITS, V_BITS, NGK, NGV, BLOCK_D, BLOCK_DV, Tags, RingSlots,
                                                   KRing, VRing, KRows, VRows, RECENT, K_EXTRA, V_EXTRA, True)
            else:
                acc, m_i, l_i = _attn_chunk_recent(acc, m_i, l_i, q, start, hi, q_pos, row_ok, b, kvh, q_start, c0,
                                                   first, K, V, PageTable, scale, softcap, stride_pt, PAGE_SIZE,
                                                   RECENT_BLOCK_N, CAUSAL, WINDOW, SOFTCAP, DOT_PREC, KS, VS, HK,
                                                   K_BITS, V_BITS, NGK, NGV, BLOCK_D, BLOCK_DV, Tags, RingSlots,
                                                   KRing, VRing, KRows, VRows, RECENT, K_EXTRA, V_EXTRA, False)
    else:
        # chunks below the causal diagonal in their own unmasked loop: no mask arithmetic for most of a prefill
        for start in range(lo, full, BLOCK_N):
            acc, m_i, l_i = _attn_chunk(acc, m_i, l_i, q, start, hi, q_pos, row_ok, d, dv, b, kvh, q_start,
                                        K, V, PageTable, scale, softcap,
                                        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
                                        PAGE_SIZE, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGED, CAUSAL, WINDOW, SOFTCAP,
                                        False, DOT_PREC, KS, VS, RP, HK, QUANT, K_BITS, V_BITS, NGK, NGV, QK_DIM,
                                        BLOCK_D, BLOCK_DV)
        for start in range(full, hi, BLOCK_N):
            acc, m_i, l_i = _attn_chunk(acc, m_i, l_i, q, start, hi, q_pos, row_ok, d, dv, b, kvh, q_start,
                                        K, V, PageTable, scale, softcap,
                                        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
                                        PAGE_SIZE, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGED, CAUSAL, WINDOW, SOFTCAP,
                                        True, DOT_PREC, KS, VS, RP, HK, QUANT, K_BITS, V_BITS, NGK, NGV, QK_DIM,
                                        BLOCK_D, BLOCK_DV)

    if QUANT:  # back from the rotated basis of the values
        acc = hadamard_cols(acc, BLOCK_M, BLOCK_DV)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptr = Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < HEAD_DIM_V))


@triton.jit
def _split_rows(PageTable, b, start, stride_pt, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, n_ok):
    # cache rows (page * PAGE_SIZE-strided slots) of positions start .. start + BLOCK_N - 1, through the
    # page table; 0 where not n_ok
    n = start + tl.arange(0, BLOCK_N)
    page = tl.load(PageTable + b * stride_pt + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    return page, n % PAGE_SIZE


@triton.jit
def _split_load(K, V, page, slot, kvh, n_ok, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                Q, KS, VS, RP, PAGE_SIZE: tl.constexpr, HK: tl.constexpr, QUANT: tl.constexpr, K_BITS: tl.constexpr,
                V_BITS: tl.constexpr, NGK: tl.constexpr, NGV: tl.constexpr, QK_DIM: tl.constexpr,
                BLOCK_N: tl.constexpr):
    # keys [BLOCK_D, BLOCK_N] and values [BLOCK_N, BLOCK_DV] of the rows (page, slot) where n_ok, zeros elsewhere;
    # QUANT: dequantized from the code words (rotated basis), in q's dtype
    # one return after a constexpr if/else: the compiler generates only the taken branch, where an early
    # return would leave both returns (int32 code words and float values) in one function
    if QUANT:
        row = page * PAGE_SIZE + slot
        k = _quant_keys(K, KS, RP, row, n_ok, kvh, HK, NGK, K_BITS, QK_DIM, HEAD_DIM, BLOCK_N, BLOCK_D)
        v = _quant_values(V, VS, row, n_ok, kvh, HK, NGV, V_BITS, BLOCK_N, BLOCK_DV)
        k = k.to(Q.dtype.element_ty)
        v = v.to(Q.dtype.element_ty)
    else:
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        k = tl.load(K + (page * stride_kp + slot * stride_ks)[None, :] + kvh * stride_kh + d[:, None],
                    mask=n_ok[None, :] & (d[:, None] < HEAD_DIM), other=0.0)
        v = tl.load(V + (page * stride_vp + slot * stride_vs)[:, None] + kvh * stride_vh + dv[None, :],
                    mask=n_ok[:, None] & (dv[None, :] < HEAD_DIM_V), other=0.0)
    return k, v


@triton.jit
def _split_tiles(K, V, PageTable, b, kvh, start, hi, stride_pt, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                 stride_vh, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                 Q, KS, VS, RP, HK: tl.constexpr, QUANT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                 NGK: tl.constexpr, NGV: tl.constexpr, QK_DIM: tl.constexpr):
    # keys and values of positions start .. start + BLOCK_N - 1 below hi, zeros elsewhere
    n_ok = start + tl.arange(0, BLOCK_N) < hi
    page, slot = _split_rows(PageTable, b, start, stride_pt, PAGE_SIZE, BLOCK_N, n_ok)
    return _split_load(K, V, page, slot, kvh, n_ok, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                       HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, Q, KS, VS, RP, PAGE_SIZE, HK, QUANT, K_BITS, V_BITS,
                       NGK, NGV, QK_DIM, BLOCK_N)


@triton.jit
def _split_step(q, k, v, start, hi, m_i, l_i, acc, scale, softcap, q_pos,
                BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, ROWS: tl.constexpr):
    # one BLOCK_N chunk of the online softmax (fp32 state m_i, l_i, acc); ROWS > 1: each row sees the keys up to
    # its query's position q_pos (causal)
    n = start + tl.arange(0, BLOCK_N)
    s = tl.dot(q, k, input_precision=DOT_PREC) * scale
    if SOFTCAP:
        s = s / softcap
        s = softcap * (2.0 * tl.sigmoid(2.0 * s) - 1.0)  # tanh via sigmoid
    if ROWS > 1:
        s = tl.where((n[None, :] < hi) & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an earlier query may see no key of this chunk
    else:
        s = tl.where(n[None, :] < hi, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every chunk holds >= 1 visible key
        m_ref = m_new
    p = tl.exp(s - m_ref[:, None])
    alpha = tl.exp(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _split_probs(s, n, hi, m_i, l_i, softcap, q_pos, SOFTCAP: tl.constexpr):
    # _split_step's online softmax of several queries' scaled scores s [BLOCK_H, BLOCK_N] (keys n), for _split_recent:
    # (p, alpha, m_new, l_i). A copy, since _split_step calling it perturbs ptxas's scheduling of kernels without
    # recent rows (through the line info of one more inlined function).
    if SOFTCAP:
        s = s / softcap
        s = softcap * (2.0 * tl.sigmoid(2.0 * s) - 1.0)  # tanh via sigmoid
    s = tl.where((n[None, :] < hi) & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an earlier query may see no key of this chunk
    p = tl.exp(s - m_ref[:, None])
    alpha = tl.exp(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _split_recent(reads, q, start, hi, m_i, l_i, acc, scale, softcap, q_pos, b, kvh, q_start, c0, first,
                  Tags, RingSlots, KRing, VRing, KRows, VRows, HK: tl.constexpr, NGK: tl.constexpr,
                  NGV: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, RECENT: tl.constexpr,
                  K_EXTRA: tl.constexpr, V_EXTRA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, ROWS: tl.constexpr,
                  MIXED: tl.constexpr):
    # _split_step of a "kv/quant" chunk (_split_reads' reads) that overlaps a query's window of recent rows: key n at
    # 8 bits where kv_recent's rule says so, else at the pages' bits. One tile, its held keys at 8 bits; MIXED (several
    # queries, some of which read a held key n <= their position - RECENT at the pages' bits): both readings decoded
    # and both products selected per (row, key).
    row, n_ok, kr, vr = reads
    n = start + tl.arange(0, BLOCK_N)
    held, fwd, low_row = recent_keys(Tags, RingSlots, b, n, n_ok, first, c0, q_start, RECENT)
    k8 = tl.trans(_refined_tile(kr, KRing, KRows, held, fwd, low_row, kvh * NGK, NGK, HK * NGK, K_BITS, K_EXTRA,
                                BLOCK_N, BLOCK_D // 32)).to(q.dtype)
    v8 = _refined_tile(vr, VRing, VRows, held, fwd, low_row, kvh * NGV, NGV, HK * NGV, V_BITS, V_EXTRA, BLOCK_N,
                       BLOCK_DV // 32).to(q.dtype)
    if MIXED:  # (those past a query's position are masked)
        fine = held[None, :] & (n[None, :] > q_pos[:, None] - RECENT)
        s = tl.dot(q, k8, input_precision=DOT_PREC)
        if K_EXTRA > 0:
            k = tl.trans(decode_tile(kr[0], kr[1], kr[2], kr[3], kr[4], K_BITS, BLOCK_N, BLOCK_D // 32)).to(q.dtype)
            s = tl.where(fine, s, tl.dot(q, k, input_precision=DOT_PREC))
        p, alpha, m_new, l_i = _split_probs(s * scale, n, hi, m_i, l_i, softcap, q_pos, SOFTCAP)
        if V_EXTRA > 0:
            v = decode_tile(vr[0], vr[1], vr[2], vr[3], vr[4], V_BITS, BLOCK_N, BLOCK_DV // 32).to(q.dtype)
            p8 = tl.where(fine, p, 0.0)
            acc = acc * alpha[:, None] + tl.dot((p - p8).to(v.dtype), v, input_precision=DOT_PREC)
            acc = tl.dot(p8.to(v8.dtype), v8, acc, input_precision=DOT_PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v8.dtype), v8, input_precision=DOT_PREC)
    else:
        m_new, l_i, acc = _split_step(q, k8, v8, start, hi, m_i, l_i, acc, scale, softcap, q_pos, BLOCK_N, SOFTCAP,
                                      DOT_PREC, ROWS)
    return m_new, l_i, acc


@triton.jit
def _split_row_ids(hblk, q_len, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr):
    # the (query, head-within-group) pairs of rows hblk * BLOCK_H + 0 .. BLOCK - 1 and which of them exist
    r = hblk * BLOCK_H + tl.arange(0, BLOCK)
    if ROWS > 1:
        tok = r // GROUP
        return tok, r % GROUP, (r < ROWS * GROUP) & (tok < q_len)
    return r * 0, r, (r < GROUP) & (r * 0 + q_len > 0)


@triton.jit
def _token_rows(q_start, tok, ROWS: tl.constexpr):
    # the query token of each row, as a column to broadcast; one query per sequence: the scalar itself (one
    # return after a constexpr if/else: an early return would leave two return types)
    if ROWS > 1:
        t = (q_start + tok)[:, None]
    else:
        t = q_start
    return t


@triton.jit
def _merge_splits(PartM, PartL, PartAcc, Out, b, hblk, q_start, q_len, n_used, NUM_SPLITS, stride_ot, stride_oh,
                  NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, KV_HEAD0, BLOCK_H: tl.constexpr,
                  BLOCK_HM: tl.constexpr, SPLIT_CHUNK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_DV: tl.constexpr, QUANT: tl.constexpr, ROWS: tl.constexpr):
    # The softmax-weighted sum of splits 0 .. n_used - 1 (later ones are empty) for the head block's
    # rows, SPLIT_CHUNK splits per round with a running max; written to Out in its dtype. The
    # partials were stored by other programs of this launch: read at L2 (.cg), not a stale L1 line.
    tok, hrow, h_ok = _split_row_ids(hblk, q_len, BLOCK_HM, BLOCK_H, GROUP, ROWS)
    head = KV_HEAD0 + hrow
    dv = tl.arange(0, BLOCK_DV)
    sc = tl.arange(0, SPLIT_CHUNK)
    m_run = tl.full([BLOCK_HM], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_HM], tl.float32)
    acc = tl.zeros([BLOCK_HM, BLOCK_DV], tl.float32)
    for s0 in range(0, n_used, SPLIT_CHUNK):
        s_ok = s0 + sc < n_used
        part = ((b * ROWS + tok) * NUM_HEADS + head)[:, None] * NUM_SPLITS + s0 + sc[None, :]  # [BLOCK_HM, SPLIT_CHUNK]
        ok2 = h_ok[:, None] & s_ok[None, :]
        m = tl.load(PartM + part, mask=ok2, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(PartL + part, mask=ok2, other=0.0, cache_modifier=".cg")
        a = tl.load(PartAcc + part.to(tl.int64)[:, :, None] * HEAD_DIM_V + dv[None, None, :],
                    mask=ok2[:, :, None] & (dv[None, None, :] < HEAD_DIM_V), other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: every weight is exp(-inf) = 0
        alpha = tl.exp(m_run - m_ref)
        w = tl.exp(m - m_ref[:, None])
        l_run = l_run * alpha + tl.sum(w * l_s, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * a, 1)
        m_run = m_new
    if QUANT:  # the partials are in the values' rotated basis: rotate the merged sum back
        acc = hadamard_cols(acc, BLOCK_HM, BLOCK_DV)
    out = acc / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
    tl.store(Out + _token_rows(q_start, tok, ROWS) * stride_ot + head[:, None] * stride_oh + dv[None, :],
             out.to(Out.dtype.element_ty), mask=h_ok[:, None] & (dv[None, :] < HEAD_DIM_V))


@triton.jit
def _decode_split(
    Q, K, V, PageTable, CuQ, SeqLensK, PartM, PartL, PartAcc, Count, Out,
    scale, softcap,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_pt, stride_ot, stride_oh, NUM_SPLITS,  # a runtime value: one compiled kernel serves every split count
    NUM_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
    RELOAD_FRESH: tl.constexpr, BLOCK_HM: tl.constexpr, SPLIT_CHUNK: tl.constexpr, USED_ONLY: tl.constexpr,
    KS, VS, RP, HK: tl.constexpr, QUANT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    NGK: tl.constexpr, NGV: tl.constexpr, QK_DIM: tl.constexpr, ROWS: tl.constexpr,
    Tags, RingSlots, KRing, VRing, KRows, VRows, RECENT: tl.constexpr, K_EXTRA: tl.constexpr, V_EXTRA: tl.constexpr,
):
    # grid (batch, kv_heads * HEAD_BLOCKS, NUM_SPLITS); rows = BLOCK_H (query, head-within-group) pairs of one
    # GQA group, ROWS queries per sequence at most (the last at position seq_k - 1). A split's first BLOCK_N keys
    # (its least share) are loaded before the wait, the rest in BLOCK_N chunks after it. RECENT > 0: a "kv/quant"
    # view's recent rows (window RECENT, K_EXTRA/V_EXTRA low bits per value), read in the chunks that overlap it.
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    hblk = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    # Before the wait for the kernel that wrote q (and this step's keys/values): the batch
    # description and every cached key/value of earlier steps. Both were complete before this step's
    # first kernel started: the inputs are copied before it (or the graph replay starts after them),
    # and a step begins after the previous one has finished (a copy or a graph launch in between).
    # Within a step this grid may start before its predecessor has even waited (a pre-decoding EXL3
    # linear signals at its start, csrc/exl3/exl3_fused.cuh), so nothing written within the step is
    # read here; the only such values, this step's own positions (the last q_len), are reloaded after the wait.
    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    seq_k = tl.load(SeqLensK + b)

    tok, hrow, row_ok = _split_row_ids(hblk, q_len, BLOCK_H, BLOCK_H, GROUP, ROWS)
    h_ok = (hrow < GROUP) & (tok < ROWS)  # rows with a partial slot (row_ok: and a query this step)
    head = kvh * GROUP + hrow
    q_pos = seq_k - q_len + tok
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)

    # This split's key range, from this sequence's own length: equal shares rounded up to whole
    # BLOCK_N chunks, at least one chunk, so short sequences leave trailing splits empty (no cache
    # reads below) and one that fits a chunk is the first split's alone.
    per = tl.maximum(tl.cdiv(tl.cdiv(seq_k, NUM_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)
    lo = split * per
    hi = tl.minimum(lo + per, seq_k)
    if WINDOW > 0:  # one query (ROWS = 1): it sits at seq_k - 1 and sees keys n > seq_k - 1 - WINDOW
        lo = tl.maximum(lo, seq_k - WINDOW)
    hi = tl.where(q_len > 0, hi, lo)  # padded/empty rows read nothing
    n0_ok = lo + tl.arange(0, BLOCK_N) < hi
    page0, slot0 = _split_rows(PageTable, b, lo, stride_pt, PAGE_SIZE, BLOCK_N, n0_ok)
    k0, v0 = _split_load(K, V, page0, slot0, kvh, n0_ok, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                         stride_vh, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, Q, KS, VS, RP, PAGE_SIZE, HK, QUANT,
                         K_BITS, V_BITS, NGK, NGV, QK_DIM, BLOCK_N)
    if PDL:  # a programmatic dependent of the cache write (exl3_core/kernels/pdl.py); o_proj, which decodes its
        # weights before its own wait, may start now
        gdc_wait()
        gdc_launch_dependents()

    q_ptr = Q + _token_rows(q_start, tok, ROWS) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    if QUANT:
        q = _rotate_q(q, d, QK_DIM, BLOCK_H, BLOCK_D)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    if RECENT > 0:
        # The keys some query of this step reads at 8 bits (from first on) in a loop of their own, over small chunks
        # from mid on, after the others, which run the loop without recent rows (a branch in one loop costs every
        # chunk registers); read after the wait, since this step's store writes low bits, tags and the newest rows.
        c0 = seq_k - q_len
        first = c0 - RECENT + 1
        mid = lo + tl.cdiv(tl.maximum(first + 1 - RECENT_BLOCK_N - lo, 0), RECENT_BLOCK_N) * RECENT_BLOCK_N
        below = tl.minimum(mid, hi)
        if lo < below:  # keys older than this step's rows: the loads before the wait are current
            m_i, l_i, acc = _split_step(q, k0, v0, lo, below, m_i, l_i, acc, scale, softcap, q_pos, BLOCK_N, SOFTCAP,
                                        DOT_PREC, ROWS)
        reads = _split_reads(K, V, KS, VS, PageTable, b, kvh, lo + BLOCK_N, below, stride_pt, PAGE_SIZE, HK, NGK, NGV,
                             K_BITS, V_BITS, BLOCK_N, BLOCK_D, BLOCK_DV)
        for start in range(lo + BLOCK_N, below, BLOCK_N):
            ahead = _split_reads(K, V, KS, VS, PageTable, b, kvh, start + BLOCK_N, below, stride_pt, PAGE_SIZE, HK,
                                 NGK, NGV, K_BITS, V_BITS, BLOCK_N, BLOCK_D, BLOCK_DV)
            k, v = _split_decode(reads, Q, RP, K_BITS, V_BITS, QK_DIM, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_DV)
            m_i, l_i, acc = _split_step(q, k, v, start, below, m_i, l_i, acc, scale, softcap, q_pos, BLOCK_N,
                                        SOFTCAP, DOT_PREC, ROWS)
            reads = ahead
        # Every query reads a held key from seq_k - RECENT on at 8 bits (the band below it, ROWS - 1 keys at most, is
        # read both ways); a few chunks, not software-pipelined (loads carried across iterations cost registers).
        for start in tl.range(mid, hi, RECENT_BLOCK_N, num_stages=1):
            tile = _split_reads(K, V, KS, VS, PageTable, b, kvh, start, hi, stride_pt, PAGE_SIZE, HK, NGK, NGV,
                                 K_BITS, V_BITS, RECENT_BLOCK_N, BLOCK_D, BLOCK_DV)
            mixed = False  # one query per sequence: the rule is per key (a compile-time False: one branch)
            if ROWS > 1:
                mixed = start < seq_k - RECENT
            if mixed:
                m_i, l_i, acc = _split_recent(tile, q, start, hi, m_i, l_i, acc, scale, softcap, q_pos, b, kvh,
                                              q_start, c0, first, Tags, RingSlots, KRing, VRing, KRows, VRows, HK,
                                              NGK, NGV, K_BITS, V_BITS, RECENT, K_EXTRA, V_EXTRA, RECENT_BLOCK_N,
                                              BLOCK_D, BLOCK_DV, SOFTCAP, DOT_PREC, ROWS, True)
            else:
                m_i, l_i, acc = _split_recent(tile, q, start, hi, m_i, l_i, acc, scale, softcap, q_pos, b, kvh,
                                              q_start, c0, first, Tags, RingSlots, KRing, VRing, KRows, VRows, HK,
                                              NGK, NGV, K_BITS, V_BITS, RECENT, K_EXTRA, V_EXTRA, RECENT_BLOCK_N,
                                              BLOCK_D, BLOCK_DV, SOFTCAP, DOT_PREC, ROWS, False)
    else:
        if lo < hi:
            if RELOAD_FRESH:  # this step's own keys/values, where in the first chunk, may postdate the loads above
                # (their cache rows are already known: one round trip, alongside q's)
                new = lo + tl.arange(0, BLOCK_N) >= seq_k - q_len
                kn, vn = _split_load(K, V, page0, slot0, kvh, new & n0_ok, stride_kp, stride_ks, stride_kh, stride_vp,
                                     stride_vs, stride_vh, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, Q, KS, VS, RP,
                                     PAGE_SIZE, HK, QUANT, K_BITS, V_BITS, NGK, NGV, QK_DIM, BLOCK_N)
                k0 = tl.where(new[None, :], kn, k0)
                v0 = tl.where(new[:, None], vn, v0)
            m_i, l_i, acc = _split_step(q, k0, v0, lo, hi, m_i, l_i, acc, scale, softcap, q_pos, BLOCK_N, SOFTCAP,
                                        DOT_PREC, ROWS)
        if QUANT:
            # a chunk's words and scales are read one chunk ahead, so that their latency passes under this chunk's
            # decoding and products (fp16 pages get the same from the compiler's pipelined copies)
            reads = _split_reads(K, V, KS, VS, PageTable, b, kvh, lo + BLOCK_N, hi, stride_pt, PAGE_SIZE, HK, NGK, NGV,
                                 K_BITS, V_BITS, BLOCK_N, BLOCK_D, BLOCK_DV)
            for start in range(lo + BLOCK_N, hi, BLOCK_N):
                ahead = _split_reads(K, V, KS, VS, PageTable, b, kvh, start + BLOCK_N, hi, stride_pt, PAGE_SIZE, HK,
                                     NGK, NGV, K_BITS, V_BITS, BLOCK_N, BLOCK_D, BLOCK_DV)
                k, v = _split_decode(reads, Q, RP, K_BITS, V_BITS, QK_DIM, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_DV)
                m_i, l_i, acc = _split_step(q, k, v, start, hi, m_i, l_i, acc, scale, softcap, q_pos, BLOCK_N, SOFTCAP,
                                            DOT_PREC, ROWS)
                reads = ahead
        else:
            for start in range(lo + BLOCK_N, hi, BLOCK_N):
                k, v = _split_tiles(K, V, PageTable, b, kvh, start, hi, stride_pt, stride_kp, stride_ks, stride_kh,
                                    stride_vp, stride_vs, stride_vh, PAGE_SIZE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                                    BLOCK_N, Q, KS, VS, RP, HK, QUANT, K_BITS, V_BITS, NGK, NGV, QK_DIM)
                m_i, l_i, acc = _split_step(q, k, v, start, hi, m_i, l_i, acc, scale, softcap, q_pos, BLOCK_N, SOFTCAP,
                                            DOT_PREC, ROWS)

    # partials [B, ROWS, Hq, NUM_SPLITS] and [B, ROWS, Hq, NUM_SPLITS, HEAD_DIM_V]; empty splits: (-inf, 0, 0).
    # With USED_ONLY (several sequences), splits past the sequence's used ones (a graph captured at the
    # cache capacity runs NUM_SPLITS programs; a short sequence uses a few) store nothing and do not
    # arrive: the merge waits for the used splits only (at least split 0, so a zero-length row still gets
    # its output); one sequence keeps every split arriving, which is faster there.
    n_used = tl.minimum(tl.cdiv(seq_k, tl.maximum(per, 1)), NUM_SPLITS)
    # A sequence that one split holds takes no partials and no arrival: its first split writes the
    # output itself (the merge of one split is this same division, bit for bit).
    n_arrive = tl.maximum(n_used, 1) if USED_ONLY else NUM_SPLITS
    alone = n_used <= 1
    n_arrive = tl.where(alone, 0, n_arrive)
    if alone and split == 0:
        o = acc
        if QUANT:  # back from the values' rotated basis
            o = hadamard_cols(acc, BLOCK_H, BLOCK_DV)
        out = o / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + _token_rows(q_start, tok, ROWS) * stride_ot + head[:, None] * stride_oh + dv[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < HEAD_DIM_V))
    if split < n_arrive:  # partials, then the head block's last used split merges them: no second launch
        part = ((b * ROWS + tok) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(PartM + part, m_i, mask=h_ok)
        tl.store(PartL + part, l_i, mask=h_ok)
        tl.store(PartAcc + part.to(tl.int64)[:, None] * HEAD_DIM_V + dv[None, :], acc,
                 mask=h_ok[:, None] & (dv[None, :] < HEAD_DIM_V))
        tl.debug_barrier()  # every thread's partial stores precede the release below
        cnt = Count + b * (tl.num_programs(1)) + tl.program_id(1)
        if tl.atomic_add(cnt, 1, sem="acq_rel") == n_arrive - 1:
            if q_len > 0:
                _merge_splits(PartM, PartL, PartAcc, Out, b, hblk, q_start, q_len, n_used, NUM_SPLITS, stride_ot,
                              stride_oh, NUM_HEADS, GROUP, kvh * GROUP, BLOCK_H, BLOCK_HM, SPLIT_CHUNK, HEAD_DIM_V,
                              BLOCK_DV, QUANT, ROWS)
            tl.store(cnt, 0)  # clean for the next call (a replayed graph reuses the buffer)


_CACHE_VIEWS = frozenset(f"{k}/{d}" for k in ("kv", "mla") for d in ("fp16", "bf16", "fp32", "quant"))
_QUANT_GROUP = 32


def quant_reasons(spec: AttnSpec) -> list[str]:
    """Why a quantized view (format spec 6) cannot be read for ``spec``: its quantized widths must be whole groups."""
    why = ""
    if spec.cache == "kv/quant" and (spec.head_dim % _QUANT_GROUP or spec.v_dim % _QUANT_GROUP):
        why = (f"kv/quant needs key and value head dims that are multiples of {_QUANT_GROUP} (got "
               f"{spec.head_dim}/{spec.v_dim})")
    if spec.cache == "mla/quant" and (spec.v_dim % _QUANT_GROUP or spec.v_dim >= spec.head_dim):
        why = (f"mla/quant needs a latent width (head_dim_v) that is a multiple of {_QUANT_GROUP} below the key "
               f"width (got {spec.v_dim}/{spec.head_dim})")
    return [why] if why else []


def _quant_kwargs(args: AttnArgs) -> dict[str, object]:
    """The kernels' arguments for the cache view of ``args``: placeholders for float views, the scales, rotary
    keys and group counts for a quantized one."""
    spec = args.spec
    qp = args.quant
    k = args.k_cache if args.k_cache is not None else args.q
    if spec.cache is None or not spec.cache.endswith("/quant"):
        return {"KS": k, "VS": k, "RP": k, "HK": 1, "QUANT": False, "K_BITS": 0, "V_BITS": 0, "NGK": 0, "NGV": 0,
                "QK_DIM": 0, **_NO_RECENT}
    if qp is None:
        raise ValueError(f"triton_paged: cache view {spec.cache!r} needs AttnArgs.quant (scales and bit widths)")
    latent = spec.cache.startswith("mla/")
    qk_dim = spec.v_dim if latent else spec.head_dim
    tensors = [t for t in (args.k_cache, args.v_cache, qp.k_scales, qp.v_scales, qp.rope) if t is not None]
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("triton_paged: the pages of a quantized view must be contiguous")
    return {"KS": qp.k_scales, "VS": qp.k_scales if latent or qp.v_scales is None else qp.v_scales,
            "RP": qp.rope if qp.rope is not None else qp.k_scales, "HK": spec.num_kv_heads, "QUANT": True,
            "K_BITS": qp.k_bits, "V_BITS": qp.k_bits if latent else qp.v_bits, "NGK": qk_dim // _QUANT_GROUP,
            "NGV": spec.v_dim // _QUANT_GROUP, "QK_DIM": qk_dim, **_recent_kwargs(args)}


#: the kernels' recent-row arguments without recent rows: None pointers are compile-time constants, so the kernels
#: are those compiled before recent rows existed, parameters included
_NO_RECENT: dict[str, object] = {"Tags": None, "RingSlots": None, "KRing": None, "VRing": None, "KRows": None,
                                 "VRows": None, "RECENT": 0, "K_EXTRA": 0, "V_EXTRA": 0}


def _recent_kwargs(args: AttnArgs) -> dict[str, object]:
    """The kernels' arguments for the recent rows of a "kv/quant" call (:mod:`exl3_core.reference.kv_recent`):
    :data:`_NO_RECENT` unless the spec keeps a window and the call names ring slots, and a side holds low bits."""
    spec, qp = args.spec, args.quant
    rr = qp.recent if qp is not None else None
    if not spec.recent or rr is None or (rr.k_ring is None and rr.v_ring is None):
        return _NO_RECENT
    assert qp is not None
    if spec.cache != "kv/quant" or rr.window != spec.recent or rr.size != rr.window:
        raise ValueError(f"triton_paged: recent rows need the 'kv/quant' view (got {spec.cache!r}) and a ring of "
                         f"spec.recent={spec.recent} rows per slot (got window {rr.window}, {rr.size} rows)")
    extra = {}
    for side, ring, rows, bits, dim in (("K", rr.k_ring, rr.k_rows, qp.k_bits, spec.head_dim),
                                        ("V", rr.v_ring, rr.v_rows, qp.v_bits, spec.v_dim)):
        extra[side] = 0 if ring is None else 8 - bits
        width = spec.num_kv_heads * dim // _QUANT_GROUP * extra[side]
        if ring is not None and (rows is None or bits >= 8 or ring.shape[-1] != width or rows.shape[-1] != width
                                 or not ring.is_contiguous() or not rows.is_contiguous()):
            raise ValueError(f"triton_paged: {side.lower()}_ring/{side.lower()}_rows must be contiguous with "
                             f"{width} low-bit words per row at {bits} bits")
    if not (rr.tags.is_contiguous() and rr.slots.is_contiguous()):
        raise ValueError("triton_paged: the recent rows' tags and slots must be contiguous")
    return {"Tags": rr.tags, "RingSlots": rr.slots, "KRing": rr.k_ring, "VRing": rr.v_ring, "KRows": rr.k_rows,
            "VRows": rr.v_rows, "RECENT": rr.window, "K_EXTRA": extra["K"], "V_EXTRA": extra["V"]}


def _interpreting() -> bool:
    # Triton's own switch (not an exl3 setting): kernels run in the CPU interpreter
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonPagedAttention:
    """Paged/varlen attention in Triton; outranks the torch reference on CUDA."""

    name: ClassVar[str] = "triton_paged"
    #: no host syncs, caching-allocator outputs, current stream: decode steps may be CUDA-graphed
    graph_safe: ClassVar[bool] = True

    def __init__(self) -> None:
        #: force the split count of paged decode calls (None: :func:`choose_num_splits`); 1 = the
        #: single-pass kernel. For tests and benchmarks.
        self.decode_num_splits: int | None = None

    def priority(self, spec: AttnSpec) -> int:
        # Under the CPU interpreter the kernel is correct but slow: available, never preferred.
        if spec.device_type != "cuda":
            return -10
        if spec.dtype == torch.float32 and spec.cache is None and spec.phase != "decode":
            # fp32 tiles use exact (ieee) dots on CUDA cores, far slower for the conversion's cache-less
            # calibration rows than the torch reference's two cuBLAS matmuls (TF32 while converting)
            return -5
        return 100

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = []
        if spec.device_type != "cuda" and not (spec.device_type == "cpu" and _interpreting()):
            r.append(f"needs a CUDA device (got {spec.device_type}); on CPU only under TRITON_INTERPRET=1")
        if spec.device_type == "cuda" and spec.device_cc < (8, 0):
            r.append(f"needs compute capability >= 8.0 (got {spec.device_cc})")
        if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            r.append(f"dtype {spec.dtype} not supported")
        if spec.num_q_heads % spec.num_kv_heads:
            r.append("num_q_heads must be a multiple of num_kv_heads")
        if spec.has_sinks:
            r.append("attention sinks not implemented")
        if spec.non_causal_spans:
            r.append("non-causal spans not implemented")
        if spec.recent and spec.cache != "kv/quant":
            r.append(f"recent rows are read from the 'kv/quant' view only (got {spec.cache!r})")
        if spec.cache is not None and spec.cache not in _CACHE_VIEWS:
            r.append(f"cache view {spec.cache!r} not supported ({', '.join(sorted(_CACHE_VIEWS))})")
        r += quant_reasons(spec)
        if max(spec.head_dim, spec.v_dim) > 1024:
            r.append("head dim > 1024")
        return r

    @staticmethod
    def _split_route(spec: AttnSpec) -> bool:
        # several queries per sequence: the same count in every sequence, causal, without a window
        rows_ok = spec.q_per_seq == 1 or (spec.q_per_seq > 1 and spec.causal and not spec.window)
        return spec.phase == "decode" and spec.cache is not None and rows_ok

    def route(self, spec: AttnSpec) -> str:
        """The kernel calls matching ``spec`` take (see :meth:`forward`)."""
        if self._split_route(spec):
            return "split-KV decode kernel (splits from the static key bound)"
        return "single-pass varlen kernel"

    def forward(self, args: AttnArgs) -> torch.Tensor:
        spec = args.spec
        if self._split_route(spec):
            # the split kernel even at one split: its key tile is loaded before its wait
            splits = self.decode_num_splits if self.decode_num_splits is not None else choose_num_splits(args)
            if splits > 1 or self.decode_num_splits is None:
                return decode_split_kv(args, splits)
        return attention_single_pass(args)


#: split-KV heuristic: aim for this many programs per SM in the split kernel, at most MAX_SPLITS splits: the
#: split count is fixed at capture from the cache capacity, so it must serve short and long contexts alike,
#: and more splits lengthen the merge by as much as they shorten each split.
PROGRAMS_PER_SM = 4
MAX_SPLITS = 32
#: The split kernel's key chunk while the static bound holds at most MAX_SPLITS such chunks, so that every
#: split has one chunk, loaded before its wait; longer bounds keep the single-pass kernel's (64 up to head
#: dim 128), whose chunks cost fewer iterations. 0: every bound takes the single-pass kernel's chunk.
SHORT_BOUND_BLOCK_N = 32
#: fp32 elements of the merge's [heads, splits, dv] partial tile per round (8192: 64 registers a
#: thread at 4 warps); more splits than fit take several rounds with a running max.
MERGE_TILE = 8192
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the interpreter: any value that exercises several splits in the tests
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:  # a host-side property read, no sync; cached per device
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _block_sizes(spec: AttnSpec) -> tuple[int, int, int]:
    block_d = max(16, triton.next_power_of_2(spec.head_dim))
    block_dv = max(16, triton.next_power_of_2(spec.v_dim))
    widest = max(block_d, block_dv)
    # K and V chunks are staged in shared memory (x num_stages): keep them within an SM's share
    block_n = 16 if widest > 512 else (32 if widest > 128 else 64)
    return block_d, block_dv, block_n


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise run as TF32 on the GPU (10-bit mantissa), far off the fp32 reference
    return "ieee" if dtype == torch.float32 else "tf32"


def _decode_block_n(spec: AttnSpec, max_seqlen_k: int) -> int:
    """The split kernel's key chunk for this static bound (see :data:`SHORT_BOUND_BLOCK_N`), which is
    also a split's least share of the keys."""
    block_n = _block_sizes(spec)[2]
    if 16 <= SHORT_BOUND_BLOCK_N < block_n and triton.cdiv(max(max_seqlen_k, 1), SHORT_BOUND_BLOCK_N) <= MAX_SPLITS:
        return SHORT_BOUND_BLOCK_N
    return block_n


def choose_num_splits(args: AttnArgs) -> int:
    """Splits over the key axis for a paged decode call, from static host values only.

    Enough (batch x kv_heads x head_blocks x splits) programs to give every SM a few, but no
    more splits than ``max_seqlen_k`` (the bound a CUDA graph is captured with) has key chunks
    (:func:`_decode_block_n`): each split's range is rounded up to whole chunks on the device.
    """
    spec = args.spec
    rows = max(1, spec.q_per_seq) * (spec.num_q_heads // spec.num_kv_heads)
    programs = args.seq_lens_k.shape[0] * spec.num_kv_heads * triton.cdiv(rows, 16)
    want = triton.cdiv(PROGRAMS_PER_SM * _sm_count(args.q.device), programs)
    share = _decode_block_n(spec, args.max_seqlen_k)
    return max(1, min(want, triton.cdiv(max(args.max_seqlen_k, 1), share), MAX_SPLITS))


def decode_split_kv(args: AttnArgs, num_splits: int, reload_fresh: bool | None = None) -> torch.Tensor:
    """Split-KV decode over a paged cache (``spec.q_per_seq`` causal queries per sequence at most, 1 for a plain
    decode step): the split kernel, whose last program per head block merges the splits.

    ``reload_fresh``: reload each sequence's newest key/value after the wait for the kernel that wrote
    them (the split kernel loads its first chunk before that wait); None = when launched as a
    programmatic dependent, the only case where the early loads can see the old row. Tests force it.
    With recent rows the chunks that hold a step's rows are read after the wait anyway.
    """
    spec = args.spec
    q = args.q
    Hq = q.shape[1]
    group = Hq // spec.num_kv_heads
    B = args.seq_lens_k.shape[0]
    k = args.k_cache
    v = args.v_cache if args.v_cache is not None else args.k_cache  # latent: values = leading channels
    pt = args.page_table
    assert k is not None and pt is not None
    block_d, block_dv, _ = _block_sizes(spec)
    block_n = _decode_block_n(spec, args.max_seqlen_k)
    block_h = 16  # tl.dot needs M >= 16: small GQA groups leave rows masked, which costs no memory traffic
    rows = max(1, spec.q_per_seq)
    head_blocks = triton.cdiv(rows * group, block_h)
    dev = q.device
    part_m = torch.empty((B, rows, Hq, num_splits), dtype=torch.float32, device=dev)
    part_l = torch.empty((B, rows, Hq, num_splits), dtype=torch.float32, device=dev)
    part_acc = torch.empty((B, rows, Hq, num_splits, spec.v_dim), dtype=torch.float32, device=dev)
    out = torch.empty((q.shape[0], Hq, spec.v_dim), dtype=q.dtype, device=dev)
    opts = launch_opts(out)
    block_hm = min(block_h, triton.next_power_of_2(rows * group))
    programs = B * spec.num_kv_heads * head_blocks
    _decode_split[(B, spec.num_kv_heads * head_blocks, num_splits)](
        q, k, v, pt, args.cu_seqlens_q, args.seq_lens_k, part_m, part_l, part_acc,
        arrival_counters("decode_split", dev, programs), out,
        float(args.scale), float(spec.softcap or 1.0),
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        pt.stride(0), out.stride(0), out.stride(1), num_splits,
        NUM_HEADS=Hq, PAGE_SIZE=k.shape[1], GROUP=group, HEAD_BLOCKS=head_blocks,
        HEAD_DIM=spec.head_dim, HEAD_DIM_V=spec.v_dim, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_H=block_h, BLOCK_N=block_n,
        WINDOW=spec.window or 0, SOFTCAP=spec.softcap > 0, DOT_PREC=_dot_precision(spec.dtype),
        RELOAD_FRESH=opts["PDL"] if reload_fresh is None else reload_fresh, BLOCK_HM=block_hm,
        SPLIT_CHUNK=min(triton.next_power_of_2(num_splits), max(1, MERGE_TILE // (block_hm * block_dv))),
        USED_ONLY=B > 1, ROWS=rows, num_warps=4, **opts, **_quant_kwargs(args),
    )
    return out
def attention_single_pass(args: AttnArgs) -> torch.Tensor:
    """The one-kernel path: prefill, mixed steps, cache-less calls (and decode when one split suffices)."""
    spec = args.spec
    q = args.q
    T, Hq, _ = q.shape
    group = Hq // spec.num_kv_heads
    out = torch.empty((T, Hq, spec.v_dim), dtype=q.dtype, device=q.device)
    B = args.seq_lens_k.shape[0]
    paged = spec.cache is not None
    if paged:
        k = args.k_cache
        v = args.v_cache if args.v_cache is not None else args.k_cache  # latent: values = leading channels
        pt = args.page_table
        assert k is not None and v is not None and pt is not None
        page_size = k.shape[1]
        skp, sks, skh = k.stride(0), k.stride(1), k.stride(2)
        svp, svs, svh = v.stride(0), v.stride(1), v.stride(2)
    else:
        k, v = args.k, args.v
        assert k is not None and v is not None
        pt = args.cu_seqlens_q  # unused placeholder pointer
        page_size = 16
        skp, sks, skh = 0, k.stride(0), k.stride(1)
        svp, svs, svh = 0, v.stride(0), v.stride(1)
    block_d, block_dv, block_n = _block_sizes(spec)
    block_m = 16 if args.max_seqlen_q * group <= 16 else (32 if block_d > 128 else 64)
    launch: dict[str, int] = {}
    quant = _quant_kwargs(args)
    # (quantized views keep the smaller tiles: their keys and values are unpacked in registers)
    if (q.is_cuda and q.element_size() == 2 and max(block_d, block_dv) <= 128 and args.max_seqlen_q * group >= 512
            and not quant["QUANT"]):
        # long 16-bit prefill: larger tiles and 8 warps keep the tensor cores fed
        block_m, block_n, launch = 128, 128, {"num_warps": 8, "num_stages": 2}
    grid = (B, spec.num_kv_heads, triton.cdiv(max(args.max_seqlen_q, 1) * group, block_m))
    _attn_fwd[grid](
        q, k, v, out, pt, args.cu_seqlens_q, args.seq_lens_k,
        float(args.scale), float(spec.softcap or 1.0),
        q.stride(0), q.stride(1),
        skp, sks, skh, svp, svs, svh,
        out.stride(0), out.stride(1),
        pt.stride(0) if paged else 0,
        PAGE_SIZE=page_size, GROUP=group,
        HEAD_DIM=spec.head_dim, HEAD_DIM_V=spec.v_dim, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=block_m, BLOCK_N=block_n,
        PAGED=paged, CAUSAL=spec.causal, WINDOW=spec.window or 0, SOFTCAP=spec.softcap > 0,
        DOT_PREC=_dot_precision(spec.dtype), **launch, **quant,
    )
    return out
