// Blockwise 128-point Hadamard (natural-order Sylvester, scaled by 1/sqrt(128); format spec 4.1, 4.3).
// One warp per 128-element block; lane l holds elements 4l..4l+3 (had128_warp, exl3_kernels.cuh:
// bits 0-1 of the index butterflied in registers, bits 2-6 across lanes). Arithmetic is fp32.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "exl3_kernels.cuh"
#include "exl3_launch.h"

namespace exl3 {

template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&v)[4]);
template <>
__device__ __forceinline__ void load4<float>(const float* p, float (&v)[4]) {
    float4 u = *reinterpret_cast<const float4*>(p);
    v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
}
template <>
__device__ __forceinline__ void load4<__half>(const __half* p, float (&v)[4]) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
    float2 a = __half22float2(bits_h2(u.x)), b = __half22float2(bits_h2(u.y));
    v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}

// Input side (spec 4.3 step 1): fp16(x * pre) in fp16 when x is fp16, then the butterfly in fp32.
// Output side (step 3): butterfly in fp32, rounded to fp16 when the output is fp16, then * post in
// fp16 (fp32 output: * post in fp32).
template <typename TI, typename TO>
__global__ void __launch_bounds__(256) had128_kernel(const TI* __restrict__ x, TO* __restrict__ y, const __half* __restrict__ pre,
                                                     const __half* __restrict__ post, long blocks, long dim) {
    const long blk = (long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (blk >= blocks) return;
    const int lane = threadIdx.x & 31;
    const long base = blk * 128 + lane * 4;
    const long col = base % dim;
    float v[4];
    load4<TI>(x + base, v);
    if (pre != nullptr) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if constexpr (sizeof(TI) == 2) v[j] = __half2float(__hmul(__float2half_rn(v[j]), pre[col + j]));
            else v[j] = v[j] * __half2float(pre[col + j]);
        }
    }
    had128_warp(v, lane);
    if constexpr (sizeof(TO) == 2) {
        __half h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            h[j] = __float2half_rn(v[j]);
            if (post != nullptr) h[j] = __hmul(h[j], post[col + j]);
        }
        uint2 u;
        u.x = h2_bits(__halves2half2(h[0], h[1]));
        u.y = h2_bits(__halves2half2(h[2], h[3]));
        *reinterpret_cast<uint2*>(y + base) = u;
    } else {
        if (post != nullptr) {
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] *= __half2float(post[col + j]);
        }
        *reinterpret_cast<float4*>(y + base) = make_float4(v[0], v[1], v[2], v[3]);
    }
}

void launch_had128(const void* x, bool x_fp16, void* y, bool y_fp16, const __half* pre, const __half* post,
                   long rows, long dim, cudaStream_t st) {
    const long blocks = rows * dim / 128;
    const unsigned grid = (unsigned)((blocks + 7) / 8);
    if (grid == 0) return;
    if (x_fp16 && y_fp16)
        had128_kernel<__half, __half><<<grid, 256, 0, st>>>((const __half*)x, (__half*)y, pre, post, blocks, dim);
    else if (x_fp16)
        had128_kernel<__half, float><<<grid, 256, 0, st>>>((const __half*)x, (float*)y, pre, post, blocks, dim);
    else if (y_fp16)
        had128_kernel<float, __half><<<grid, 256, 0, st>>>((const float*)x, (__half*)y, pre, post, blocks, dim);
    else
        had128_kernel<float, float><<<grid, 256, 0, st>>>((const float*)x, (float*)y, pre, post, blocks, dim);
}

// codebook fan-out (defined one codebook per file)
int launch_gemm_cb0(int K, int mb, const GemmArgs& a, cudaStream_t st);
int launch_gemm_cb1(int K, int mb, const GemmArgs& a, cudaStream_t st);
int launch_gemm_cb2(int K, int mb, const GemmArgs& a, cudaStream_t st);
void launch_reconstruct_cb0(int K, const uint32_t* t, __half* out, int kt, int nt, cudaStream_t st);
void launch_reconstruct_cb1(int K, const uint32_t* t, __half* out, int kt, int nt, cudaStream_t st);
void launch_reconstruct_cb2(int K, const uint32_t* t, __half* out, int kt, int nt, cudaStream_t st);

int launch_gemm(int cb, int K, int mb, const GemmArgs& a, cudaStream_t st) {
    if (cb == 0) return launch_gemm_cb0(K, mb, a, st);
    if (cb == 1) return launch_gemm_cb1(K, mb, a, st);
    return launch_gemm_cb2(K, mb, a, st);
}

void launch_reconstruct(int cb, int K, const uint32_t* t, __half* out, int k_tiles, int n_tiles, cudaStream_t st) {
    if (cb == 0) launch_reconstruct_cb0(K, t, out, k_tiles, n_tiles, st);
    else if (cb == 1) launch_reconstruct_cb1(K, t, out, k_tiles, n_tiles, st);
    else launch_reconstruct_cb2(K, t, out, k_tiles, n_tiles, st);
}


}  // namespace exl3
