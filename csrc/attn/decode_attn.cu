// Decode attention for short key bounds: one thread block per (sequence, kv head) holds the sequence's
// keys and values in shared memory and finishes the softmax itself, so no partials, no arrival counter
// and no second merge pass. Registered as torch.ops.exl3.decode_attention; the Python side is the backend
// plugins/attn_backends/src/exl3_attn_backends/cuda_decode.py, which sends long bounds to the Triton
// split-KV kernel.
//
// Why: at b=1 the split kernel's merge (partials stored, an arrival atomic, the last program reloading
// every partial) sits on each layer's critical path; with it ablated the 1B-shape step ran 3.3% faster
// (docs/performance.md, run 21). Here the merge is eight warps' states combined through shared memory.
//
// Block: 8 warps. Keys in passes of `cap` (the smem rows; a multiple of 32). Pass 0 is copied with
// cp.async before griddepcontrol.wait: rows of earlier steps and the page table were complete before the
// step began, the newest row (seq - 1, written by the kernel before) is copied after the wait. In a pass,
// warp w takes 32-key blocks w, w + 8, ...: lane = key for the scores (the row's 16-byte pieces XOR-
// swizzled by row & 7 against bank conflicts), an online softmax per warp in fp32 (base 2, q pre-scaled
// by scale * log2 e), then lane = channels for P.V. The eight warps' (m, l, acc) are merged at the end.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>

namespace exl3_attn {

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int MAX_GROUP = 8;  // query heads per kv head

struct DecodeArgs {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const int* page_table;
    const int* cu_q;
    const int* seq_k;
    long long q_t, q_h, k_p, k_s, k_h, v_p, v_s, v_h, o_t, o_h, pt_b;
    int page_size, group, cap;
    float qscale;  // softmax scale * log2(e)
};

template <class T> __device__ __forceinline__ float2 to_f2(uint32_t w);
template <> __device__ __forceinline__ float2 to_f2<__half>(uint32_t w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
template <> __device__ __forceinline__ float2 to_f2<__nv_bfloat16>(uint32_t w) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
template <class T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Element offset of channel piece c (8 channels) of smem row r: pieces XOR-swizzled by r & 7, so 8
// lanes reading the same piece of 8 consecutive rows hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int smem_at(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

// Copy the cache rows of positions pos0 + [r0, r1) into smem rows [r0, r1), asynchronously.
template <int D>
__device__ __forceinline__ void copy_rows(const DecodeArgs& a, int b, int kvh, int pos0, int r0, int r1,
                                          uint16_t* ks, uint16_t* vs) {
    constexpr int P = D / 8;
    const char* kb = static_cast<const char*>(a.k);
    const char* vb = static_cast<const char*>(a.v);
    const int* pt = a.page_table + (long long)b * a.pt_b;
    for (int i = threadIdx.x; i < (r1 - r0) * P; i += THREADS) {
        const int r = r0 + i / P, c = i % P, pos = pos0 + r;
        const long long page = pt[pos / a.page_size];
        const long long slot = pos % a.page_size;
        cp_async16(ks + smem_at<D>(r, c), kb + 2 * (page * a.k_p + slot * a.k_s + kvh * a.k_h + c * 8));
        cp_async16(vs + smem_at<D>(r, c), vb + 2 * (page * a.v_p + slot * a.v_s + kvh * a.v_h + c * 8));
    }
}

// Prefetch the cache rows of positions [r0, r1) into L2 (128-byte lines), for passes loaded after the wait.
template <int D>
__device__ __forceinline__ void prefetch_rows(const DecodeArgs& a, int b, int kvh, int r0, int r1) {
    constexpr int L = D * 2 / 128;  // lines per row
    const char* kb = static_cast<const char*>(a.k);
    const char* vb = static_cast<const char*>(a.v);
    const int* pt = a.page_table + (long long)b * a.pt_b;
    for (int i = threadIdx.x; i < (r1 - r0) * L; i += THREADS) {
        const int pos = r0 + i / L, c = (i % L) * 64;
        const long long page = pt[pos / a.page_size];
        const long long slot = pos % a.page_size;
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(kb + 2 * (page * a.k_p + slot * a.k_s + kvh * a.k_h + c)));
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(vb + 2 * (page * a.v_p + slot * a.v_s + kvh * a.v_h + c)));
    }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Dynamic shared memory of one block: K and V passes, the scaled queries, each warp's probabilities
// [32 keys][GP heads] and each warp's final state [G][2 + D] (m, l, acc).
__host__ __device__ inline int group_pad(int G) { return (G + 3) & ~3; }
__host__ __device__ inline size_t smem_bytes(int D, int G, int cap) {
    return 4ull * cap * D + 4ull * (G * D + WARPS * 32 * group_pad(G) + WARPS * G * (D + 2));
}

// GM: the largest group the instantiation serves (4 or 8): the per-head registers are GM wide.
template <class T, int D, int GM>
__global__ void __launch_bounds__(THREADS) decode_attn_kernel(const DecodeArgs a, const bool pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int P = D / 8;     // 16-byte pieces per row
    constexpr int DPL = D / 32;  // channels per lane in P.V
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int G = a.group, GP = group_pad(G), cap = a.cap;
    uint16_t* ks = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* vs = ks + cap * D;
    float* qs = reinterpret_cast<float*>(vs + cap * D);  // [G][D]
    float* ps = qs + G * D;                              // [WARPS][32][GP]
    float* st = ps + WARPS * 32 * GP;                    // [WARPS][G][2 + D]

    const int kvh = blockIdx.x, b = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Before the wait: the batch description and earlier steps' cache rows (see the file comment).
    const int q_row = a.cu_q[b];
    const int q_len = a.cu_q[b + 1] - q_row;
    const int seq = a.seq_k[b];
    if (q_len <= 0) {  // a padded row: nothing to read or write
        if (pdl) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
        return;
    }
    const int first = min(seq - 1, cap);
    copy_rows<D>(a, b, kvh, 0, 0, first, ks, vs);
    cp_async_commit();
    prefetch_rows<D>(a, b, kvh, first, seq - 1);  // later passes' rows of earlier steps, into L2
    if (pdl) {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    }
    // After it: this step's queries and newest key/value row.
    if (seq >= 1 && seq - 1 < cap) copy_rows<D>(a, b, kvh, 0, seq - 1, seq, ks, vs);
    cp_async_commit();
    for (int i = tid; i < G * P; i += THREADS) {
        const int h = i / P, c = i % P;
        const uint4 w4 = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.q) + q_row * a.q_t +
                                                         (kvh * G + h) * a.q_h + c * 8);
        const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
        float4* dst = reinterpret_cast<float4*>(qs + h * D + c * 8);
        const float2 f0 = to_f2<T>(w[0]), f1 = to_f2<T>(w[1]), f2 = to_f2<T>(w[2]), f3 = to_f2<T>(w[3]);
        dst[0] = make_float4(f0.x * a.qscale, f0.y * a.qscale, f1.x * a.qscale, f1.y * a.qscale);
        dst[1] = make_float4(f2.x * a.qscale, f2.y * a.qscale, f3.x * a.qscale, f3.y * a.qscale);
    }
    cp_async_wait_all();
    __syncthreads();

    float m[GM], l[GM], acc[GM][DPL];
#pragma unroll
    for (int h = 0; h < GM; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.f;
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[h][e] = 0.f;
    }
    float* pw = ps + warp * 32 * GP;
    for (int p0 = 0; p0 < seq; p0 += cap) {
        const int n = min(seq - p0, cap);
        if (p0 > 0) {  // a later pass (a sequence longer than the smem rows): loaded after the wait
            __syncthreads();  // every warp is done with the previous pass
            copy_rows<D>(a, b, kvh, p0, 0, n, ks, vs);
            cp_async_commit();
            cp_async_wait_all();
            __syncthreads();
        }
        for (int kb = warp; kb * 32 < n; kb += WARPS) {
            // scores: lane = key r
            const int r = kb * 32 + lane;
            const bool ok = r < n;
            float s[GM];
#pragma unroll
            for (int h = 0; h < GM; ++h) s[h] = 0.f;
            if (ok) {
#pragma unroll
                for (int c = 0; c < P; ++c) {
                    const uint4 w4 = *reinterpret_cast<const uint4*>(ks + smem_at<D>(r, c));
                    const float2 k0 = to_f2<T>(w4.x), k1 = to_f2<T>(w4.y), k2 = to_f2<T>(w4.z), k3 = to_f2<T>(w4.w);
#pragma unroll
                    for (int h = 0; h < GM; ++h) {
                        if (h >= G) break;
                        const float4* qh = reinterpret_cast<const float4*>(qs + h * D + c * 8);
                        const float4 qa = qh[0], qb = qh[1];
                        float t = s[h];
                        t = fmaf(qa.x, k0.x, t);
                        t = fmaf(qa.y, k0.y, t);
                        t = fmaf(qa.z, k1.x, t);
                        t = fmaf(qa.w, k1.y, t);
                        t = fmaf(qb.x, k2.x, t);
                        t = fmaf(qb.y, k2.y, t);
                        t = fmaf(qb.z, k3.x, t);
                        t = fmaf(qb.w, k3.y, t);
                        s[h] = t;
                    }
                }
            }
            // online softmax of the block, per head (every block holds >= 1 key, so m_new is finite)
#pragma unroll
            for (int h = 0; h < GM; ++h) {
                if (h >= G) break;
                const float sh = ok ? s[h] : -INFINITY;
                const float m_new = fmaxf(m[h], warp_max(sh));
                const float p = exp2f(sh - m_new);
                const float alpha = exp2f(m[h] - m_new);  // 0 on the warp's first block
                l[h] = l[h] * alpha + warp_sum(p);
                m[h] = m_new;
#pragma unroll
                for (int e = 0; e < DPL; ++e) acc[h][e] *= alpha;
                pw[lane * GP + h] = p;
            }
            __syncwarp();
            // P.V: lane = channels lane * DPL ..
            const int nb = min(32, n - kb * 32);
            const int c = (lane * DPL) >> 3, off = (lane * DPL) & 7;
            for (int j = 0; j < nb; ++j) {
                const int row = kb * 32 + j;
                const uint16_t* vp = vs + row * D + ((c ^ (row & 7)) << 3) + off;
                float vf[DPL];
                if constexpr (DPL == 2) {
                    const float2 f = to_f2<T>(*reinterpret_cast<const uint32_t*>(vp));
                    vf[0] = f.x;
                    vf[1] = f.y;
                } else {
                    const uint2 w2 = *reinterpret_cast<const uint2*>(vp);
                    const float2 f0 = to_f2<T>(w2.x), f1 = to_f2<T>(w2.y);
                    vf[0] = f0.x;
                    vf[1] = f0.y;
                    vf[2] = f1.x;
                    vf[3] = f1.y;
                }
                const float* pj = pw + j * GP;
#pragma unroll
                for (int h = 0; h < GM; ++h) {
                    if (h >= G) break;
                    const float p = pj[h];
#pragma unroll
                    for (int e = 0; e < DPL; ++e) acc[h][e] = fmaf(p, vf[e], acc[h][e]);
                }
            }
            __syncwarp();  // the block's probabilities are read before the next block's overwrite them
        }
    }
    // merge the warps' states (a warp without keys holds m = -inf, l = 0, acc = 0: weight 0)
#pragma unroll
    for (int h = 0; h < GM; ++h) {
        if (h >= G) break;
        float* sw = st + (warp * G + h) * (2 + D);
        if (lane == 0) {
            sw[0] = m[h];
            sw[1] = l[h];
        }
#pragma unroll
        for (int e = 0; e < DPL; ++e) sw[2 + lane * DPL + e] = acc[h][e];
    }
    __syncthreads();
    T* out = static_cast<T*>(a.out) + q_row * a.o_t + kvh * G * a.o_h;
    for (int o = tid; o < G * D; o += THREADS) {
        const int h = o / D, d = o % D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, st[(w * G + h) * (2 + D)]);
        float num = 0.f, den = 0.f;
        if (M != -INFINITY) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float* sw = st + (w * G + h) * (2 + D);
                const float wt = exp2f(sw[0] - M);
                num = fmaf(wt, sw[2 + d], num);
                den = fmaf(wt, sw[1], den);
            }
        }
        out[h * a.o_h + d] = from_f<T>(den > 0.f ? num / den : 0.f);
    }
#else
    __trap();  // launched only on compute capability >= 9.0 (checked on the host)
#endif
}

template <class T, int D>
cudaError_t launch(const DecodeArgs& a, int kv_heads, int batch, bool pdl, cudaStream_t st) {
    auto kern = a.group <= 4 ? decode_attn_kernel<T, D, 4> : decode_attn_kernel<T, D, 8>;
    const size_t bytes = smem_bytes(D, a.group, a.cap);
    if (bytes > 48 * 1024) {  // above the default dynamic limit: raised (to the largest asked) per device
        static int raised[2][64] = {};
        int dev = 0;
        cudaGetDevice(&dev);
        int* done = dev < 64 ? &raised[a.group <= 4 ? 0 : 1][dev] : nullptr;
        if (!done || *done < (int)bytes) {
            const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
            if (e != cudaSuccess) return e;
            if (done) *done = (int)bytes;
        }
    }
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(kv_heads, batch, 1);
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = bytes;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kern, a, pdl);
}

}  // namespace exl3_attn

namespace {

using at::Tensor;

// q [T, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D]; page_table int32 [B, W]; cu_seqlens_q int32
// [B + 1] (at most one query per sequence); seq_lens_k int32 [B]. Returns [T, Hq, D] in q's dtype (rows of
// sequences without a query are left unwritten). cap: cache rows per pass in shared memory (a multiple of
// 32). The Python caller (exl3_attn_backends.cuda_decode.check_call) validates every input first and names
// what is wrong; the checks here are the last line.
Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& page_table,
                        const Tensor& cu_seqlens_q, const Tensor& seq_lens_k, double scale, int64_t cap, bool pdl) {
    using namespace exl3_attn;
    TORCH_CHECK(q.is_cuda() && k_cache.is_cuda() && v_cache.is_cuda() && page_table.is_cuda() &&
                cu_seqlens_q.is_cuda() && seq_lens_k.is_cuda(), "decode_attention: every tensor must be on the GPU");
    TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "decode_attention: bad ranks");
    TORCH_CHECK((q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) &&
                k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
                "decode_attention: q and the caches must share float16 or bfloat16");
    const int64_t D = q.size(2), Hq = q.size(1), Hkv = k_cache.size(2);
    TORCH_CHECK((D == 64 || D == 128) && k_cache.size(3) == D && v_cache.size(3) == D,
                "decode_attention: head dim must be 64 or 128");
    TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= MAX_GROUP, "decode_attention: GQA group over ", MAX_GROUP);
    TORCH_CHECK(cap >= 32 && cap % 32 == 0 && cap <= 4096, "decode_attention: cap must be a multiple of 32");
    TORCH_CHECK(page_table.scalar_type() == at::kInt && cu_seqlens_q.scalar_type() == at::kInt &&
                seq_lens_k.scalar_type() == at::kInt, "decode_attention: int32 batch description");
    const int64_t B = page_table.size(0);
    const c10::cuda::CUDAGuard guard(q.device());
    Tensor out = at::empty({q.size(0), Hq, D}, q.options());
    if (B == 0 || q.size(0) == 0) return out;
    DecodeArgs a{};
    a.q = q.data_ptr();
    a.k = k_cache.data_ptr();
    a.v = v_cache.data_ptr();
    a.out = out.data_ptr();
    a.page_table = page_table.data_ptr<int>();
    a.cu_q = cu_seqlens_q.data_ptr<int>();
    a.seq_k = seq_lens_k.data_ptr<int>();
    a.q_t = q.stride(0), a.q_h = q.stride(1);
    a.k_p = k_cache.stride(0), a.k_s = k_cache.stride(1), a.k_h = k_cache.stride(2);
    a.v_p = v_cache.stride(0), a.v_s = v_cache.stride(1), a.v_h = v_cache.stride(2);
    a.o_t = out.stride(0), a.o_h = out.stride(1);
    a.pt_b = page_table.stride(0);
    a.page_size = (int)k_cache.size(1);
    a.group = (int)(Hq / Hkv);
    a.cap = (int)cap;
    a.qscale = (float)(scale * 1.4426950408889634);
    const cudaStream_t st = at::cuda::getCurrentCUDAStream();
    const bool half = q.scalar_type() == at::kHalf;
    cudaError_t err;
    if (D == 64) {
        err = half ? launch<__half, 64>(a, (int)Hkv, (int)B, pdl, st) : launch<__nv_bfloat16, 64>(a, (int)Hkv, (int)B, pdl, st);
    } else {
        err = half ? launch<__half, 128>(a, (int)Hkv, (int)B, pdl, st)
                   : launch<__nv_bfloat16, 128>(a, (int)Hkv, (int)B, pdl, st);
    }
    TORCH_CHECK(err == cudaSuccess, "decode_attention: launch failed: ", cudaGetErrorString(err));
    return out;
}

int64_t decode_attention_smem(int64_t head_dim, int64_t group, int64_t cap) {
    return (int64_t)exl3_attn::smem_bytes((int)head_dim, (int)group, (int)cap);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3, m) {
    m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
          "Tensor seq_lens_k, float scale, int cap, bool pdl) -> Tensor");
    m.def("decode_attention_smem(int head_dim, int group, int cap) -> int", &decode_attention_smem);
}

TORCH_LIBRARY_IMPL(exl3, CUDA, m) { m.impl("decode_attention", &decode_attention); }
