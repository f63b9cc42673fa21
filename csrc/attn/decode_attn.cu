// Decode attention over the paged KV cache, one query per sequence, its keys split across the blocks of
// one thread block cluster (Hopper) that merge their partial softmax states through distributed shared
// memory. Registered as torch.ops.exl3.decode_attention; the Python side is the attention backend
// plugins/attn_backends/src/exl3_attn_backends/cuda_decode.py.
//
// Why: at b=1 the Triton split-KV kernel's merge (partials stored, an acq_rel arrival, the last program
// reloading every partial from L2) was ~2.9 us of each 1B layer's attention above a minimal dependent
// kernel (docs/performance.md, run 20). Here a cluster barrier and DSMEM reads replace it.
//
// Grid (splits, kv heads, sequences), cluster (splits, 1, 1), 128 threads. Block r of a cluster owns keys
// [r * per, (r + 1) * per) of its sequence (per = the length over the splits, rounded up to 16), read in
// CHUNK-key passes; its first pass is copied into shared memory before griddepcontrol.wait (the cache rows of
// earlier steps and the page table were complete before the step began; the newest row is reloaded after
// the wait). Scores in base 2 (q pre-scaled by scale * log2 e), fp32 online softmax over the passes.
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

constexpr int THREADS = 128;
constexpr int CHUNK = 64;        // keys per pass (one pass preloaded before the wait)
constexpr int MAX_GROUP = 8;     // query heads per kv head
constexpr int MAX_SPLITS = 8;    // the portable cluster size
constexpr int KEY_GROUP = 8;     // lanes sharing one key's dot product

struct DecodeArgs {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const int* page_table;
    const int* cu_q;
    const int* seq_k;
    long q_t, q_h, k_p, k_s, k_h, v_p, v_s, v_h, o_t, o_h, pt_b;
    int page_size, group, splits;
    float qscale;  // softmax scale * log2(e)
};

template <class T> __device__ inline float2 to_f2(uint32_t w);
template <> __device__ inline float2 to_f2<__half>(uint32_t w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
template <> __device__ inline float2 to_f2<__nv_bfloat16>(uint32_t w) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
template <class T> __device__ inline T from_f(float x);
template <> __device__ inline __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ inline __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ inline void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ inline void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Shared memory of one block (dynamic): K and V rows of a pass (padded by 16 bytes against bank
// conflicts), the scaled queries, the pass's scores/probabilities, the softmax state and the PV partials.
template <int D>
struct Smem {
    static constexpr int ROW = D + 8;  // halves per cached row
    static constexpr int PARTS = THREADS / (D / 2);  // key-interleaved parts of the PV product
    static constexpr size_t kv_bytes = 2ull * CHUNK * ROW * 2;
    static constexpr size_t bytes = kv_bytes + 4ull * (MAX_GROUP * D + MAX_GROUP * CHUNK + 3 * MAX_GROUP +
                                                       PARTS * MAX_GROUP * D);
};

// Copy keys/values [c0, c0 + n) of the sequence (kv head kvh) into the pass buffers, asynchronously.
template <int D>
__device__ inline void load_pass(const DecodeArgs& a, int b, int kvh, int c0, int n, uint16_t* ks, uint16_t* vs) {
    constexpr int PIECES = D / 8;  // 16-byte pieces per row
    const char* kb = static_cast<const char*>(a.k);
    const char* vb = static_cast<const char*>(a.v);
    for (int i = threadIdx.x; i < n * PIECES; i += THREADS) {
        const int r = i / PIECES, c = i % PIECES, pos = c0 + r;
        const long page = a.page_table[(long)b * a.pt_b + pos / a.page_size];
        const long slot = pos % a.page_size;
        cp_async16(ks + r * Smem<D>::ROW + c * 8, kb + 2 * (page * a.k_p + slot * a.k_s + kvh * a.k_h + c * 8));
        cp_async16(vs + r * Smem<D>::ROW + c * 8, vb + 2 * (page * a.v_p + slot * a.v_s + kvh * a.v_h + c * 8));
    }
}

template <class T, int D>
__global__ void __launch_bounds__(THREADS) decode_attn_kernel(const DecodeArgs a, const bool pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using S = Smem<D>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint16_t* ks = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* vs = ks + CHUNK * S::ROW;
    float* qs = reinterpret_cast<float*>(smem_raw + S::kv_bytes);  // [MAX_GROUP][D], scaled
    float* ss = qs + MAX_GROUP * D;                                 // [MAX_GROUP][CHUNK]
    float* m_run = ss + MAX_GROUP * CHUNK;                          // [MAX_GROUP] each
    float* l_run = m_run + MAX_GROUP;
    float* alpha = l_run + MAX_GROUP;
    float* red = alpha + MAX_GROUP;  // [PARTS][MAX_GROUP][D]; part 0 ends as the block's acc

    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank();
    const int kvh = blockIdx.y, b = blockIdx.z, G = a.group;
    const int tid = threadIdx.x;
    // Before the wait: the batch description and earlier steps' cache rows (see the file comment).
    const int q_row = a.cu_q[b];
    const int q_len = a.cu_q[b + 1] - q_row;
    const int seq = a.seq_k[b];
    if (q_len <= 0) {  // a padded row: the whole cluster (one sequence) leaves, nothing is written
        if (pdl) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
        return;
    }
    const int per = ((seq + a.splits - 1) / a.splits + 15) / 16 * 16;
    const int lo = min(rank * per, seq), hi = min(lo + per, seq);
    const int n0 = min(hi - lo, CHUNK);
    load_pass<D>(a, b, kvh, lo, n0, ks, vs);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    if (pdl) {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    }
    // After it: this step's queries and its newest key/value row (written by the kernel before).
    constexpr int PIECES = D / 8;
    uint4 qv = make_uint4(0, 0, 0, 0), kn = qv, vn = qv;
    const bool q_piece = tid < G * PIECES;
    const int newest = seq - 1 - lo;  // its row in the first pass, if there
    const bool fresh = newest >= 0 && newest < n0 && tid < PIECES;
    if (q_piece) {
        const int h = tid / PIECES, c = tid % PIECES;
        qv = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.q) + q_row * a.q_t + (kvh * G + h) * a.q_h + c * 8);
    }
    if (fresh) {
        const long pos = seq - 1;
        const long page = a.page_table[(long)b * a.pt_b + pos / a.page_size], slot = pos % a.page_size;
        kn = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.k) + page * a.k_p + slot * a.k_s + kvh * a.k_h + tid * 8);
        vn = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.v) + page * a.v_p + slot * a.v_s + kvh * a.v_h + tid * 8);
    }
    cp_async_wait_all();
    __syncthreads();  // every thread's copies have landed: the newest row's stores below come after them
    if (q_piece) {
        const int h = tid / PIECES, c = tid % PIECES;
        const uint32_t w[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = to_f2<T>(w[j]);
            qs[h * D + c * 8 + 2 * j] = f.x * a.qscale;
            qs[h * D + c * 8 + 2 * j + 1] = f.y * a.qscale;
        }
    }
    if (fresh) {
        *reinterpret_cast<uint4*>(ks + newest * S::ROW + tid * 8) = kn;
        *reinterpret_cast<uint4*>(vs + newest * S::ROW + tid * 8) = vn;
    }
    if (tid < MAX_GROUP) {
        m_run[tid] = -INFINITY;
        l_run[tid] = 0.f;
    }
    const int lane = tid & 31, warp = tid >> 5;
    constexpr int PARTS = S::PARTS;
    const int cp = tid % (D / 2), part = tid / (D / 2);  // PV: a column pair, every PARTS-th key
    float acc[MAX_GROUP][2];
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) acc[h][0] = acc[h][1] = 0.f;
    __syncthreads();

    for (int c0 = lo; c0 < hi; c0 += CHUNK) {
        const int n = min(hi - c0, CHUNK);
        if (c0 != lo) {  // a later pass (only past the launcher's static bound): loaded after the wait
            __syncthreads();  // the previous pass's readers are done with the buffers
            load_pass<D>(a, b, kvh, c0, n, ks, vs);
            asm volatile("cp.async.commit_group;\n" ::: "memory");
            cp_async_wait_all();
            __syncthreads();
        }
        // scores: KEY_GROUP lanes per key; lane j takes the row's 16-byte pieces j, j + KEY_GROUP, ... (a
        // group reads contiguous 128 bytes per step) and keeps head j's sum. The loop bound is the block's,
        // so every lane of a warp reaches the shuffles.
        {
            constexpr int NP = PIECES / KEY_GROUP;  // pieces per lane
            const int j = lane % KEY_GROUP;
            for (int r0 = 0; r0 < n; r0 += THREADS / KEY_GROUP) {
                const int r = r0 + tid / KEY_GROUP;
                const bool ok = r < n;
                float kf[NP * 8];
#pragma unroll
                for (int p = 0; p < NP; ++p) {
                    const uint4 w4 = ok ? *reinterpret_cast<const uint4*>(ks + r * S::ROW + (j + KEY_GROUP * p) * 8)
                                        : make_uint4(0, 0, 0, 0);
                    const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float2 f = to_f2<T>(w[e]);
                        kf[p * 8 + 2 * e] = f.x;
                        kf[p * 8 + 2 * e + 1] = f.y;
                    }
                }
                float mine = 0.f;
#pragma unroll
                for (int h = 0; h < MAX_GROUP; ++h) {
                    if (h >= G) break;
                    float s = 0.f;
#pragma unroll
                    for (int p = 0; p < NP; ++p) {
                        const float4* qh = reinterpret_cast<const float4*>(qs + h * D + (j + KEY_GROUP * p) * 8);
                        const float4 qa = qh[0], qb = qh[1];
                        s = fmaf(qa.x, kf[p * 8 + 0], s);
                        s = fmaf(qa.y, kf[p * 8 + 1], s);
                        s = fmaf(qa.z, kf[p * 8 + 2], s);
                        s = fmaf(qa.w, kf[p * 8 + 3], s);
                        s = fmaf(qb.x, kf[p * 8 + 4], s);
                        s = fmaf(qb.y, kf[p * 8 + 5], s);
                        s = fmaf(qb.z, kf[p * 8 + 6], s);
                        s = fmaf(qb.w, kf[p * 8 + 7], s);
                    }
#pragma unroll
                    for (int o = KEY_GROUP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                    if (h == j) mine = s;
                }
                if (ok && j < G) ss[j * CHUNK + r] = mine;
            }
        }
        __syncthreads();
        // online softmax per head: warp w takes heads w, w + 4
        for (int h = warp; h < G; h += THREADS / 32) {
            float mx = -INFINITY;
            for (int r = lane; r < n; r += 32) mx = fmaxf(mx, ss[h * CHUNK + r]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_old = m_run[h];
            const float m_new = fmaxf(m_old, mx);  // finite: a pass holds >= 1 key
            float sum = 0.f;
            for (int r = lane; r < n; r += 32) {
                const float p = exp2f(ss[h * CHUNK + r] - m_new);
                ss[h * CHUNK + r] = p;
                sum += p;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) {
                const float al = exp2f(m_old - m_new);  // 0 on the first pass (m_old = -inf)
                alpha[h] = al;
                l_run[h] = l_run[h] * al + sum;
                m_run[h] = m_new;
            }
        }
        __syncthreads();
        // PV: this thread's column pair over keys part, part + PARTS, ...
#pragma unroll
        for (int h = 0; h < MAX_GROUP; ++h) {
            if (h >= G) break;
            acc[h][0] *= alpha[h];
            acc[h][1] *= alpha[h];
        }
        for (int r = part; r < n; r += PARTS) {
            const float2 v2 = to_f2<T>(*reinterpret_cast<const uint32_t*>(vs + r * S::ROW + 2 * cp));
#pragma unroll
            for (int h = 0; h < MAX_GROUP; ++h) {
                if (h >= G) break;
                const float p = ss[h * CHUNK + r];
                acc[h][0] = fmaf(p, v2.x, acc[h][0]);
                acc[h][1] = fmaf(p, v2.y, acc[h][1]);
            }
        }
    }
    // the block's partial acc: the parts summed into red's part 0
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {
        if (h >= G) break;
        red[(part * MAX_GROUP + h) * D + 2 * cp] = acc[h][0];
        red[(part * MAX_GROUP + h) * D + 2 * cp + 1] = acc[h][1];
    }
    __syncthreads();
    for (int o = tid; o < G * D; o += THREADS) {
        float t = red[o];
#pragma unroll
        for (int p = 1; p < PARTS; ++p) t += red[p * MAX_GROUP * D + o];
        red[o] = t;
    }
    // merge across the cluster: block r writes outputs r * THREADS + tid, stepping by the cluster's threads
    cluster.sync();  // every block's m_run, l_run and acc are final and visible cluster-wide
    for (int o = rank * THREADS + tid; o < G * D; o += a.splits * THREADS) {
        const int h = o / D, d = o % D;
        float M = -INFINITY;
        for (int r = 0; r < a.splits; ++r) M = fmaxf(M, *cluster.map_shared_rank(m_run + h, r));
        float num = 0.f, den = 0.f;
        if (M != -INFINITY) {
            for (int r = 0; r < a.splits; ++r) {
                const float w = exp2f(*cluster.map_shared_rank(m_run + h, r) - M);  // an empty split: 0
                num = fmaf(w, *cluster.map_shared_rank(red + o, r), num);
                den = fmaf(w, *cluster.map_shared_rank(l_run + h, r), den);
            }
        }
        static_cast<T*>(a.out)[q_row * a.o_t + (kvh * G + h) * a.o_h + d] = from_f<T>(den > 0.f ? num / den : 0.f);
    }
    cluster.sync();  // no block leaves while another still reads its shared memory
#else
    __trap();  // launched only on compute capability >= 9.0 (checked on the host)
#endif
}

template <class T, int D>
cudaError_t launch(const DecodeArgs& a, int kv_heads, int batch, bool pdl, cudaStream_t st) {
    auto kern = decode_attn_kernel<T, D>;
    if (Smem<D>::bytes > 48 * 1024) {  // above the default dynamic limit: raised once per device
        static bool raised[64] = {};
        int dev = 0;
        cudaGetDevice(&dev);
        if (dev >= 64 || !raised[dev]) {
            const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)Smem<D>::bytes);
            if (e != cudaSuccess) return e;
            if (dev < 64) raised[dev] = true;
        }
    }
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(a.splits, kv_heads, batch);
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = Smem<D>::bytes;
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

void check_rows(const Tensor& t, const char* name, int64_t D) {
    TORCH_CHECK(t.stride(-1) == 1, "decode_attention: ", name, " needs contiguous channels (stride(-1) == 1)");
    for (int64_t i = 0; i < t.dim() - 1; ++i)
        TORCH_CHECK(t.stride(i) % 8 == 0, "decode_attention: ", name, "'s strides must be multiples of 8 elements "
                    "(16-byte rows), got stride(", i, ") = ", t.stride(i));
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "decode_attention: ", name,
                " must be 16-byte aligned");
    TORCH_CHECK(t.size(-1) == D, "decode_attention: ", name, " has ", t.size(-1), " channels, q has ", D);
}

// q [T, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D]; page_table int32 [B, W]; cu_seqlens_q int32
// [B + 1] (at most one query per sequence); seq_lens_k int32 [B]. Returns [T, Hq, D] in q's dtype (rows of
// sequences without a query are left unwritten). splits: keys split over that many blocks of a cluster (1-8).
Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& page_table,
                        const Tensor& cu_seqlens_q, const Tensor& seq_lens_k, double scale, int64_t splits, bool pdl) {
    using namespace exl3_attn;
    TORCH_CHECK(q.is_cuda() && k_cache.is_cuda() && v_cache.is_cuda() && page_table.is_cuda() && cu_seqlens_q.is_cuda()
                && seq_lens_k.is_cuda(), "decode_attention: every tensor must be on the GPU");
    TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "decode_attention: q must be [T, Hq, D] and "
                "the caches [pages, page_size, Hkv, D], got ", q.sizes(), ", ", k_cache.sizes(), ", ", v_cache.sizes());
    TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                "decode_attention: q must be float16 or bfloat16, got ", q.scalar_type());
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
                "decode_attention: the caches must have q's dtype ", q.scalar_type());
    const int64_t D = q.size(2), Hq = q.size(1), Hkv = k_cache.size(2);
    TORCH_CHECK(D == 64 || D == 128, "decode_attention: head dim must be 64 or 128, got ", D);
    TORCH_CHECK(v_cache.size(2) == Hkv && v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1),
                "decode_attention: k_cache ", k_cache.sizes(), " and v_cache ", v_cache.sizes(), " differ");
    TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= MAX_GROUP, "decode_attention: ", Hq, " query heads over ",
                Hkv, " kv heads: the group must divide evenly and be at most ", MAX_GROUP);
    check_rows(q, "q", D);
    check_rows(k_cache, "k_cache", D);
    check_rows(v_cache, "v_cache", D);
    TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2 && page_table.stride(1) == 1,
                "decode_attention: page_table must be int32 [B, W] with contiguous rows");
    const int64_t B = page_table.size(0);
    TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.is_contiguous() && cu_seqlens_q.numel() == B + 1,
                "decode_attention: cu_seqlens_q must be contiguous int32 [B + 1] with B = ", B);
    TORCH_CHECK(seq_lens_k.scalar_type() == at::kInt && seq_lens_k.is_contiguous() && seq_lens_k.numel() == B,
                "decode_attention: seq_lens_k must be contiguous int32 [B] with B = ", B);
    TORCH_CHECK(splits >= 1 && splits <= MAX_SPLITS, "decode_attention: splits must be 1..", MAX_SPLITS, ", got ", splits);
    TORCH_CHECK(B <= 65535 && Hkv <= 65535, "decode_attention: at most 65535 sequences and kv heads");
    const c10::cuda::CUDAGuard guard(q.device());
    const auto* prop = at::cuda::getCurrentDeviceProperties();
    TORCH_CHECK(prop->major >= 9, "decode_attention: needs compute capability >= 9.0 (thread block clusters), got ",
                prop->major, ".", prop->minor);
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
    if (D == 64) err = half ? launch<__half, 64>(a, (int)Hkv, (int)B, pdl, st) : launch<__nv_bfloat16, 64>(a, (int)Hkv, (int)B, pdl, st);
    else err = half ? launch<__half, 128>(a, (int)Hkv, (int)B, pdl, st) : launch<__nv_bfloat16, 128>(a, (int)Hkv, (int)B, pdl, st);
    TORCH_CHECK(err == cudaSuccess, "decode_attention: launch failed: ", cudaGetErrorString(err));
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3, m) {
    m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
          "Tensor seq_lens_k, float scale, int splits, bool pdl) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3, CUDA, m) { m.impl("decode_attention", &decode_attention); }
