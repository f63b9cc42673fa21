// Decode attention for short key bounds: the keys of one (sequence, kv head) split over the blocks of a
// thread block cluster, 32 keys per block, whose partial softmax states merge through distributed shared
// memory after a cluster barrier. Registered as torch.ops.exl3.decode_attention; the Python side is the
// backend plugins/attn_backends/src/exl3_attn_backends/cuda_decode.py, which sends long bounds to the
// Triton split-KV kernel.
//
// Why: at b=1 the Triton split kernel's merge (partials stored, an arrival atomic, the last program
// reloading every partial from L2) sits on each layer's critical path (run 21's ablation: 3.3% of the 1B
// step). Run 24 measured one block per kv head instead: its warps' serial chains cost more than the merge
// (docs/performance.md). Here every block's work is one short chain per warp, as in the split kernel, and
// the merge is a cluster barrier and DSMEM reads instead of an atomic and a reload.
//
// Block: 4 warps; warp w owns query heads w, w + 4 (groups up to 8). A block's keys (32 per pass) are
// copied into shared memory with cp.async before griddepcontrol.wait: rows of earlier steps and the page
// table were complete before the step began; the newest row (seq - 1, written by the kernel before) is
// copied after the wait. Scores with lane = key (16-byte pieces XOR-swizzled by row & 7), fp32 online
// softmax in base 2 (q pre-scaled by scale * log2 e), P.V with lane = channels.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>

namespace exl3_attn {

namespace cg = cooperative_groups;

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int MAX_GROUP = 8;   // query heads per kv head
constexpr int MAX_SPLITS = 16; // blocks per cluster (a non-portable size on Hopper)
constexpr int PASS = 32;       // keys per pass

struct DecodeArgs {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const int* page_table;
    const int* cu_q;
    const int* seq_k;
    long long q_t, q_h, k_p, k_s, k_h, v_p, v_s, v_h, o_t, o_h, pt_b;
    int page_size, group, splits;
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

// Static shared memory of one block: one pass of K and V rows, the scaled queries, and each head's state
// (m, l, acc), which the cluster reads in the merge.
template <int D>
struct Smem {
    uint16_t k[PASS * D];
    uint16_t v[PASS * D];
    float q[MAX_GROUP * D];
    float st[MAX_GROUP * (2 + D)];
};

template <class T, int D>
__global__ void __launch_bounds__(THREADS) decode_attn_kernel(const DecodeArgs a, const bool pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int P = D / 8;     // 16-byte pieces per row
    constexpr int DPL = D / 32;  // channels per lane in P.V
    __shared__ __align__(16) Smem<D> sm;
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank();
    const int kvh = blockIdx.y, b = blockIdx.z, G = a.group;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Before the wait: the batch description and earlier steps' cache rows (see the file comment).
    const int q_row = a.cu_q[b];
    const int q_len = a.cu_q[b + 1] - q_row;
    const int seq = a.seq_k[b];
    if (q_len <= 0) {  // a padded row: the whole cluster (one sequence) leaves, nothing is written
        if (pdl) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
        return;
    }
    // this block's keys: equal shares rounded up to whole passes
    const int per = max(PASS, ((seq + a.splits - 1) / a.splits + PASS - 1) / PASS * PASS);
    const int lo = min(rank * per, seq), hi = min(lo + per, seq);
    const int n0 = min(hi - lo, PASS);
    copy_rows<D>(a, b, kvh, lo, 0, min(n0, seq - 1 - lo), sm.k, sm.v);  // the newest row after the wait
    cp_async_commit();
    if (pdl) {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    }
    // After it: this step's queries and newest key/value row.
    if (seq - 1 >= lo && seq - 1 < lo + n0) copy_rows<D>(a, b, kvh, lo, seq - 1 - lo, seq - lo, sm.k, sm.v);
    cp_async_commit();
    for (int i = tid; i < G * P; i += THREADS) {
        const int h = i / P, c = i % P;
        const uint4 w4 = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.q) + q_row * a.q_t +
                                                         (kvh * G + h) * a.q_h + c * 8);
        float4* dst = reinterpret_cast<float4*>(sm.q + h * D + c * 8);
        const float2 f0 = to_f2<T>(w4.x), f1 = to_f2<T>(w4.y), f2 = to_f2<T>(w4.z), f3 = to_f2<T>(w4.w);
        dst[0] = make_float4(f0.x * a.qscale, f0.y * a.qscale, f1.x * a.qscale, f1.y * a.qscale);
        dst[1] = make_float4(f2.x * a.qscale, f2.y * a.qscale, f3.x * a.qscale, f3.y * a.qscale);
    }
    cp_async_wait_all();
    __syncthreads();

    // warp w: heads w and w + WARPS (slot 1 only for groups over 4)
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, acc[2][DPL];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[i][e] = 0.f;
    for (int p0 = lo; p0 < hi; p0 += PASS) {
        const int n = min(hi - p0, PASS);
        if (p0 != lo) {  // a later pass (a share over 32 keys: only past the launcher's bound), after the wait
            __syncthreads();
            copy_rows<D>(a, b, kvh, p0, 0, n, sm.k, sm.v);
            cp_async_commit();
            cp_async_wait_all();
            __syncthreads();
        }
        const bool ok = lane < n;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int h = warp + i * WARPS;
            if (h >= G) break;
            // score of key `lane` for head h
            float s = 0.f;
            if (ok) {
                const float* qh = sm.q + h * D;
#pragma unroll
                for (int c = 0; c < P; ++c) {
                    const uint4 w4 = *reinterpret_cast<const uint4*>(sm.k + smem_at<D>(lane, c));
                    const float4 qa = *reinterpret_cast<const float4*>(qh + c * 8);
                    const float4 qb = *reinterpret_cast<const float4*>(qh + c * 8 + 4);
                    const float2 k0 = to_f2<T>(w4.x), k1 = to_f2<T>(w4.y), k2 = to_f2<T>(w4.z), k3 = to_f2<T>(w4.w);
                    s = fmaf(qa.x, k0.x, s);
                    s = fmaf(qa.y, k0.y, s);
                    s = fmaf(qa.z, k1.x, s);
                    s = fmaf(qa.w, k1.y, s);
                    s = fmaf(qb.x, k2.x, s);
                    s = fmaf(qb.y, k2.y, s);
                    s = fmaf(qb.z, k3.x, s);
                    s = fmaf(qb.w, k3.y, s);
                }
            } else {
                s = -INFINITY;
            }
            const float m_new = fmaxf(m[i], warp_max(s));  // finite: a pass holds >= 1 key
            const float p = exp2f(s - m_new);
            const float alpha = exp2f(m[i] - m_new);  // 0 on the first pass
            l[i] = l[i] * alpha + warp_sum(p);
            m[i] = m_new;
#pragma unroll
            for (int e = 0; e < DPL; ++e) acc[i][e] *= alpha;
            // P.V: lane = channels lane * DPL ..; p of key j from lane j
            const int c = (lane * DPL) >> 3, off = (lane * DPL) & 7;
#pragma unroll 8
            for (int j = 0; j < PASS; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j);  // 0 for keys past n
                if (j < n) {
                    const uint16_t* vp = sm.v + j * D + ((c ^ (j & 7)) << 3) + off;
                    if constexpr (DPL == 2) {
                        const float2 f = to_f2<T>(*reinterpret_cast<const uint32_t*>(vp));
                        acc[i][0] = fmaf(pj, f.x, acc[i][0]);
                        acc[i][1] = fmaf(pj, f.y, acc[i][1]);
                    } else {
                        const uint2 w2 = *reinterpret_cast<const uint2*>(vp);
                        const float2 f0 = to_f2<T>(w2.x), f1 = to_f2<T>(w2.y);
                        acc[i][0] = fmaf(pj, f0.x, acc[i][0]);
                        acc[i][1] = fmaf(pj, f0.y, acc[i][1]);
                        acc[i][2] = fmaf(pj, f1.x, acc[i][2]);
                        acc[i][3] = fmaf(pj, f1.y, acc[i][3]);
                    }
                }
            }
        }
    }
    // this block's state per head (an empty block: m = -inf, l = 0, acc = 0, weight 0 in the merge)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int h = warp + i * WARPS;
        if (h >= G) break;
        float* sw = sm.st + h * (2 + D);
        if (lane == 0) {
            sw[0] = m[i];
            sw[1] = l[i];
        }
#pragma unroll
        for (int e = 0; e < DPL; ++e) sw[2 + lane * DPL + e] = acc[i][e];
    }
    cluster.sync();  // every block's states are final and visible cluster-wide
    T* out = static_cast<T*>(a.out) + q_row * a.o_t + kvh * G * a.o_h;
    const int S = a.splits;
    for (int o = rank * THREADS + tid; o < G * D; o += S * THREADS) {
        const int h = o / D, d = o % D;
        float M = -INFINITY;
        for (int r = 0; r < S; ++r) M = fmaxf(M, *cluster.map_shared_rank(sm.st + h * (2 + D), r));
        float num = 0.f, den = 0.f;
        if (M != -INFINITY) {
            for (int r = 0; r < S; ++r) {
                const float* sw = cluster.map_shared_rank(sm.st + h * (2 + D), r);
                const float w = exp2f(sw[0] - M);
                num = fmaf(w, sw[2 + d], num);
                den = fmaf(w, sw[1], den);
            }
        }
        out[h * a.o_h + d] = from_f<T>(den > 0.f ? num / den : 0.f);
    }
    cluster.sync();  // no block leaves while another still reads its shared memory
#else
    __trap();  // launched only on compute capability >= 9.0 (checked on the host)
#endif
}

template <class T, int D>
cudaError_t launch(const DecodeArgs& a, int kv_heads, int batch, bool pdl, cudaStream_t st) {
    auto kern = decode_attn_kernel<T, D>;
    if (a.splits > 8) {  // a non-portable cluster size: allowed once per device
        static bool allowed[64] = {};
        int dev = 0;
        cudaGetDevice(&dev);
        if (dev >= 64 || !allowed[dev]) {
            const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
            if (e != cudaSuccess) return e;
            if (dev < 64) allowed[dev] = true;
        }
    }
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(a.splits, kv_heads, batch);
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = st;
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = a.splits;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 2 : 1;
    return cudaLaunchKernelEx(&cfg, kern, a, pdl);
}

}  // namespace exl3_attn

namespace {

using at::Tensor;

// q [T, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D]; page_table int32 [B, W]; cu_seqlens_q int32
// [B + 1] (at most one query per sequence); seq_lens_k int32 [B]. Returns [T, Hq, D] in q's dtype (rows of
// sequences without a query are left unwritten). splits: blocks per cluster over the keys (1-16). The Python caller (exl3_attn_backends.cuda_decode.check_call) validates every input first and names
// what is wrong; the checks here are the last line.
Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& page_table,
                        const Tensor& cu_seqlens_q, const Tensor& seq_lens_k, double scale, int64_t splits, bool pdl) {
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
    TORCH_CHECK(splits >= 1 && splits <= MAX_SPLITS, "decode_attention: splits must be 1..", MAX_SPLITS);
    TORCH_CHECK(page_table.scalar_type() == at::kInt && cu_seqlens_q.scalar_type() == at::kInt &&
                seq_lens_k.scalar_type() == at::kInt, "decode_attention: int32 batch description");
    const int64_t B = page_table.size(0);
    const c10::cuda::CUDAGuard guard(q.device());
    TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 9, "decode_attention: needs compute capability >= 9.0");
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
    a.splits = (int)splits;
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


}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3, m) {
    m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
          "Tensor seq_lens_k, float scale, int splits, bool pdl) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3, CUDA, m) { m.impl("decode_attention", &decode_attention); }
