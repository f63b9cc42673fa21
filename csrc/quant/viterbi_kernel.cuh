// EXL3 tail-biting Viterbi tile encoder: the per-block algorithm, shared by the CUDA kernel
// (viterbi_cuda.cu) and a host emulator (viterbi_emu.cc, CPU test of the exact same code).
//
// No torch includes. The arithmetic is the one defined in exl3_core/quant/exl3/viterbi.py (module
// docstring), operation for operation, so the states equal those of the CPU op bit for bit:
//   d = fp32(lut[s] - w); c = fma(d, d, D[s >> K]) rounded once; D'[n] = min over a, lowest a on ties.
// Costs are non-negative fp32 or +inf (never NaN, never -0), so their uint32 bit patterns order like
// the floats; all comparisons are done on the bits. That is exact regardless of --use_fast_math
// (no flush-to-zero compare), and sub/fma go through ftz-free PTX in the device context.
//
// Block layout (kThreads threads, T tiles per block, all tiles of a block advance in lockstep):
// * node n (low 16-K bits) is grouped in chunks of 8 consecutive nodes; a thread owns one chunk per
//   iteration and the candidates a = q, q+NQ, q+2NQ, ... of it (q = tid % NQ). For K <= 4, NQ = 1
//   (one thread scans all 2^K candidates); for larger K the 2^K candidates are split over NQ
//   adjacent lanes (2^(K-4)) and merged with a lexicographic (cost, a) shuffle reduction, which
//   equals "lowest a among the minima" in any order.
// * The LUT lives in shared memory as fp16 (exact: the codebook values are fp16) in the read order
//   [a / NQ][chunk][a % NQ][8], so a warp's 16-byte loads hit consecutive banks for every K.
// * Costs D: two buffers [T][NN] fp32, in shared memory for K >= 3 and in a global scratch slot
//   otherwise (NN = 2^(16-K) is 128 KiB per buffer at K = 1).
// * Survivors (the a of every node at every step, uint8) go to a global scratch slot [T][256][NN];
//   one thread per tile traces back. Pass 1 stores them only for steps 128..255 (the traceback
//   stops at rotated index 128), and its first 128 steps track the minimum only.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define VT_FN __device__ __forceinline__
#else
#define VT_FN inline
#endif

namespace exl3vit {

constexpr int kSeq = 256;          // weights per tile
constexpr int kStates = 65536;     // 16-bit trellis states
constexpr int kThreads = 512;      // threads per block
constexpr int kCh = 8;             // nodes per chunk
constexpr int kWarps = kThreads / 32;
constexpr uint32_t kInfBits = 0x7f800000u;  // +inf as fp32 bits

template <int K>
struct Cfg {
    static constexpr int NN = 1 << (16 - K);        // nodes
    static constexpr int L = 1 << K;                // candidates per node
    static constexpr int M = 1 << (16 - 2 * K);     // predecessor of (a, n) is a*M + (n >> K)
    static constexpr int NQ = K <= 4 ? 1 : 1 << (K - 4);  // lanes sharing one chunk
    static constexpr int LA = L / NQ;               // candidates per lane
    static constexpr int CHUNKS = NN / kCh;
    static constexpr int CPI = kThreads / NQ;       // chunks covered per iteration
    static constexpr int NIT = CHUNKS / CPI;        // iterations per step (8 at K = 1, else <= 4)
    static constexpr int T = K <= 3 ? 1 : (K == 4 ? 2 : 4);  // tiles per block
    static constexpr bool D_SMEM = K >= 3;
    static_assert(NIT >= 1 && NIT * CPI == CHUNKS, "chunks must tile the nodes");
};

// Shared-memory footprint (bytes) of the block for bitrate K; offsets follow this order.
template <int K>
constexpr size_t smem_bytes() {
    using C = Cfg<K>;
    return (size_t)kStates * 2                          // fp16 LUT
           + (size_t)C::T * kSeq * 4                    // tile weights
           + (C::D_SMEM ? (size_t)2 * C::T * C::NN * 4 : 0)  // cost buffers
           + (size_t)C::T * kWarps * 8 + (size_t)C::T * 4;  // arg-min scratch, overlaps
}

// Global scratch per resident block (bytes): survivors, then (K <= 2) the cost buffers.
template <int K>
constexpr size_t surv_slot_bytes() {
    return (size_t)Cfg<K>::T * kSeq * Cfg<K>::NN;
}
template <int K>
constexpr size_t dscratch_slot_floats() {
    return Cfg<K>::D_SMEM ? 0 : (size_t)2 * Cfg<K>::T * Cfg<K>::NN;
}

struct Args {
    const float* tiles;      // [n_tiles, 256] fp32
    int64_t n_tiles;
    const uint16_t* lut;     // [65536] fp16 bit patterns
    int32_t* out;            // [n_tiles, 256] states
    uint8_t* surv;           // [grid] slots of surv_slot_bytes
    float* dscratch;         // [grid] slots of dscratch_slot_floats (K <= 2)
    int block;               // this block's index
    int nblocks;             // grid size
};

// Position in the shared LUT of state s = a*NN + n (see the header comment).
template <int K>
VT_FN int lut_index(int s) {
    using C = Cfg<K>;
    const int a = s >> (16 - K), n = s & (C::NN - 1);
    const int ah = a / C::NQ, al = a % C::NQ;
    return ((ah * C::CHUNKS + (n >> 3)) * C::NQ + al) * kCh + (n & 7);
}

// Lexicographic (cost, a) merge with lane tid ^ m (the lanes hold disjoint candidate sets).
template <int N, class Cx>
VT_FN void merge_lanes(Cx& cx, uint32_t (&best)[N], uint32_t (&arg)[N], int m) {
    uint32_t o[2 * N];  // one exchange for costs and args (one barrier pair in the emulator)
#pragma unroll
    for (int i = 0; i < N; ++i) {
        o[i] = best[i];
        o[N + i] = arg[i];
    }
    cx.template shfl_xor_n<2 * N>(o, m);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const bool take = o[i] < best[i] || (o[i] == best[i] && o[N + i] < arg[i]);
        best[i] = take ? o[i] : best[i];
        arg[i] = take ? o[N + i] : arg[i];
    }
}

// One trellis step for all T tiles: Dn[t][n] = min_a fma(d, d, Dp[t][a*M + (n>>K)]) with
// d = lut[a*NN + n] - w[t]; with SURV the lowest arg-min a goes to sv[t*sv_tile + n].
template <int K, bool SURV, class Cx>
VT_FN void step(Cx& cx, const uint16_t* lut_s, const float* Dp, float* Dn, uint8_t* sv, size_t sv_tile,
                const float (&w)[Cfg<K>::T], int q, int cl) {
    using C = Cfg<K>;
    constexpr int T = C::T;
#pragma unroll 1
    for (int it = 0; it < C::NIT; ++it) {
        const int chunk = cl + it * C::CPI;
        const int n0 = chunk * kCh;
        uint32_t best[T * kCh], arg[T * kCh];
#pragma unroll
        for (int i = 0; i < T * kCh; ++i) {
            best[i] = kInfBits;  // all-+inf nodes keep a = 0, as a strict '<' scan from +inf does
            arg[i] = 0;
        }
#pragma unroll 4
        for (int ah = 0; ah < C::LA; ++ah) {
            const int a = ah * C::NQ + q;
            float lv[kCh];
            cx.load8h(lut_s + ((ah * C::CHUNKS + chunk) * C::NQ + q) * kCh, lv);
#pragma unroll
            for (int t = 0; t < T; ++t) {
                const float* Da = Dp + t * C::NN + a * C::M + (n0 >> K);
                constexpr int ND = K >= 3 ? 1 : kCh >> K;  // distinct predecessors of the chunk
                float dp[ND];
#pragma unroll
                for (int j = 0; j < ND; ++j) dp[j] = Da[j];
#pragma unroll
                for (int k = 0; k < kCh; ++k) {
                    const float d = cx.sub(lv[k], w[t]);
                    const uint32_t c = cx.bits(cx.fma(d, d, dp[K >= 3 ? 0 : (k >> K)]));
                    const int i = t * kCh + k;
                    if constexpr (SURV) {
                        const bool lt = c < best[i];  // strict: the lowest a wins ties
                        best[i] = lt ? c : best[i];
                        arg[i] = lt ? (uint32_t)a : arg[i];
                    } else {
                        best[i] = c < best[i] ? c : best[i];
                    }
                }
            }
        }
        if constexpr (C::NQ > 1) {
#pragma unroll
            for (int m = 1; m < C::NQ; m <<= 1) {
                if constexpr (SURV) {
                    merge_lanes<T * kCh>(cx, best, arg, m);
                } else {
                    uint32_t ob[T * kCh];
#pragma unroll
                    for (int i = 0; i < T * kCh; ++i) ob[i] = best[i];
                    cx.template shfl_xor_n<T * kCh>(ob, m);
#pragma unroll
                    for (int i = 0; i < T * kCh; ++i) best[i] = ob[i] < best[i] ? ob[i] : best[i];
                }
            }
        }
        if (q == 0) {
#pragma unroll
            for (int t = 0; t < T; ++t) {
                cx.store8f(Dn + t * C::NN + n0, best + t * kCh);
                if constexpr (SURV) cx.store8b(sv + t * sv_tile + n0, arg + t * kCh);
            }
        }
    }
}

// Lowest node index with the minimal cost after the last step, per tile (block-wide reduction).
template <int K, class Cx>
VT_FN void argmin_nodes(Cx& cx, const float* D, uint32_t* red, int* node_out) {
    using C = Cfg<K>;
    constexpr int T = C::T;
    const int tid = cx.tid();
    uint32_t best[T], idx[T];
    for (int t = 0; t < T; ++t) {
        best[t] = 0xffffffffu;
        idx[t] = 0;
        for (int n = tid; n < C::NN; n += kThreads) {  // ascending n, strict '<': lowest index
            const uint32_t c = cx.bits(D[t * C::NN + n]);
            if (c < best[t]) {
                best[t] = c;
                idx[t] = (uint32_t)n;
            }
        }
    }
    for (int m = 1; m < 32; m <<= 1) merge_lanes<T>(cx, best, idx, m);
    if ((tid & 31) == 0) {
        for (int t = 0; t < T; ++t) {
            red[(t * kWarps + (tid >> 5)) * 2] = best[t];
            red[(t * kWarps + (tid >> 5)) * 2 + 1] = idx[t];
        }
    }
    cx.sync();
    if (tid < T) {
        uint32_t b = 0xffffffffu, i = 0;
        for (int wp = 0; wp < kWarps; ++wp) {
            const uint32_t ob = red[(tid * kWarps + wp) * 2], oi = red[(tid * kWarps + wp) * 2 + 1];
            if (ob < b || (ob == b && oi < i)) {
                b = ob;
                i = oi;
            }
        }
        node_out[tid] = (int)i;
    }
    cx.sync();
}

// The whole encoder for the blocks' share of tile groups (group g = tiles g*T .. g*T+T-1).
template <int K, class Cx>
VT_FN void encode_block(Cx& cx, const Args& A) {
    using C = Cfg<K>;
    constexpr int T = C::T;
    constexpr int NN = C::NN;
    const int tid = cx.tid();
    const int q = tid % C::NQ, cl = tid / C::NQ;

    uint8_t* sm = cx.smem();
    uint16_t* lut_s = reinterpret_cast<uint16_t*>(sm);
    float* w_s = reinterpret_cast<float*>(sm + (size_t)kStates * 2);
    float* dbase;
    size_t off = (size_t)kStates * 2 + (size_t)T * kSeq * 4;
    if constexpr (C::D_SMEM) {
        dbase = reinterpret_cast<float*>(sm + off);
        off += (size_t)2 * T * NN * 4;
    } else {
        dbase = A.dscratch + (size_t)A.block * dscratch_slot_floats<K>();
    }
    uint32_t* red = reinterpret_cast<uint32_t*>(sm + off);
    int* ovl = reinterpret_cast<int*>(sm + off + (size_t)T * kWarps * 8);
    uint8_t* surv = A.surv + (size_t)A.block * surv_slot_bytes<K>();
    constexpr size_t SV_TILE = (size_t)kSeq * NN;

    for (int s = tid; s < kStates; s += kThreads) lut_s[lut_index<K>(s)] = A.lut[s];

    const int64_t groups = (A.n_tiles + T - 1) / T;
    for (int64_t g = A.block; g < groups; g += A.nblocks) {
        const int64_t t0 = g * T;
        for (int e = tid; e < T * kSeq; e += kThreads) {
            const int64_t tile = t0 + e / kSeq;
            w_s[e] = tile < A.n_tiles ? A.tiles[tile * kSeq + e % kSeq] : 0.0f;  // padding tiles: zeros
        }
        // pass 1: every node starts at cost 0; sequence rotated by 128
        for (int e = tid; e < T * NN; e += kThreads) dbase[e] = 0.0f;
        cx.sync();
        int cur = 0;
        float w[T];
#pragma unroll 1
        for (int i = 0; i < kSeq / 2; ++i) {  // rotated steps 0..127: nothing traces back into them
            for (int t = 0; t < T; ++t) w[t] = w_s[t * kSeq + i + kSeq / 2];
            step<K, false>(cx, lut_s, dbase + (size_t)cur * T * NN, dbase + (size_t)(cur ^ 1) * T * NN, nullptr,
                           SV_TILE, w, q, cl);
            cx.sync();
            cur ^= 1;
        }
#pragma unroll 1
        for (int i = kSeq / 2; i < kSeq; ++i) {
            for (int t = 0; t < T; ++t) w[t] = w_s[t * kSeq + i - kSeq / 2];
            step<K, true>(cx, lut_s, dbase + (size_t)cur * T * NN, dbase + (size_t)(cur ^ 1) * T * NN,
                          surv + (size_t)i * NN, SV_TILE, w, q, cl);
            cx.sync();
            cur ^= 1;
        }
        argmin_nodes<K>(cx, dbase + (size_t)cur * T * NN, red, ovl);
        if (tid < T) {  // trace back to rotated index 128: the node there is the overlap
            int n = ovl[tid];
            const uint8_t* sv = surv + tid * SV_TILE;
            for (int i = kSeq - 1; i >= kSeq / 2; --i) n = (int)(((uint32_t)sv[(size_t)i * NN + n] * NN + n) >> K);
            ovl[tid] = n;
        }
        cx.sync();
        // pass 2: natural order, start node forced to the overlap
        for (int e = tid; e < T * NN; e += kThreads) dbase[e] = (e % NN) == ovl[e / NN] ? 0.0f : cx.inf();
        cx.sync();
        cur = 0;
#pragma unroll 1
        for (int i = 0; i < kSeq; ++i) {
            for (int t = 0; t < T; ++t) w[t] = w_s[t * kSeq + i];
            step<K, true>(cx, lut_s, dbase + (size_t)cur * T * NN, dbase + (size_t)(cur ^ 1) * T * NN,
                          surv + (size_t)i * NN, SV_TILE, w, q, cl);
            cx.sync();
            cur ^= 1;
        }
        if (tid < T && t0 + tid < A.n_tiles) {  // trace back from the overlap: s_0 >> K == overlap
            int n = ovl[tid];
            const uint8_t* sv = surv + tid * SV_TILE;
            int32_t* o = A.out + (t0 + tid) * kSeq;
            for (int p = kSeq - 1; p >= 0; --p) {
                const int s = (int)sv[(size_t)p * NN + n] * NN + n;
                o[p] = s;
                n = s >> K;
            }
        }
        cx.sync();  // w_s, ovl and the survivors are reused by the next group
    }
}

}  // namespace exl3vit
