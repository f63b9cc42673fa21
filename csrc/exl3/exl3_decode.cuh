// EXL3 trellis decoding on the GPU (format spec sections 2 and 3).
//
// Layout: one warp decodes one 16x16 tile; lane t decodes sequence positions 8t..8t+7, which by
// the tensor-core order (spec 3.2) are rows 2(t&3)+{0,1,8,9}, cols (t>>2)+{0,8} of the tile: the
// B fragments of two mma.m16n8k16 (n-block 0 = j 0..3, n-block 1 = j 4..7). Lane t's states are the
// 7K+16 stream bits starting at bit 8tK+K-16 (mod 256K), so a lane needs 2-3 little-endian uint32
// words of its tile; states sit at compile-time bit offsets once the window is aligned.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

namespace exl3 {

constexpr int CB_3INST = 0;
constexpr int CB_MCG = 1;
constexpr int CB_MUL1 = 2;

// ---- per-K window geometry, all compile time

__host__ __device__ constexpr int lane_start_bit(int K, int lane) {
    // first bit of lane's window, taken mod N = 256K (tail-biting: lane 0 starts in the tile's end)
    return (8 * lane * K + K - 16 + 256 * K) % (256 * K);
}

// every lane starts at the same offset inside a word when 8K is a multiple of 32 (K = 4, 8)
__host__ __device__ constexpr bool window_aligned(int K) { return (8 * K) % 32 == 0; }

__host__ __device__ constexpr int max_start_offset(int K) {
    int m = 0;
    for (int l = 0; l < 32; ++l) {
        int o = lane_start_bit(K, l) & 31;
        m = o > m ? o : m;
    }
    return m;
}

// raw words a lane loads: enough for its worst start offset plus 7K+16 bits
__host__ __device__ constexpr int raw_words(int K) { return (max_start_offset(K) + 7 * K + 16 + 31) / 32; }

// ---- state extraction

// 16 bits starting MSB-first at bit o of the word array w (o, and so the word index, compile time)
template <int O, int NW>
__device__ __forceinline__ uint32_t state_at(const uint32_t (&w)[NW]) {
    constexpr int a = O >> 5;
    constexpr int b = O & 31;
    static_assert(a < NW, "state window runs past the loaded words");
    if constexpr (b == 0) {
        return w[a] >> 16;
    } else if constexpr (b <= 16) {
        return (w[a] >> (16 - b)) & 0xFFFFu;
    } else {
        static_assert(a + 1 < NW, "state window runs past the loaded words");
        return __funnelshift_r(w[a + 1], w[a], 48 - b) & 0xFFFFu;
    }
}

// The 32 bits starting MSB-first at bit O: two states 16 bits apart (the high half is the one at O)
template <int O, int NW>
__device__ __forceinline__ uint32_t window_at(const uint32_t (&w)[NW]) {
    constexpr int a = O >> 5;
    constexpr int b = O & 31;
    static_assert(a < NW && (b == 0 || a + 1 < NW), "state window runs past the loaded words");
    if constexpr (b == 0) {
        return w[a];
    } else {
        return __funnelshift_l(w[a + 1], w[a], b);
    }
}

// States 16 bits apart share one 32-bit window (K = 4: i and i+4; K = 8: i and i+2): one funnel
// shift, then a shift and a mask, instead of a shift and a mask each. 0 when no two of a lane's 8
// states are 16 bits apart.
__host__ __device__ constexpr int pair_distance(int K) { return (16 % K == 0 && 16 / K < 8) ? 16 / K : 0; }

// Load lane's raw words (circularly) and return them aligned so that bit 0 (MSB of w[0]) is the
// lane's first window bit, or left as-is with the constant offset when the window is aligned.
template <int K>
struct LaneWindow {
    static constexpr int NW = raw_words(K);
    // offset of the window inside w[0] after load(): constant for aligned K, 0 after normalization
    static constexpr int OFF = window_aligned(K) ? (lane_start_bit(K, 0) & 31) : 0;

    __device__ __forceinline__ static void load(const uint32_t* __restrict__ tile, int lane, uint32_t (&w)[NW]) {
        constexpr int NWORDS = 8 * K;
        const int s = lane_start_bit(K, lane);
        int i0 = s >> 5;
#pragma unroll
        for (int i = 0; i < NW; ++i) {
            int idx = i0 + i;
            idx = idx >= NWORDS ? idx - NWORDS : idx;
            w[i] = __ldg(tile + idx);
        }
    }

    // Per-lane word pointers into a tile (loop-invariant; the GEMM advances them tile by tile)
    __device__ __forceinline__ static void pointers(const uint32_t* tile, int lane, const uint32_t* (&ptr)[NW]) {
        constexpr int NWORDS = 8 * K;
        const int i0 = lane_start_bit(K, lane) >> 5;
#pragma unroll
        for (int i = 0; i < NW; ++i) {
            int idx = i0 + i;
            idx = idx >= NWORDS ? idx - NWORDS : idx;
            ptr[i] = tile + idx;
        }
    }

    // unaligned K: shift the window to offset 0 (one funnel shift per word, runtime amount)
    __device__ __forceinline__ static void align(int lane, uint32_t (&w)[NW]) {
        if constexpr (!window_aligned(K)) {
            const int off = lane_start_bit(K, lane) & 31;
#pragma unroll
            for (int i = 0; i < NW; ++i) w[i] = __funnelshift_l(i + 1 < NW ? w[i + 1] : 0u, w[i], off);
        }
    }
};

// ---- codebooks (spec 2), two states -> one half2 (low half = first state), bit-exact

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

template <int CB>
__device__ __forceinline__ uint32_t cb_hash(uint32_t s) {
    if constexpr (CB == CB_3INST) {
        uint32_t x = s * 89226354u + 64248484u;
        return (x & 0x8FFF8FFFu) ^ 0x3B603B60u;
    } else if constexpr (CB == CB_MCG) {
        uint32_t x = s * 0xCBAC1FEDu;
        return (x & 0x8FFF8FFFu) ^ 0x3B603B60u;
    } else {
        // byte sum of s*MUL1 plus 0x6400: the fp16 bit pattern of 1024 + b (b <= 1020, no carry out)
        return __dp4a(s * 0x83DCD12Du, 0x01010101u, 0x6400u);
    }
}

template <int CB>
__device__ __forceinline__ __half2 cb_pair(uint32_t s0, uint32_t s1) {
    uint32_t x0 = cb_hash<CB>(s0);
    uint32_t x1 = cb_hash<CB>(s1);
    if constexpr (CB == CB_MUL1) {
        const __half2 kinv = bits_h2(0x1EEE1EEEu);   // 1774 / 2^18
        const __half2 kbias = bits_h2(0xC931C931u);  // -10.3828125
        __half2 h = bits_h2(__byte_perm(x0, x1, 0x5410));
        return __hfma2(h, kinv, kbias);  // one rounding, as the spec's fp16 fma
    } else {
        // (lo0, lo1) + (hi0, hi1): each sum exact in fp32 then rounded once, as __hadd
        __half2 lo = bits_h2(__byte_perm(x0, x1, 0x5410));
        __half2 hi = bits_h2(__byte_perm(x0, x1, 0x7632));
        return __hadd2(lo, hi);
    }
}

// State I of a lane's 8 (and, when it heads a pair, its partner I + pair_distance(K)) into s.
template <int K, int I>
__device__ __forceinline__ void lane_state(const uint32_t (&w)[LaneWindow<K>::NW], uint32_t (&s)[8]) {
    constexpr int O = LaneWindow<K>::OFF + I * K;
    constexpr int D = pair_distance(K);
    if constexpr (D == 0) {
        s[I] = state_at<O, LaneWindow<K>::NW>(w);
    } else if constexpr (I % (2 * D) < D) {
        const uint32_t win = window_at<O, LaneWindow<K>::NW>(w);
        s[I] = win >> 16;
        s[I + D] = win & 0xFFFFu;
    }  // else: filled by its partner I - D
}

// Decode lane's 8 positions into 4 half2: f[0] = (j0, j1), f[1] = (j2, j3) are the B fragment of
// n-block 0 (rows 2q, 2q+1 | 2q+8, 2q+9; col g), f[2], f[3] the same for n-block 1 (col g+8),
// with q = lane & 3, g = lane >> 2.
template <int K, int CB>
__device__ __forceinline__ void decode_lane(const uint32_t (&w)[LaneWindow<K>::NW], __half2 (&f)[4]) {
    uint32_t s[8];
    lane_state<K, 0>(w, s);
    lane_state<K, 1>(w, s);
    lane_state<K, 2>(w, s);
    lane_state<K, 3>(w, s);
    lane_state<K, 4>(w, s);
    lane_state<K, 5>(w, s);
    lane_state<K, 6>(w, s);
    lane_state<K, 7>(w, s);
    f[0] = cb_pair<CB>(s[0], s[1]);
    f[1] = cb_pair<CB>(s[2], s[3]);
    f[2] = cb_pair<CB>(s[4], s[5]);
    f[3] = cb_pair<CB>(s[6], s[7]);
}

}  // namespace exl3
