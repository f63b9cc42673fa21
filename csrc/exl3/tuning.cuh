// Compile-time tuning of the EXL3 CUDA kernels, in one place: launch shapes, ring depths and occupancy
// targets, each with the reason for its value. The standalone harnesses bench/gemv_tune.cu and
// bench/recon_tune.cu time the kernels built from these values; to try another value, edit it here and
// rebuild (the product sources take no -D overrides).
#pragma once

namespace exl3 {

// ---- decode + mma main loop (exl3_kernels.cuh: DecodeMmaLoop, gemm_kernel)

// Warps per block of the m16 loop (more than 8 rows), the inner split-k GEMM and pre-decoding: four warps
// of GEMM_NT tiles each reuse every x fragment across their tiles with a small register file.
constexpr int GEMM_WARPS = 4;
// n tiles (16 columns each) per warp of those loops; GEMM_WARPS x GEMM_NT covers one 128-column block.
constexpr int GEMM_NT = 2;
// n tiles per warp of the transposed loop without pre-decoding and of the decode-only kernel: four tiles
// spread each ring stage's fixed instructions (wait, copy, commit, x fragment, loop test) over more weights.
constexpr int TR_NT = 4;
// k tiles per warp (and per fused block) at most: bounds the x staging buffer in shared memory.
constexpr int GEMM_KT_MAX = 32;

// Trellis k tiles in flight per warp of the m16 loop: deep enough to hide global-load latency, one stage
// less at K = 5, whose larger stages would otherwise cost a resident block per SM.
constexpr int ring_stages(int K) { return K == 5 ? 5 : 6; }
// The transposed loop's ring (TR_NT tiles per stage): 4 stages at K = 6, whose smaller footprint admits more
// resident blocks for the wide 6-bit heads.
constexpr int tr_ring_stages(int K) { return K == 6 ? 4 : ring_stages(K); }

// ---- one-launch linear (exl3_fused.cuh)

// Resident blocks per SM asked of ptxas for the transposed kernel (capped by what shared memory admits at
// K): the most that fit 32 registers without spills, since this decode-bound loop needs warps to hide latency.
constexpr int FUSED_TR_MIN_BLOCKS = 15;
// Ring of the transposed kernel for chunks of at most SHORT_RING_MAX_KT k tiles: a short ring already holds
// most of such a chunk, and its smaller shared footprint admits more resident blocks.
constexpr int SHORT_RING = 4;
constexpr int SHORT_RING_MAX_KT = 12;
// Pre-decoding: the longest chunk a block requests whole before griddepcontrol.wait (its ring must fit the
// 48 KB of static shared memory, so K > 4 takes half as many tiles).
constexpr int PD_TILES = 32;
constexpr int pd_ring(int K) { return K <= 4 ? PD_TILES : PD_TILES / 2; }
// k tiles decoded into registers before the wait (4 registers per tile): more would cost resident blocks.
constexpr int PD_STEPS = 8;
// Resident blocks per SM asked of ptxas for a pre-decoding kernel, whose decoded fragments need ~111 registers.
constexpr int PD_MIN_BLOCKS = 4;

// ---- W rebuilt in the original basis (exl3_recon_full.cuh)

// Largest K served by the half2 butterfly kernel: its extra rounding stays far below the quantization error
// up to K = 6, while at K = 7, 8 it would be a visible share of it.
constexpr int RF_HALF_MAX_K = 6;
// Resident CTAs per SM asked of ptxas for the half2 kernel: the most that hold its 64 values without spills.
constexpr int RFH_MIN_BLOCKS = 5;

}  // namespace exl3
