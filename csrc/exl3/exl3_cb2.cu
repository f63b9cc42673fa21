// Instantiations of the EXL3 kernels for codebook 2 (one codebook per file: parallel builds).
#include "exl3_fused.cuh"
#include "exl3_kernels.cuh"
#include "exl3_launch.h"
#include "exl3_recon_full.cuh"

namespace exl3 {
int launch_gemm_cb2(int K, int mb, const GemmArgs& a, cudaStream_t st) { return dispatch_gemm<2>(K, mb, a, st); }
void launch_reconstruct_cb2(int K, const uint32_t* t, __half* out, int kt, int nt, cudaStream_t st) {
    dispatch_reconstruct<2>(K, t, out, kt, nt, st);
}
int launch_fused_cb2(int K, const FusedArgs& a, cudaStream_t st) { return dispatch_fused<2>(K, a, st); }
cudaError_t launch_recon_full_cb2(int K, const uint32_t* t, const __half* suh, const __half* svh, void* out, bool bf16,
                                  int kt, int nt, long ldo, cudaStream_t st) {
    return dispatch_recon_full<2>(K, t, suh, svh, out, bf16, kt, nt, ldo, st);
}
}  // namespace exl3
