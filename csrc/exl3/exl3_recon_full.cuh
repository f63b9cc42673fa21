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
//
// For K <= RF_HALF_MAX_K (tuning.cuh) the launcher uses recon_full_half_kernel instead: the same
// transform with the butterflies in packed half2 (HADD2/HSUB2, two elements per instruction; 64
// registers for the 128 values) through an fp16 [128][136] tile (half the smem), so that 5 CTAs fit per SM
// instead of 3, at a relative error of ~8.9e-4 instead of ~2.1e-4: < 0.3% of the quantization error's
// energy up to K = 6 (and ~5% at K = 8). Details at recon_full_half_kernel below.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "exl3_decode.cuh"
#include "tuning.cuh"

namespace exl3 {

constexpr int RF_THREADS = 128;
// fp32 kernel
constexpr int RF_RS = 132;                       // smem row stride in floats
constexpr int RF_SMEM = 128 * RF_RS * 4;          // 67,584 B: 3 CTAs per SM on sm_90 (227 KB)
constexpr int RF_MIN_BLOCKS = 3;                  // register cap 65536 / (3 * 128) -> 168 per thread
// half2 kernel
constexpr int RFH_RS = 136;                       // smem row stride in halves (17 16-byte chunks)
constexpr int RFH_TILE = 128 * RFH_RS;            // tile halves; the block's suh, svh follow (2 x 128)
constexpr int RFH_SMEM = (RFH_TILE + 256) * 2;    // 35,328 B: room for 6 CTAs per SM (6 x (34.5 + 1 reserved) KB < 228 KB)
// RFH_MIN_BLOCKS (tuning.cuh) CTAs per SM: at 5 the register cap 65536 / (5 * 128) = 96 per thread holds
// the 64 values plus addresses and scales without spills (6, cap 80, would spill)

// Output element type: fp16, or bf16 (BF) for a prefill whose GEMMs take bf16 operands (cuBLAS's bf16
// GEMMs draw less power at the card's power cap). The half2 kernel rounds to fp16
// first and converts that to bf16 (exact: equal to torch's fp16 -> bf16 cast of the fp16 output); the
// fp32 kernel rounds its fp32 result once, to the output type
template <bool BF>
using rf_out_t = typename std::conditional<BF, __nv_bfloat16, __half>::type;
template <bool BF>
__device__ __forceinline__ uint32_t rf_h2_out(__half2 h) {
    if constexpr (BF) {
        __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(h));
        return *reinterpret_cast<uint32_t*>(&b);
    } else {
        return h2_bits(h);
    }
}
template <bool BF>
__device__ __forceinline__ uint32_t rf_f2_out(float a, float b) {
    if constexpr (BF) {
        __nv_bfloat162 o = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<uint32_t*>(&o);
    } else {
        return h2_bits(__floats2half2_rn(a, b));
    }
}

// 16-byte global store; inline asm because nvcc split some uint4 stores of this kernel into 4 x u32
__device__ __forceinline__ void rf_st16(void* p, const uint32_t (&o)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(o[0]), "r"(o[1]), "r"(o[2]), "r"(o[3]));
}

// Pass 1 of both kernels: decode the 16 trellis tiles of this warp's share of one 128x128 block, tile
// rows tr 0..7 and tile columns 2*warp + tcl (tcl 0..1), all 16 tiles' words requested before any
// decode (memory-level parallelism). put(tr, tcl, f) receives decode_lane's four half2: f[nb*2 + h] =
// block rows (2q + 8h + 16tr, +1), block column g + 8nb + 16(2warp + tcl).
template <int K, int CB, class Put>
__device__ __forceinline__ void rf_decode_block(const uint32_t* __restrict__ trellis, int kblk, int nblk, int n_tiles,
                                                int warp, int lane, Put put) {
    using W = LaneWindow<K>;
    uint32_t wd[16][W::NW];
    const long tile_words = 8 * K;
#pragma unroll
    for (int tr = 0; tr < 8; ++tr)
#pragma unroll
        for (int tcl = 0; tcl < 2; ++tcl) {
            const long tile = (long)(kblk * 8 + tr) * n_tiles + nblk * 8 + 2 * warp + tcl;
            W::load(trellis + tile * tile_words, lane, wd[tr * 2 + tcl]);
        }
#pragma unroll
    for (int tr = 0; tr < 8; ++tr)
#pragma unroll
        for (int tcl = 0; tcl < 2; ++tcl) {
            W::align(lane, wd[tr * 2 + tcl]);
            __half2 f[4];
            decode_lane<K, CB>(wd[tr * 2 + tcl], f);
            put(tr, tcl, f);
        }
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

// ---- half2 variant. Same grid, block, pass-1 decode layout and output contract as the fp32 kernel;
// the 7 register bits of each pass are one pair bit (the two halves of a half2) + 6 half2-index bits.
//   pass 1: pair = row bit 0 (decode_lane's half2), p = e >> 1 = h | nb<<1 | tcl<<2 | tr<<3
//   pass 2: pair = col bit 0 (the two halves are adjacent columns), p = c>>1 | rr<<2 | j<<4;
//           threads: lane bit 0,1 = col bits 3,4; lane bit 2 = row bit 3; lane bit 3 = row bit 0;
//           lane bit 4 = row bit 4; warp = row bits 5,6 (row bits 0 and 3 swapped vs the fp32 kernel)
// Scaling: the exact 2^-7 (the two Hadamards' 1/sqrt(128)^2) multiplies the decoded values BEFORE any
// butterfly. Every codebook value has |v| < 4 (3INST/MCG: sum of two halves below 2; MUL1: within
// +-3.46), and a stage at most doubles the largest magnitude, so after s stages |x| < 4 * 2^-7 * 2^s
// <= 512 (s = 14): far from fp16's 65504. The typical magnitude starts at rms(v)/128 ~ 2^-7 and grows
// by sqrt(2) per stage, so only values already below 2^-7 of the block's typical size touch fp16's
// subnormals (< 2^-14), where the absolute error 2^-25 is negligible against the normal-range roundings.
// Rounding: each of the 14 stages rounds to fp16 (relative 2^-11 per stage on values of the running
// size; the errors are independent and the remaining stages are orthogonal up to scale, so they add in
// quadrature: rel-L2 ~ 8.9e-4 in the CPU model on random trellis data, vs ~2.1e-4 for the fp32 kernel);
// the epilogue rounds (a +- b), then * suh, then * svh, each to fp16 (HFMA2, HMUL2, HMUL2).
// Smem: fp16 [128][136], physical 16-byte chunk = (col >> 3) ^ (row bit 3 << 2). Pass-1 STS.U16 of one
// register: lanes cover rows r + 2q (q = 0..3) and 8 columns of one chunk (4 words, two lanes per word:
// same-word writes do not conflict); the 17-chunk row stride puts row r + 2q at bank (8q + c) mod 32,
// so 16 distinct words in 16 distinct banks. Pass-2 LDS.128 (quarter-warp phases of 8 lanes): lane bits
// 0,1 pick chunk bits 0,1, lane bit 2 (row bit 3) flips chunk bit 2 through the XOR while its row offset
// 8 * 17 chunks is 0 mod 8 chunks: 8 distinct chunks of the 128-byte bank window. A plain pad cannot do
// both: pass 1 needs an odd chunk stride, pass 2 with row bit 0 on lane bit 2 needs a stride = 4 mod 8.
// The XOR's row bit 3 is register index h in pass 1 (two per-thread base pointers) and lane bit 2 in pass 2.
__device__ __forceinline__ void rf_wht64h(__half2 (&v)[64]) {
#pragma unroll
    for (int s = 1; s < 64; s <<= 1) {
#pragma unroll
        for (int i = 0; i < 64; ++i) {
            if (!(i & s)) {
                const __half2 a = v[i], b = v[i | s];
                v[i] = __hadd2(a, b);
                v[i | s] = __hsub2(a, b);
            }
        }
    }
}

// grid (n/128, k/128); out row-major [k, n] fp16 with row stride ldo (a multiple of 8: the stores are
// 16-byte; ldo > n writes a column block of a wider matrix); suh [k], svh [n] fp16 (svh 16-byte aligned)
template <int K, int CB, bool BF>
__global__ void __launch_bounds__(RF_THREADS, RFH_MIN_BLOCKS)
    recon_full_half_kernel(const uint32_t* __restrict__ trellis, const __half* __restrict__ suh,
                      const __half* __restrict__ svh, rf_out_t<BF>* __restrict__ out, int n_tiles, int ldo) {
    extern __shared__ __align__(16) __half rf_smem_h[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nblk = blockIdx.x, kblk = blockIdx.y;

    // the block's 128 suh and 128 svh behind the tile, for the epilogue
    rf_smem_h[RFH_TILE + threadIdx.x] = suh[kblk * 128 + threadIdx.x];
    rf_smem_h[RFH_TILE + 128 + threadIdx.x] = svh[nblk * 128 + threadIdx.x];

    __half2 v[64];
    {
        // ---- pass 1, as the fp32 kernel; the exact 2^-7 first (no overflow, see above)
        const __half2 s7 = __float2half2_rn(0.0078125f);
        rf_decode_block<K, CB>(trellis, kblk, nblk, n_tiles, warp, lane, [&](int tr, int tcl, const __half2 (&f)[4]) {
#pragma unroll
            for (int nb = 0; nb < 2; ++nb)
#pragma unroll
                for (int h = 0; h < 2; ++h) v[h | (nb << 1) | (tcl << 2) | (tr << 3)] = __hmul2(f[nb * 2 + h], s7);
        });
    }
    rf_wht64h(v);
    {
        // last pass-1 stage (row bit 0, inside each half2) fused with the stores: low + high and
        // low - high as scalar fp16 ops (operand half selectors, no unpacking), one STS.U16 each
        const int q = lane & 3, g = lane >> 2;
        const __half2 pm = __floats2half2_rn(1.0f, -1.0f);
        __half* s[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) s[h] = rf_smem_h + (2 * q) * RFH_RS + g + 32 * (warp ^ h);  // chunk bit 2 ^= h
#pragma unroll
        for (int p = 0; p < 64; ++p) {
            const int h = p & 1, nb = (p >> 1) & 1, tcl = (p >> 2) & 1, tr = p >> 3;
            const __half2 y = __hfma2(__high2half2(v[p]), pm, __low2half2(v[p]));  // (a + b, a - b)
            __half* d = s[h] + (8 * h + 16 * tr) * RFH_RS + 8 * nb + 16 * tcl;
            d[0] = __low2half(y);
            d[RFH_RS] = __high2half(y);
        }
    }
    __syncthreads();

    // ---- pass 2: p = c>>1 | rr<<2 | j<<4 for block row rowbase + 2rr, block cols colbase + c + 32j
    const int row3 = (lane >> 2) & 1;
    const int rowbase = ((lane >> 3) & 1) + 8 * row3 + 16 * ((lane >> 4) & 1) + 32 * warp;
    const int colbase = 8 * (lane & 1) + 16 * ((lane >> 1) & 1);
    {
        // physical chunk bit 2 = j bit 0 ^ row bit 3: even j at +32 * row3 halves, odd j at -32 * row3
        const __half* s0 = rf_smem_h + rowbase * RFH_RS + colbase + 32 * row3;
        const __half* s1 = s0 - 64 * row3;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int rr = 0; rr < 4; ++rr) {
                const uint4 u = *reinterpret_cast<const uint4*>((j & 1 ? s1 : s0) + 2 * rr * RFH_RS + 32 * j);
                const int p = (rr << 2) | (j << 4);
                v[p] = bits_h2(u.x);
                v[p + 1] = bits_h2(u.y);
                v[p + 2] = bits_h2(u.z);
                v[p + 3] = bits_h2(u.w);
            }
    }
    rf_wht64h(v);

    // ---- last stage (col bit 0) and scales: ((a + b, a - b) * suh) * svh, three fp16 roundings
    // (HFMA2 with operand half selectors, HMUL2, HMUL2); 16-byte stores of 8 contiguous columns.
    // The block's scales come from the smem copy made in pass 1 (global loads here were hoisted
    // above the butterflies by the scheduler: 20 more live registers, spills under the 80 cap)
    const __half* ssu = rf_smem_h + RFH_TILE + rowbase;
    const __half* ssv = rf_smem_h + RFH_TILE + 128 + colbase;
    const __half2 pm = __floats2half2_rn(1.0f, -1.0f);
    rf_out_t<BF>* o = out + ((long)kblk * 128 + rowbase) * ldo + (long)nblk * 128 + colbase;
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
        const __half2 su = __half2half2(ssu[2 * rr]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint4 sv8 = *reinterpret_cast<const uint4*>(ssv + 32 * j);
            const uint32_t svw[4] = {sv8.x, sv8.y, sv8.z, sv8.w};
            uint32_t ov[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const __half2 x = v[i | (rr << 2) | (j << 4)];
                const __half2 y = __hfma2(__high2half2(x), pm, __low2half2(x));  // (a + b, a - b)
                ov[i] = rf_h2_out<BF>(__hmul2(__hmul2(y, su), bits_h2(svw[i])));
            }
            rf_st16(o + 32 * j, ov);
        }
        o += 2 * (long)ldo;
    }
}
// grid (n/128, k/128); out row-major [k, n] fp16 with row stride ldo (a multiple of 8: the stores are
// 16-byte; ldo > n writes a column block of a wider matrix); suh [k], svh [n] fp16 (svh 16-byte aligned)
template <int K, int CB, bool BF>
__global__ void __launch_bounds__(RF_THREADS, RF_MIN_BLOCKS)
    recon_full_kernel(const uint32_t* __restrict__ trellis, const __half* __restrict__ suh,
                      const __half* __restrict__ svh, rf_out_t<BF>* __restrict__ out, int n_tiles, int ldo) {
    extern __shared__ __align__(16) float rf_smem[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nblk = blockIdx.x, kblk = blockIdx.y;

    float v[128];
    // ---- pass 1: register index e = b | h<<1 | nb<<2 | tcl<<3 | tr<<4 for block row b + 2q + 8h + 16tr
    // and block col g + 8nb + 16(2warp + tcl); decode_lane's f[nb*2 + h] holds rows (b = 0, 1)
    rf_decode_block<K, CB>(trellis, kblk, nblk, n_tiles, warp, lane, [&](int tr, int tcl, const __half2 (&f)[4]) {
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float2 p = __half22float2(f[nb * 2 + h]);
                const int e = (h << 1) | (nb << 2) | (tcl << 3) | (tr << 4);
                v[e] = p.x;
                v[e | 1] = p.y;
            }
    });
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
    // rounded once to the output type; 16-byte stores of 8 contiguous columns
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
                o[i] = rf_f2_out<BF>(y0, y1);
            }
            rf_st16(out + (row0 + 2 * rr) * (long)ldo + col0 + 32 * j, o);
        }
    }
}


// the kernel for K (HALF: the half2 one; only the launcher's choice is instantiated, bench/recon_tune.cu
// instantiates both) and its dynamic shared memory
template <int K>
constexpr bool rf_uses_half = K <= RF_HALF_MAX_K;
template <bool HALF>
constexpr int rf_smem_bytes = HALF ? RFH_SMEM : RF_SMEM;
template <int K, int CB, bool BF, bool HALF = rf_uses_half<K>>
inline auto recon_full_pick() {
    if constexpr (HALF) return recon_full_half_kernel<K, CB, BF>;
    else return recon_full_kernel<K, CB, BF>;
}

// k_tiles and n_tiles multiples of 8 (dims multiples of 128); returns the launch error, if any
template <int K, int CB, bool BF, bool HALF = rf_uses_half<K>>
cudaError_t launch_recon_full_t(const uint32_t* trellis, const __half* suh, const __half* svh, void* out,
                                int k_tiles, int n_tiles, long ldo, cudaStream_t st) {
    constexpr int smem = rf_smem_bytes<HALF>;
    auto kern = recon_full_pick<K, CB, BF, HALF>();
    // > 48 KB of dynamic shared memory needs an opt-in per function and device (host-side, legal
    // during graph capture); done once per device for this instantiation
    static unsigned long long ready = 0;  // bit d: attributes set on device d (benign race: idempotent)
    int dev = 0;
    cudaGetDevice(&dev);
    const unsigned long long bit = 1ull << (dev & 63);
    if (!(ready & bit)) {
        cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return e;
        cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
        ready |= bit;
    }
    dim3 grid((unsigned)(n_tiles / 8), (unsigned)(k_tiles / 8));
    kern<<<grid, RF_THREADS, smem, st>>>(trellis, suh, svh, static_cast<rf_out_t<BF>*>(out), n_tiles, (int)ldo);
    return cudaGetLastError();
}

template <int CB, bool BF>
cudaError_t dispatch_recon_full_t(int K, const uint32_t* trellis, const __half* suh, const __half* svh, void* out,
                                  int k_tiles, int n_tiles, long ldo, cudaStream_t st) {
    switch (K) {
        case 1: return launch_recon_full_t<1, CB, BF>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 2: return launch_recon_full_t<2, CB, BF>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 3: return launch_recon_full_t<3, CB, BF>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 4: return launch_recon_full_t<4, CB, BF>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 5: return launch_recon_full_t<5, CB, BF>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 6: return launch_recon_full_t<6, CB, BF>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 7: return launch_recon_full_t<7, CB, BF>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        case 8: return launch_recon_full_t<8, CB, BF>(trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
        default: return cudaErrorInvalidValue;
    }
}

// out: fp16, or bf16 when bf16 is set
template <int CB>
cudaError_t dispatch_recon_full(int K, const uint32_t* trellis, const __half* suh, const __half* svh, void* out,
                                bool bf16, int k_tiles, int n_tiles, long ldo, cudaStream_t st) {
    return bf16 ? dispatch_recon_full_t<CB, true>(K, trellis, suh, svh, out, k_tiles, n_tiles, ldo, st)
                : dispatch_recon_full_t<CB, false>(K, trellis, suh, svh, out, k_tiles, n_tiles, ldo, st);
}

}  // namespace exl3
