// Device helpers shared by the decode attention kernels (decode_attn.cu, decode_attn_qsplit.cu): 16-bit packing,
// the m16n8k16 tensor-core product and the H32 rotation of quantized caches (format spec 6).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace exl3_attn {

// A decode kernel's recent rows (exl3_core/reference/kv_recent.py): the low-bit rings of the sides under 8 bits
// [slots, size, Hkv * D / 32 * (8 - bits)] (null for an 8-bit side), the position each ring row holds [slots, size]
// and each sequence's ring slot [B]
struct RecentArgs {
    const uint32_t* kr;
    const uint32_t* vr;
    const int* tags;
    const int* slots;
    long long kr_n, kr_r, vr_n, vr_r, tg_n;  // ring strides per slot and per row, tags' per slot (elements)
    int window, size;                        // positions read at 8 bits, ring rows
};

template <class T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}
template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

// c += a * b, m16n8k16, fp32 accumulators
template <class T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (std::is_same_v<T, __half>) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// x (32 fp32 values) times H32 / sqrt(32): the butterfly, widths 1, 2, 4, 8, 16
__device__ __forceinline__ void hadamard32(float (&x)[32]) {
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            if (i & h) continue;
            const float p = x[i], q = x[i + h];
            x[i] = p + q;
            x[i + h] = p - q;
        }
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) x[i] *= 0.17677669529663687f;
}

// One value per lane: the warp's 32 values times H32 / sqrt(32), the operations of hadamard32 in its order (so the
// results are equal bit for bit), each level's partner from a shuffle instead of another register.
__device__ __forceinline__ float hadamard32_warp(float x, int lane) {
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, x, h);
        x = (lane & h) ? y - x : x + y;
    }
    return x * 0.17677669529663687f;
}

// kern<<<grid, block, smem, st>>>(a, pdl), as a programmatic dependent of the stream's previous kernel when pdl
// (Hopper PDL: it may start before that kernel completes and waits for it with griddepcontrol.wait)
template <class Kern, class Arg>
inline cudaError_t launch_pdl(Kern kern, dim3 grid, dim3 block, size_t smem, cudaStream_t st, const Arg& a, bool pdl) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kern, a, pdl);
}

}  // namespace exl3_attn
