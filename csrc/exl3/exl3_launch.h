// Host-side entry points of the EXL3 CUDA kernels (defined in exl3_cb*.cu and exl3_had.cu).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace exl3 {

struct GemmArgs;
struct FusedArgs;

// codebook cb in 0..2, K in 1..8; out is fp16 [16*k_tiles, 16*n_tiles]
void launch_reconstruct(int cb, int K, const uint32_t* trellis, __half* out, int k_tiles, int n_tiles, cudaStream_t st);
// mb: 1 or 2 m16 row blocks per launch; a.kt_per_warp <= 0 picks one wave of resident warps.
// Returns the k tiles per warp it used.
int launch_gemm(int cb, int K, int mb, const GemmArgs& a, cudaStream_t st);
// blockwise H128/sqrt(128) along the last dim of a row-major [rows, dim] tensor (see exl3_had.cu)
void launch_had128(const void* x, bool x_fp16, void* y, bool y_fp16, const __half* pre, const __half* post,
                   long rows, long dim, cudaStream_t st);

// one-launch linear for m <= 16 (exl3_fused.cuh): Hadamard in, decode GEMM, Hadamard out, for up to
// 3 problems sharing x; a.kt_per_chunk <= 0 picks one wave. Returns the k tiles per chunk it used.
int launch_fused(int cb, int K, const FusedArgs& a, cudaStream_t st);
int launch_fused_cb0(int K, const FusedArgs& a, cudaStream_t st);
int launch_fused_cb1(int K, const FusedArgs& a, cudaStream_t st);
int launch_fused_cb2(int K, const FusedArgs& a, cudaStream_t st);

// W = diag(suh) · BD_k · Ŵ · BD_n · diag(svh) as fp16 (bf16 when bf16 is set) [16*k_tiles, 16*n_tiles]
// (exl3_recon_full.cuh),
// row stride ldo (>= 16*n_tiles, a multiple of 8; out 16-byte aligned); k_tiles, n_tiles multiples of
// 8, suh/svh fp16 (svh 16-byte aligned). Returns the launch error.
cudaError_t launch_recon_full(int cb, int K, const uint32_t* trellis, const __half* suh, const __half* svh,
                              void* out, bool bf16, int k_tiles, int n_tiles, long ldo, cudaStream_t st);
cudaError_t launch_recon_full_cb0(int K, const uint32_t* trellis, const __half* suh, const __half* svh, void* out,
                                  bool bf16, int k_tiles, int n_tiles, long ldo, cudaStream_t st);
cudaError_t launch_recon_full_cb1(int K, const uint32_t* trellis, const __half* suh, const __half* svh, void* out,
                                  bool bf16, int k_tiles, int n_tiles, long ldo, cudaStream_t st);
cudaError_t launch_recon_full_cb2(int K, const uint32_t* trellis, const __half* suh, const __half* svh, void* out,
                                  bool bf16, int k_tiles, int n_tiles, long ldo, cudaStream_t st);

}  // namespace exl3
