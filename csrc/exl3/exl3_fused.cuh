// One-launch EXL3 linear for decode (m <= 16, one m16 row block; m <= 8 takes the transposed main loop,
// one mma per tile, see exl3_kernels.cuh): input Hadamard, on-the-fly-decode
// split-k GEMM and output Hadamard in a single kernel (format spec 4.3, same rounding as the
// had128 -> gemm_xh -> had128 chain). Included by exl3_cb{0,1,2}.cu (one codebook per file).
//
// Grid: each block covers 128 output columns (warps_for(NT) warps x NT n tiles x 16) of one
// problem and one k chunk of kt_per_chunk k tiles (any count: the prologue transforms each 128-column
// Hadamard block of x the chunk overlaps and keeps the chunk's part). Up to FUSED_MAX_PROBLEMS
// independent problems sharing x, K and codebook (q/k/v, gate/up) run in one launch, each owning a
// contiguous range of blocks.
//
// Workspace protocol (what makes the op CUDA-graph capturable with no memset node): z (fp32) and
// the per-128-column arrival counters are all zero between launches. Every block adds its partial
// sums into z with atomics, fences, and bumps its column block's counter; the block that brings it
// to the number of k chunks reads the finished z tile, writes y, and puts zeros back in z and in
// the counter. Launches on one stream are serialized, so the next launch sees a clean workspace.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "exl3_decode.cuh"
#include "exl3_kernels.cuh"
#include "tuning.cuh"

namespace exl3 {

constexpr int FUSED_MAX_PROBLEMS = 3;
constexpr int FUSED_COLS = BLOCK_TILES * 16;  // output columns per block
static_assert(FUSED_COLS == 128, "the fused epilogue Hadamard needs blocks of exactly 128 columns");

struct FusedProblem {
    const uint32_t* trellis;  // [k/16, n/16, 8K] uint32
    const __half* suh;        // [k] fp16
    const __half* svh;        // [n] fp16
    __half* y;                // [m, n] fp16
    float* z;                 // workspace slice [16, n] fp32 (rows < m used), zero between launches
    int* counters;            // workspace slice [n / 128], zero between launches
    int n_tiles;              // n / 16
    int block0;               // first blockIdx.x of this problem
};

// Gated activation applied to the input in the prologue (FusedArgs::gate): x := fp16(act(gate) * x),
// fp32 math and one rounding, as the separate act*mul kernel (exl3_core/kernels/fused.py, ACTS)
constexpr int FUSED_ACT_SILU = 0;
constexpr int FUSED_ACT_GELU_TANH = 1;

// act(g) * u in fp32, rounded once to fp16: silu(g) = g sigmoid(g); gelu_tanh(g) = g sigmoid(2 c (g + 0.044715 g^3))
// with c = sqrt(2/pi) (0.5 (1 + tanh t) == sigmoid(2t))
__device__ __forceinline__ __half fused_act_mul(__half gh, __half uh, int act) {
    const float g = __half2float(gh);
    const float t = act == FUSED_ACT_GELU_TANH ? 2.f * 0.7978845608028654f * (g + 0.044715f * g * g * g) : g;
    return __float2half_rn(g * (1.f / (1.f + __expf(-t))) * __half2float(uh));
}

struct FusedArgs {
    const __half* x;  // [m, x_cols] fp16, row-major
    // x's width: k (= k_tiles * 16), or the layer's unpadded input width (a multiple of 4 within 128 of k),
    // whose missing columns read as zeros: the same product as x padded with zeros, without the pad's launch
    int x_cols;
    const __half* gate;  // nullptr, or [m, k] fp16: the input is act(gate) * x (a gated MLP's down projection)
    int act;             // FUSED_ACT_* when gate is set
    int m, k_tiles;
    int kt_per_chunk;  // k tiles per block (1..GEMM_KT_MAX); <= 0: the launcher picks (pick_kt_per_chunk)
    int n_problems;
    FusedProblem p[FUSED_MAX_PROBLEMS];
    // Deferred RMSNorm of the input (a pre-norm block's norm, moved into the linear after it): with
    // norm_ss set, x is the unnormalised residual stream h and the prologue uses
    // fp16(fp32(h) * rsqrt(norm_ss[r] * norm_inv_dim + norm_eps) * (norm_w + norm_offset)), the norm
    // kernel's math (exl3_core/kernels/fused.py). norm_ss [m]: h's row sums of squares, added up by
    // the linear that produced h (res_ss below); norm_w [x_cols] fp32 or nullptr (no weight).
    const float* norm_ss;
    const float* norm_w;
    float norm_eps, norm_offset, norm_inv_dim;
    // Residual producer (one problem): y = fp16(res + y) with the same rounding as the stream's
    // `h = h + y`, and res_ss[r] += Σ over this launch's columns of y[r]² (fp32 atomics, one per row and
    // 128 columns; res_ss must be zero before the launch). The next linear's prologue normalises
    // with it, so no norm kernel runs between the two.
    const __half* res;  // nullptr: plain output; else [m, res_cols] fp16
    float* res_ss;      // with res: [m] fp32
    // with res: the stream's width, n or the layer's unpadded output width (a multiple of 4 within 128 of
    // n); y is then [m, res_cols] too, and the columns past it are neither read, stored nor summed
    int res_cols;
    // Attention's RoPE and KV-cache write in q/k/v's epilogue (problems in rope_mask / with a cache): row r's
    // heads of rope_head = 2 * rope_half columns (32, 64 or 128, rotary over the whole head) are rotated
    // by the fp32 tables rope_cos/rope_sin [m, rope_half] (halves, or adjacent pairs if
    // rope_interleaved), the rotation kernel's math (exl3_core/kernels/fused.py) on the fp16 output,
    // rounded once more to fp16; slots [m]: each row's flat cache slot.
    const float* rope_cos;
    const float* rope_sin;
    int rope_half, rope_interleaved;
    int rope_mask;                          // bit i: rotate problem i's heads
    __half* cache[FUSED_MAX_PROBLEMS];      // nullptr, or a KV cache [slots, cache_ld_i] fp16 that problem i's row r also goes to
    int cache_ld[FUSED_MAX_PROBLEMS];       // a cache slot's width: n_i, or the layer's unpadded width (a multiple of 4
                                            // within 128 of n_i), whose columns alone are stored
    const int64_t* slots;                   // [m] each row's cache slot
    // (kept out of FusedProblem: fields there are selected per block before the main loop and cost
    // registers across it; these are read in the epilogue only, with constant indices)
    // Workspace for x transformed once per launch, problem i's [m, k] fp16 at xh_buf + i m k:
    // fp16(Had128(fp16(x' * suh_i))) with x' the prologue's input (gated, normalised). From xh_min_rows
    // rows (0: never) the launcher runs fused_xh_kernel first and the linear's XH variant, whose blocks
    // copy their chunk instead of each transforming it again; nullptr: every block transforms its chunk.
    __half* xh_buf;
    int xh_min_rows;
    // programmatic dependent launch (Hopper): the grid may start while the previous kernel on the
    // stream is still finishing; it prefetches (and, pre-decoding, decodes) trellis words, which nothing
    // before it writes, then waits (griddepcontrol.wait) before touching x or the workspace. The kernel
    // always signals its own dependents (a no-op when none is launched as one): after its main loop, or at
    // its start (pd_early). sm_90 or newer only.
    bool pdl;
    // a pre-decoding launch (PD > 0) signals its dependent at its start instead of after its main loop, so
    // that the dependent's early blocks decode their own weights meanwhile (the launcher sets it from
    // predecode)
    bool pd_early;
    // Host side, read by the launcher only (after the kernel's fields, so that their parameter offsets stay):
    // pre-decoding of short chunks (PD_TILES): 0 off, 1 on with the dependent signalled after the main loop,
    // 2 on with the signal at the kernel's start; and the longest chunk a pre-decoding launch takes (0: its
    // ring's length). Per launch, from the caller's options (exl3_ops.cu: the ops' `launch` argument).
    int predecode;
    int predecode_max_kt;
};

__device__ __forceinline__ uint2 pack_half4(const __half (&h)[4]) {
    uint2 u;
    u.x = h2_bits(__halves2half2(h[0], h[1]));
    u.y = h2_bits(__halves2half2(h[2], h[3]));
    return u;
}

// Whether a fused kernel signals its programmatic dependent at its start rather than after its main loop:
// only a pre-decoding launch (PD > 0) asked to, whose dependent's early blocks then decode their own weights.
__host__ __device__ constexpr bool pdl_trigger_early(int pd, bool pd_early) { return pd > 0 && pd_early; }

// The deep ring of one fused variant: the default S of fused_linear_kernel and fused_occupancy, so that the
// launcher's choice and its occupancy query cannot disagree.
constexpr int fused_ring(int K, bool TR) { return TR ? tr_ring_stages(K) : ring_stages(K); }

// n tiles per warp of a fused variant: the transposed loop without pre-decoding takes TR_NT, pre-decoding
// and the m16 loop GEMM_NT (pre-decoding holds 4 fragment registers per tile and would double them)
constexpr int fused_nt(bool TR, int PD) { return TR && PD == 0 ? TR_NT : GEMM_NT; }
// the ring (the block's 8 n tiles x S stages, whatever the warps) and the x stage
template <int K, bool TR, int S = ring_stages(K)>
constexpr int fused_smem_bytes() {
    return BLOCK_TILES * S * 8 * K * 4 + (TR ? 8 : 16) * X_STAGE_STRIDE * 2 + 16;
}
// resident blocks per SM asked of ptxas: for the transposed kernel FUSED_TR_MIN_BLOCKS, capped by what
// shared memory admits (1 KB reserved per block); the m16 kernel leaves it to ptxas
template <int K, bool TR, int S = ring_stages(K)>
constexpr int fused_min_blocks() {
    if (!TR) return 1;
    const int by_smem = (228 * 1024) / (fused_smem_bytes<K, TR, S>() + 1024);
    return by_smem < FUSED_TR_MIN_BLOCKS ? by_smem : FUSED_TR_MIN_BLOCKS;
}

// RoPE on a lane's 4 consecutive output columns of row r (d0: the first one's column within its head):
// halves pair column d with d + rope_half, held by the lane rope_half / 4 away (a shuffle); interleaved
// pairs are adjacent columns of the same lane. Every lane of the warp calls rope_apply (the shuffle).
// The tables are loaded apart (rope_tables) so that their loads share the z load's round trip.
__device__ __forceinline__ void rope_tables(const FusedArgs& a, int r, int d0, float (&c)[4], float (&s)[4]) {
    const long row = (long)r * a.rope_half;
    if (a.rope_interleaved) {  // pairs (d0, d0 + 1), (d0 + 2, d0 + 3): entries d0 / 2 and d0 / 2 + 1
#pragma unroll
        for (int j = 0; j < 2; ++j) c[j] = __ldg(a.rope_cos + row + d0 / 2 + j), s[j] = __ldg(a.rope_sin + row + d0 / 2 + j);
        c[2] = c[3] = s[2] = s[3] = 0.f;
        return;
    }
    const long i0 = row + (d0 < a.rope_half ? d0 : d0 - a.rope_half);
#pragma unroll
    for (int j = 0; j < 4; ++j) c[j] = __ldg(a.rope_cos + i0 + j), s[j] = __ldg(a.rope_sin + i0 + j);
}

__device__ __forceinline__ void rope_apply(const FusedArgs& a, int d0, const float (&c)[4], const float (&s)[4],
                                           __half (&h)[4]) {
    if (a.rope_interleaved) {
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
            const float e = __half2float(h[j]), o = __half2float(h[j + 1]);
            h[j] = __float2half_rn(e * c[j / 2] - o * s[j / 2]);
            h[j + 1] = __float2half_rn(o * c[j / 2] + e * s[j / 2]);
        }
        return;
    }
    const bool lower = d0 < a.rope_half;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float x = __half2float(h[j]);
        const float p = __shfl_xor_sync(0xffffffffu, x, a.rope_half / 4);  // the pair's other column
        h[j] = __float2half_rn(lower ? x * c[j] - p * s[j] : x * c[j] + p * s[j]);
    }
}

// One prologue item: x' = (gate ? act(gate) * x : x), normalised if deferred, times suh, Hadamard over
// the 128 columns of row r whose lane's 4 start at gc, rounded to fp16. The fused linear's prologue and
// fused_xh_kernel share it (the same arithmetic bit for bit).
__device__ __forceinline__ uint2 prologue_item(const FusedArgs& a, const __half* suh, int r, long gc, int lane) {
    const bool in = gc < a.x_cols;  // a lane's 4 columns are all in x or all past its width (x_cols % 4 == 0)
    uint2 xu = make_uint2(0u, 0u);
    if (in) xu = __ldg(reinterpret_cast<const uint2*>(a.x + (long)r * a.x_cols + gc));
    if (a.gate != nullptr && in) {  // the gated MLP's act(gate) * up, fused here instead of its own launch
        const uint2 gu = __ldg(reinterpret_cast<const uint2*>(a.gate + (long)r * a.x_cols + gc));
        const __half2 g0 = bits_h2(gu.x), g1 = bits_h2(gu.y), u0 = bits_h2(xu.x), u1 = bits_h2(xu.y);
        xu.x = h2_bits(__halves2half2(fused_act_mul(__low2half(g0), __low2half(u0), a.act),
                                      fused_act_mul(__high2half(g0), __high2half(u0), a.act)));
        xu.y = h2_bits(__halves2half2(fused_act_mul(__low2half(g1), __low2half(u1), a.act),
                                      fused_act_mul(__high2half(g1), __high2half(u1), a.act)));
    }
    if (a.norm_ss != nullptr) {  // the deferred RMSNorm (fp32 math, one rounding, as the norm kernel)
        const float rs = rsqrtf(__ldcg(a.norm_ss + r) * a.norm_inv_dim + a.norm_eps);
        float4 w = make_float4(1.f, 1.f, 1.f, 1.f);
        if (a.norm_w != nullptr && in) {
            w = __ldg(reinterpret_cast<const float4*>(a.norm_w + gc));
            w.x += a.norm_offset, w.y += a.norm_offset, w.z += a.norm_offset, w.w += a.norm_offset;
        }
        const __half2 h0 = bits_h2(xu.x), h1 = bits_h2(xu.y);
        xu.x = h2_bits(__floats2half2_rn(__low2float(h0) * rs * w.x, __high2float(h0) * rs * w.y));
        xu.y = h2_bits(__floats2half2_rn(__low2float(h1) * rs * w.z, __high2float(h1) * rs * w.w));
    }
    const uint2 su = __ldg(reinterpret_cast<const uint2*>(suh + gc));
    const __half2 p0 = __hmul2(bits_h2(xu.x), bits_h2(su.x));  // fp16 product, as had128's pre-scale
    const __half2 p1 = __hmul2(bits_h2(xu.y), bits_h2(su.y));
    float v[4] = {__low2float(p0), __high2float(p0), __low2float(p1), __high2float(p1)};
    had128_warp(v, lane);
    __half h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __float2half_rn(v[j]);
    return pack_half4(h);
}

// x transformed once per launch for every problem (FusedArgs::xh_buf), one warp per (problem, row,
// 128 columns), because at m rows every block of the fused linear would otherwise repeat m x (its chunk's
// 128-column blocks) of these transforms. Launched as a programmatic dependent just before the fused
// linear (which waits for it).
// DUMMY: a template, so each translation unit including this header has its own weak instance.
template <int DUMMY>
__global__ void __launch_bounds__(128) fused_xh_kernel(FusedArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (a.pdl) {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the linear prefetches its trellis now
    }
#endif
    const int lane = threadIdx.x & 31;
    const long kdim = (long)a.k_tiles * 16;
    const int kb = a.k_tiles / 8;
    const int item = (int)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (item >= a.n_problems * a.m * kb) return;
    const int pi = item / (a.m * kb), r = (item / kb) % a.m;
    const long gc = (long)(item % kb) * 128 + 4 * lane;
    const __half* suh = pi == 0 ? a.p[0].suh : pi == 1 ? a.p[1].suh : a.p[2].suh;
    const uint2 h = prologue_item(a, suh, r, gc, lane);
    *reinterpret_cast<uint2*>(a.xh_buf + ((long)pi * a.m + r) * kdim + gc) = h;
}

// TR: m <= 8, transposed main loop (one mma per tile; exl3_kernels.cuh)
// XH: the prologue copies x transformed once for the launch (FusedArgs::xh_buf, fused_xh_kernel); a
// variant of its own, so that the kernels without it keep their registers (a runtime branch spilled)
// S: trellis ring stages (fused_ring by default; SHORT_RING for short k chunks, launch_fused_t)
// PD: the k tiles decoded before griddepcontrol.wait (pre-decoding, TR only: the whole chunk, <= S tiles, is
// requested at once; its first PD tiles are decoded into registers)
// NT: n tiles per warp (fused_nt), so warps_for(NT) warps per block
template <int K, int CB, bool TR, bool XH = false, int S = fused_ring(K, TR), int PD = 0, int NT = fused_nt(TR, PD)>
__global__ void __launch_bounds__(warps_for(NT) * 32, (PD > 0 ? PD_MIN_BLOCKS : fused_min_blocks<K, TR, S>()))
    fused_linear_kernel(FusedArgs a) {
    constexpr int WARPS = warps_for(NT);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int q = lane & 3, g = lane >> 2;

    // which problem / column block / k chunk this block owns; constant indices keep the problem
    // table in the parameter bank (a runtime index would copy it to local memory)
    static_assert(FUSED_MAX_PROBLEMS == 3, "update the problem selection below");
    FusedProblem P = a.p[0];
    if (a.n_problems > 1 && (int)blockIdx.x >= a.p[1].block0) P = a.p[1];
    if (a.n_problems > 2 && (int)blockIdx.x >= a.p[2].block0) P = a.p[2];
    const int n_blocks = P.n_tiles / BLOCK_TILES;
    const int b = (int)blockIdx.x - P.block0;
    const int cblk = b % n_blocks;
    const int chunk = b / n_blocks;
    const int kt0 = chunk * a.kt_per_chunk;
    const int kt1 = min(kt0 + a.kt_per_chunk, a.k_tiles);
    const int chunks = (a.k_tiles + a.kt_per_chunk - 1) / a.kt_per_chunk;
    const long kdim = (long)a.k_tiles * 16;
    const long ndim = (long)P.n_tiles * 16;

    // ---- trellis stream of this warp (the main loop shared with gemm_kernel, exl3_kernels.cuh); the
    // first k tiles are requested now so that their latency overlaps the x prologue
    using R = Ring<K, S, NT>;
    __shared__ __align__(16) uint32_t ring[WARPS * R::WARP_WORDS];
    const int ng = cblk * WARPS + warp;  // this warp's NT-tile group
    const long tile_words = 8 * K;
    const DecodeMmaLoop<K, CB, 1, false, TR, S, NT> loop{P.trellis + ((long)kt0 * P.n_tiles + (long)ng * NT) * tile_words,
                                              (long)P.n_tiles * tile_words, kt1 - kt0, ring + warp * R::WARP_WORDS,
                                              lane};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // a programmatic dependent launched after this grid (exl3_core/kernels/pdl.py) may start now;
    // it waits for this grid's completion before it reads y
    if (pdl_trigger_early(PD, a.pd_early)) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    // pre-decoding: the chunk's first PD tiles decoded now, while the kernel before this one still runs
    uint32_t pre[PD > 0 ? PD : 1][NT][4];
    if constexpr (PD > 0) {
        loop.start_all();
        loop.template predecode<PD>(pre);
    } else {
        loop.start();
    }
    // Everything below may read what the previous kernel on the stream wrote (x, the workspace that
    // the previous fused launch cleaned): wait for it. A no-op when not launched as a dependent.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif

    // ---- prologue: xs = fp16(Had128(fp16(x * suh))) for this k chunk. Rows m..15 are left as they
    // are: row r of the mma's A only reaches output row r, and rows >= m are never stored.
    constexpr int XS = X_STAGE_STRIDE;
    __shared__ __align__(16) __half xs[(TR ? 8 : 16) * XS];  // TR: only rows < m <= 8 are read
    __shared__ int s_last;
    {
        // the chunk need not start or end on a 128-column Hadamard block (any k tiles per chunk): every
        // block it overlaps is transformed whole and only the chunk's columns are kept
        const int cols = (kt1 - kt0) * 16;
        const int c0 = kt0 * 16;
        const int hb0 = c0 / 128;
        const int hb = (c0 + cols + 127) / 128 - hb0;
        if constexpr (XH) {  // x transformed once for the launch (fused_xh_kernel): copy the chunk's columns
            const int pi = (a.n_problems > 2 && (int)blockIdx.x >= a.p[2].block0) ? 2
                           : (a.n_problems > 1 && (int)blockIdx.x >= a.p[1].block0) ? 1 : 0;
            const __half* xh = a.xh_buf + (long)pi * a.m * kdim + c0;
            const int q8 = cols / 8;  // 16-byte pieces per row
            // asynchronous copies (no registers held while in flight); waiting for all groups also waits
            // for the ring's first stages, requested before griddepcontrol.wait and landed by now
            for (int i = threadIdx.x; i < a.m * q8; i += WARPS * 32) {
                const int r = i / q8, c = (i - r * q8) * 8;
                cp_async16((uint32_t)__cvta_generic_to_shared(&xs[r * XS + c]), xh + r * kdim + c);
            }
            cp_async_commit();
            cp_async_wait<0>();
        } else {
            for (int i = warp; i < a.m * hb; i += WARPS) {
                const int r = i / hb;
                const long gc = (long)(hb0 + i % hb) * 128 + 4 * lane;
                const int c = (int)(gc - c0);  // a lane's 4 columns are in or out of the chunk together
                const uint2 h = prologue_item(a, P.suh, r, gc, lane);
                if (c >= 0 && c < cols) *reinterpret_cast<uint2*>(&xs[r * XS + c]) = h;
            }
        }
        __syncthreads();
    }
    // ldmatrix row addresses: x4 (A = x): lane -> row lane%16, column half lane/16; x2 (TR, B = xᵀ):
    // lanes 0-15 -> row lane%8, column half (lane/8)%2
    const uint32_t xs_lane = (uint32_t)__cvta_generic_to_shared(
        TR ? &xs[(lane & 7) * XS + ((lane >> 3) & 1) * 8] : &xs[(lane & 15) * XS + (lane >> 4) * 8]);

    float acc[1][NT][2][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[0][nt][nb][i] = 0.f;
    __half2 unused = __float2half2_rn(0.f);
    if constexpr (PD > 0) loop.template run_pd<PD>(xs_lane, acc, pre);
    else loop.run(xs_lane, 0, acc, unused);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (!pdl_trigger_early(PD, a.pd_early)) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif

    // ---- split-k partials into z (fp32 atomics at L2)
    if constexpr (TR) {
        // lane: rows 2q, 2q+1; columns g, g+8 of each of its n tiles
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int row = 2 * q + j;
            if (row >= a.m) continue;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                float* dst = P.z + (long)row * ndim + ((long)ng * NT + nt) * 16 + g;
                atomicAdd(dst, acc[0][nt][0][j]);
                atomicAdd(dst + 8, acc[0][nt][0][2 + j]);
            }
        }
    } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = g + 8 * h;
            if (row >= a.m) continue;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int nb = 0; nb < 2; ++nb) {
                    const long col = ((long)ng * NT + nt) * 16 + nb * 8 + 2 * q;
                    float* dst = P.z + (long)row * ndim + col;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                    atomicAdd(reinterpret_cast<float2*>(dst),
                              make_float2(acc[0][nt][nb][2 * h], acc[0][nt][nb][2 * h + 1]));
#else
                    atomicAdd(dst, acc[0][nt][nb][2 * h]);
                    atomicAdd(dst + 1, acc[0][nt][nb][2 * h + 1]);
#endif
                }
        }
    }

    // ---- last-arriving block of this column block: output Hadamard, then leave the workspace clean.
    // The barrier orders every thread's atomics before thread 0's release fence (fences are cumulative
    // over what the barrier made the thread observe), so one acq_rel fence on each side of the counter
    // publishes the arrival after the block's partials, and the last block's z reads come after it
    // observed every arrival (the barrier again), which is cheaper than a fence.sc in every thread.
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
        const int prev = atomicAdd(P.counters + cblk, 1);
        asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
        s_last = prev == chunks - 1;
    }
    __syncthreads();
    if (!s_last) return;

    const long col0 = (long)cblk * FUSED_COLS + 4 * lane;
    const uint2 sv = __ldg(reinterpret_cast<const uint2*>(P.svh + col0));
    const __half svh4[4] = {__low2half(bits_h2(sv.x)), __high2half(bits_h2(sv.x)), __low2half(bits_h2(sv.y)),
                            __high2half(bits_h2(sv.y))};
    const bool res = a.res != nullptr;
    // an unpadded stream is compiled out of the x-once variants (their 32 registers would spill for it): the
    // launcher takes those for streams of the full width only
    const long yld = !XH && res ? a.res_cols : ndim;     // y's row stride: the stream's width for a residual producer
    const bool col_ok = XH || !res || col0 < a.res_cols;  // a lane's 4 columns are all in the stream or all past it
    for (int r = warp; r < a.m; r += WARPS) {
        // q/k/v's RoPE and cache rows: which problem this block serves (kept off the common path)
        const int pi = (a.n_problems > 2 && (int)blockIdx.x >= a.p[2].block0) ? 2
                       : (a.n_problems > 1 && (int)blockIdx.x >= a.p[1].block0) ? 1 : 0;
        const bool rope = (a.rope_mask >> pi) & 1;
        __half* cache = pi == 0 ? a.cache[0] : pi == 1 ? a.cache[1] : a.cache[2];
        // the x-once variants store whole slots of n only (their 32 registers would spill for a narrower one)
        const long cld = XH ? ndim : pi == 0 ? a.cache_ld[0] : pi == 1 ? a.cache_ld[1] : a.cache_ld[2];
        const int d0 = rope ? (int)(col0 % (2 * a.rope_half)) : 0;
        float4* zp = reinterpret_cast<float4*>(P.z + (long)r * ndim + col0);
        // everything the epilogue reads besides z, loaded before z's values are used: one round trip
        uint2 ru = make_uint2(0u, 0u);
        if (res && col_ok) ru = *reinterpret_cast<const uint2*>(a.res + (long)r * yld + col0);
        const long slot = cache != nullptr ? __ldg(a.slots + r) : 0;
        float rc[4] = {0.f, 0.f, 0.f, 0.f}, rs[4] = {0.f, 0.f, 0.f, 0.f};
        if (rope) rope_tables(a, r, d0, rc, rs);
        const float4 zv = __ldcg(zp);  // L2, where the atomics landed; never a stale L1 line
        float v[4] = {zv.x, zv.y, zv.z, zv.w};
        had128_warp(v, lane);
        __half h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) h[j] = __hmul(__float2half_rn(v[j]), svh4[j]);
        if (rope) rope_apply(a, d0, rc, rs, h);
        if (cache != nullptr && (XH || col0 < cld))
            *reinterpret_cast<uint2*>(cache + slot * cld + col0) = pack_half4(h);
        if (res) {  // residual producer: the stream's add, then this row's partial sum of squares
            const __half rh[4] = {__low2half(bits_h2(ru.x)), __high2half(bits_h2(ru.x)), __low2half(bits_h2(ru.y)),
                                  __high2half(bits_h2(ru.y))};
            float ss = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                h[j] = __hadd(rh[j], h[j]);  // correctly rounded, as fp16(fp32(res) + fp32(y))
                const float f = __half2float(h[j]);
                ss += col_ok ? f * f : 0.f;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (lane == 0) atomicAdd(a.res_ss + r, ss);
        }
        if (col_ok) *reinterpret_cast<uint2*>(P.y + (long)r * yld + col0) = pack_half4(h);
        __stcg(zp, make_float4(0.f, 0.f, 0.f, 0.f));
    }
    if (threadIdx.x == 0) P.counters[cblk] = 0;  // every chunk has arrived: no block of this launch reads it again
}

// ------------------------------------------------------------------ host side

// k tiles per block (any count up to GEMM_KT_MAX): the one minimising a simple cost model, waves of
// resident blocks x (k tiles + a fixed per-block cost of ~4 k tiles for the x prologue and the split-k
// epilogue). A ragged last wave costs a whole wave (its blocks take as long as a full wave's), so
// e.g. 4096x14336 gets 26 k tiles (1,120 blocks, one wave of 1,188) where whole Hadamard blocks only
// allowed 32 (896 blocks, 75% of the slots) or 24 (1,232 blocks: a second wave of 44). Grids of several
// waves (a head's vocabulary) take the same model, since their ragged last wave costs about a wave too.
inline int pick_kt_per_chunk(int k_tiles, long col_blocks, long resident_blocks) {
    if (resident_blocks < 1) resident_blocks = 1;
    const int lo = k_tiles < 8 ? (k_tiles > 0 ? k_tiles : 1) : 8;
    const int hi = k_tiles < GEMM_KT_MAX ? (k_tiles > 0 ? k_tiles : 1) : GEMM_KT_MAX;
    int best = hi;
    long best_cost = -1;
    for (int kt = hi; kt >= lo; --kt) {  // ties go to the larger chunk (fewer atomics, less x re-reading)
        const long chunks = (k_tiles + kt - 1) / kt;
        const long waves = (col_blocks * chunks + resident_blocks - 1) / resident_blocks;
        const long cost = waves * (kt + 4);
        if (best_cost < 0 || cost < best_cost) {
            best_cost = cost;
            best = kt;
        }
    }
    return best;
}

// Whether a transposed launch (m <= 8) transforms x once (FusedArgs::xh_buf, fused_xh_kernel) instead of in
// every block: from min_rows rows (0: never), or at any row count when the output is wide (a head's
// vocabulary: every k chunk of x would be transformed again by each of >= XH_WIDE_COL_BLOCKS column blocks;
// the decoder's narrower linears at one row are faster transforming their own chunk).
// The one test, shared by the launcher and the workspace (exl3_ops.cu).
constexpr long XH_WIDE_COL_BLOCKS = 512;
// the ring of the x-once variant with GEMM_NT tiles per warp (launch_fused_t's xh_few): the m16 loop's depth
constexpr int xh_few_ring(int K) { return ring_stages(K); }
inline bool xh_wanted(int m, int k_tiles, long col_blocks, int min_rows) {
    return min_rows > 0 && m <= 8 && k_tiles % 8 == 0 && (m >= min_rows || col_blocks >= XH_WIDE_COL_BLOCKS);
}

// The instantiations launch_fused_t chooses between, each named once with its block size.
enum FusedVariantId {
    FV_M16,       // m16 main loop (9..16 rows)
    FV_TR,        // transposed main loop (m <= 8), its deep ring
    FV_TR_SHORT,  // transposed, the short ring (chunks of <= SHORT_RING_MAX_KT tiles)
    FV_XH,        // transposed, x transformed once (a head: wide output)
    FV_XH_FEW,    // transposed, x once for the rows, GEMM_NT tiles per warp (xh_few_ring)
    FV_PD,        // transposed, pre-decoding (pd_ring, PD_STEPS)
    FV_COUNT
};
struct FusedVariant {
    void (*kern)(FusedArgs);
    unsigned threads;
};

template <int K, int CB, bool TR, bool XH = false, int S = fused_ring(K, TR), int PD = 0, int NT = fused_nt(TR, PD)>
inline FusedVariant fused_variant_of() {
    return {fused_linear_kernel<K, CB, TR, XH, S, PD, NT>, (unsigned)(warps_for(NT) * 32)};
}

template <int K, int CB>
FusedVariant fused_variant(FusedVariantId id) {
    switch (id) {
        case FV_M16: return fused_variant_of<K, CB, false>();
        case FV_TR: return fused_variant_of<K, CB, true>();
        case FV_TR_SHORT: return fused_variant_of<K, CB, true, false, SHORT_RING>();
        case FV_XH: return fused_variant_of<K, CB, true, true>();
        case FV_XH_FEW: return fused_variant_of<K, CB, true, true, xh_few_ring(K), 0, GEMM_NT>();
        case FV_PD: default: return fused_variant_of<K, CB, true, false, pd_ring(K), PD_STEPS>();
    }
}

// resident blocks per SM of one variant (same on every H-class device; queried once per variant)
template <int K, int CB>
int fused_occupancy(FusedVariantId id) {
    static int occ[FV_COUNT] = {};  // 0: not queried yet
    if (occ[id] == 0) {
        const FusedVariant v = fused_variant<K, CB>(id);
        int o = 0;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, v.kern, (int)v.threads, 0);
        occ[id] = o > 0 ? o : 1;
    }
    return occ[id];
}

// Fills a.kt_per_chunk (when <= 0) and the problems' block0, launches; returns the k tiles per chunk.
template <int K, int CB>
int launch_fused_t(FusedArgs a, cudaStream_t st) {
    const bool tr = a.m <= 8;
    long col_blocks = 0;
    for (int i = 0; i < a.n_problems; ++i) col_blocks += a.p[i].n_tiles / BLOCK_TILES;
    // the x-once variants take a residual stream and cache slots of the full width only (fused_linear_kernel's
    // epilogue)
    bool full_stream = a.res == nullptr || (long)a.res_cols == col_blocks * FUSED_COLS;
    for (int i = 0; i < a.n_problems; ++i)
        full_stream = full_stream && (a.cache[i] == nullptr || a.cache_ld[i] == a.p[i].n_tiles * 16);
    const bool xh = tr && full_stream && a.xh_buf != nullptr && xh_wanted(a.m, a.k_tiles, col_blocks, a.xh_min_rows);
    // x once for the rows (a decoder linear at m >= xh_min_rows), not for the width (a head): 2 n tiles per
    // warp, so that the short chunks' fixed work (x copy, 8 rows' epilogue) has twice the warps.
    const bool xh_few = xh && col_blocks < XH_WIDE_COL_BLOCKS;
    const bool short_ok = tr && !xh && SHORT_RING < tr_ring_stages(K);  // the short ring variant may serve
    // the variant for the rows and width; pre-decoding or the short ring may take its place below
    const FusedVariantId base = xh_few ? FV_XH_FEW : xh ? FV_XH : tr ? FV_TR : FV_M16;
    const bool picked = a.kt_per_chunk <= 0;  // the launcher's choice (a caller's chunk is kept as given)
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (a.kt_per_chunk <= 0) {
        const int occ = fused_occupancy<K, CB>(base);
        a.kt_per_chunk = pick_kt_per_chunk(a.k_tiles, col_blocks, (long)sms * occ);
        if (short_ok && a.kt_per_chunk <= SHORT_RING_MAX_KT) {  // again with the short ring's residency
            const long res = (long)sms * fused_occupancy<K, CB>(FV_TR_SHORT);
            const int kt = pick_kt_per_chunk(a.k_tiles, col_blocks, res);
            if (kt <= SHORT_RING_MAX_KT) a.kt_per_chunk = kt;
        }
    }
    if (a.kt_per_chunk > GEMM_KT_MAX) a.kt_per_chunk = GEMM_KT_MAX;
    auto grid_blocks = [&](int kt) { return col_blocks * ((a.k_tiles + kt - 1) / kt); };
    // pre-decoding: chunks its ring holds whole, in a grid of at most one wave of its (larger) blocks. A
    // launcher-picked chunk whose grid is too large for that grows to the shortest one that fits.
    bool pd = false;
    a.pd_early = a.predecode == 2;
    if (tr && !xh && a.predecode > 0) {
        constexpr int ring = pd_ring(K);
        const int cap = a.predecode_max_kt;
        const int longest = cap > 0 && cap < ring ? cap : ring;
        const long slots = (long)sms * fused_occupancy<K, CB>(FV_PD);
        int kt = a.kt_per_chunk;
        while (picked && kt < longest && grid_blocks(kt) > slots) ++kt;
        pd = kt <= longest && grid_blocks(kt) <= slots;
        if (pd) a.kt_per_chunk = kt;
    }
    const long chunks = (a.k_tiles + a.kt_per_chunk - 1) / a.kt_per_chunk;
    long blocks = 0;
    for (int i = 0; i < a.n_problems; ++i) {
        a.p[i].block0 = (int)blocks;
        blocks += (long)(a.p[i].n_tiles / BLOCK_TILES) * chunks;
    }
    if (blocks <= 0) return a.kt_per_chunk;
    // short_ok implies tr && !xh, so the short ring only ever replaces FV_TR
    const FusedVariant v = fused_variant<K, CB>(pd ? FV_PD
                                                : short_ok && a.kt_per_chunk <= SHORT_RING_MAX_KT ? FV_TR_SHORT
                                                : base);
    if (xh) {  // x transformed once, then the linear (a dependent of this pass, which waits for it)
        const long items = (long)a.n_problems * a.m * (a.k_tiles / 8);
        const unsigned xblocks = (unsigned)((items + 3) / 4);
        if (a.pdl) launch_as_dependent(fused_xh_kernel<0>, xblocks, 128, st, a);
        else fused_xh_kernel<0><<<xblocks, 128, 0, st>>>(a);
    }
    if (!a.pdl) {
        v.kern<<<(unsigned)blocks, v.threads, 0, st>>>(a);
        return a.kt_per_chunk;
    }
    launch_as_dependent(v.kern, (unsigned)blocks, v.threads, st, a);  // errors: cudaGetLastError at the caller
    return a.kt_per_chunk;
}

template <int CB>
int dispatch_fused(int K, const FusedArgs& a, cudaStream_t st) {
    switch (K) {
        case 1: return launch_fused_t<1, CB>(a, st);
        case 2: return launch_fused_t<2, CB>(a, st);
        case 3: return launch_fused_t<3, CB>(a, st);
        case 4: return launch_fused_t<4, CB>(a, st);
        case 5: return launch_fused_t<5, CB>(a, st);
        case 6: return launch_fused_t<6, CB>(a, st);
        case 7: return launch_fused_t<7, CB>(a, st);
        case 8: return launch_fused_t<8, CB>(a, st);
        default: return 0;
    }
}

}  // namespace exl3
