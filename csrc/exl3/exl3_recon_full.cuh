// Reconstruct an EXL3 weight in the ORIGINAL basis (format spec 4.2):
//   W = diag(suh) · BD_k · Ŵ · BD_n · diag(svh), fp16 [k, n],
// so a prefill linear is one dense fp16 GEMM y = x @ W with no activation Hadamards.
//
// Both rotations are block-diagonal with 128-blocks, so each 128x128 block of W depends only on the
// same block of Ŵ (8x8 trellis tiles), and on that block the two rotations together are one 14-bit
// Walsh-Hadamard transform (H⊗H over the 7 row bits and 7 column bits) scaled by 1/128.
// One CTA of 128 threads owns one block; every thread holds 128 fp32 values, i.e. 7 index bits in
// registers, so the 14 bits are covered by two in-register passes with one shared-memory transpose:
//   pass 1 (decode layout):  registers = row bits {0,3,4,5,6} + col bits {3,4};
//                            threads  = row bits {1,2} (lane&3) + col bits {0,1,2} (lane>>2) + col bits {5,6} (warp)
//   pass 2 (store layout):   registers = col bits {0,1,2} (8 contiguous cols) + row bits {1,2} + col bits {5,6};
//                            threads  = col bits {3,4} (lane&3) + row bits {0,3,4} (lane>>2) + row bits {5,6} (warp)
// No shuffles; fp32 butterflies (the exact 1/128 is folded into the row scale). Shared memory is a
// fp32 [128][132] tile: the 4-float row pad makes the pass-1 scalar stores and the pass-2 float4
// loads bank-conflict free. csrc/exl3/recon_full_emu.py models this index math on the CPU.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "exl3_decode.cuh"

namespace exl3 {

constexpr int RF_THREADS = 128;
constexpr int RF_RS = 132;                       // smem row stride in floats
constexpr int RF_SMEM = 128 * RF_RS * 4;          // 67,584 B: 3 CTAs per SM on sm_90 (227 KB)
constexpr int RF_MIN_BLOCKS = 3;                  // register cap 65536 / (3 * 128) -> 168 per thread

// 16-byte global store; inline asm because nvcc split some uint4 stores of this kernel into 4 x u32
__device__ __forceinline__ void rf_st16(__half* p, const uint32_t (&o)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(o[0]), "r"(o[1]), "r"(o[2]), "r"(o[3]));
}

// In-place unnormalized WHT over the 7 bits of the register index (fully unrolled: constant indices)
__device__ __forceinline__ void rf_wht128(float (&v)[128]) {
#pragma unroll
    for (int s = 1; s < 128; s <<= 1) {
#pragma unroll
        for (int i = 0; i < 128; ++i) {
            if (!(i & s)) {
                const float a = v[i], b = v[i | s];
                v[i] = a + b;
                v[i | s] = a - b;
            }
        }
    }
}

// grid (n/128, k/128); out row-major [k, n] fp16 with row stride ldo (a multiple of 8: the stores are
// 16-byte; ldo > n writes a column block of a wider matrix); suh [k], svh [n] fp16 (svh 16-byte aligned)
template <int K, int CB>
__global__ void __launch_bounds__(RF_THREADS, RF_MIN_BLOCKS)
    recon_full_kernel(const uint32_t* __restrict__ trellis, const __half* __restrict__ suh,
                      const __half* __restrict__ svh, __half* __restrict__ out, int n_tiles, int ldo) {
    extern __shared__ __align__(16) float rf_smem[];
    using W = LaneWindow<K>;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nblk = blockIdx.x, kblk = blockIdx.y;

    float v[128];
    {
        // ---- pass 1: this warp decodes tile columns tc = 2*warp + tcl (tcl 0..1), tile rows tr 0..7.
        // All 16 tiles' words are requested before any decode (memory-level parallelism).
        uint32_t wd[16][W::NW];
        const long tile_words = 8 * K;
#pragma unroll
        for (int tr = 0; tr < 8; ++tr)
#pragma unroll
            for (int tcl = 0; tcl < 2; ++tcl) {
                const long tile = (long)(kblk * 8 + tr) * n_tiles + nblk * 8 + 2 * warp + tcl;
                W::load(trellis + tile * tile_words, lane, wd[tr * 2 + tcl]);
            }
        // register index e = b | h<<1 | nb<<2 | tcl<<3 | tr<<4 for block row b + 2q + 8h + 16tr and
        // block col g + 8nb + 16(2warp + tcl); decode_lane's f[nb*2 + h] holds rows (b = 0, 1)
#pragma unroll
        for (int tr = 0; tr < 8; ++tr)
#pragma unroll
            for (int tcl = 0; tcl < 2; ++tcl) {
                W::align(lane, wd[tr * 2 + tcl]);
                __half2 f[4];
                decode_lane<K, CB>(wd[tr * 2 + tcl], f);
#pragma unroll
                for (int nb = 0; nb < 2; ++nb)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float2 p = __half22float2(f[nb * 2 + h]);
                        const int e = (h << 1) | (nb << 2) | (tcl << 3) | (tr << 4);
                        v[e] = p.x;
                        v[e | 1] = p.y;
                    }
            }
    }
    rf_wht128(v);
    {
        const int q = lane & 3, g = lane >> 2;
        float* s = rf_smem + (2 * q) * RF_RS + g + 32 * warp;  // row 2q, col g + 16*(2*warp)
#pragma unroll
        for (int e = 0; e < 128; ++e) {
            const int b = e & 1, h = (e >> 1) & 1, nb = (e >> 2) & 1, tcl = (e >> 3) & 1, tr = e >> 4;
            s[(b + 8 * h + 16 * tr) * RF_RS + 8 * nb + 16 * tcl] = v[e];
        }
    }
    __syncthreads();

    // ---- pass 2: e = c | rr<<3 | j<<5 for block row rowbase + 2rr, block col colbase + c + 32j
    const int rowbase = ((lane >> 2) & 1) + 8 * ((lane >> 3) & 1) + 16 * ((lane >> 4) & 1) + 32 * warp;
    const int colbase = 8 * (lane & 1) + 16 * ((lane >> 1) & 1);
    {
        const float* s = rf_smem + rowbase * RF_RS + colbase;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int rr = 0; rr < 4; ++rr)
#pragma unroll
                for (int c4 = 0; c4 < 2; ++c4) {
                    const float4 u = *reinterpret_cast<const float4*>(s + 2 * rr * RF_RS + 32 * j + 4 * c4);
                    const int e = (c4 * 4) | (rr << 3) | (j << 5);
                    v[e] = u.x;
                    v[e + 1] = u.y;
                    v[e + 2] = u.z;
                    v[e + 3] = u.w;
                }
    }
    rf_wht128(v);

    // ---- scale and store: (v * suh/128) * svh, as the fp32 reference's (w * suh) * svh (1/128 exact),
    // rounded once to fp16; 16-byte stores of 8 contiguous columns
    const long row0 = (long)kblk * 128 + rowbase;
    const long col0 = (long)nblk * 128 + colbase;
    float su[4];
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) su[rr] = __half2float(suh[row0 + 2 * rr]) * 0.0078125f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint4 sv8 = __ldg(reinterpret_cast<const uint4*>(svh + col0 + 32 * j));
        const uint32_t svw[4] = {sv8.x, sv8.y, sv8.z, sv8.w};
        float sv[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 p = __half22float2(bits_h2(svw[i]));
            sv[2 * i] = p.x;
            sv[2 * i + 1] = p.y;
        }
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
            uint32_t o[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int e = (2 * i) | (rr << 3) | (j << 5);
                const float y0 = (v[e] * su[rr]) * sv[2 * i];
                const float y1 = (v[e + 1] * su[rr]) * sv[2 * i + 1];
                o[i] = h2_bits(__floats2half2_rn(y0, y1));
            }
            rf_st16(out + (row0 + 2 * rr) * (long)ldo + col0 + 32 * j, o);
        }
    }
}

// k_tiles and n_tiles multiples of 8 (dims multiples of 128); returns the launch error, if any
template <int K, int CB>
cudaError_t launch_recon_full_t(const uint32_t* trellis, const __half* suh, const __half* svh, __half* out,
                                int k_tiles, int n_tiles, long ldo, cudaStream_t st) {
    auto kern = recon_full_kernel<K, CB>;
    // > 48 KB of dynamic shared memory needs an opt-in per function and device (host-side, legal
    // during graph capture); done once per device for this instantiation
    static unsigned long long ready = 0;  // bit d: attributes set on device d (benign race: idempotent)
    int dev = 0;
    cudaGetDevice(&dev);
    const unsigned long long bit = 1ull << (dev & 63);
    if (!(ready & bit)) {
        cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, RF_SMEM);
        if (e != cudaSuccess) return e;
        cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
        ready |= bit;
    }
    dim3 grid((unsigned)(n_tiles / 8), (unsigned)(k_tiles / 8));
    kern<<<grid, RF_THREADS, RF_SMEM, st>>>(trellis, suh, svh, out, n_tiles, (int)ldo);
    return cudaGetLastError();
}

template <int CB>
cudaError_t dispatch_recon_full(int K, const uint32_t* trellis, const __half* suh, const __half* svh, __half* out,
                                int k_tiles, int n_tiles, long ldo, cudaStream_t st) {
    switch (K) {
        case 1: return launch_recon_full_t<1, CB>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 2: return launch_recon_full_t<2, CB>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 3: return launch_recon_full_t<3, CB>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 4: return launch_recon_full_t<4, CB>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 5: return launch_recon_full_t<5, CB>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 6: return launch_recon_full_t<6, CB>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 7: return launch_recon_full_t<7, CB>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 8: return launch_recon_full_t<8, CB>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace exl3
