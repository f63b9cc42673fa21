// CUDA side of the EXL3 Viterbi tile encoder: the device context for encode_block()
// (viterbi_kernel.cuh), the kernel, and a torch-free launcher. viterbi_cuda.cu binds it to the op
// exl3::viterbi_encode; this header compiles on its own with nvcc (see compile_check.sh).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "viterbi_kernel.cuh"

namespace exl3vit {

// Inline PTX without .ftz: IEEE subnormals even when the build uses --use_fast_math, and no
// contraction of the subtraction into a neighbouring multiply.
__device__ __forceinline__ float sub_rn(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}

struct DevCx {
    uint8_t* sm;
    __device__ __forceinline__ int tid() const { return (int)threadIdx.x; }
    __device__ __forceinline__ uint8_t* smem() const { return sm; }
    __device__ __forceinline__ void sync() const { __syncthreads(); }
    template <int N>
    __device__ __forceinline__ void shfl_xor_n(uint32_t (&v)[N], int m) const {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = __shfl_xor_sync(0xffffffffu, v[i], m);
    }
    __device__ __forceinline__ float sub(float a, float b) const { return sub_rn(a, b); }
    __device__ __forceinline__ float fma(float a, float b, float c) const { return fma_rn(a, b, c); }
    __device__ __forceinline__ uint32_t bits(float x) const { return __float_as_uint(x); }
    __device__ __forceinline__ float inf() const { return __uint_as_float(kInfBits); }
    // 8 fp16 LUT values (16-byte aligned) to fp32; the conversion is exact
    __device__ __forceinline__ void load8h(const uint16_t* p, float (&o)[kCh]) const {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
            o[2 * i] = f.x;
            o[2 * i + 1] = f.y;
        }
    }
    __device__ __forceinline__ void store8f(float* p, const uint32_t* b) const {
        float4* p4 = reinterpret_cast<float4*>(p);
        p4[0] = make_float4(__uint_as_float(b[0]), __uint_as_float(b[1]), __uint_as_float(b[2]), __uint_as_float(b[3]));
        p4[1] = make_float4(__uint_as_float(b[4]), __uint_as_float(b[5]), __uint_as_float(b[6]), __uint_as_float(b[7]));
    }
    __device__ __forceinline__ void store8b(uint8_t* p, const uint32_t* a) const {
        const uint32_t lo = a[0] | (a[1] << 8) | (a[2] << 16) | (a[3] << 24);
        const uint32_t hi = a[4] | (a[5] << 8) | (a[6] << 16) | (a[7] << 24);
        *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
    }
};

template <int K>
__global__ void __launch_bounds__(kThreads, 1) viterbi_kernel(Args a) {
    extern __shared__ __align__(16) uint8_t vt_smem[];
    a.block = (int)blockIdx.x;
    a.nblocks = (int)gridDim.x;
    DevCx cx{vt_smem};
    encode_block<K>(cx, a);
}

// Launch geometry and scratch for n tiles at bitrate K on `device`: grid = resident blocks (one
// wave, each block strides over tile groups), surv_bytes / dscratch_floats for the whole grid.
struct Plan {
    int grid;
    size_t surv_bytes;
    size_t dscratch_floats;
    size_t smem;
};

template <int K>
inline cudaError_t plan_k(int64_t n_tiles, int device, Plan& p) {
    p.smem = smem_bytes<K>();
    cudaError_t e = cudaFuncSetAttribute(viterbi_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)p.smem);
    if (e != cudaSuccess) return e;
    int per_sm = 0, sms = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, viterbi_kernel<K>, kThreads, p.smem);
    if (e != cudaSuccess) return e;
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return e;
    if (per_sm < 1) return cudaErrorInvalidConfiguration;  // shared memory does not fit this device
    const int64_t groups = (n_tiles + Cfg<K>::T - 1) / Cfg<K>::T;
    const int64_t wave = (int64_t)per_sm * sms;
    p.grid = (int)(groups < wave ? groups : wave);
    if (p.grid < 1) p.grid = 1;
    p.surv_bytes = surv_slot_bytes<K>() * p.grid;
    p.dscratch_floats = dscratch_slot_floats<K>() * p.grid;
    return cudaSuccess;
}

inline cudaError_t plan(int K, int64_t n_tiles, int device, Plan& p) {
    switch (K) {
        case 1: return plan_k<1>(n_tiles, device, p);
        case 2: return plan_k<2>(n_tiles, device, p);
        case 3: return plan_k<3>(n_tiles, device, p);
        case 4: return plan_k<4>(n_tiles, device, p);
        case 5: return plan_k<5>(n_tiles, device, p);
        case 6: return plan_k<6>(n_tiles, device, p);
        case 7: return plan_k<7>(n_tiles, device, p);
        case 8: return plan_k<8>(n_tiles, device, p);
    }
    return cudaErrorInvalidValue;
}

// a.surv / a.dscratch sized by plan(); a.block / a.nblocks are set by the kernel.
inline cudaError_t launch(int K, const Plan& p, const Args& a, cudaStream_t st) {
    switch (K) {
        case 1: viterbi_kernel<1><<<p.grid, kThreads, p.smem, st>>>(a); break;
        case 2: viterbi_kernel<2><<<p.grid, kThreads, p.smem, st>>>(a); break;
        case 3: viterbi_kernel<3><<<p.grid, kThreads, p.smem, st>>>(a); break;
        case 4: viterbi_kernel<4><<<p.grid, kThreads, p.smem, st>>>(a); break;
        case 5: viterbi_kernel<5><<<p.grid, kThreads, p.smem, st>>>(a); break;
        case 6: viterbi_kernel<6><<<p.grid, kThreads, p.smem, st>>>(a); break;
        case 7: viterbi_kernel<7><<<p.grid, kThreads, p.smem, st>>>(a); break;
        case 8: viterbi_kernel<8><<<p.grid, kThreads, p.smem, st>>>(a); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

}  // namespace exl3vit
