// EXL3 kernels templated on (K, codebook): reconstruct Ŵ and the on-the-fly-decode GEMM, with the decode + mma
// main loop they share with the one-launch linear. Included by exl3_cb{0,1,2}.cu, one codebook per file so
// the 24 (K, cb) instantiations of each kernel compile in parallel.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "exl3_decode.cuh"
#include "tuning.cuh"

namespace exl3 {

// ------------------------------------------------------------------ Hadamard

// In-place H128/sqrt(128) of the 128 values a warp holds (lane l: elements 4l..4l+3), fp32.
// The one butterfly of every kernel (had128_kernel in exl3_had.cu, the fused linear's prologue and
// epilogue), so their results agree bit for bit.
__device__ __forceinline__ void had128_warp(float (&v)[4], int lane) {
    float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    v[0] = a0 + a2; v[2] = a0 - a2; v[1] = a1 + a3; v[3] = a1 - a3;
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
        const bool upper = lane & s;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float o = __shfl_xor_sync(0xffffffffu, v[j], s);
            v[j] = upper ? o - v[j] : v[j] + o;
        }
    }
    const float sc = 0.088388347648318440550f;  // 1/sqrt(128)
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] *= sc;
}

// ------------------------------------------------------------------ reconstruct

// One warp per RT consecutive tiles (all loads issued first, for memory-level parallelism); each
// tile goes through shared memory so the global stores are 16-byte row pieces.
constexpr int RECON_RT = 4;

template <int K, int CB>
__global__ void __launch_bounds__(256) reconstruct_kernel(const uint32_t* __restrict__ trellis, __half* __restrict__ out,
                                                          int k_tiles, int n_tiles) {
    __shared__ __align__(16) __half2 stage[8][16][9];  // [warp][row][col pair], padded by one word per row
    using W = LaneWindow<K>;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const long total = (long)k_tiles * n_tiles;
    const long first = ((long)blockIdx.x * 8 + warp) * RECON_RT;
    if (first >= total) return;

    uint32_t w[RECON_RT][W::NW];
#pragma unroll
    for (int i = 0; i < RECON_RT; ++i)
        if (first + i < total) W::load(trellis + (first + i) * 8 * K, lane, w[i]);

    const int q = lane & 3, g = lane >> 2;
    __half* st = reinterpret_cast<__half*>(&stage[warp][0][0]);
    constexpr int RS = 18;  // row stride of the staging tile in halves
    const long ld = (long)n_tiles * 16;
#pragma unroll
    for (int i = 0; i < RECON_RT; ++i) {
        const long tile = first + i;
        if (tile >= total) break;
        W::align(lane, w[i]);
        __half2 f[4];
        decode_lane<K, CB>(w[i], f);
        // f[nb*2 + h] = rows (2q + 8h, +1), col g + 8nb
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * q + 8 * h, c = g + 8 * nb;
                st[r * RS + c] = __low2half(f[nb * 2 + h]);
                st[(r + 1) * RS + c] = __high2half(f[nb * 2 + h]);
            }
        }
        __syncwarp();
        // lane -> row lane/2, 8 columns starting at (lane&1)*8
        const int r = lane >> 1, c0 = (lane & 1) * 8;
        const uint32_t* src = reinterpret_cast<const uint32_t*>(st + r * RS + c0);
        uint4 v = make_uint4(src[0], src[1], src[2], src[3]);
        __syncwarp();  // the next tile overwrites the staging buffer
        const int tk = (int)(tile / n_tiles), tn = (int)(tile % n_tiles);
        *reinterpret_cast<uint4*>(out + ((long)tk * 16 + r) * ld + (long)tn * 16 + c0) = v;
    }
}

// ------------------------------------------------------------------ GEMM / GEMV with on-the-fly decode

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

struct GemmArgs {
    const __half* x;         // [m, k] fp16 (already rotated: xh), row-major
    const uint32_t* trellis; // [k/16, n/16, 8K] uint32
    float* z;                // [m, n] fp32, zero-initialised (split-k partials are added atomically)
    int m, k_tiles, n_tiles;
    int kt_per_warp;         // k tiles each warp sums over (split-k granularity)
    int m0;                  // first row of this launch's row chunk
};

// n tiles per block: a block covers 128 output columns (one output Hadamard block) whatever its shape,
// warps_for(nt) warps of nt n tiles each
constexpr int BLOCK_TILES = 8;
__host__ __device__ constexpr int warps_for(int nt) { return BLOCK_TILES / nt; }
static_assert(GEMM_WARPS * GEMM_NT == BLOCK_TILES && BLOCK_TILES % TR_NT == 0, "a block holds 8 n tiles");
constexpr int X_STAGE_STRIDE = GEMM_KT_MAX * 16 + 8;  // x staging row stride in halves; +8 staggers banks for ldmatrix

// ---- the decode + mma main loop shared by gemm_kernel and fused_linear_kernel
//
// Each warp streams its NT adjacent tiles of every k tile through a private ring of ring_stages(K)
// slots in shared memory, filled with 16-byte cp.async (L2 only): the bytes in flight hold no
// registers, so the ring can be deep enough to hide global-load latency and the kernel keeps more
// warps resident. A lane then reads the 2-3 words
// of its tile window from shared memory (conflict-free for K <= 4: the lanes' first words are
// distinct), decodes 8 weights per tile and feeds two mma.m16n8k16 per tile and m16 block.
//
// Transposed form (TR, m <= 8 rows): the decoded tile is the mma's A operand (Ŵᵀ, 16 output
// columns x 16 k) and x the B operand (k x 8 rows), so one mma covers a whole 16x16 tile: a lane's
// four decoded half2 are exactly Ŵᵀ's A fragment, reordered {f0, f2, f1, f3}. Half the mma issues,
// half the accumulators (a lane holds rows 2q, 2q+1 of output columns g and g+8) and a two-register
// B fragment: fewer registers, more resident warps for the decode-bound GEMV.
// DECODE_ONLY: the same loads and decoding, the weights summed by HFMA2 instead of multiplied by x: the
// decode-only ceiling kernel of bench/ext (no kernel of the library instantiates it).
// S: k tiles in flight (the fused linear also instantiates SHORT_RING, exl3_fused.cuh)
template <int K, int STAGES = ring_stages(K), int NT = GEMM_NT>
struct Ring {
    static constexpr int S = STAGES;
    static constexpr int TILE_WORDS = 8 * K;
    static constexpr int STAGE_WORDS = NT * TILE_WORDS;     // the NT tiles are adjacent in memory
    static constexpr int CHUNKS = STAGE_WORDS / 4;          // 16-byte copies per stage
    static constexpr int COPIES = (CHUNKS + 31) / 32;       // per lane and stage (2 for NT = 4 above K = 4)
    static constexpr int WARP_WORDS = S * STAGE_WORDS;      // shared words per warp
};

__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gptr) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gptr));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

template <int K, int CB, int MB, bool DECODE_ONLY, bool TR = false, int STAGES = ring_stages(K), int NT_ = GEMM_NT>
struct DecodeMmaLoop {
    static_assert(!TR || (MB == 1 && !DECODE_ONLY), "the transposed form serves one block of <= 8 rows");
    using W = LaneWindow<K>;
    using R = Ring<K, STAGES, NT_>;
    static constexpr int NT = NT_;

    const uint32_t* src;  // this warp's first tile in its first k tile
    long row_words;       // words between consecutive k tiles
    int steps;            // k tiles to process
    uint32_t* ring;       // this warp's R::WARP_WORDS words of shared memory (16-byte aligned)
    int lane;

    // k tile `step` into ring slot `slot`; always commits a group (possibly empty) so that group
    // counts stay uniform across lanes and steps
    __device__ __forceinline__ void issue(int step, int slot) const {
        if (step < steps)
            copy_stage((uint32_t)__cvta_generic_to_shared(ring + slot * R::STAGE_WORDS + 4 * lane),
                       src + (long)step * row_words + 4 * lane);
        cp_async_commit();
    }

    // one k tile's NT tiles into a ring slot: the lane's 16-byte pieces (dst, gsrc: its first one), 32 apart
    __device__ __forceinline__ void copy_stage(uint32_t dst, const uint32_t* gsrc) const {
#pragma unroll
        for (int c = 0; c < R::COPIES; ++c)
            if (R::CHUNKS % 32 == 0 || 32 * c + lane < R::CHUNKS) cp_async16(dst + 512u * c, gsrc + 128 * c);
    }

    // request the first S-1 k tiles (may run before the caller's own prologue, to overlap it)
    __device__ __forceinline__ void start() const {
#pragma unroll
        for (int s = 0; s < R::S - 1; ++s) issue(s, s);
    }

    // Decode the NT tiles of k tile `step` (the lane's window words w) and feed them to the mma.
    __device__ __forceinline__ void step_mma(int step, uint32_t (&w)[NT][W::NW], uint32_t xs_lane, uint32_t xs_mb_bytes,
                                             float (&acc)[MB][NT][2][4], __half2& dsum) const {
        uint32_t a[MB][4];
        if constexpr (TR) {
            x_frag_tr(step, xs_lane, a[0][0], a[0][1]);
        } else if constexpr (!DECODE_ONLY) {
#pragma unroll
            for (int mb = 0; mb < MB; ++mb) {
                const uint32_t addr = xs_lane + (uint32_t)mb * xs_mb_bytes + (uint32_t)step * 32u;
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(a[mb][0]), "=r"(a[mb][1]), "=r"(a[mb][2]), "=r"(a[mb][3])
                             : "r"(addr));
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if constexpr (TR) {
                uint32_t wt[4];
                decode_tile_tr(w[nt], wt);
                mma_16816(acc[0][nt][0], wt, a[0][0], a[0][1]);
                continue;
            }
            W::align(lane, w[nt]);
            __half2 f[4];
            decode_lane<K, CB>(w[nt], f);
            if constexpr (DECODE_ONLY) {
                const __half2 one = __float2half2_rn(1.f);
#pragma unroll
                for (int i = 0; i < 4; ++i) dsum = __hfma2(f[i], one, dsum);
            } else {
#pragma unroll
                for (int mb = 0; mb < MB; ++mb) {
                    mma_16816(acc[mb][nt][0], a[mb], h2_bits(f[0]), h2_bits(f[1]));
                    mma_16816(acc[mb][nt][1], a[mb], h2_bits(f[2]), h2_bits(f[3]));
                }
            }
        }
    }

    // xs_lane: ldmatrix address (shared, bytes) of this lane's row of k tile 0 of m16 block 0;
    // xs_mb_bytes: bytes between m16 blocks. Accumulates into acc (or dsum when DECODE_ONLY).
    // TR: xs_lane addresses row lane&7, column half (lane>>3)&1 (ldmatrix.x2), and only
    // acc[0][nt][0] is used: {row 2q col g, row 2q+1 col g, row 2q col g+8, row 2q+1 col g+8}.
    __device__ __forceinline__ void run(uint32_t xs_lane, uint32_t xs_mb_bytes, float (&acc)[MB][NT][2][4],
                                        __half2& dsum) const {
        // The step loop is unrolled by the ring depth so that every ring slot is a compile-time offset:
        // the lane's window words are read at [its word + constant] and the copies land at [its
        // 16 bytes + constant]; the trellis pointer advances by one k tile per step. (A runtime slot
        // cost ~30 address instructions per k tile next to ~70 of decoding.)
        const uint32_t* rp[W::NW];  // the lane's window words in slot 0 (circular: the stream is tail-biting)
        slot0_pointers(rp);
        const uint32_t wr = (uint32_t)__cvta_generic_to_shared(ring + 4 * lane);
        const uint32_t* gp = src + (long)(R::S - 1) * row_words + 4 * lane;  // k tile step + S - 1
        for (int step0 = 0; step0 < steps; step0 += R::S) {
#pragma unroll
            for (int j = 0; j < R::S; ++j) {
                const int step = step0 + j;
                if (step >= steps) break;
                cp_async_wait<R::S - 2>();  // this lane's copies of k tile `step` (slot j) have landed
                __syncwarp();               // ... and every lane's; the previous slot's reads are all done
                if (step + R::S - 1 < steps) copy_stage(wr + (uint32_t)(((j + R::S - 1) % R::S) * R::STAGE_WORDS * 4), gp);
                cp_async_commit();  // always a group, possibly empty: uniform counts across lanes and steps
                gp += row_words;
                uint32_t w[NT][W::NW];
                slot_words(rp, j, w);
                step_mma(step, w, xs_lane, xs_mb_bytes, acc, dsum);
            }
        }
        cp_async_wait<0>();  // no copy may still target the ring when the warp moves on
    }

    // TR: one tile's A fragment (Ŵᵀ: decode_lane's half2 reordered {f0, f2, f1, f3}) from its window words
    __device__ __forceinline__ void decode_tile_tr(uint32_t (&w)[W::NW], uint32_t (&fr)[4]) const {
        W::align(lane, w);
        __half2 f[4];
        decode_lane<K, CB>(w, f);
        fr[0] = h2_bits(f[0]);
        fr[1] = h2_bits(f[2]);
        fr[2] = h2_bits(f[1]);
        fr[3] = h2_bits(f[3]);
    }

    // TR: x's B fragment of k tile `step` (rows lane&7, column half (lane>>3)&1, see run)
    __device__ __forceinline__ void x_frag_tr(int step, uint32_t xs_lane, uint32_t& b0, uint32_t& b1) const {
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(b0), "=r"(b1)
                     : "r"(xs_lane + (uint32_t)step * 32u));
    }

    // ---- pre-decoding (TR only): the first PD k tiles decoded before the caller's x exists.
    // The fused linear calls predecode between its trellis requests and griddepcontrol.wait, so the
    // integer work of those tiles runs while the kernel before it drains (run_pd then only multiplies).

    // The A fragments of this warp's NT tiles
    __device__ __forceinline__ void decode_tr(uint32_t (&w)[NT][W::NW], uint32_t (&fr)[NT][4]) const {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) decode_tile_tr(w[nt], fr[nt]);
    }

    // x's B fragment of k tile `step` and one mma per n tile (the TR arithmetic of step_mma)
    __device__ __forceinline__ void mma_tr(int step, const uint32_t (&fr)[NT][4], uint32_t xs_lane,
                                           float (&acc)[MB][NT][2][4]) const {
        uint32_t b0, b1;
        x_frag_tr(step, xs_lane, b0, b1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_16816(acc[0][nt][0], fr[nt], b0, b1);
    }

    // the lane's window words of k tile `j` (ring slot j % S) from the slot-0 pointers rp
    __device__ __forceinline__ void slot_words(const uint32_t* const (&rp)[W::NW], int j, uint32_t (&w)[NT][W::NW]) const {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < W::NW; ++i) w[nt][i] = rp[i][(j % R::S) * R::STAGE_WORDS + nt * R::TILE_WORDS];
    }

    __device__ __forceinline__ void slot0_pointers(const uint32_t* (&rp)[W::NW]) const {
        const int i0 = lane_start_bit(K, lane) >> 5;
#pragma unroll
        for (int i = 0; i < W::NW; ++i) rp[i] = ring + (i0 + i) % R::TILE_WORDS;
    }

    // Pre-decoding's start(): the whole chunk (steps <= S, the launcher's condition) requested at once,
    // one group per slot (S groups, some possibly empty), so that predecode can wait for its first PD.
    __device__ __forceinline__ void start_all() const {
#pragma unroll
        for (int s = 0; s < R::S; ++s) issue(s, s);
    }

    // After start_all(): wait for the first PD k tiles (PD <= S) and decode them into fr.
    template <int PD>
    __device__ __forceinline__ void predecode(uint32_t (&fr)[PD][NT][4]) const {
        static_assert(TR && PD >= 1 && PD <= R::S, "pre-decoding serves the transposed form, PD <= S");
        cp_async_wait<R::S - PD>();
        __syncwarp();
        const uint32_t* rp[W::NW];
        slot0_pointers(rp);
#pragma unroll
        for (int j = 0; j < PD; ++j) {
            if (j >= steps) break;
            uint32_t w[NT][W::NW];
            slot_words(rp, j, w);
            decode_tr(w, fr[j]);
        }
    }

    // run() for a chunk of at most S k tiles, all requested by start_all(), whose first PD were
    // pre-decoded into fr: the rest are decoded from the ring, then every tile meets x.
    template <int PD>
    __device__ __forceinline__ void run_pd(uint32_t xs_lane, float (&acc)[MB][NT][2][4],
                                           const uint32_t (&fr)[PD][NT][4]) const {
        static_assert(TR && PD >= 1 && PD <= R::S, "pre-decoding serves the transposed form, PD <= S");
        cp_async_wait<0>();  // the tiles beyond PD (none in flight when PD = S: a no-op)
        __syncwarp();
        const uint32_t* rp[W::NW];
        slot0_pointers(rp);
#pragma unroll
        for (int j = 0; j < R::S; ++j) {
            if (j >= steps) break;
            if (j < PD) {
                mma_tr(j, fr[j < PD ? j : 0], xs_lane, acc);
            } else {
                uint32_t w[NT][W::NW];
                slot_words(rp, j, w);
                uint32_t f[NT][4];
                decode_tr(w, f);
                mma_tr(j, f, xs_lane, acc);
            }
        }
    }
};

// Each warp owns GEMM_NT adjacent n tiles and a run of kt_per_warp k tiles; MB m16 blocks of rows.
template <int K, int CB, int MB>
__global__ void __launch_bounds__(GEMM_WARPS * 32) gemm_kernel(GemmArgs p) {
    constexpr int NT = GEMM_NT;
    constexpr int WARPS = GEMM_WARPS;
    constexpr int S = ring_stages(K);
    using R = Ring<K, S, NT>;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * WARPS + warp;
    const int n_groups = p.n_tiles / NT;
    const int ng = gw % n_groups;
    const int kt0 = (gw / n_groups) * p.kt_per_warp;
    if (kt0 >= p.k_tiles) return;
    const int kt1 = min(kt0 + p.kt_per_warp, p.k_tiles);
    const int q = lane & 3, g = lane >> 2;
    const long kdim = (long)p.k_tiles * 16;

    __shared__ __align__(16) uint32_t ring[WARPS * R::WARP_WORDS];
    const long tile_words = 8 * K;
    const DecodeMmaLoop<K, CB, MB, false, false, S, NT> loop{
        p.trellis + ((long)kt0 * p.n_tiles + (long)ng * NT) * tile_words, (long)p.n_tiles * tile_words, kt1 - kt0,
        ring + warp * R::WARP_WORDS, lane};
    loop.start();  // the trellis requests overlap the x staging below

    float acc[MB][NT][2][4];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int nb = 0; nb < 2; ++nb)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[mb][nt][nb][i] = 0.f;
    __half2 unused = __float2half2_rn(0.f);

    // The block's warps share one k chunk (n_groups is a multiple of WARPS): stage the x rows
    // of this launch's row chunk for that k range in shared memory once (rows past m as zeros), so
    // the loop reads its A fragments with ldmatrix instead of global loads.
    constexpr int XS = X_STAGE_STRIDE;
    __shared__ __align__(16) __half xs[MB * 16 * XS];
    {
        const int cols = (kt1 - kt0) * 16;
        for (int i = threadIdx.x; i < MB * 16 * (cols / 8); i += WARPS * 32) {
            const int r = i / (cols / 8), c = (i % (cols / 8)) * 8;
            const int row = p.m0 + r;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (row < p.m) v = __ldg(reinterpret_cast<const uint4*>(p.x + (long)row * kdim + (long)kt0 * 16 + c));
            *reinterpret_cast<uint4*>(&xs[r * XS + c]) = v;
        }
        __syncthreads();
    }
    // ldmatrix.x4 row addresses: lane l -> row l%16 of the m16 block, 8-col half l/16
    const uint32_t xs_lane = (uint32_t)__cvta_generic_to_shared(&xs[(lane & 15) * XS + (lane >> 4) * 8]);
    loop.run(xs_lane, 16 * XS * 2, acc, unused);

    const long ndim = (long)p.n_tiles * 16;
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = p.m0 + mb * 16 + g + 8 * h;
            if (row >= p.m) continue;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int nb = 0; nb < 2; ++nb) {
                    const long col = ((long)ng * NT + nt) * 16 + nb * 8 + 2 * q;
                    float* dst = p.z + (long)row * ndim + col;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                    atomicAdd(reinterpret_cast<float2*>(dst), make_float2(acc[mb][nt][nb][2 * h], acc[mb][nt][nb][2 * h + 1]));
#else
                    atomicAdd(dst, acc[mb][nt][nb][2 * h]);
                    atomicAdd(dst + 1, acc[mb][nt][nb][2 * h + 1]);
#endif
                }
        }
}

// ------------------------------------------------------------------ host-side launchers

// Launch kern<<<grid, block, 0, st>>>(a) as a programmatic dependent of the previous kernel on the
// stream (Hopper PDL: it may start before that kernel completes; exl3_core/kernels/pdl.py)
template <class Kern, class Arg>
inline cudaError_t launch_as_dependent(Kern kern, unsigned grid, unsigned block, cudaStream_t st, const Arg& a) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kern, a);
}

// k tiles per warp so that the grid is about one full wave of resident warps (all warps of a GEMM
// do equal work, so a single wave has no tail); the x rows are re-read once per k chunk.
inline int pick_kt_per_warp(int k_tiles, int n_tiles, long resident_warps, int nt = GEMM_NT) {
    const long n_groups = n_tiles / nt;
    long chunks = resident_warps / (n_groups > 0 ? n_groups : 1);
    if (chunks < 1) chunks = 1;
    long kt = (k_tiles + chunks - 1) / chunks;
    if (kt < 2) kt = 2;
    if (kt > GEMM_KT_MAX) kt = GEMM_KT_MAX;
    return (int)(kt > k_tiles ? (k_tiles > 0 ? k_tiles : 1) : kt);
}

template <int K, int CB>
void launch_reconstruct_t(const uint32_t* trellis, __half* out, int k_tiles, int n_tiles, cudaStream_t st) {
    const long tiles = (long)k_tiles * n_tiles;
    const long warps = (tiles + RECON_RT - 1) / RECON_RT;
    reconstruct_kernel<K, CB><<<(unsigned)((warps + 7) / 8), 256, 0, st>>>(trellis, out, k_tiles, n_tiles);
}

struct LaunchShape {
    unsigned blocks, threads;  // a 1-D grid and its block size
};

// gemm_kernel's launch for a.kt_per_warp
inline LaunchShape gemm_launch_shape(const GemmArgs& a) {
    const long chunks = (a.k_tiles + a.kt_per_warp - 1) / a.kt_per_warp;
    const long warps = (a.n_tiles / GEMM_NT) * chunks;
    return {(unsigned)((warps + GEMM_WARPS - 1) / GEMM_WARPS), (unsigned)(GEMM_WARPS * 32)};
}

// fills a.kt_per_warp when <= 0 (about one wave of resident warps); at most GEMM_KT_MAX (the x staging)
template <int K, int CB, int MB>
inline void gemm_pick_kt(GemmArgs& a) {
    if (a.kt_per_warp <= 0) {
        static int occ = -1;  // resident blocks per SM for this instantiation (same on every H-class device)
        if (occ < 0) {
            int o = 0;
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, gemm_kernel<K, CB, MB>, GEMM_WARPS * 32, 0);
            occ = o > 0 ? o : 1;
        }
        int dev = 0, sms = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        a.kt_per_warp = pick_kt_per_warp(a.k_tiles, a.n_tiles, (long)sms * occ * GEMM_WARPS, GEMM_NT);
    }
    if (a.kt_per_warp > GEMM_KT_MAX) a.kt_per_warp = GEMM_KT_MAX;
}

template <int K, int CB, int MB>
int launch_gemm_t(GemmArgs a, cudaStream_t st) {
    gemm_pick_kt<K, CB, MB>(a);
    const LaunchShape ls = gemm_launch_shape(a);
    gemm_kernel<K, CB, MB><<<ls.blocks, ls.threads, 0, st>>>(a);
    return a.kt_per_warp;
}

// dispatch over K for a fixed codebook; mb: 1 or 2 m16 row blocks
template <int CB>
int dispatch_gemm(int K, int mb, const GemmArgs& a, cudaStream_t st) {
#define EXL3_GEMM_CASE(KK)                                   \
    case KK:                                                 \
        if (mb == 1) return launch_gemm_t<KK, CB, 1>(a, st); \
        return launch_gemm_t<KK, CB, 2>(a, st);
    switch (K) {
        EXL3_GEMM_CASE(1) EXL3_GEMM_CASE(2) EXL3_GEMM_CASE(3) EXL3_GEMM_CASE(4)
        EXL3_GEMM_CASE(5) EXL3_GEMM_CASE(6) EXL3_GEMM_CASE(7) EXL3_GEMM_CASE(8)
        default: return 0;
    }
#undef EXL3_GEMM_CASE
}

template <int CB>
void dispatch_reconstruct(int K, const uint32_t* trellis, __half* out, int k_tiles, int n_tiles, cudaStream_t st) {
    switch (K) {
        case 1: launch_reconstruct_t<1, CB>(trellis, out, k_tiles, n_tiles, st); break;
        case 2: launch_reconstruct_t<2, CB>(trellis, out, k_tiles, n_tiles, st); break;
        case 3: launch_reconstruct_t<3, CB>(trellis, out, k_tiles, n_tiles, st); break;
        case 4: launch_reconstruct_t<4, CB>(trellis, out, k_tiles, n_tiles, st); break;
        case 5: launch_reconstruct_t<5, CB>(trellis, out, k_tiles, n_tiles, st); break;
        case 6: launch_reconstruct_t<6, CB>(trellis, out, k_tiles, n_tiles, st); break;
        case 7: launch_reconstruct_t<7, CB>(trellis, out, k_tiles, n_tiles, st); break;
        case 8: launch_reconstruct_t<8, CB>(trellis, out, k_tiles, n_tiles, st); break;
        default: break;
    }
}

}  // namespace exl3
