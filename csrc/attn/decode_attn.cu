// Decode attention for short key bounds on the tensor cores, one thread block per (sequence, kv head), no
// merge pass. Registered as torch.ops.exl3.decode_attention; the Python side is the backend
// plugins/attn_backends/src/exl3_attn_backends/cuda_decode.py, which sends long bounds to the Triton
// split-KV kernel.
//
// Why: at batch 1 the Triton split kernel's merge (partials, an arrival atomic, their reload) sits on every
// layer's critical path, while here one block's warps run both products on the tensor cores (~16 + 16
// mma.m16n8k16 a warp, the FlashAttention-2 way) and merge in shared memory, with every key of a short bound
// copied before the wait.
//
// Block: 8 warps. The query heads of one kv head are the rows of the mma's A (padded to 16 with zeros).
// Keys in passes of `cap` rows held in shared memory (sized by the launch from the static key bound, at
// most 8 * KW); warp w takes rows [w * KW, (w + 1) * KW) of a pass. KW = 32 or 64 at head dim 64, 16 or 32
// at 128 (the smaller while the bound fits 8 of them): a bound within one pass is the fast case, since
// pass 0 is copied with cp.async before griddepcontrol.wait and later passes after it. Rows of earlier
// steps and the page table were complete before the step began; the newest row (seq - 1, written by the
// kernel before) is copied after the wait, with q, from an address computed before it. Rows are 16-byte
// chunks XOR-swizzled by row & 7, so every ldmatrix phase hits 8 different bank groups. fp32 scores,
// online softmax in base 2.
//
// Quantized caches (view "kv/quant", format spec 6; the Q template flag): k/v are int32 code words
// [pages, page_size, Hkv * D / 32 * bits] with fp16 scales [pages, page_size, Hkv * D / 32]. Each thread
// unpacks one 8-value chunk of a row (its bit planes, widest first) and stores it dequantized into the same
// swizzled shared rows, still in the H32-rotated basis; q is rotated into that basis in shared memory and the
// output rotated back once at the end (H32 / sqrt(32) is orthonormal: q.k and p.V are unchanged), so no key
// or value is rotated per token. Earlier rows are dequantized before the wait, the newest row after it.
//
// Recent rows (exl3_core/reference/kv_recent.py; decode_attn_recent_kernel, so that calls without them run the plain
// kernel): a cache may keep the low bits of each sequence's newest `window` positions in a ring, so that a query reads
// them at 8 bits. In a one-query step the store has written the newest row into the ring too, so row j is unpacked at
// 8 bits, (code << extra) | low with extra = 8 - bits, iff j > p - window and its ring row's tag is j (p = seq - 1).
// Earlier rows' ring rows and tags were written by earlier steps, so they are read before the wait like the pages;
// the newest row's after it, through L2.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <utility>

#include "attn/attn_common.cuh"
#include "attn/recent_args.h"

namespace exl3_attn {

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int MAX_GROUP = 8;  // query heads per kv head (rows 0..7 of the mma's 16)

// keys per warp and pass: the short one while the bound fits 8 of them, else twice that
template <int D> constexpr int short_kw() { return D == 64 ? 32 : 16; }

struct DecodeArgs {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const int* page_table;
    const int* cu_q;
    const int* seq_k;
    long long q_t, q_h, k_p, k_s, k_h, v_p, v_s, v_h, o_t, o_h, pt_b;
    int page_size, group;
    int cap;       // rows of a pass in shared memory (a multiple of KW, at most WARPS * KW)
    float qscale;  // softmax scale * log2(e)
    // quantized caches only: scales and their page/slot strides (elements), code bits of keys and values
    const __half* ks;
    const __half* vs;
    long long ks_p, ks_s, vs_p, vs_s;
    int k_bits, v_bits;
    RecentArgs rc;  // recent rows (decode_attn_recent_kernel only)
};

__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldsm4_t(uint32_t (&r)[4], const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Element offset of 16-byte chunk c of smem row r (rows of D elements): chunks XOR-swizzled by r & 7.
template <int D>
__device__ __forceinline__ int smem_at(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

// Copy the cache rows of positions pos0 + [r0, r1) into smem rows [r0, r1), asynchronously.
template <int D>
__device__ __forceinline__ void copy_rows(const DecodeArgs& a, int b, int kvh, int pos0, int r0, int r1,
                                          uint16_t* ks, uint16_t* vs) {
    constexpr int P = D / 8;
    const char* kb = static_cast<const char*>(a.k);
    const char* vb = static_cast<const char*>(a.v);
    const int* pt = a.page_table + (long long)b * a.pt_b;
    for (int i = threadIdx.x; i < (r1 - r0) * P; i += THREADS) {
        const int r = r0 + i / P, c = i % P, pos = pos0 + r;
        const long long page = pt[pos / a.page_size];
        const long long slot = pos % a.page_size;
        cp_async16(ks + smem_at<D>(r, c), kb + 2 * (page * a.k_p + slot * a.k_s + kvh * a.k_h + c * 8));
        cp_async16(vs + smem_at<D>(r, c), vb + 2 * (page * a.v_p + slot * a.v_s + kvh * a.v_h + c * 8));
    }
}

// A word of a code or low-bit plane: through L2 (L2) where the kernel may have read its cache line before the wait,
// which a row the kernel before wrote (the newest row's ring row and tag) must not be served from.
template <bool L2>
__device__ __forceinline__ uint32_t word(const uint32_t* w, int i) { return L2 ? __ldcg(w + i) : w[i]; }

// The 8 codes of values 8c .. 8c + 7 of a group's `bits` words w (format spec 6: planes 8, 4, 2, 1, each value j of a
// w-bit plane at bits [j * w, (j + 1) * w)), or of its recent row's low bits (`bits` = 8 - its width, the planes 4, 2,
// 1 of kv_recent.low_planes by the same rule), OR-ed into code.
template <bool L2 = false>
__device__ __forceinline__ void chunk_codes(uint32_t (&code)[8], const uint32_t* w, int c, int bits) {
    const int j0 = 8 * c;  // c in 0..3: the chunk's first value in the group
#pragma unroll
    for (int pw = 8; pw >= 1; pw >>= 1) {
        if (!(bits & pw)) continue;
        const int low = bits & (pw - 1), first = bits & ~(2 * pw - 1);
        const uint32_t mask = (1u << pw) - 1u;
        if (pw == 8) {  // 64 bits: two words
            const uint32_t a = word<L2>(w, first + j0 / 4), b = word<L2>(w, first + j0 / 4 + 1);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                code[i] |= ((a >> (8 * i)) & mask) << low;
                code[4 + i] |= ((b >> (8 * i)) & mask) << low;
            }
        } else {  // 8 * pw <= 32 bits inside one word
            const int bit = j0 * pw;
            const uint32_t x = word<L2>(w, first + bit / 32) >> (bit % 32);
#pragma unroll
            for (int i = 0; i < 8; ++i) code[i] |= ((x >> (pw * i)) & mask) << low;
        }
    }
}

// 8 codes of `bits` bits dequantized with the group's scale into 16-bit values packed in a uint4.
template <class T>
__device__ __forceinline__ uint4 dequant_codes(const uint32_t (&code)[8], int bits, float scale) {
    const float m = (float)(1 << (bits - 1));
    const float step = scale / m;  // exact: m is a power of two
    uint4 out;
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        o[i] = pack2<T>(((float)code[2 * i] - m + 0.5f) * step, ((float)code[2 * i + 1] - m + 0.5f) * step);
    return out;
}

// The 8 codes of values 8c .. 8c + 7 of a group's `bits` words w, dequantized (chunk_codes, dequant_codes).
template <class T>
__device__ __forceinline__ uint4 dequant_chunk(const uint32_t* w, int c, int bits, float scale) {
    uint32_t code[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    chunk_codes(code, w, c, bits);
    return dequant_codes<T>(code, bits, scale);
}

// Dequantize chunk c (8 channels) of kv head kvh's keys and values at (page, slot) into smem row r.
template <class T, int D>
__device__ __forceinline__ void dequant_row_chunk(const DecodeArgs& a, int kvh, long long page, long long slot, int r,
                                                  int c, uint16_t* ks, uint16_t* vs) {
    const int g = kvh * (D / 32) + c / 4;  // the chunk's group in the token's flattened row
    const uint32_t* kw = static_cast<const uint32_t*>(a.k) + page * a.k_p + slot * a.k_s + (long long)g * a.k_bits;
    const uint32_t* vw = static_cast<const uint32_t*>(a.v) + page * a.v_p + slot * a.v_s + (long long)g * a.v_bits;
    const float sk = __half2float(a.ks[page * a.ks_p + slot * a.ks_s + g]);
    const float sv = __half2float(a.vs[page * a.vs_p + slot * a.vs_s + g]);
    *reinterpret_cast<uint4*>(ks + smem_at<D>(r, c)) = dequant_chunk<T>(kw, c % 4, a.k_bits, sk);
    *reinterpret_cast<uint4*>(vs + smem_at<D>(r, c)) = dequant_chunk<T>(vw, c % 4, a.v_bits, sv);
}

// A chunk of one side with recent rows: its `bits`-bit codes, and where `fine` (the row held in the recent rows of a
// side under 8 bits) its ring row's low bits `low` below them, 8 - bits wide, dequantized at 8 bits (the 8-bit codes'
// top bits are the page's codes). One path for both, so that the kernel holds one copy of the unpacking.
template <class T, bool L2>
__device__ __forceinline__ uint4 dequant_chunk_recent(const uint32_t* w, const uint32_t* low, int c, int bits,
                                                      bool fine, float scale) {
    const int extra = fine ? 8 - bits : 0;
    uint32_t code[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    chunk_codes(code, w, c, bits);
#pragma unroll
    for (int i = 0; i < 8; ++i) code[i] <<= extra;
    chunk_codes<L2>(code, low, c, extra);  // the low bits below (nothing read for 0 of them: no plane)
    return dequant_codes<T>(code, bits + extra, scale);
}

// dequant_row_chunk for a kernel with recent rows: position pos of the sequence in ring slot `ring` at 8 bits where
// its ring row holds it (pos >= w0, the window's first position), each side under 8 bits. L2: the tag and low bits
// through L2 (the newest row, after the wait).
template <class T, int D, bool L2>
__device__ __forceinline__ void dequant_row_chunk_recent(const DecodeArgs& a, int kvh, long long page, long long slot,
                                                         int r, int c, uint16_t* ks, uint16_t* vs, int pos, int w0,
                                                         int ring) {
    const int g = kvh * (D / 32) + c / 4;  // the chunk's group in the token's flattened row
    const int row = pos % a.rc.size;
    const int* tag = a.rc.tags + ring * a.rc.tg_n + row;
    const bool fine = pos >= w0 && (L2 ? __ldcg(tag) : *tag) == pos;
    const uint32_t* kw = static_cast<const uint32_t*>(a.k) + page * a.k_p + slot * a.k_s + (long long)g * a.k_bits;
    const uint32_t* vw = static_cast<const uint32_t*>(a.v) + page * a.v_p + slot * a.v_s + (long long)g * a.v_bits;
    const float sk = __half2float(a.ks[page * a.ks_p + slot * a.ks_s + g]);
    const float sv = __half2float(a.vs[page * a.vs_p + slot * a.vs_s + g]);
    const uint32_t* kl = a.rc.kr + ring * a.rc.kr_n + row * a.rc.kr_r + g * (8 - a.k_bits);  // not read unless fine && a.rc.kr
    const uint32_t* vl = a.rc.vr + ring * a.rc.vr_n + row * a.rc.vr_r + g * (8 - a.v_bits);
    *reinterpret_cast<uint4*>(ks + smem_at<D>(r, c)) =
        dequant_chunk_recent<T, L2>(kw, kl, c % 4, a.k_bits, fine && a.rc.kr != nullptr, sk);
    *reinterpret_cast<uint4*>(vs + smem_at<D>(r, c)) =
        dequant_chunk_recent<T, L2>(vw, vl, c % 4, a.v_bits, fine && a.rc.vr != nullptr, sv);
}

// The quantized counterpart of copy_rows (synchronous: each thread unpacks its chunks into shared memory).
template <class T, int D>
__device__ __forceinline__ void dequant_rows(const DecodeArgs& a, int b, int kvh, int pos0, int r0, int r1,
                                             uint16_t* ks, uint16_t* vs) {
    constexpr int P = D / 8;
    const int* pt = a.page_table + (long long)b * a.pt_b;
    for (int i = threadIdx.x; i < (r1 - r0) * P; i += THREADS) {
        const int r = r0 + i / P, c = i % P, pos = pos0 + r;
        dequant_row_chunk<T, D>(a, kvh, pt[pos / a.page_size], pos % a.page_size, r, c, ks, vs);
    }
}

// dequant_rows with recent rows (see dequant_row_chunk_recent)
template <class T, int D, bool L2>
__device__ __forceinline__ void dequant_rows_recent(const DecodeArgs& a, int b, int kvh, int pos0, int r0, int r1,
                                                    uint16_t* ks, uint16_t* vs, int w0, int ring) {
    constexpr int P = D / 8;
    const int* pt = a.page_table + (long long)b * a.pt_b;
    for (int i = threadIdx.x; i < (r1 - r0) * P; i += THREADS) {
        const int r = r0 + i / P, c = i % P, pos = pos0 + r;
        dequant_row_chunk_recent<T, D, L2>(a, kvh, pt[pos / a.page_size], pos % a.page_size, r, c, ks, vs, pos, w0,
                                           ring);
    }
}

// Dynamic shared memory: a pass's K and V rows, q (16 rows, rows >= G zero), each warp's final state [G][2 + D];
// quantized caches add the merged output [G][D] (fp32) that is rotated back before it is stored.
__host__ __device__ inline size_t smem_bytes(int D, int G, int cap, bool quant) {
    return 4ull * cap * D + 2ull * 16 * D + 4ull * WARPS * G * (2 + D) + (quant ? 4ull * G * D : 0);
}

// registers: 3 blocks an SM with the short KW at head dim 64 (80-ish a thread, beside the q/k/v linear's
// blocks), else 2
template <int D, int KW> constexpr int min_blocks() { return D == 64 && KW == 32 ? 3 : 2; }

// The kernel (R: with recent rows, a quantized cache's only).
template <class T, int D, int KW, bool Q, bool R>
__device__ __forceinline__ void decode_attn_body(const DecodeArgs& a, const bool pdl) {
    static_assert(Q || !R, "recent rows are a quantized cache's");
    constexpr int P = D / 8;                  // 16-byte chunks per row
    const int CAP = a.cap;                    // rows of a pass
    constexpr int NT = KW / 8;                // score n tiles (8 keys each)
    constexpr int KS = D / 16;                // k steps of the scores
    constexpr int DT = D / 8;                 // output n tiles (8 channels each)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint16_t* ks = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* vs = ks + CAP * D;
    uint16_t* qs = vs + CAP * D;                                  // [16][D], swizzled
    float* st = reinterpret_cast<float*>(qs + 16 * D);            // [WARPS][G][2 + D]

    const int G = a.group;
    const int kvh = blockIdx.x, b = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    // Before the wait: the batch description, earlier steps' cache rows and q's zero padding rows.
    const int q_row = a.cu_q[b];
    const int q_len = a.cu_q[b + 1] - q_row;
    const int seq = a.seq_k[b];
    if (q_len <= 0) {  // a padded row: nothing to read or write
        if (pdl) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
        return;
    }
    // recent rows: the sequence's ring slot (a step input like the page table) and its window's first position
    const int ring = R ? a.rc.slots[b] : 0, w0 = R ? seq - a.rc.window : 0;
    if constexpr (R) {
        dequant_rows_recent<T, D, false>(a, b, kvh, 0, 0, min(seq - 1, CAP), ks, vs, w0, ring);
    } else if constexpr (Q) {
        dequant_rows<T, D>(a, b, kvh, 0, 0, min(seq - 1, CAP), ks, vs);
    } else {
        copy_rows<D>(a, b, kvh, 0, 0, min(seq - 1, CAP), ks, vs);
        cp_async_commit();
    }
    // the newest row's cache address (the page table is the step's input): after the wait only its copy
    // is left, in the same round trip as q's
    const bool newest = seq >= 1 && seq - 1 < CAP && tid < P;
    const char* k_new = nullptr;
    const char* v_new = nullptr;
    long long new_page = 0, new_slot = 0;
    if (newest) {
        new_page = a.page_table[(long long)b * a.pt_b + (seq - 1) / a.page_size];
        new_slot = (seq - 1) % a.page_size;
        k_new = static_cast<const char*>(a.k) + 2 * (new_page * a.k_p + new_slot * a.k_s + kvh * a.k_h + tid * 8);
        v_new = static_cast<const char*>(a.v) + 2 * (new_page * a.v_p + new_slot * a.v_s + kvh * a.v_h + tid * 8);
    }
    for (int i = tid; i < (16 - G) * P; i += THREADS) {
        const int r = G + i / P, c = i % P;
        *reinterpret_cast<uint4*>(qs + smem_at<D>(r, c)) = make_uint4(0, 0, 0, 0);
    }
    // rows past a short sequence up to its last warp's end: P.V reads them with probability 0, and stale
    // shared memory could hold NaN bits (0 * NaN = NaN). Later passes' tails hold earlier rows, finite.
    for (int i = tid; i < (min(CAP, (seq + KW - 1) / KW * KW) - max(seq, 0)) * P; i += THREADS) {
        const int r = max(seq, 0) + i / P, c = i % P;
        *reinterpret_cast<uint4*>(ks + smem_at<D>(r, c)) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(vs + smem_at<D>(r, c)) = make_uint4(0, 0, 0, 0);
    }
    if (pdl) {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    }
    // After it: this step's queries and newest key/value row, one round trip.
    if (newest) {
        if constexpr (R) {
            dequant_row_chunk_recent<T, D, true>(a, kvh, new_page, new_slot, seq - 1, tid, ks, vs, seq - 1, w0, ring);
        } else if constexpr (Q) {
            dequant_row_chunk<T, D>(a, kvh, new_page, new_slot, seq - 1, tid, ks, vs);
        } else {
            cp_async16(ks + smem_at<D>(seq - 1, tid), k_new);
            cp_async16(vs + smem_at<D>(seq - 1, tid), v_new);
        }
    }
    for (int i = tid; i < G * P; i += THREADS) {
        const int h = i / P, c = i % P;
        cp_async16(qs + smem_at<D>(h, c), static_cast<const T*>(a.q) + q_row * a.q_t + (kvh * G + h) * a.q_h + c * 8);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    if constexpr (Q) {  // q into the keys' rotated basis: one thread per (head, group of 32 channels)
        if (tid < G * (D / 32)) {
            const int h = tid / (D / 32), c0 = 4 * (tid % (D / 32));  // the group's four 8-value chunks
            float x[32];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const T* p = reinterpret_cast<const T*>(qs + smem_at<D>(h, c0 + c));
#pragma unroll
                for (int i = 0; i < 8; ++i) x[8 * c + i] = to_f(p[i]);
            }
            hadamard32(x);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                T* p = reinterpret_cast<T*>(qs + smem_at<D>(h, c0 + c));
#pragma unroll
                for (int i = 0; i < 8; ++i) p[i] = from_f<T>(x[8 * c + i]);
            }
        }
        __syncthreads();
    }

    // q's A fragments are reloaded per pair of k steps (8 registers live instead of 2 * D / 8)
    const int q_r = (lane & 7) + 8 * ((lane >> 3) & 1), q_c = lane >> 4;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;  // rows g and g + 8
    float o[DT][4];
#pragma unroll
    for (int u = 0; u < DT; ++u) o[u][0] = o[u][1] = o[u][2] = o[u][3] = 0.f;

    for (int p0 = 0; p0 < seq; p0 += CAP) {
        const int n = min(seq - p0, CAP);
        if (p0 > 0) {  // a later pass (a sequence longer than the smem rows): loaded after the wait
            __syncthreads();  // every warp is done with the previous pass
            if constexpr (R) {
                dequant_rows_recent<T, D, true>(a, b, kvh, p0, 0, n, ks, vs, w0, ring);
            } else if constexpr (Q) {
                dequant_rows<T, D>(a, b, kvh, p0, 0, n, ks, vs);
            } else {
                copy_rows<D>(a, b, kvh, p0, 0, n, ks, vs);
                cp_async_commit();
                cp_async_wait_all();
            }
            __syncthreads();
        }
        const int key0 = warp * KW;
        if (key0 >= n) continue;  // no key of this pass for this warp (its state stays as it is)
        // scores S = q K^T for the warp's KW keys: NT n tiles of 8 keys
        float sc[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; s += 2) {  // k steps s, s + 1: chunks 2s .. 2s + 3
            uint32_t qa[4], qb[4];
            ldsm4(qa, qs + smem_at<D>(q_r, 2 * s + q_c));
            ldsm4(qb, qs + smem_at<D>(q_r, 2 * s + 2 + q_c));
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                uint32_t kf[4];
                ldsm4(kf, ks + smem_at<D>(key0 + 8 * j + (lane & 7), 2 * s + (lane >> 3)));
                mma<T>(sc[j], qa, kf[0], kf[1]);
                mma<T>(sc[j], qb, kf[2], kf[3]);
            }
        }
        // scale, mask keys past the pass, running max per row (a quad holds one row's 2 * NT values)
        float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool ok = key0 + 8 * j + 2 * t + e < n;
                sc[j][e] = ok ? sc[j][e] * a.qscale : -INFINITY;
                sc[j][2 + e] = ok ? sc[j][2 + e] * a.qscale : -INFINITY;
                mx_lo = fmaxf(mx_lo, sc[j][e]);
                mx_hi = fmaxf(mx_hi, sc[j][2 + e]);
            }
        }
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, x));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, x));
        }
        const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);  // finite: key0 < n
        const float al_lo = exp2f(m_lo - mn_lo), al_hi = exp2f(m_hi - mn_hi);  // 0 on the warp's first keys
        m_lo = mn_lo;
        m_hi = mn_hi;
        float sum_lo = 0.f, sum_hi = 0.f;
        uint32_t pf[NT][2];  // P as packed pairs: rows g (0) and g + 8 (1), keys 8j + 2t, + 1
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const float p0_ = exp2f(sc[j][0] - mn_lo), p1_ = exp2f(sc[j][1] - mn_lo);
            const float p2_ = exp2f(sc[j][2] - mn_hi), p3_ = exp2f(sc[j][3] - mn_hi);
            sum_lo += p0_ + p1_;
            sum_hi += p2_ + p3_;
            pf[j][0] = pack2<T>(p0_, p1_);
            pf[j][1] = pack2<T>(p2_, p3_);
        }
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, x);
            sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, x);
        }
        l_lo = l_lo * al_lo + sum_lo;
        l_hi = l_hi * al_hi + sum_hi;
#pragma unroll
        for (int u = 0; u < DT; ++u) {
            o[u][0] *= al_lo;
            o[u][1] *= al_lo;
            o[u][2] *= al_hi;
            o[u][3] *= al_hi;
        }
        // O += P V: k steps of 16 keys (n tiles 2ks, 2ks + 1 of P as the A fragment), 2 channel tiles per ldmatrix
#pragma unroll
        for (int kq = 0; kq < NT / 2; ++kq) {
            const uint32_t pa[4] = {pf[2 * kq][0], pf[2 * kq][1], pf[2 * kq + 1][0], pf[2 * kq + 1][1]};
            const int row = key0 + 16 * kq + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
            for (int u = 0; u < DT; u += 2) {
                uint32_t vf[4];
                ldsm4_t(vf, vs + smem_at<D>(row, u + (lane >> 4)));
                mma<T>(o[u], pa, vf[0], vf[1]);
                mma<T>(o[u + 1], pa, vf[2], vf[3]);
            }
        }
    }
    // each warp's state for the heads (rows g < G; G <= 8 so rows g + 8 are padding)
    if (g < G) {
        float* sw = st + (warp * G + g) * (2 + D);
        if (t == 0) {
            sw[0] = m_lo;
            sw[1] = l_lo;
        }
#pragma unroll
        for (int u = 0; u < DT; ++u) {
            sw[2 + 8 * u + 2 * t] = o[u][0];
            sw[3 + 8 * u + 2 * t] = o[u][1];
        }
    }
    __syncthreads();
    // merge the warps (a warp without keys holds m = -inf, l = 0, acc = 0: weight 0)
    T* out = static_cast<T*>(a.out) + q_row * a.o_t + kvh * G * a.o_h;
    const int nw = min(WARPS, (min(seq, CAP) + KW - 1) / KW);  // warps that held keys (all of them past pass 0)
    for (int idx = tid; idx < G * D; idx += THREADS) {
        const int h = idx / D, d = idx % D;
        float M = -INFINITY;
        for (int w = 0; w < nw; ++w) M = fmaxf(M, st[(w * G + h) * (2 + D)]);
        float num = 0.f, den = 0.f;
        if (M != -INFINITY) {
            for (int w = 0; w < nw; ++w) {
                const float* sw = st + (w * G + h) * (2 + D);
                const float wt = exp2f(sw[0] - M);
                num = fmaf(wt, sw[2 + d], num);
                den = fmaf(wt, sw[1], den);
            }
        }
        if constexpr (Q) {
            st[WARPS * G * (2 + D) + idx] = den > 0.f ? num / den : 0.f;
        } else {
            out[h * a.o_h + d] = from_f<T>(den > 0.f ? num / den : 0.f);
        }
    }
    if constexpr (Q) {  // back from the values' rotated basis: one thread per (head, group of 32 channels)
        __syncthreads();
        if (tid < G * (D / 32)) {
            const int h = tid / (D / 32), d0 = 32 * (tid % (D / 32));
            const float* src = st + WARPS * G * (2 + D) + h * D + d0;
            float x[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) x[i] = src[i];
            hadamard32(x);
#pragma unroll
            for (int i = 0; i < 32; ++i) out[h * a.o_h + d0 + i] = from_f<T>(x[i]);
        }
    }
}

template <class T, int D, int KW, bool Q>
__global__ void __launch_bounds__(THREADS, min_blocks<D, KW>()) decode_attn_kernel(const DecodeArgs a, const bool pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    decode_attn_body<T, D, KW, Q, false>(a, pdl);
#else
    __trap();  // launched only on compute capability >= 9.0 (checked on the host)
#endif
}

// A quantized call with recent rows (a separate kernel, so that calls without them run the plain one unchanged)
template <class T, int D, int KW>
__global__ void __launch_bounds__(THREADS, min_blocks<D, KW>()) decode_attn_recent_kernel(const DecodeArgs a,
                                                                                          const bool pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    decode_attn_body<T, D, KW, true, true>(a, pdl);
#else
    __trap();  // launched only on compute capability >= 9.0 (checked on the host)
#endif
}

template <class T, int D, int KW, bool Q, bool R>
cudaError_t launch(DecodeArgs a, int kv_heads, int batch, int bound, bool pdl, cudaStream_t st) {
    auto kern = decode_attn_kernel<T, D, KW, Q>;
    if constexpr (R) kern = decode_attn_recent_kernel<T, D, KW>;
    // a pass holds the bound (rounded up to whole warps' keys) when it can: one pass, copied before the wait
    const int most = WARPS * KW;
    a.cap = bound > 0 && bound < most ? (bound + KW - 1) / KW * KW : most;
    const size_t bytes = smem_bytes(D, a.group, a.cap, Q);
    if (bytes > 48 * 1024) {  // above the default dynamic limit: raised (to the largest asked) per device
        static int raised[64] = {};
        int dev = 0;
        cudaGetDevice(&dev);
        if (dev >= 64 || raised[dev] < (int)bytes) {
            const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
            if (e != cudaSuccess) return e;
            if (dev < 64) raised[dev] = (int)bytes;
        }
    }
    return launch_pdl(kern, dim3(kv_heads, batch, 1), dim3(THREADS), bytes, st, a, pdl);
}

// The kernel for head dim D with the short keys per warp (`shrt`) or twice that: 4 instantiations per type and cache
// (R: a quantized cache's with recent rows)
template <class T, bool Q, bool R = false>
cudaError_t launch_for(int D, bool shrt, DecodeArgs a, int kv_heads, int batch, int bound, bool pdl, cudaStream_t st) {
    constexpr int s64 = short_kw<64>(), s128 = short_kw<128>();
    if (D == 64)
        return shrt ? launch<T, 64, s64, Q, R>(a, kv_heads, batch, bound, pdl, st)
                    : launch<T, 64, 2 * s64, Q, R>(a, kv_heads, batch, bound, pdl, st);
    return shrt ? launch<T, 128, s128, Q, R>(a, kv_heads, batch, bound, pdl, st)
                : launch<T, 128, 2 * s128, Q, R>(a, kv_heads, batch, bound, pdl, st);
}

}  // namespace exl3_attn

namespace {

using at::Tensor;

// q [T, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D]; page_table int32 [B, W]; cu_seqlens_q int32
// [B + 1] (at most one query per sequence); seq_lens_k int32 [B]. Returns [T, Hq, D] in q's dtype (rows of
// sequences without a query are left unwritten). The Python caller (exl3_attn_backends.cuda_decode.check_call)
// validates every input first and names what is wrong; the checks here are the last line.
// bound: the longest sequence the call (or the graph it is captured in) may see, 0 if unknown; it sizes the
// block's pass (shared memory) and picks the keys per warp.
// Quantized caches (k_scales given): k_cache, v_cache are int32 code words [pages, page_size, Hkv * D / 32 * bits]
// and k_scales, v_scales fp16 [pages, page_size, Hkv * D / 32], with k_bits, v_bits in 2..8 (format spec 6).
// Their recent rows (recent_tags given, recent_window > 0): k_ring / v_ring int32 [slots, size, Hkv * D / 32 *
// (8 - bits)] for each side under 8 bits (None for an 8-bit one); recent_tags int32 [slots, size]; recent_slots int32
// [B], each in 0 .. slots - 1; a window of at most size.
Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& page_table,
                        const Tensor& cu_seqlens_q, const Tensor& seq_lens_k, double scale, bool pdl, int64_t bound,
                        const std::optional<Tensor>& k_scales, const std::optional<Tensor>& v_scales, int64_t k_bits,
                        int64_t v_bits, const std::optional<Tensor>& k_ring, const std::optional<Tensor>& v_ring,
                        const std::optional<Tensor>& recent_tags, const std::optional<Tensor>& recent_slots,
                        int64_t recent_window) {
    using namespace exl3_attn;
    const bool quant = k_scales.has_value();
    TORCH_CHECK(q.is_cuda() && k_cache.is_cuda() && v_cache.is_cuda() && page_table.is_cuda() &&
                cu_seqlens_q.is_cuda() && seq_lens_k.is_cuda(), "decode_attention: every tensor must be on the GPU");
    TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                "decode_attention: q must be float16 or bfloat16");
    const int64_t D = q.size(2), Hq = q.size(1);
    int64_t Hkv = 0;
    if (quant) {
        TORCH_CHECK(v_scales.has_value() && k_scales->is_cuda() && v_scales->is_cuda(),
                    "decode_attention: a quantized cache needs k_scales and v_scales on the GPU");
        TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && k_scales->dim() == 3 &&
                    v_scales->dim() == 3, "decode_attention: bad ranks (quantized cache)");
        TORCH_CHECK(k_cache.scalar_type() == at::kInt && v_cache.scalar_type() == at::kInt &&
                    k_scales->scalar_type() == at::kHalf && v_scales->scalar_type() == at::kHalf,
                    "decode_attention: int32 code words and fp16 scales");
        TORCH_CHECK(k_bits >= 2 && k_bits <= 8 && v_bits >= 2 && v_bits <= 8, "decode_attention: bits in 2..8");
        TORCH_CHECK(D == 64 || D == 128, "decode_attention: head dim must be 64 or 128");
        Hkv = k_scales->size(2) * 32 / D;
        TORCH_CHECK(Hkv > 0 && k_scales->size(2) * 32 == Hkv * D && v_scales->size(2) == k_scales->size(2) &&
                    k_cache.size(2) == k_scales->size(2) * k_bits && v_cache.size(2) == v_scales->size(2) * v_bits &&
                    k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k_scales->stride(2) == 1 &&
                    v_scales->stride(2) == 1, "decode_attention: code words / scales do not fit the head dim and bits");
    } else {
        TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "decode_attention: bad ranks");
        TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
                    "decode_attention: q and the caches must share float16 or bfloat16");
        Hkv = k_cache.size(2);
        TORCH_CHECK((D == 64 || D == 128) && k_cache.size(3) == D && v_cache.size(3) == D,
                    "decode_attention: head dim must be 64 or 128");
    }
    TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= MAX_GROUP, "decode_attention: GQA group over ", MAX_GROUP);
    TORCH_CHECK(page_table.scalar_type() == at::kInt && cu_seqlens_q.scalar_type() == at::kInt &&
                seq_lens_k.scalar_type() == at::kInt, "decode_attention: int32 batch description");
    TORCH_CHECK(bound >= 0 && bound < (1 << 30), "decode_attention: bound must be in [0, 2^30)");
    const int64_t B = page_table.size(0);
    TORCH_CHECK(recent_tags.has_value() || (!k_ring.has_value() && !v_ring.has_value() && !recent_slots.has_value()),
                "decode_attention: rings or slots without recent_tags");
    TORCH_CHECK(!recent_tags.has_value() || quant, "decode_attention: recent rows are a quantized cache's");
    TORCH_CHECK(recent_window >= 0 && recent_window < (1ll << 30), "decode_attention: recent_window in [0, 2^30)");
    // two 8-bit sides have no low bits: their pages are the 8-bit codes, which the plain kernel reads
    const bool recent = recent_tags.has_value() && recent_window > 0 && (k_bits < 8 || v_bits < 8);
    if (recent_tags.has_value()) {
        const Tensor& tags = *recent_tags;
        TORCH_CHECK(recent_slots.has_value() && tags.is_cuda() && recent_slots->is_cuda() &&
                    tags.scalar_type() == at::kInt && recent_slots->scalar_type() == at::kInt && tags.dim() == 2 &&
                    tags.stride(1) == 1 && tags.size(1) > 0 && recent_slots->dim() == 1 &&
                    recent_slots->numel() == B && recent_slots->is_contiguous() && recent_window <= tags.size(1),
                    "decode_attention: recent_tags int32 [slots, size] with contiguous rows, recent_slots int32 [B] "
                    "on the GPU and a window of at most size");
        for (const auto& [ring, bits] : {std::pair{&k_ring, k_bits}, std::pair{&v_ring, v_bits}}) {
            TORCH_CHECK(ring->has_value() == (bits < 8), "decode_attention: a ring exactly for each side under 8 bits");
            if (!ring->has_value()) continue;
            const Tensor& r = **ring;
            TORCH_CHECK(r.is_cuda() && r.scalar_type() == at::kInt && r.dim() == 3 && r.size(0) == tags.size(0) &&
                        r.size(1) == tags.size(1) && r.size(2) == v_scales->size(2) * (8 - bits) && r.stride(2) == 1,
                        "decode_attention: a ring must be int32 [slots, size, groups * (8 - bits)] on the GPU with "
                        "contiguous rows");
        }
    }
    const c10::cuda::CUDAGuard guard(q.device());
    TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 9, "decode_attention: needs compute capability >= 9.0");
    Tensor out = at::empty({q.size(0), Hq, D}, q.options());
    if (B == 0 || q.size(0) == 0) return out;
    DecodeArgs a{};
    a.q = q.data_ptr();
    a.k = k_cache.data_ptr();
    a.v = v_cache.data_ptr();
    a.out = out.data_ptr();
    a.page_table = page_table.data_ptr<int>();
    a.cu_q = cu_seqlens_q.data_ptr<int>();
    a.seq_k = seq_lens_k.data_ptr<int>();
    a.q_t = q.stride(0), a.q_h = q.stride(1);
    a.k_p = k_cache.stride(0), a.k_s = k_cache.stride(1), a.k_h = quant ? 0 : k_cache.stride(2);
    a.v_p = v_cache.stride(0), a.v_s = v_cache.stride(1), a.v_h = quant ? 0 : v_cache.stride(2);
    if (quant) {
        a.ks = reinterpret_cast<const __half*>(k_scales->data_ptr());
        a.vs = reinterpret_cast<const __half*>(v_scales->data_ptr());
        a.ks_p = k_scales->stride(0), a.ks_s = k_scales->stride(1);
        a.vs_p = v_scales->stride(0), a.vs_s = v_scales->stride(1);
        a.k_bits = (int)k_bits, a.v_bits = (int)v_bits;
    }
    if (recent) set_recent_args(a.rc, k_ring, v_ring, recent_tags, recent_slots, recent_window);
    a.o_t = out.stride(0), a.o_h = out.stride(1);
    a.pt_b = page_table.stride(0);
    a.page_size = (int)k_cache.size(1);
    a.group = (int)(Hq / Hkv);
    a.qscale = (float)(scale * 1.4426950408889634);
    const cudaStream_t st = at::cuda::getCurrentCUDAStream();
    const int bd = (int)bound, hk = (int)Hkv, nb = (int)B;
    // the short keys per warp while the bound fits them in one pass (a shorter chain per warp), else twice that
    const bool shrt = bd > 0 && bd <= WARPS * (D == 64 ? short_kw<64>() : short_kw<128>());
    const bool half = q.scalar_type() == at::kHalf;
    const cudaError_t err =
        recent ? (half ? launch_for<__half, true, true>((int)D, shrt, a, hk, nb, bd, pdl, st)
                       : launch_for<__nv_bfloat16, true, true>((int)D, shrt, a, hk, nb, bd, pdl, st))
        : quant ? (half ? launch_for<__half, true>((int)D, shrt, a, hk, nb, bd, pdl, st)
                        : launch_for<__nv_bfloat16, true>((int)D, shrt, a, hk, nb, bd, pdl, st))
                : (half ? launch_for<__half, false>((int)D, shrt, a, hk, nb, bd, pdl, st)
                        : launch_for<__nv_bfloat16, false>((int)D, shrt, a, hk, nb, bd, pdl, st));
    TORCH_CHECK(err == cudaSuccess, "decode_attention: launch failed: ", cudaGetErrorString(err));
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3, m) {
    m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
          "Tensor seq_lens_k, float scale, bool pdl, int bound=0, Tensor? k_scales=None, Tensor? v_scales=None, "
          "int k_bits=0, int v_bits=0, Tensor? k_ring=None, Tensor? v_ring=None, Tensor? recent_tags=None, "
          "Tensor? recent_slots=None, int recent_window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3, CUDA, m) { m.impl("decode_attention", &decode_attention); }
