// The decode-only ceiling kernel: every weight of a trellis decoded once by the GEMV's own main loop
// (exl3::DecodeMmaLoop, same ring, loads and decoder) and summed by HFMA2 instead of multiplied by
// activations, i.e. the integer-pipeline bound of on-the-fly decoding for those weights. A benchmark, kept
// out of exl3_core._C: the torch op in decode_only_op.cu (built by build.py) and bench/gemv_tune.cu use it.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "exl3/exl3_kernels.cuh"

namespace exl3_bench {

struct DecodeOnlyArgs {
    const uint32_t* trellis;  // [k/16, n/16, 8K] uint32
    float* sink;              // one float per warp, written only for an impossible sum: keeps the decoding alive
    int k_tiles, n_tiles;     // n_tiles a multiple of exl3::BLOCK_TILES
    int kt_per_warp;          // k tiles each warp decodes; <= 0: the launcher's pick
};

// the shape of the m = 1 loop it bounds: the transposed loop's n tiles per warp and ring depth
constexpr int DO_NT = exl3::TR_NT;
constexpr int DO_WARPS = exl3::warps_for(DO_NT);

template <int K, int CB>
__global__ void __launch_bounds__(DO_WARPS * 32) decode_only_kernel(DecodeOnlyArgs p) {
    constexpr int S = exl3::tr_ring_stages(K);
    using R = exl3::Ring<K, S, DO_NT>;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * DO_WARPS + warp;
    const int n_groups = p.n_tiles / DO_NT;
    const int ng = gw % n_groups;
    const int kt0 = (gw / n_groups) * p.kt_per_warp;
    if (kt0 >= p.k_tiles) return;
    const int kt1 = min(kt0 + p.kt_per_warp, p.k_tiles);

    __shared__ __align__(16) uint32_t ring[DO_WARPS * R::WARP_WORDS];
    const long tile_words = 8 * K;
    const exl3::DecodeMmaLoop<K, CB, 1, true, false, S, DO_NT> loop{
        p.trellis + ((long)kt0 * p.n_tiles + (long)ng * DO_NT) * tile_words, (long)p.n_tiles * tile_words,
        kt1 - kt0, ring + warp * R::WARP_WORDS, lane};
    loop.start();
    float acc[1][DO_NT][2][4];  // the decode-only loop accumulates into dsum only
    __half2 dsum = __float2half2_rn(0.f);
    loop.run(0u, 0u, acc, dsum);
    const float s = __low2float(dsum) + __high2float(dsum);
    if (s == 12345.678f) p.sink[gw] = s;  // practically never true
}

// Warps a launch with kt_per_warp k tiles per warp runs (the sink needs one float each).
inline long decode_only_warps(int k_tiles, int n_tiles, int kt_per_warp) {
    return (long)(n_tiles / DO_NT) * ((k_tiles + kt_per_warp - 1) / kt_per_warp);
}

// Launches the kernel, as a programmatic dependent of the stream's previous kernel when pdl is set (it reads
// nothing an earlier launch writes, so it needs no griddepcontrol.wait). kt_per_warp <= 0 picks about one wave
// of resident warps, as the GEMM launcher does. Returns the k tiles per warp used.
template <int K, int CB>
int launch_decode_only_t(DecodeOnlyArgs a, cudaStream_t st, bool pdl = false) {
    if (a.kt_per_warp <= 0) {
        static int occ = -1;  // resident blocks per SM of this instantiation
        if (occ < 0) {
            int o = 0;
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, decode_only_kernel<K, CB>, DO_WARPS * 32, 0);
            occ = o > 0 ? o : 1;
        }
        int dev = 0, sms = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        a.kt_per_warp = exl3::pick_kt_per_warp(a.k_tiles, a.n_tiles, (long)sms * occ * DO_WARPS, DO_NT);
    }
    const long warps = decode_only_warps(a.k_tiles, a.n_tiles, a.kt_per_warp);
    const unsigned blocks = (unsigned)((warps + DO_WARPS - 1) / DO_WARPS);
    if (pdl) exl3::launch_as_dependent(decode_only_kernel<K, CB>, blocks, DO_WARPS * 32, st, a);
    else decode_only_kernel<K, CB><<<blocks, DO_WARPS * 32, 0, st>>>(a);
    return a.kt_per_warp;
}

template <int CB>
int dispatch_decode_only(int K, const DecodeOnlyArgs& a, cudaStream_t st, bool pdl) {
    switch (K) {
        case 1: return launch_decode_only_t<1, CB>(a, st, pdl);
        case 2: return launch_decode_only_t<2, CB>(a, st, pdl);
        case 3: return launch_decode_only_t<3, CB>(a, st, pdl);
        case 4: return launch_decode_only_t<4, CB>(a, st, pdl);
        case 5: return launch_decode_only_t<5, CB>(a, st, pdl);
        case 6: return launch_decode_only_t<6, CB>(a, st, pdl);
        case 7: return launch_decode_only_t<7, CB>(a, st, pdl);
        case 8: return launch_decode_only_t<8, CB>(a, st, pdl);
        default: return 0;
    }
}

// codebook cb in 0..2, K in 1..8
inline int launch_decode_only(int cb, int K, const DecodeOnlyArgs& a, cudaStream_t st, bool pdl = false) {
    if (cb == exl3::CB_3INST) return dispatch_decode_only<exl3::CB_3INST>(K, a, st, pdl);
    if (cb == exl3::CB_MCG) return dispatch_decode_only<exl3::CB_MCG>(K, a, st, pdl);
    return dispatch_decode_only<exl3::CB_MUL1>(K, a, st, pdl);
}

}  // namespace exl3_bench
