// Split-KV decode attention over a quantized cache (view "kv/quant", format spec 6) with 4- or 8-bit keys and
// values, for key bounds past the short-bound kernel's one pass (decode_attn.cu). Registered as
// torch.ops.exl3.decode_attention_qsplit; the Python side is plugins/attn_backends/src/exl3_attn_backends/
// cuda_qsplit.py.
//
// Why: reading a quantized page costs more arithmetic than bytes, so the codes are unpacked in registers
// straight into the tensor cores' operand layout (no shared-memory staging, no layout change). Each 16-bit
// value is built by the fp16 bit trick: a code c under 0x6400 is the half 1024 + c, so one lop3 (after a
// shift for every other pair of fields) gives two values, a subtraction centres them exactly and one fma
// applies the group's scale (the product rounded once, as the reference's fp32 dequantisation rounded to fp16).
//
// Layout: grid (kv heads, splits, sequences), 8 warps a block; a split's keys are 16-token tiles taken by the
// warps in turn. Scores are S^T = K q^T (mma.m16n8k16: 16 keys x 8 query heads of the group, k over
// channels) and the output O^T = V^T P^T (16 channels x 8 heads, k over keys), so no query row of the mma is
// padding. Channel order inside a product is free as long as both operands agree: lane (g, t) = (lane / 4,
// lane % 4) unpacks for keys g and g + 8 the D / 4 channels starting at t * D / 4, in the order its words
// give them, and q is loaded in that same order; for values it unpacks channels g * D / 8 .. + D / 8 of keys
// 2t, 2t + 1, 2t + 8, 2t + 9 (pairs of keys per register, as the k axis of the second product wants them),
// and the output is stored back in channel order. P goes from the first product's accumulator layout to the
// second's operand layout with movmatrix (an 8x8 transpose inside the warp). Keys and values stay in the
// H32-rotated basis: q is rotated into it first and the output rotated back once (H32 / sqrt(32) is
// orthonormal). fp32 scores, online softmax in base 2, one tile's loads issued ahead of its use.
//
// Splits and merge: each block merges its warps in shared memory, then writes its partial state (max, sum,
// unnormalised output) and the last block of a (sequence, kv head) to arrive merges the used splits, rotates
// back and writes the output (an arrival counter the merging block resets). A sequence one split holds is
// written by that split directly. Splits are derived on the device from the sequence's own length, so a
// graph captured at a bound replays at any length within it.
//
// Programmatic dependent launch: tiles entirely before the newest key (written by the kernel before) are
// loaded before griddepcontrol.wait; q and any tile holding the newest key after it.
//
// Recent rows (exl3_core/reference/kv_recent.py; qsplit_recent_kernel): a cache may keep the low bits of each
// sequence's newest `window` positions in a ring, so that a query reads them at 8 bits. In a one-query step the
// store has written the newest row into the ring too, so key j reads at 8 bits iff j > p - window and its ring
// row's tag is j (p = seq - 1). Only a 4-bit side has a ring here (4 low bits, laid out as its codes), so the 8-bit
// code of a field is (code << 4) | low. The tiles overlapping the window are peeled off the key loop into a tail
// without prefetching that reads both widths (a 4-bit code is the 8-bit one with low bits 0 and a half step of 8/128
// instead of 1/2/128), so every other tile runs the plain kernel's loop, and calls without recent rows the plain
// kernel.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <utility>

#include "attn/attn_common.cuh"
#include "attn/recent_args.h"

namespace exl3_attn_qsplit {

using exl3_attn::mma;

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int TILE = 16;     // keys per warp iteration
constexpr int MAX_GROUP = 8;  // query heads per kv head: the n = 8 columns of both products
constexpr int MAX_SPLITS = 64;  // the merging block stages every split's state in shared memory
constexpr float RESCALE = 8.f;  // how far (log2) a score may pass the running max before the outputs are rescaled

struct QSplitArgs {
    const __half* q;
    const uint32_t* k;  // code words [pages, page_size, Hkv * D / 32 * KB]
    const uint32_t* v;
    const __half* ks;   // scales [pages, page_size, Hkv * D / 32]
    const __half* vs;
    __half* out;
    const int* page_table;
    const int* cu_q;
    const int* seq_k;
    float* part_m;    // [B, Hq, splits]
    float* part_l;    // [B, Hq, splits]
    float* part_acc;  // [B, Hq, splits, D]
    int* counters;    // [B * Hkv], zero between calls
    long long q_t, q_h, o_t, o_h, pt_b;
    long long k_p, v_p, ks_p, vs_p;  // page strides (elements)
    int k_s, v_s, ks_s, vs_s;        // slot strides (elements; a page's rows span under 2^31)
    int page_size, group, hkv, splits;
    float qscale;   // softmax scale * log2(e)
    exl3_attn::RecentArgs rc;  // recent rows (qsplit_recent_kernel only; the rings of its 4-bit sides)
};

// One tile's loads for one lane: keys g, g + 8 (its D / 4 key channels), keys 2t, 2t + 1, 2t + 8, 2t + 9 (its
// D / 8 value channels) and their scales. Keys past the split's end get a zero scale (load_row).
template <int D, int KB, int VB>
struct TileLoads {
    static constexpr int NWK = D / 4 * KB / 32;  // words of a lane's key channels
    static constexpr int NWV = D / 8 * VB / 32;  // words of a lane's value channels
    uint32_t kw[2][NWK];
    uint32_t vw[4][NWV];
    __half ks[2];
    __half vs[4];
};

template <int N>
__device__ __forceinline__ void load_words(uint32_t (&w)[N], const uint32_t* p) {
    if constexpr (N == 8) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
        const uint4 b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
    } else if constexpr (N == 4) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
    } else if constexpr (N == 2) {
        const uint2 a = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = a.x, w[1] = a.y;
    } else {
        static_assert(N == 1, "words per lane: 1, 2, 4 or 8");
        w[0] = __ldg(p);
    }
}

// One key or value row's words and scale for this lane. A tile lies inside one allocated page, so rows past the keys
// hold finite codes (1024 + code as fp16) and are read like the others; their scale is zero, so they dequantize to 0.
template <int N>
__device__ __forceinline__ void load_row(uint32_t (&w)[N], __half& s, const uint32_t* words, const __half* scale,
                                         bool ok) {
    load_words(w, words);
    const __half x = *scale;
    s = ok ? x : __float2half_rn(0.f);
}

// The page and slot of a warp's next tile, advanced by whole steps of the warp loop without a division.
struct TileCursor {
    int page, slot;
    __device__ TileCursor(int t0, int page_size) : page(t0 / page_size), slot(t0 % page_size) {}
    __device__ __forceinline__ void advance(int keys, int page_size) {
        slot += keys;
        while (slot >= page_size) slot -= page_size, ++page;
    }
};

// This lane's rows of a tile, as element offsets from the tile's first row in the code words and the scales: keys
// g and g + 8 (its D / 4 key channels from t * D / 4), keys 2t, 2t + 1, 2t + 8, 2t + 9 (its D / 8 value channels
// from g * D / 8). Computed once; a tile adds only its page and slot.
struct LaneRows {
    uint32_t k[2], ks[2], v[4], vs[4];
};

template <int D, int KB, int VB>
__device__ __forceinline__ LaneRows lane_rows(const QSplitArgs& a, int kvh, int lane) {
    constexpr int NG = D / 32;
    const int g = lane >> 2, t = lane & 3;
    const int gk = kvh * NG + (t * (D / 4)) / 32;  // the group of the lane's first key channel, and its word
    const int wk = gk * KB + ((t * (D / 4)) % 32) * KB / 32;
    const int gv = kvh * NG + (g * (D / 8)) / 32;
    const int wv = gv * VB + ((g * (D / 8)) % 32) * VB / 32;
    LaneRows r;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        r.k[i] = (uint32_t)((g + 8 * i) * a.k_s + wk);
        r.ks[i] = (uint32_t)((g + 8 * i) * a.ks_s + gk);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int key = 2 * t + (i & 1) + 8 * (i >> 1);
        r.v[i] = (uint32_t)(key * a.v_s + wv);
        r.vs[i] = (uint32_t)(key * a.vs_s + gv);
    }
    return r;
}

// Tile keys t0 .. t0 + 15 of sequence b below `hi`, at page and slot `at` (a tile lies inside one page: the page
// size is a multiple of 16).
template <int D, int KB, int VB>
__device__ __forceinline__ void load_tile(TileLoads<D, KB, VB>& L, const QSplitArgs& a, const LaneRows& r, int b,
                                          int t0, TileCursor at, int hi, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const long long page = a.page_table[(long long)b * a.pt_b + at.page];
    const uint32_t* k = a.k + page * a.k_p + at.slot * a.k_s;
    const __half* ks = a.ks + page * a.ks_p + at.slot * a.ks_s;
    const uint32_t* v = a.v + page * a.v_p + at.slot * a.v_s;
    const __half* vs = a.vs + page * a.vs_p + at.slot * a.vs_s;
#pragma unroll
    for (int i = 0; i < 2; ++i) load_row(L.kw[i], L.ks[i], k + r.k[i], ks + r.ks[i], t0 + g + 8 * i < hi);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        load_row(L.vw[i], L.vs[i], v + r.v[i], vs + r.vs[i], t0 + 2 * t + (i & 1) + 8 * (i >> 1) < hi);
}

__device__ __forceinline__ uint32_t h2u(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 u2h(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// (x & MASK) | 0x64006400, the codes under MASK as fp16 1024 + code, in one lop3 (with both constants immediate
// the compiler emits two)
template <uint32_t MASK>
__device__ __forceinline__ uint32_t with_magic(uint32_t x) {
    uint32_t y;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(y) : "r"(x), "n"(MASK), "r"(0x64006400u));
    return y;
}

// 4-bit codes in the high nibble of a byte are taken in place, as 16 x code (no shift), with a step of 1/16 the
// low nibbles' (exact wherever that step is a normal fp16 number, i.e. the group's scale is at least 2^-7)
template <int BITS>
constexpr bool HIGH_NIBBLES = BITS == 4;

// code bits -> values: x holds 1024 + F * code in each half (F = 16 for HIGH, else 1) and step is F times smaller:
// (code + 1/2 - M) / M * scale, exact before one rounding
template <int BITS, bool HIGH = false>
__device__ __forceinline__ uint32_t dequant2(uint32_t x, __half2 step, __half2 half_step) {
    constexpr int M = 1 << (BITS - 1);
    constexpr int F = HIGH ? 16 : 1;
    const __half2 centre = __half2half2(__ushort_as_half((unsigned short)(0x6400 + F * M)));  // 1024 + F * M
    return h2u(__hfma2(__hsub2(u2h(x), centre), step, half_step));
}

// Value pair u (0 .. D / 8 - 1) of a lane's key channels: the fields at (u / (P / 2)) words in and u % (P / 2)
// fields along, with their partner P / 2 fields on (the word's high half), P = 32 / KB values a word.
// With 4-bit codes an odd u's codes are the high nibbles, taken as 16 x code (HIGH_NIBBLES).
template <int KB>
__device__ __forceinline__ uint32_t key_codes(const uint32_t* w, int u) {
    if constexpr (KB == 4) {
        const uint32_t x = w[u / 4] >> (u % 4 >= 2 ? 8 : 0);
        return u % 2 ? with_magic<0x00F000F0u>(x) : with_magic<0x000F000Fu>(x);
    } else {
        return with_magic<0x00FF00FFu>(w[u / 2] >> (8 * (u % 2)));
    }
}

// The key channel of pair u, element e (0: low half), relative to the lane's first key channel.
template <int KB>
__host__ __device__ constexpr int key_channel(int u, int e) {
    constexpr int P = 32 / KB;
    return P * (u / (P / 2)) + u % (P / 2) + e * (P / 2);
}

// Value channel c (0 .. D / 8 - 1) of a lane's value channels for two keys (words wa, wb): low half key a. With
// 4-bit codes an odd c's are the high nibbles, taken as 16 x code (HIGH_NIBBLES).
template <int VB>
__device__ __forceinline__ uint32_t value_codes(const uint32_t* wa, const uint32_t* wb, int c) {
    if constexpr (VB == 8) {
        const uint32_t x = __byte_perm(wa[c / 4], wb[c / 4], (c % 4) | ((4 + c % 4) << 8));
        return with_magic<0x00FF00FFu>(x);
    } else {
        const int n = c % 8;
        const uint32_t x = __byte_perm(wa[c / 8], wb[c / 8], n < 4 ? 0x5410 : 0x7632) >> (n % 4 >= 2 ? 8 : 0);
        return n % 2 ? with_magic<0x00F000F0u>(x) : with_magic<0x000F000Fu>(x);
    }
}

__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// Shared-memory rows of q (D + 4 floats) and of the warps' outputs (D + 12) with a skew of one word per quarter (q) or
// eighth (o) of the head, so that the lanes' reads of q into the score operand and their stores of the output
// accumulators (8 heads or channel blocks x 4 lanes, each at the same offset within its row) fall in 32 banks; a
// row's skewed end stays below the next row's start.
template <int D>
__host__ __device__ constexpr int q_at(int h, int c) { return h * (D + 4) + c + c / (D / 4); }
template <int D>
__host__ __device__ constexpr int o_at(int h, int c) { return h * (D + 12) + c + c / (D / 8); }

template <int D>
struct Smem {
    float q[MAX_GROUP * (D + 4)];  // rotated q at q_at, then the merged output [G][D] before its rotation back
    float m[WARPS][MAX_GROUP];
    float l[WARPS][MAX_GROUP];
    float o[WARPS][MAX_GROUP * (D + 12)];  // at o_at
    int last;
};

// S^T of one tile (unscaled): scores of keys g, g + 8 (rows) for heads 2t, 2t + 1, added to sc
template <int D, int KB, int VB>
__device__ __forceinline__ void key_scores(float (&sc)[4], const TileLoads<D, KB, VB>& cur,
                                           const uint32_t (&qb)[D / 16][2]) {
    constexpr int KS = D / 16;
    constexpr int MK = 1 << (KB - 1);
    float sc2[4] = {0.f, 0.f, 0.f, 0.f};  // the odd k steps: two independent chains of products
    const __half2 st0 = __half2half2(__hmul(cur.ks[0], __float2half_rn(1.f / MK)));
    const __half2 st1 = __half2half2(__hmul(cur.ks[1], __float2half_rn(1.f / MK)));
    const __half2 hs0 = __half2half2(__hmul(cur.ks[0], __float2half_rn(0.5f / MK)));
    const __half2 hs1 = __half2half2(__hmul(cur.ks[1], __float2half_rn(0.5f / MK)));
    constexpr bool HK = HIGH_NIBBLES<KB>;  // the odd pairs' steps
    const __half2 so0 = HK ? __hmul2(st0, __float2half2_rn(1.f / 16)) : st0;
    const __half2 so1 = HK ? __hmul2(st1, __float2half2_rn(1.f / 16)) : st1;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
        const uint32_t ka[4] = {dequant2<KB>(key_codes<KB>(cur.kw[0], 2 * s), st0, hs0),
                                dequant2<KB>(key_codes<KB>(cur.kw[1], 2 * s), st1, hs1),
                                dequant2<KB, HK>(key_codes<KB>(cur.kw[0], 2 * s + 1), so0, hs0),
                                dequant2<KB, HK>(key_codes<KB>(cur.kw[1], 2 * s + 1), so1, hs1)};
        mma<__half>(s % 2 ? sc2 : sc, ka, qb[s][0], qb[s][1]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) sc[i] += sc2[i];
}

// One tile into the warp's online softmax: scale, mask keys at or past hi, the tile's max per head over the warp
// (lanes of equal t), the running max m, sums l and outputs o updated; P^T as the output product's B operand
template <int KS>
__device__ __forceinline__ void online_softmax(float (&sc)[4], float (&m)[2], float (&l)[2], float (&o)[KS][4],
                                               int t0, int hi, int g, float qscale, uint32_t& pb0, uint32_t& pb1) {
    float mx[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        sc[e] = t0 + g < hi ? sc[e] * qscale : -INFINITY;
        sc[2 + e] = t0 + g + 8 < hi ? sc[2 + e] * qscale : -INFINITY;
        mx[e] = fmaxf(sc[e], sc[2 + e]);
    }
#pragma unroll
    for (int x = 4; x <= 16; x <<= 1) {
        mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], x));
        mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], x));
    }
    // the running max moves only when a score passes it by more than RESCALE (log2 units), so most tiles skip
    // the rescale; probabilities stay under 2^RESCALE, well inside fp16 for the second product
    float al[2], p[4];
    bool moved = false;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        al[e] = 1.f;
        if (mx[e] > m[e] + RESCALE) {  // always on the first tile (m = -inf); mx is finite: key t0 < hi
            al[e] = exp2f(m[e] - mx[e]);
            m[e] = mx[e];
            moved = true;
        }
        p[e] = exp2f(sc[e] - m[e]);
        p[2 + e] = exp2f(sc[2 + e] - m[e]);
        l[e] = l[e] * al[e] + p[e] + p[2 + e];
    }
    if (moved) {
#pragma unroll
        for (int u = 0; u < KS; ++u) {
            o[u][0] *= al[0];
            o[u][1] *= al[1];
            o[u][2] *= al[0];
            o[u][3] *= al[1];
        }
    }
    // P^T as the output's B operand: keys 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1) of head g
    pb0 = transpose8x8(exl3_attn::pack2<__half>(p[0], p[1]));
    pb1 = transpose8x8(exl3_attn::pack2<__half>(p[2], p[3]));
}

// O^T += V^T P^T for one tile: channel rows g, g + 8 of m tile u, heads 2t, 2t + 1
template <int D, int KB, int VB>
__device__ __forceinline__ void value_products(float (&o)[D / 16][4], const TileLoads<D, KB, VB>& cur, uint32_t pb0,
                                               uint32_t pb1) {
    constexpr int KS = D / 16;
    constexpr int MV = 1 << (VB - 1);
    const __half2 rs = __float2half2_rn(1.f / MV), rh = __float2half2_rn(0.5f / MV);
    const __half2 st01 = __hmul2(__halves2half2(cur.vs[0], cur.vs[1]), rs);
    const __half2 st89 = __hmul2(__halves2half2(cur.vs[2], cur.vs[3]), rs);
    const __half2 hs01 = __hmul2(__halves2half2(cur.vs[0], cur.vs[1]), rh);
    const __half2 hs89 = __hmul2(__halves2half2(cur.vs[2], cur.vs[3]), rh);
    constexpr bool HV = HIGH_NIBBLES<VB>;  // the odd channels' steps
    const __half2 so01 = HV ? __hmul2(st01, __float2half2_rn(1.f / 16)) : st01;
    const __half2 so89 = HV ? __hmul2(st89, __float2half2_rn(1.f / 16)) : st89;
#pragma unroll
    for (int u = 0; u < KS; ++u) {
        const uint32_t va[4] = {dequant2<VB>(value_codes<VB>(cur.vw[0], cur.vw[1], 2 * u), st01, hs01),
                                dequant2<VB, HV>(value_codes<VB>(cur.vw[0], cur.vw[1], 2 * u + 1), so01, hs01),
                                dequant2<VB>(value_codes<VB>(cur.vw[2], cur.vw[3], 2 * u), st89, hs89),
                                dequant2<VB, HV>(value_codes<VB>(cur.vw[2], cur.vw[3], 2 * u + 1), so89, hs89)};
        mma<__half>(o[u], va, pb0, pb1);
    }
}

// -- recent rows (the tail of qsplit_recent_kernel) --

// The first word of a lane's key channels (t = lane % 4) or value channels (g = lane / 4) in a row of B-bit codes, or
// of 4 low bits laid out as 4-bit codes (lane_rows' offsets)
template <int D, int B>
__device__ __forceinline__ int key_word(int kvh, int t) {
    return (kvh * (D / 32) + (t * (D / 4)) / 32) * B + ((t * (D / 4)) % 32) * B / 32;
}
template <int D, int B>
__device__ __forceinline__ int value_word(int kvh, int g) {
    return (kvh * (D / 32) + (g * (D / 8)) / 32) * B + ((g * (D / 8)) % 32) * B / 32;
}

// Whether key j is read at 8 bits: in the window (r0 <= j < hi, hi <= seq) and its ring row holds it. An L2 load:
// the newest key's tag was written by the kernel before.
__device__ __forceinline__ bool held(const QSplitArgs& a, int slot, int j, int r0, int hi) {
    return j >= r0 && j < hi && __ldcg(a.rc.tags + slot * a.rc.tg_n + j % a.rc.size) == j;
}

// A ring row's low-bit words for this lane (at the offsets of its 4-bit code words), through L2 like the tags. Loaded
// whatever the tag (the row exists), so that both are in flight at once; the caller zeroes them unless it is held.
template <int N>
__device__ __forceinline__ void load_low(uint32_t (&w)[N], const uint32_t* p) {
    if constexpr (N == 4) {
        const uint4 x = __ldcg(reinterpret_cast<const uint4*>(p));
        w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else if constexpr (N == 2) {
        const uint2 x = __ldcg(reinterpret_cast<const uint2*>(p));
        w[0] = x.x, w[1] = x.y;
    } else {
        static_assert(N == 1, "low words per lane: 1, 2 or 4");
        w[0] = __ldcg(p);
    }
}

// The low bits of a row read at 8 bits, else 0 (its codes then read at 4 bits)
template <int N>
__device__ __forceinline__ void keep_if(uint32_t (&w)[N], bool fine) {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = fine ? w[i] : 0u;
}

// Two 4-bit code fields x and their low bits y (nibble n of each 16-bit half, n = 0, 4 or 1, 5 after the fields'
// shift; odd: the high nibbles) as fp16 1024 + the 8-bit code (code << 4 | low) in each half
__device__ __forceinline__ uint32_t fine_codes(uint32_t x, uint32_t y, bool odd) {
    const uint32_t c = odd ? (x & 0x00F000F0u) | ((y >> 4) & 0x000F000Fu)
                           : ((x & 0x000F000Fu) << 4) | (y & 0x000F000Fu);
    return c | 0x64006400u;
}

// The half step of a 4-bit side's field read as 8 bits: (code8 - 128) * s / 128 plus s / 256 for a held row
// ((code8 - 127.5) * s / 128), or plus s / 16 for another (its low bits are 0: (code - 7.5) * s / 8, the 4-bit value)
__device__ __forceinline__ __half half_step(__half s, bool fine) {
    return __hmul(s, __float2half_rn(fine ? 0.5f / 128 : 1.f / 16));
}

// One tile of the window: key_scores, online_softmax and value_products with each 4-bit side's held rows at 8 bits
template <int D, int KB, int VB>
__device__ __forceinline__ void recent_tile(const QSplitArgs& a, const LaneRows& rows, int kvh, int b, int t0,
                                            TileCursor at, int hi, int r0, int slot, const uint32_t (&qb)[D / 16][2],
                                            float (&m)[2], float (&l)[2], float (&o)[D / 16][4], int lane) {
    using Loads = TileLoads<D, KB, VB>;
    constexpr int KS = D / 16;
    const int g = lane >> 2, t = lane & 3;
    Loads cur;
    load_tile(cur, a, rows, b, t0, at, hi, lane);
    float sc[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (KB == 4) {
        const int wk = key_word<D, KB>(kvh, t);
        bool fine[2];
        uint32_t low[2][Loads::NWK];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int j = t0 + g + 8 * i;
            fine[i] = held(a, slot, j, r0, hi);
            load_low(low[i], a.rc.kr + slot * a.rc.kr_n + (j % a.rc.size) * a.rc.kr_r + wk);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) keep_if(low[i], fine[i]);
        const __half2 st0 = __half2half2(__hmul(cur.ks[0], __float2half_rn(1.f / 128)));
        const __half2 st1 = __half2half2(__hmul(cur.ks[1], __float2half_rn(1.f / 128)));
        const __half2 hs0 = __half2half2(half_step(cur.ks[0], fine[0]));
        const __half2 hs1 = __half2half2(half_step(cur.ks[1], fine[1]));
        float sc2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            uint32_t ka[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // pairs 2s (ka[0..1]) and 2s + 1 (ka[2..3]), as key_codes<4> takes them
                const int u = 2 * s + h, sh = u % 4 >= 2 ? 8 : 0;
                ka[2 * h] = dequant2<8>(fine_codes(cur.kw[0][u / 4] >> sh, low[0][u / 4] >> sh, u % 2), st0, hs0);
                ka[2 * h + 1] = dequant2<8>(fine_codes(cur.kw[1][u / 4] >> sh, low[1][u / 4] >> sh, u % 2), st1, hs1);
            }
            mma<__half>(s % 2 ? sc2 : sc, ka, qb[s][0], qb[s][1]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[i] += sc2[i];
    } else {
        key_scores(sc, cur, qb);
    }
    uint32_t pb0, pb1;
    online_softmax(sc, m, l, o, t0, hi, g, a.qscale, pb0, pb1);
    if constexpr (VB == 4) {
        const int wv = value_word<D, VB>(kvh, g);
        bool fine[4];
        uint32_t low[4][Loads::NWV];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int j = t0 + 2 * t + (i & 1) + 8 * (i >> 1);
            fine[i] = held(a, slot, j, r0, hi);
            load_low(low[i], a.rc.vr + slot * a.rc.vr_n + (j % a.rc.size) * a.rc.vr_r + wv);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) keep_if(low[i], fine[i]);
        const __half2 rs = __float2half2_rn(1.f / 128);
        const __half2 st01 = __hmul2(__halves2half2(cur.vs[0], cur.vs[1]), rs);
        const __half2 st89 = __hmul2(__halves2half2(cur.vs[2], cur.vs[3]), rs);
        const __half2 hs01 = __halves2half2(half_step(cur.vs[0], fine[0]), half_step(cur.vs[1], fine[1]));
        const __half2 hs89 = __halves2half2(half_step(cur.vs[2], fine[2]), half_step(cur.vs[3], fine[3]));
#pragma unroll
        for (int u = 0; u < KS; ++u) {
            uint32_t va[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // channels 2u + h of keys 2t, 2t + 1 (va[h]) and 2t + 8, 2t + 9 (va[2 + h])
                const int c = 2 * u + h, n = c % 8;
                const uint32_t sel = n < 4 ? 0x5410 : 0x7632;
                const int sh = n % 4 >= 2 ? 8 : 0;
                va[h] = dequant2<8>(fine_codes(__byte_perm(cur.vw[0][c / 8], cur.vw[1][c / 8], sel) >> sh,
                                               __byte_perm(low[0][c / 8], low[1][c / 8], sel) >> sh, n % 2),
                                    st01, hs01);
                va[2 + h] = dequant2<8>(fine_codes(__byte_perm(cur.vw[2][c / 8], cur.vw[3][c / 8], sel) >> sh,
                                                   __byte_perm(low[2][c / 8], low[3][c / 8], sel) >> sh, n % 2),
                                        st89, hs89);
            }
            mma<__half>(o[u], va, pb0, pb1);
        }
    } else {
        value_products(o, cur, pb0, pb1);
    }
}

// The kernel (R: the recent-rows variant, which peels the tiles overlapping the window off the key loop).
template <int D, int KB, int VB, bool R>
__device__ __forceinline__ void qsplit_body(const QSplitArgs& a, const bool pdl) {
    constexpr int KS = D / 16;  // k steps of the scores (16 channels each); m tiles of the output
    static_assert(2 * MAX_GROUP * MAX_SPLITS + MAX_GROUP <= WARPS * MAX_GROUP * D, "merge scratch fits sm.o");
    static_assert(o_at<D>(0, D - 1) < o_at<D>(1, 0) && q_at<D>(0, D - 1) < q_at<D>(1, 0), "skewed rows overlap");
    __shared__ Smem<D> sm;
    const int kvh = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int G = a.group, S = a.splits;
    const int q_row = a.cu_q[b];
    const int q_len = a.cu_q[b + 1] - q_row;
    const int seq = a.seq_k[b];
    // this split's keys: equal shares of the sequence in whole tiles, at least a tile for every warp, so a short
    // sequence in a graph captured at a long bound fills a few blocks instead of leaving most warps of many idle
    const int per = max((((seq + S - 1) / S) + TILE - 1) / TILE * TILE, WARPS * TILE);
    const int lo = split * per;
    const int hi = min(lo + per, seq);
    const int n_used = min((seq + per - 1) / per, S);
    // the key loop's end: with recent rows, the first tile holding a key of the window (the tail takes the rest)
    const int r0 = R ? seq - a.rc.window : seq;  // the window's first key (negative: the window starts at 0)
    const int hi_main = R ? min(hi, max(lo, max(r0, 0) / TILE * TILE)) : hi;
    // a padded row, or no keys here (a short sequence under a long bound): neither reads, writes nor arrives
    if (q_len <= 0 || (split > 0 && lo >= seq)) {
        if (pdl) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
        return;
    }

    TileLoads<D, KB, VB> cur;
    int t0 = lo + warp * TILE;
    const bool early = t0 + TILE <= seq - 1;  // the warp's first tile is older than this step's key
    const LaneRows rows = lane_rows<D, KB, VB>(a, kvh, lane);
    TileCursor at(t0, a.page_size);  // of the next tile to load
    if (t0 < hi_main && early) load_tile(cur, a, rows, b, t0, at, hi_main, lane);
    if (pdl) {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    }
    if (t0 < hi_main && !early) load_tile(cur, a, rows, b, t0, at, hi_main, lane);

    // q rotated into the keys' basis (fp32 in shared memory), a warp per (head, group of 32 channels)
    for (int j = warp; j < G * (D / 32); j += WARPS) {
        const int h = j / (D / 32), d = 32 * (j % (D / 32)) + lane;
        const float x = __half2float(a.q[(long long)q_row * a.q_t + (long long)(kvh * G + h) * a.q_h + d]);
        sm.q[q_at<D>(h, d)] = exl3_attn::hadamard32_warp(x, lane);
    }
    __syncthreads();
    // q^T as the scores' B operand: k positions 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1) of step s are this lane's
    // key pairs 2s and 2s + 1; column g is head g (zero past the group)
    uint32_t qb[KS][2];
    {
        const int c0 = t * (D / 4);
#pragma unroll
        for (int s = 0; s < KS; ++s) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int u = 2 * s + h;
                const float x0 = g < G ? sm.q[q_at<D>(g, c0 + key_channel<KB>(u, 0))] : 0.f;
                const float x1 = g < G ? sm.q[q_at<D>(g, c0 + key_channel<KB>(u, 1))] : 0.f;
                qb[s][h] = exl3_attn::pack2<__half>(x0, x1);
            }
        }
    }

    float m[2] = {-INFINITY, -INFINITY};  // heads 2t, 2t + 1
    float l[2] = {0.f, 0.f};              // this lane's share of the sums
    float o[KS][4];                       // O^T: channel rows g, g + 8 of m tile u, heads 2t, 2t + 1
#pragma unroll
    for (int u = 0; u < KS; ++u) o[u][0] = o[u][1] = o[u][2] = o[u][3] = 0.f;

    for (; t0 < hi_main; t0 += WARPS * TILE) {
        TileLoads<D, KB, VB> nxt;
        const int t1 = t0 + WARPS * TILE;
        at.advance(WARPS * TILE, a.page_size);
        if (t1 < hi_main) load_tile(nxt, a, rows, b, t1, at, hi_main, lane);
        float sc[4] = {0.f, 0.f, 0.f, 0.f};
        key_scores(sc, cur, qb);
        uint32_t pb0, pb1;
        online_softmax(sc, m, l, o, t0, hi_main, g, a.qscale, pb0, pb1);
        value_products(o, cur, pb0, pb1);
        cur = nxt;  // past the split's end nothing reads it
    }
    if constexpr (R) {  // the tiles overlapping the window, after the wait like every tile after the first
        if (t0 < hi) {
            const int slot = a.rc.slots[b];
            for (; t0 < hi; t0 += WARPS * TILE, at.advance(WARPS * TILE, a.page_size))
                recent_tile<D, KB, VB>(a, rows, kvh, b, t0, at, hi, r0, slot, qb, m, l, o, lane);
        }
    }

    // the warp's sums over its lanes of equal t, then its state into shared memory (channels in order)
#pragma unroll
    for (int x = 4; x <= 16; x <<= 1) {
        l[0] += __shfl_xor_sync(0xffffffffu, l[0], x);
        l[1] += __shfl_xor_sync(0xffffffffu, l[1], x);
    }
    if (g == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            if (2 * t + e < MAX_GROUP) {
                sm.m[warp][2 * t + e] = m[e];
                sm.l[warp][2 * t + e] = l[e];
            }
        }
    }
#pragma unroll
    for (int u = 0; u < KS; ++u) {
        const int c = g * (D / 8) + 2 * u;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            sm.o[warp][o_at<D>(2 * t + e, c)] = o[u][e];
            sm.o[warp][o_at<D>(2 * t + e, c + 1)] = o[u][2 + e];
        }
    }
    __syncthreads();
    // the block's state per (head, channel): warps without keys hold m = -inf, l = 0, o = 0 (weight 0)
    const bool alone = n_used <= 1;
    const int n_arrive = alone ? 0 : n_used;  // only the splits the sequence uses arrive
    float* out_f = sm.q;  // the merged output [G][D] before its rotation back
    const long long part0 = ((long long)b * a.hkv + kvh) * G * S;  // (b, head kvh * G) row of the partials
    for (int i = threadIdx.x; i < G * D; i += THREADS) {
        const int h = i / D, d = i % D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm.m[w][h]);
        float num = 0.f, den = 0.f;
        if (M != -INFINITY) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float wt = exp2f(sm.m[w][h] - M);
                num = fmaf(wt, sm.o[w][o_at<D>(h, d)], num);
                den = fmaf(wt, sm.l[w][h], den);
            }
        }
        if (alone) {
            if (split == 0) out_f[i] = den > 0.f ? num / den : 0.f;
        } else if (split < n_arrive) {
            const long long row = part0 + (long long)h * S + split;
            a.part_acc[row * D + d] = num;
            if (d == 0) {
                a.part_m[row] = M;
                a.part_l[row] = den;
            }
        }
    }
    bool finish = alone && split == 0;
    if (!alone && split < n_arrive) {
        __threadfence();  // this block's partials before its arrival
        __syncthreads();
        if (threadIdx.x == 0) {
            int* cnt = a.counters + (long long)b * a.hkv + kvh;
            const int seen = atomicAdd(cnt, 1);
            sm.last = seen == n_arrive - 1;
            if (sm.last) *cnt = 0;  // clean for the next call (a replayed graph reuses the buffer)
        }
        __syncthreads();
        finish = sm.last;
        if (finish) {
            __threadfence();
            // the used splits' maxima and sums into shared memory in one round trip (the warps' states are
            // merged already, so their space is free), then each head's weights, then the outputs with the
            // partial loads of several splits in flight at once
            float* wt = &sm.o[0][0];               // [MAX_GROUP][MAX_SPLITS]: max, then weight
            float* sums = wt + MAX_GROUP * MAX_SPLITS;  // [MAX_GROUP][MAX_SPLITS]
            float* den = sums + MAX_GROUP * MAX_SPLITS;  // [MAX_GROUP]
            for (int i = threadIdx.x; i < G * n_used; i += THREADS) {
                const int h = i / n_used, s = i % n_used;
                wt[h * MAX_SPLITS + s] = __ldcg(a.part_m + part0 + (long long)h * S + s);
                sums[h * MAX_SPLITS + s] = __ldcg(a.part_l + part0 + (long long)h * S + s);
            }
            __syncthreads();
            if (threadIdx.x < G) {
                const int h = threadIdx.x;
                float M = -INFINITY;
                for (int s = 0; s < n_used; ++s) M = fmaxf(M, wt[h * MAX_SPLITS + s]);
                float d = 0.f;
                for (int s = 0; s < n_used; ++s) {
                    const float w = M == -INFINITY ? 0.f : exp2f(wt[h * MAX_SPLITS + s] - M);
                    wt[h * MAX_SPLITS + s] = w;
                    d = fmaf(w, sums[h * MAX_SPLITS + s], d);
                }
                den[h] = d;
            }
            __syncthreads();
            for (int i = threadIdx.x; i < G * D; i += THREADS) {
                const int h = i / D, d = i % D;
                const float* acc = a.part_acc + (part0 + (long long)h * S) * D + d;
                float num = 0.f;
#pragma unroll 8
                for (int s = 0; s < n_used; ++s) num = fmaf(wt[h * MAX_SPLITS + s], __ldcg(acc + (long long)s * D), num);
                out_f[i] = den[h] > 0.f ? num / den[h] : 0.f;
            }
        }
    }
    if (finish) {  // back from the values' rotated basis: a warp per (head, group of 32 channels)
        __syncthreads();
        for (int j = warp; j < G * (D / 32); j += WARPS) {
            const int h = j / (D / 32), d = 32 * (j % (D / 32)) + lane;
            const float x = exl3_attn::hadamard32_warp(out_f[h * D + d], lane);
            a.out[(long long)q_row * a.o_t + (long long)(kvh * G + h) * a.o_h + d] = __float2half_rn(x);
        }
    }
}

template <int D, int KB, int VB>
__global__ void __launch_bounds__(THREADS, 2) qsplit_kernel(const QSplitArgs a, const bool pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    qsplit_body<D, KB, VB, false>(a, pdl);
#else
    __trap();  // launched only on compute capability >= 9.0 (checked on the host)
#endif
}

// A call with recent rows (a separate kernel, so that calls without them run the plain one unchanged)
template <int D, int KB, int VB>
__global__ void __launch_bounds__(THREADS, 2) qsplit_recent_kernel(const QSplitArgs a, const bool pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(KB == 4 || VB == 4, "recent rows refine a 4-bit side");
    qsplit_body<D, KB, VB, true>(a, pdl);
#else
    __trap();  // launched only on compute capability >= 9.0 (checked on the host)
#endif
}

template <int D, int KB, int VB>
cudaError_t launch(const QSplitArgs& a, int batch, bool recent, bool pdl, cudaStream_t st) {
    const dim3 grid(a.hkv, a.splits, batch);
    if constexpr (KB == 4 || VB == 4) {
        if (recent) return exl3_attn::launch_pdl(qsplit_recent_kernel<D, KB, VB>, grid, dim3(THREADS), 0, st, a, pdl);
    }
    return exl3_attn::launch_pdl(qsplit_kernel<D, KB, VB>, grid, dim3(THREADS), 0, st, a, pdl);
}

// recent: the call has recent rows and a 4-bit side to read them for (8-bit sides read their pages as they are)
template <int D>
cudaError_t launch_bits(const QSplitArgs& a, int kb, int vb, int batch, bool recent, bool pdl, cudaStream_t st) {
    if (kb == 4)
        return vb == 4 ? launch<D, 4, 4>(a, batch, recent, pdl, st) : launch<D, 4, 8>(a, batch, recent, pdl, st);
    return vb == 4 ? launch<D, 8, 4>(a, batch, recent, pdl, st) : launch<D, 8, 8>(a, batch, false, pdl, st);
}

}  // namespace exl3_attn_qsplit

namespace {

using at::Tensor;

// q [T, Hq, D] fp16 (one query per sequence); k_codes, v_codes int32 [pages, page_size, Hkv * D / 32 * bits];
// k_scales, v_scales fp16 [pages, page_size, Hkv * D / 32]; page_table int32 [B, W]; cu_seqlens_q int32 [B + 1];
// seq_lens_k int32 [B]; counters int32 (at least B * Hkv, zero). splits: key ranges per (sequence, kv head), at most
// 64, from host-side values only. Returns [T, Hq, D] fp16 (rows of sequences without a query are left unwritten). The
// Python caller (exl3_attn_backends.cuda_qsplit.check_call) validates every input first; these are the last line.
// Recent rows (recent_tags given, recent_window > 0): k_ring / v_ring int32 [slots, size, Hkv * D / 32 * 4], the low
// bits of a 4-bit side (None for an 8-bit one); recent_tags int32 [slots, size]; recent_slots int32 [B], each in
// 0 .. slots - 1; a window of at most size.
Tensor decode_attention_qsplit(const Tensor& q, const Tensor& k_codes, const Tensor& v_codes, const Tensor& k_scales,
                               const Tensor& v_scales, int64_t k_bits, int64_t v_bits, const Tensor& page_table,
                               const Tensor& cu_seqlens_q, const Tensor& seq_lens_k, const Tensor& counters,
                               double scale, int64_t splits, bool pdl, const std::optional<Tensor>& k_ring,
                               const std::optional<Tensor>& v_ring, const std::optional<Tensor>& recent_tags,
                               const std::optional<Tensor>& recent_slots, int64_t recent_window) {
    using namespace exl3_attn_qsplit;
    for (const Tensor* x : {&q, &k_codes, &v_codes, &k_scales, &v_scales, &page_table, &cu_seqlens_q, &seq_lens_k,
                            &counters})
        TORCH_CHECK(x->is_cuda(), "decode_attention_qsplit: every tensor must be on the GPU");
    TORCH_CHECK(q.scalar_type() == at::kHalf && q.dim() == 3 && q.stride(2) == 1,
                "decode_attention_qsplit: q must be float16 [T, Hq, D] with contiguous rows");
    TORCH_CHECK((k_bits == 4 || k_bits == 8) && (v_bits == 4 || v_bits == 8),
                "decode_attention_qsplit: bits must be 4 or 8");
    const int64_t D = q.size(2), Hq = q.size(1);
    TORCH_CHECK(D == 64 || D == 128, "decode_attention_qsplit: head dim must be 64 or 128");
    TORCH_CHECK(k_codes.scalar_type() == at::kInt && v_codes.scalar_type() == at::kInt &&
                k_scales.scalar_type() == at::kHalf && v_scales.scalar_type() == at::kHalf &&
                k_codes.dim() == 3 && v_codes.dim() == 3 && k_scales.dim() == 3 && v_scales.dim() == 3,
                "decode_attention_qsplit: int32 code words and fp16 scales, [pages, page_size, n]");
    const int64_t groups = k_scales.size(2), Hkv = groups * 32 / D;
    TORCH_CHECK(Hkv > 0 && Hkv * D == groups * 32 && v_scales.size(2) == groups &&
                k_codes.size(2) == groups * k_bits && v_codes.size(2) == groups * v_bits &&
                k_codes.stride(2) == 1 && v_codes.stride(2) == 1 && k_scales.stride(2) == 1 &&
                v_scales.stride(2) == 1, "decode_attention_qsplit: code words / scales do not fit the head dim");
    TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= MAX_GROUP, "decode_attention_qsplit: GQA group over ", MAX_GROUP);
    const int64_t ps = k_codes.size(1);
    TORCH_CHECK(ps % TILE == 0 && v_codes.size(1) == ps, "decode_attention_qsplit: page size must be a multiple of 16");
    TORCH_CHECK(page_table.scalar_type() == at::kInt && cu_seqlens_q.scalar_type() == at::kInt &&
                seq_lens_k.scalar_type() == at::kInt && counters.scalar_type() == at::kInt,
                "decode_attention_qsplit: int32 batch description and counters");
    const int64_t B = page_table.size(0);
    TORCH_CHECK(counters.numel() >= B * Hkv, "decode_attention_qsplit: counters hold fewer than B * Hkv");
    TORCH_CHECK(splits >= 1 && splits <= MAX_SPLITS, "decode_attention_qsplit: splits in [1, ", MAX_SPLITS, "]");
    TORCH_CHECK(recent_tags.has_value() || (!k_ring.has_value() && !v_ring.has_value() && !recent_slots.has_value()),
                "decode_attention_qsplit: rings or slots without recent_tags");
    TORCH_CHECK(recent_window >= 0 && recent_window < (1ll << 30),
                "decode_attention_qsplit: recent_window in [0, 2^30)");
    // an 8-bit side has no low bits: with two, the pages are the 8-bit codes and the plain kernel reads them
    const bool recent = recent_tags.has_value() && recent_window > 0 && (k_bits == 4 || v_bits == 4);
    if (recent_tags.has_value()) {
        const Tensor& tags = *recent_tags;
        TORCH_CHECK(recent_slots.has_value() && tags.is_cuda() && recent_slots->is_cuda() &&
                    tags.scalar_type() == at::kInt && recent_slots->scalar_type() == at::kInt && tags.dim() == 2 &&
                    tags.stride(1) == 1 && tags.size(1) > 0 && recent_slots->dim() == 1 &&
                    recent_slots->numel() == page_table.size(0) && recent_slots->is_contiguous() &&
                    recent_window <= tags.size(1),
                    "decode_attention_qsplit: recent_tags int32 [slots, size] with contiguous rows, recent_slots "
                    "int32 [B] on the GPU and a window of at most size");
        for (const auto& [ring, bits] : {std::pair{&k_ring, k_bits}, std::pair{&v_ring, v_bits}}) {
            TORCH_CHECK(ring->has_value() == (bits == 4),
                        "decode_attention_qsplit: a ring exactly for each 4-bit side");
            if (!ring->has_value()) continue;
            const Tensor& r = **ring;
            TORCH_CHECK(r.is_cuda() && r.scalar_type() == at::kInt && r.dim() == 3 && r.size(0) == tags.size(0) &&
                        r.size(1) == tags.size(1) && r.size(2) == groups * 4 && r.stride(2) == 1 &&
                        r.stride(0) % 4 == 0 && r.stride(1) % 4 == 0 &&
                        reinterpret_cast<uintptr_t>(r.data_ptr()) % 16 == 0,
                        "decode_attention_qsplit: a ring must be int32 [slots, size, groups * 4] on the GPU, its rows "
                        "16-byte aligned");
        }
    }
    const c10::cuda::CUDAGuard guard(q.device());
    TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 9,
                "decode_attention_qsplit: needs compute capability >= 9.0");
    Tensor out = at::empty({q.size(0), Hq, D}, q.options());
    if (B == 0 || q.size(0) == 0) return out;
    const auto f32 = q.options().dtype(at::kFloat);
    Tensor part_m = at::empty({B, Hq, splits}, f32);
    Tensor part_l = at::empty({B, Hq, splits}, f32);
    Tensor part_acc = at::empty({B, Hq, splits, D}, f32);
    QSplitArgs a{};
    a.q = reinterpret_cast<const __half*>(q.data_ptr());
    a.k = reinterpret_cast<const uint32_t*>(k_codes.data_ptr());
    a.v = reinterpret_cast<const uint32_t*>(v_codes.data_ptr());
    a.ks = reinterpret_cast<const __half*>(k_scales.data_ptr());
    a.vs = reinterpret_cast<const __half*>(v_scales.data_ptr());
    a.out = reinterpret_cast<__half*>(out.data_ptr());
    a.page_table = page_table.data_ptr<int>();
    a.cu_q = cu_seqlens_q.data_ptr<int>();
    a.seq_k = seq_lens_k.data_ptr<int>();
    a.part_m = part_m.data_ptr<float>();
    a.part_l = part_l.data_ptr<float>();
    a.part_acc = part_acc.data_ptr<float>();
    a.counters = counters.data_ptr<int>();
    a.q_t = q.stride(0), a.q_h = q.stride(1), a.o_t = out.stride(0), a.o_h = out.stride(1);
    a.pt_b = page_table.stride(0);
    for (const Tensor* x : {&k_codes, &v_codes, &k_scales, &v_scales})
        TORCH_CHECK(x->size(1) * x->stride(1) < (1ll << 31), "decode_attention_qsplit: a page's rows must span under 2^31 "
                    "elements (page size ", x->size(1), ", row stride ", x->stride(1), ")");
    a.k_p = k_codes.stride(0), a.k_s = (int)k_codes.stride(1), a.v_p = v_codes.stride(0), a.v_s = (int)v_codes.stride(1);
    a.ks_p = k_scales.stride(0), a.ks_s = (int)k_scales.stride(1), a.vs_p = v_scales.stride(0);
    a.vs_s = (int)v_scales.stride(1);
    a.page_size = (int)ps;
    a.group = (int)(Hq / Hkv);
    a.hkv = (int)Hkv;
    a.splits = (int)splits;
    a.qscale = (float)(scale * 1.4426950408889634);
    if (recent) set_recent_args(a.rc, k_ring, v_ring, recent_tags, recent_slots, recent_window);
    const cudaStream_t st = at::cuda::getCurrentCUDAStream();
    const int kb = (int)k_bits, vb = (int)v_bits, nb = (int)B;
    const cudaError_t err = D == 64 ? launch_bits<64>(a, kb, vb, nb, recent, pdl, st)
                                    : launch_bits<128>(a, kb, vb, nb, recent, pdl, st);
    TORCH_CHECK(err == cudaSuccess, "decode_attention_qsplit: launch failed: ", cudaGetErrorString(err));
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3, m) {
    m.def("decode_attention_qsplit(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_scales, Tensor v_scales, "
          "int k_bits, int v_bits, Tensor page_table, Tensor cu_seqlens_q, Tensor seq_lens_k, Tensor counters, "
          "float scale, int splits, bool pdl, Tensor? k_ring=None, Tensor? v_ring=None, Tensor? recent_tags=None, "
          "Tensor? recent_slots=None, int recent_window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3, CUDA, m) { m.impl("decode_attention_qsplit", &decode_attention_qsplit); }
