// Torch op registration for the EXL3 CUDA kernels (namespace exl3).
// Registration lives in a .cu file, not a .cpp, so a CPU-only build (no nvcc: setup.py then compiles
// only csrc/**/*.cpp) never references the CUDA launchers.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "exl3_fused.cuh"
#include "exl3_kernels.cuh"
#include "exl3_launch.h"

namespace exl3 {
int launch_fused(int cb, int K, const FusedArgs& a, cudaStream_t st) {
    if (cb == 0) return launch_fused_cb0(K, a, st);
    if (cb == 1) return launch_fused_cb1(K, a, st);
    return launch_fused_cb2(K, a, st);
}
cudaError_t launch_recon_full(int cb, int K, const uint32_t* trellis, const __half* suh, const __half* svh, void* out,
                              bool bf16, int k_tiles, int n_tiles, long ldo, cudaStream_t st) {
    if (cb == 0) return launch_recon_full_cb0(K, trellis, suh, svh, out, bf16, k_tiles, n_tiles, ldo, st);
    if (cb == 1) return launch_recon_full_cb1(K, trellis, suh, svh, out, bf16, k_tiles, n_tiles, ldo, st);
    return launch_recon_full_cb2(K, trellis, suh, svh, out, bf16, k_tiles, n_tiles, ldo, st);
}
}  // namespace exl3

namespace {

using at::Tensor;

// rows up to this go through the on-the-fly-decode GEMM, larger ones through reconstruct + cuBLAS
constexpr int64_t GEMM_MAX_M = 64;
// rows from this on (128-divisible dims) reconstruct W in the original basis and run one cuBLAS GEMM
// y = x @ W, with no activation Hadamards. Below it (down to GEMM_MAX_M + 1) the old chain
// had128 -> reconstruct Ŵ -> cuBLAS -> had128 runs. Expected crossover: reconstruct_full costs less
// than reconstruct alone (one pass over the weights, no extra work per row), so every big m wins;
// bench/exl3_kernels.py (reconstruct section) prints both chains per m to confirm on the device.
constexpr int64_t FULL_MIN_M = GEMM_MAX_M + 1;

int check_trellis(const Tensor& t, int64_t K, int64_t codebook, const char* op) {
    TORCH_CHECK(t.is_cuda(), op, ": trellis must be a CUDA tensor, got ", t.device());
    TORCH_CHECK(t.scalar_type() == at::kShort, op, ": trellis must be int16, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 3, op, ": trellis must be 3-D [k/16, n/16, 16K], got ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), op, ": trellis must be contiguous (call .contiguous())");
    // the GEMM kernels stream tiles with 16-byte cp.async (a fresh allocation is always aligned)
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op,
                ": trellis data must be 16-byte aligned (it is a view at an odd offset; pass trellis.clone())");
    TORCH_CHECK(t.size(2) % 16 == 0 && t.size(2) / 16 >= 1 && t.size(2) / 16 <= 8, op, ": trellis last dim ",
                t.size(2), " is not 16*K with K in 1..8");
    const int k_found = (int)(t.size(2) / 16);
    TORCH_CHECK(K <= 0 || K == k_found, op, ": K=", K, " but the trellis last dim ", t.size(2), " means K=", k_found);
    TORCH_CHECK(codebook >= 0 && codebook <= 2, op, ": codebook ", codebook, " unknown; expected 0 (3inst), 1 (mcg), 2 (mul1)");
    return k_found;
}

Tensor reconstruct(const Tensor& trellis, int64_t K, int64_t codebook) {
    const int k = check_trellis(trellis, K, codebook, "exl3::reconstruct");
    c10::cuda::CUDAGuard guard(trellis.device());
    const int kt = (int)trellis.size(0), nt = (int)trellis.size(1);
    Tensor out = at::empty({kt * 16L, nt * 16L}, trellis.options().dtype(at::kHalf));
    if (out.numel() == 0) return out;
    exl3::launch_reconstruct((int)codebook, k, reinterpret_cast<const uint32_t*>(trellis.data_ptr()),
                             reinterpret_cast<__half*>(out.data_ptr()), kt, nt, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}

// t itself when its data is 16-byte aligned (the kernels' vector loads), else an aligned copy
Tensor aligned16(const Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone(at::MemoryFormat::Contiguous);
}

// W = diag(suh) · BD_k · Ŵ · BD_n · diag(svh) as fp16 [k, n] (spec 4.2; exl3_recon_full.cuh). suh/svh
// are used as fp16 (their storage type); the rest is fp32 with one final rounding to fp16. Into `out`
// when defined: fp16 or bf16 [k, n] with unit column stride and a row stride that is a multiple of 8 (a
// column block of a wider matrix: q/k/v or gate/up side by side for one prefill GEMM); else a new fp16
// tensor. A bf16 `out` holds the fp16 result converted (K <= EXL3_RF_HALF_MAX_K) or the fp32 result
// rounded once to bf16 (larger K).
static Tensor recon_full(const char* op, const Tensor& trellis, const Tensor& suh, const Tensor& svh, int64_t K,
                         int64_t codebook, Tensor out) {
    const int k = check_trellis(trellis, K, codebook, op);
    const int kt = (int)trellis.size(0), nt = (int)trellis.size(1);
    TORCH_CHECK(kt % 8 == 0 && nt % 8 == 0, op, ": k = ", kt * 16L, " and n = ", nt * 16L,
                " must be multiples of 128 (EXL3 pads to 128)");
    TORCH_CHECK(suh.is_cuda() && svh.is_cuda() && suh.device() == trellis.device() && svh.device() == trellis.device() &&
                    suh.numel() == kt * 16L && svh.numel() == nt * 16L,
                op, ": suh/svh must be vectors of ", kt * 16L, "/", nt * 16L, " elements on the trellis' device, got ",
                suh.numel(), "/", svh.numel());
    if (out.defined())
        TORCH_CHECK(out.is_cuda() && out.device() == trellis.device() &&
                        (out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16) &&
                        out.dim() == 2 && out.size(0) == kt * 16L && out.size(1) == nt * 16L && out.stride(1) == 1 &&
                        out.stride(0) % 8 == 0 && out.stride(0) <= INT32_MAX &&
                        reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
                    op, ": out must be a CUDA fp16 or bf16 [", kt * 16L, ", ", nt * 16L, "] view with unit column "
                    "stride, a row stride that is a multiple of 8 and a 16-byte aligned start; got ", out.scalar_type(),
                    " ", out.sizes(), " strides ", out.strides());
    c10::cuda::CUDAGuard guard(trellis.device());
    Tensor su = suh.to(at::kHalf).contiguous(), sv = aligned16(svh.to(at::kHalf).contiguous());
    if (!out.defined()) out = at::empty({kt * 16L, nt * 16L}, trellis.options().dtype(at::kHalf));
    if (out.numel() == 0) return out;
    C10_CUDA_CHECK(exl3::launch_recon_full((int)codebook, k, reinterpret_cast<const uint32_t*>(trellis.data_ptr()),
                                           reinterpret_cast<const __half*>(su.data_ptr()),
                                           reinterpret_cast<const __half*>(sv.data_ptr()), out.data_ptr(),
                                           out.scalar_type() == at::kBFloat16, kt, nt, out.stride(0),
                                           at::cuda::getCurrentCUDAStream()));
    return out;
}

Tensor reconstruct_full(const Tensor& trellis, const Tensor& suh, const Tensor& svh, int64_t K, int64_t codebook) {
    return recon_full("exl3::reconstruct_full", trellis, suh, svh, K, codebook, Tensor());
}

void reconstruct_full_into(const Tensor& trellis, const Tensor& suh, const Tensor& svh, int64_t K, int64_t codebook,
                           Tensor out) {
    recon_full("exl3::reconstruct_full_into", trellis, suh, svh, K, codebook, out);
}

// z = xh @ Ŵ in fp32, Ŵ decoded on the fly (no Hadamard, no scales)
Tensor gemm_xh(const Tensor& xh, const Tensor& trellis, int64_t K, int64_t codebook, int64_t kt_per_warp) {
    const int k = check_trellis(trellis, K, codebook, "exl3::exl3_gemm_xh");
    TORCH_CHECK(xh.is_cuda() && xh.scalar_type() == at::kHalf && xh.dim() == 2 && xh.is_contiguous(),
                "exl3::exl3_gemm_xh: xh must be a contiguous CUDA fp16 [m, k] tensor, got ", xh.scalar_type(), " ",
                xh.sizes());
    const int kt = (int)trellis.size(0), nt = (int)trellis.size(1);
    TORCH_CHECK(xh.size(1) == kt * 16L, "exl3::exl3_gemm_xh: xh has ", xh.size(1), " columns, trellis needs ", kt * 16L);
    TORCH_CHECK(nt % exl3::BLOCK_TILES == 0, "exl3::exl3_gemm_xh: n = ", nt * 16,
                " must be a multiple of 128 (EXL3 pads to 128)");
    c10::cuda::CUDAGuard guard(xh.device());
    const int64_t m = xh.size(0);
    Tensor z = at::zeros({m, nt * 16L}, xh.options().dtype(at::kFloat));
    if (m == 0 || kt == 0) return z;
    exl3::GemmArgs a{};
    a.x = reinterpret_cast<const __half*>(xh.data_ptr());
    a.trellis = reinterpret_cast<const uint32_t*>(trellis.data_ptr());
    a.z = z.data_ptr<float>();
    a.m = (int)m;
    a.k_tiles = kt;
    a.n_tiles = nt;
    a.kt_per_warp = (int)kt_per_warp;
    auto st = at::cuda::getCurrentCUDAStream();
    for (int64_t m0 = 0; m0 < m; m0 += 32) {  // each launch covers 32 rows (two m16 blocks)
        a.m0 = (int)m0;
        a.kt_per_warp = exl3::launch_gemm((int)codebook, k, m - m0 > 16 ? 2 : 1, a, st);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return z;
}

Tensor had128(const Tensor& x, const c10::optional<Tensor>& pre, const c10::optional<Tensor>& post, bool out_fp16) {
    TORCH_CHECK(x.is_cuda(), "exl3::had128: x must be a CUDA tensor");
    TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat, "exl3::had128: x must be fp16 or fp32, got ",
                x.scalar_type());
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 128 == 0, "exl3::had128: last dim ", x.size(-1),
                " must be a multiple of 128 (zero-pad it)");
    const int64_t dim = x.size(-1);
    for (const auto* s : {&pre, &post}) {
        if (s->has_value()) {
            const Tensor& t = s->value();
            TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kHalf && t.dim() == 1 && t.size(0) == dim && t.is_contiguous(),
                        "exl3::had128: scale vectors must be contiguous CUDA fp16 [", dim, "], got ", t.scalar_type(), " ",
                        t.sizes());
        }
    }
    c10::cuda::CUDAGuard guard(x.device());
    Tensor xc = x.contiguous();
    Tensor y = at::empty(x.sizes(), x.options().dtype(out_fp16 ? at::kHalf : at::kFloat));
    const int64_t rows = dim ? xc.numel() / dim : 0;
    if (rows == 0) return y;
    exl3::launch_had128(xc.data_ptr(), xc.scalar_type() == at::kHalf, y.data_ptr(), out_fp16,
                        pre.has_value() ? reinterpret_cast<const __half*>(pre->data_ptr()) : nullptr,
                        post.has_value() ? reinterpret_cast<const __half*>(post->data_ptr()) : nullptr, rows, dim,
                        at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}

// ------------------------------------------------------------------ fused decode linear (m <= 16)

// Per-device workspace of the fused op: fp32 z [16 * n] and int32 arrival counters [n / 128], all
// zero between launches (each launch puts its zeros back; exl3_fused.cuh). It grows only when a
// call needs more columns than any earlier one (n summed over a group), with at::zeros on the
// current stream followed by a stream sync, so it is valid on every stream afterwards. Growth is
// never done while the stream is capturing a CUDA graph (the captured memset would not run until
// replay): that call takes the 4-kernel path instead. The generator's graph code runs each bucket
// eagerly before capturing it, so the workspace is already large enough at capture time.
// Replaced buffers are kept alive, since graphs captured earlier still point at them.
// One workspace per device: concurrent fused calls on two streams of one device are not supported.
struct FusedWorkspace {
    Tensor z, counters;
    int64_t n_cap = 0;
    Tensor xh;  // fp16 [FUSED_MAX_PROBLEMS * 8 * k]: x transformed once per launch (FusedArgs::xh_buf)
    int64_t xh_k_cap = 0;
    std::vector<Tensor> retired;
};
std::mutex g_ws_mutex;
std::unordered_map<int, FusedWorkspace> g_ws;

constexpr int64_t FUSED_MAX_M = 16;
constexpr int64_t FUSED_ROUTE_M = 4;  // exl3_gemm sends rows up to this to the fused op

bool stream_capturing(cudaStream_t st) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(st, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone;
}

// z and counters covering n_total columns on x's device, or false when it would have to grow during capture
bool fused_workspace(const Tensor& like, int64_t n_total, float** z, int** counters) {
    std::lock_guard<std::mutex> lock(g_ws_mutex);
    FusedWorkspace& ws = g_ws[like.get_device()];
    if (ws.n_cap < n_total) {
        auto st = at::cuda::getCurrentCUDAStream();
        // No TORCH_WARN here: built by a compiler that breaks C++ unwinding across libraries (the device
        // image's /opt/gcc wrapper, bench/device_env.sh) a c10 warning crashes the process, and a warning
        // inside a capture helps no one; the 4-kernel path is taken silently, documented in cuda_ops.py.
        if (stream_capturing(st)) return false;
        if (ws.z.defined()) {
            ws.retired.push_back(ws.z);
            ws.retired.push_back(ws.counters);
        }
        ws.z = at::zeros({FUSED_MAX_M * n_total}, like.options().dtype(at::kFloat));
        ws.counters = at::zeros({n_total / exl3::FUSED_COLS}, like.options().dtype(at::kInt));
        ws.n_cap = n_total;
        st.synchronize();  // the zeros are in place before any stream uses the buffers
    }
    *z = ws.z.data_ptr<float>();
    *counters = ws.counters.data_ptr<int>();
    return true;
}

// Launch options of the fused ops, per call: their trailing schema argument `int[] launch`, either empty
// (the defaults below) or [pdl, predecode, predecode_max_kt, xh_min_rows] (exl3_core/kernels/launch.py,
// LaunchConfig.ints(): the execution plan passes its tuning's). Arguments rather than process-wide
// settings, so that two plans with different tunings (an A/B benchmark, two models) each launch with
// their own, and a captured graph keeps what its calls passed.
struct LaunchOpts {
    // programmatic dependent launch (exl3_fused.cuh, FusedArgs::pdl); honoured on sm_90 or newer only
    bool pdl = true;
    // pre-decoding of short chunks (FusedArgs::predecode): 0 off, 1 on, 2 on with the early signal
    int predecode = 2;
    // the longest chunk a pre-decoding launch takes, in k tiles (0: its ring's length)
    int predecode_max_kt = 0;
    // from this many rows a transposed launch transforms x once for the launch (fused_xh_kernel) instead of
    // in every block, since at 8 rows the per-block transforms cost more than the extra pass; wide outputs
    // (a head) take it at any row count (exl3::xh_wanted); 0 switches both off
    int xh_min_rows = 8;
};

LaunchOpts launch_opts(at::IntArrayRef launch, const char* op) {
    LaunchOpts o;
    if (launch.empty()) return o;
    TORCH_CHECK(launch.size() == 4, op, ": launch must be [] (the defaults) or [pdl, predecode, predecode_max_kt, "
                "xh_min_rows], got ", launch.size(), " values; pass exl3_core.kernels.launch.current().ints()");
    TORCH_CHECK(launch[0] == 0 || launch[0] == 1, op, ": launch[0] (pdl) = ", launch[0], "; expected 0 or 1");
    TORCH_CHECK(launch[1] >= 0 && launch[1] <= 2, op, ": launch[1] (predecode) = ", launch[1],
                "; expected 0 (off), 1 (on) or 2 (on, early signal)");
    TORCH_CHECK(launch[2] >= 0 && launch[2] <= exl3::GEMM_KT_MAX, op, ": launch[2] (predecode_max_kt) = ", launch[2],
                "; expected 0 (the ring's length) to ", exl3::GEMM_KT_MAX, " k tiles");
    TORCH_CHECK(launch[3] >= 0 && launch[3] <= FUSED_MAX_M, op, ": launch[3] (xh_min_rows) = ", launch[3],
                "; expected 0 (never) to ", FUSED_MAX_M, " rows");
    o.pdl = launch[0] != 0;
    o.predecode = (int)launch[1];
    o.predecode_max_kt = (int)launch[2];
    o.xh_min_rows = (int)launch[3];
    return o;
}

// The transformed-x workspace for k columns at m rows and col_blocks output blocks, or nullptr (each block
// transforms its chunk): where exl3::xh_wanted says no (min_rows: the call's LaunchOpts::xh_min_rows), or
// when it would have to grow during a capture (as fused_workspace).
__half* fused_xh_workspace(const Tensor& like, int64_t m, int64_t k, int64_t col_blocks, int min_rows) {
    if (!exl3::xh_wanted((int)m, (int)(k / 16), (long)col_blocks, min_rows)) return nullptr;
    std::lock_guard<std::mutex> lock(g_ws_mutex);
    FusedWorkspace& ws = g_ws[like.get_device()];
    if (ws.xh_k_cap < k) {
        if (stream_capturing(at::cuda::getCurrentCUDAStream())) return nullptr;
        if (ws.xh.defined()) ws.retired.push_back(ws.xh);
        ws.xh = at::empty({(int64_t)exl3::FUSED_MAX_PROBLEMS * 8 * k}, like.options().dtype(at::kHalf));
        ws.xh_k_cap = k;
    }
    return reinterpret_cast<__half*>(ws.xh.data_ptr());
}

void check_x(const Tensor& x, int64_t kd, int64_t max_m, const char* op, bool bf16_ok = false) {
    TORCH_CHECK(x.is_cuda() && (x.scalar_type() == at::kHalf || (bf16_ok && x.scalar_type() == at::kBFloat16)) &&
                    x.dim() == 2,
                op, ": x must be a CUDA fp16 [m, k] tensor", bf16_ok ? " (or bf16 from 65 rows)" : "", ", got ",
                x.scalar_type(), " ", x.sizes());
    // the padded width, or the layer's own (the kernels read the missing columns as zeros)
    TORCH_CHECK(x.size(1) == kd || (x.size(1) < kd && x.size(1) > kd - 128 && x.size(1) % 4 == 0), op, ": x has ",
                x.size(1), " columns; the trellis takes ", kd, " (or the unpadded width: a multiple of 4 within 128 "
                "of it)");
    TORCH_CHECK(max_m <= 0 || x.size(0) <= max_m, op, ": x has ", x.size(0), " rows; the fused op takes at most ",
                max_m, " (use exl3_gemm)");
}

void check_scales(const Tensor& suh, const Tensor& svh, int64_t kd, int64_t nd, const char* op) {
    TORCH_CHECK(suh.is_cuda() && svh.is_cuda() && suh.numel() == kd && svh.numel() == nd, op,
                ": suh/svh must be CUDA vectors of ", kd, "/", nd, " elements, got ", suh.numel(), "/", svh.numel());
}

// the unfused chain (had128, split-k GEMM or reconstruct + cuBLAS, had128); su/sv fp16 contiguous.
// From FULL_MIN_M rows: one cuBLAS GEMM against W reconstructed in the original basis instead.
// x may be bf16 from FULL_MIN_M rows (the bf16 prefill): W is then rebuilt in bf16.
Tensor gemm_4kernel(const Tensor& x_in, const Tensor& trellis, const Tensor& su, const Tensor& sv, int k,
                    int64_t codebook) {
    const int64_t kd = trellis.size(0) * 16;
    const Tensor x = x_in.size(1) < kd ? at::constant_pad_nd(x_in, {0, kd - x_in.size(1)}) : x_in;
    if (x.size(0) >= FULL_MIN_M && trellis.size(0) % 8 == 0 && trellis.size(1) % 8 == 0) {
        Tensor w = at::empty({trellis.size(0) * 16, trellis.size(1) * 16}, x.options());
        // cuBLAS in x's dtype, fp32 accumulation
        return at::matmul(x, recon_full("exl3::exl3_gemm", trellis, su, sv, k, codebook, w));
    }
    Tensor xh = had128(x, su, c10::nullopt, true);
    Tensor z;
    if (x.size(0) <= GEMM_MAX_M) {
        z = gemm_xh(xh, trellis, k, codebook, 0);
    } else {
        z = at::matmul(xh, reconstruct(trellis, k, codebook));  // fp16 cuBLAS, fp32 accumulation
    }
    return had128(z, c10::nullopt, sv, true);
}

// Optional prologue/epilogue work of a fused launch (FusedArgs): the deferred norm of x, the residual
// add, q/k/v's RoPE and cache rows.
struct FusedExtras {
    const float* norm_ss = nullptr;
    const float* norm_w = nullptr;
    float norm_eps = 0.f, norm_offset = 0.f;
    const __half* res = nullptr;
    float* res_ss = nullptr;
    int res_cols = 0;
    const float* rope_cos = nullptr;
    const float* rope_sin = nullptr;
    int rope_half = 0, rope_interleaved = 0;
    const int64_t* slots = nullptr;
    int rope[exl3::FUSED_MAX_PROBLEMS] = {0, 0, 0};
    __half* cache[exl3::FUSED_MAX_PROBLEMS] = {nullptr, nullptr, nullptr};
    int cache_ld[exl3::FUSED_MAX_PROBLEMS] = {0, 0, 0};
};

// One launch for up to 3 problems sharing x (same K, codebook) with the launch options lo; returns false
// (nothing launched) when the workspace cannot be had during capture.
bool fused_launch(const Tensor& x, const std::vector<Tensor>& trellis, const std::vector<Tensor>& su,
                  const std::vector<Tensor>& sv, const std::vector<Tensor>& y, int k, int64_t codebook,
                  int64_t kt_per_chunk, const LaunchOpts& lo, const Tensor* gate = nullptr, int act = 0,
                  const FusedExtras& ex = {}) {
    int64_t n_total = 0;
    for (const Tensor& t : trellis) n_total += t.size(1) * 16;
    float* z = nullptr;
    int* counters = nullptr;
    if (!fused_workspace(x, n_total, &z, &counters)) return false;
    exl3::FusedArgs a{};
    a.x = reinterpret_cast<const __half*>(x.data_ptr());
    a.gate = gate != nullptr ? reinterpret_cast<const __half*>(gate->data_ptr()) : nullptr;
    a.act = act;
    a.m = (int)x.size(0);
    a.x_cols = (int)x.size(1);
    a.k_tiles = (int)trellis[0].size(0);
    a.kt_per_chunk = (int)kt_per_chunk;
    a.n_problems = (int)trellis.size();
    a.norm_ss = ex.norm_ss;
    a.norm_w = ex.norm_w;
    a.norm_eps = ex.norm_eps;
    a.norm_offset = ex.norm_offset;
    a.norm_inv_dim = 1.f / (float)x.size(1);
    a.res = ex.res;
    a.res_ss = ex.res_ss;
    a.res_cols = ex.res_cols;
    a.rope_cos = ex.rope_cos;
    a.rope_sin = ex.rope_sin;
    a.rope_half = ex.rope_half;
    a.rope_interleaved = ex.rope_interleaved;
    a.slots = ex.slots;
    a.xh_min_rows = lo.xh_min_rows;
    a.xh_buf = fused_xh_workspace(x, x.size(0), trellis[0].size(0) * 16, n_total / exl3::FUSED_COLS, a.xh_min_rows);
    // programmatic dependent launch is Hopper's (sm_90+); torch caches the device properties
    a.pdl = lo.pdl && at::cuda::getDeviceProperties(x.device().index())->major >= 9;
    a.predecode = lo.predecode;
    a.predecode_max_kt = lo.predecode_max_kt;
    int64_t n_off = 0;
    for (size_t i = 0; i < trellis.size(); ++i) {
        exl3::FusedProblem& p = a.p[i];
        p.trellis = reinterpret_cast<const uint32_t*>(trellis[i].data_ptr());
        p.suh = reinterpret_cast<const __half*>(su[i].data_ptr());
        p.svh = reinterpret_cast<const __half*>(sv[i].data_ptr());
        p.y = reinterpret_cast<__half*>(y[i].data_ptr());
        p.z = z + FUSED_MAX_M * n_off;
        p.counters = counters + n_off / exl3::FUSED_COLS;
        p.n_tiles = (int)trellis[i].size(1);
        a.cache[i] = ex.cache[i];
        a.cache_ld[i] = ex.cache_ld[i];
        a.rope_mask |= ex.rope[i] ? 1 << i : 0;
        n_off += trellis[i].size(1) * 16;
    }
    exl3::launch_fused((int)codebook, k, a, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
}

// The checks and the per-problem fp16 scales and outputs of a grouped fused launch (problems share x,
// K and codebook; n a multiple of 128). Call under a device guard for x.
struct Group {
    int k = 0;
    int64_t kd = 0;
    std::vector<Tensor> su, sv, ys;
};

Group prepare_group(const char* op, const Tensor& x, at::TensorList trellis, at::TensorList suh, at::TensorList svh,
                    int64_t codebook) {
    TORCH_CHECK(trellis.size() >= 1 && trellis.size() <= (size_t)exl3::FUSED_MAX_PROBLEMS, op, ": takes 1 to ",
                exl3::FUSED_MAX_PROBLEMS, " problems, got ", trellis.size());
    TORCH_CHECK(suh.size() == trellis.size() && svh.size() == trellis.size(), op, ": ", trellis.size(),
                " trellis tensors but ", suh.size(), " suh and ", svh.size(), " svh");
    Group g;
    g.k = check_trellis(trellis[0], 0, codebook, op);
    g.kd = trellis[0].size(0) * 16;
    check_x(x, g.kd, FUSED_MAX_M, op);
    for (size_t i = 0; i < trellis.size(); ++i) {
        check_trellis(trellis[i], g.k, codebook, op);
        TORCH_CHECK(trellis[i].size(0) * 16 == g.kd, op, ": trellis ", i, " has k = ", trellis[i].size(0) * 16,
                    ", trellis 0 has ", g.kd, " (problems share x)");
        TORCH_CHECK(trellis[i].size(1) % (exl3::FUSED_COLS / 16) == 0, op, ": n = ", trellis[i].size(1) * 16,
                    " of trellis ", i, " must be a multiple of 128 (EXL3 pads to 128)");
        check_scales(suh[i], svh[i], g.kd, trellis[i].size(1) * 16, op);
        TORCH_CHECK(trellis[i].device() == x.device() && suh[i].device() == x.device() && svh[i].device() == x.device(),
                    op, ": problem ", i, " is not on x's device ", x.device());
    }
    TORCH_CHECK(g.kd % 128 == 0, op, ": k = ", g.kd, " must be a multiple of 128 (EXL3 pads to 128)");
    for (size_t i = 0; i < trellis.size(); ++i) {
        g.su.push_back(aligned16(suh[i].to(at::kHalf).contiguous()));
        g.sv.push_back(aligned16(svh[i].to(at::kHalf).contiguous()));
        g.ys.push_back(at::empty({x.size(0), trellis[i].size(1) * 16}, x.options()));
    }
    return g;
}

// Spec 4.3 in one launch for m <= 16 (exl3_fused.cuh): y = fp16(Had(z)) * svh, z = fp16(Had(fp16(x*suh))) @ Ŵ.
// Problems: trellis/suh/svh triples sharing x, K and codebook; returns one fp16 [m, n_i] per problem.
std::vector<Tensor> group_launch(const char* op, const Tensor& x, at::TensorList trellis, at::TensorList suh,
                                 at::TensorList svh, int64_t codebook, int64_t kt_per_chunk, at::IntArrayRef launch) {
    c10::cuda::CUDAGuard guard(x.device());
    const LaunchOpts lo = launch_opts(launch, op);
    Group g = prepare_group(op, x, trellis, suh, svh, codebook);
    Tensor xc = aligned16(x.contiguous());
    if (x.size(0) == 0) return g.ys;
    if (g.kd == 0) {  // empty sum: z = 0, so y = 0
        for (Tensor& t : g.ys) t.zero_();
        return g.ys;
    }
    if (!fused_launch(xc, trellis.vec(), g.su, g.sv, g.ys, g.k, codebook, kt_per_chunk, lo)) {
        for (size_t i = 0; i < trellis.size(); ++i)
            g.ys[i] = gemm_4kernel(xc, trellis[i], g.su[i], g.sv[i], g.k, codebook);
    }
    return g.ys;
}

std::vector<Tensor> linear_group(const Tensor& x, at::TensorList trellis, at::TensorList suh, at::TensorList svh,
                                 int64_t codebook, int64_t kt_per_chunk, at::IntArrayRef launch) {
    return group_launch("exl3::exl3_linear_group", x, trellis, suh, svh, codebook, kt_per_chunk, launch);
}

Tensor linear(const Tensor& x, const Tensor& trellis, const Tensor& suh, const Tensor& svh, int64_t codebook,
              int64_t kt_per_chunk, at::IntArrayRef launch) {
    return group_launch("exl3::exl3_linear", x, {trellis}, {suh}, {svh}, codebook, kt_per_chunk, launch)[0];
}

// The gated activation's operand checks (act code; gate shaped like x, fp16, same device)
void check_gate(const Tensor& gate, const Tensor& x, int64_t act, const char* op) {
    TORCH_CHECK(act == exl3::FUSED_ACT_SILU || act == exl3::FUSED_ACT_GELU_TANH, op, ": act = ", act,
                "; expected 0 (silu) or 1 (gelu_tanh)");
    TORCH_CHECK(gate.sizes() == x.sizes() && gate.scalar_type() == at::kHalf && gate.device() == x.device(), op,
                ": gate ", gate.sizes(), " ", gate.scalar_type(), " must match ", x.sizes(), " (fp16, same device)");
}

// fp16(act(gate) * up) with ATen, fp32 math (the capture fallback of the fused prologue's product)
Tensor aten_act_mul(const Tensor& gate, const Tensor& up, int64_t act) {
    Tensor g = gate.to(at::kFloat);
    Tensor t = act == exl3::FUSED_ACT_GELU_TANH ? (g + 0.044715 * g * g * g) * (2.0 * 0.7978845608028654) : g;
    return (g * at::sigmoid(t) * up.to(at::kFloat)).to(at::kHalf);
}

// y = linear(act(gate) * up) for m <= 16 in one launch: the gated MLP's activation product computed in
// the fused op's prologue (exl3_fused.cuh, fused_act_mul) instead of a launch of its own. act: 0 silu,
// 1 gelu (tanh approximation).
Tensor linear_act(const Tensor& gate, const Tensor& up, const Tensor& trellis, const Tensor& suh, const Tensor& svh,
                  int64_t codebook, int64_t act, at::IntArrayRef launch) {
    const char* op = "exl3::exl3_linear_act";
    c10::cuda::CUDAGuard guard(up.device());
    const LaunchOpts lo = launch_opts(launch, op);
    Group g = prepare_group(op, up, {trellis}, {suh}, {svh}, codebook);
    check_gate(gate, up, act, op);
    Tensor uc = aligned16(up.contiguous()), gc = aligned16(gate.contiguous());
    if (up.size(0) == 0) return g.ys[0];
    if (fused_launch(uc, {trellis}, g.su, g.sv, g.ys, g.k, codebook, 0, lo, &gc, (int)act)) return g.ys[0];
    // no workspace during capture: the activation product by ATen, then the 4-kernel chain
    return gemm_4kernel(aten_act_mul(gc, uc, act), trellis, g.su[0], g.sv[0], g.k, codebook);
}

// fp32 RMSNorm of fp16 rows with ATen (the capture fallback of linear_group_ex), rounded once to fp16
Tensor aten_rms_norm(const Tensor& h, const c10::optional<Tensor>& w, double eps, double offset) {
    Tensor f = h.to(at::kFloat);
    Tensor y = f * at::rsqrt(f.pow(2).mean(-1, true) + eps);
    if (w.has_value()) y = y * (w->to(at::kFloat) + offset);
    return y.to(at::kHalf);
}

void check_ss(const Tensor& ss, int64_t m, const char* op, const char* what) {
    TORCH_CHECK(ss.is_cuda() && ss.scalar_type() == at::kFloat && ss.dim() == 1 && ss.numel() >= m &&
                    ss.stride(0) == 1,
                op, ": ", what, " must be a CUDA fp32 vector with at least one element per row (", m, "), got ",
                ss.scalar_type(), " ", ss.sizes());
}

// RoPE on fp16 rows [m, n] of heads 2 * half wide with ATen (the capture fallback of linear_group_ex)
Tensor aten_rope(const Tensor& y, const Tensor& cos, const Tensor& sin, bool interleaved) {
    const int64_t m = y.size(0), half = cos.size(1);
    Tensor f = y.to(at::kFloat);
    Tensor c = cos.view({m, 1, half}), s = sin.view({m, 1, half});
    Tensor x1, x2;
    if (interleaved) {
        Tensor p = f.view({m, -1, half, 2});
        x1 = p.select(-1, 0), x2 = p.select(-1, 1);
    } else {
        Tensor p = f.view({m, -1, 2 * half});
        x1 = p.narrow(-1, 0, half), x2 = p.narrow(-1, half, half);
    }
    Tensor o1 = x1 * c - x2 * s, o2 = x2 * c + x1 * s;
    Tensor out = interleaved ? at::stack({o1, o2}, -1) : at::cat({o1, o2}, -1);
    return out.reshape({m, -1}).to(at::kHalf);
}

// linear_group with optional extras in the prologue and epilogue (exl3_fused.cuh, FusedArgs):
//  - norm_ss set: x is the residual stream h and the prologue normalises it (rms_norm with norm_w, eps,
//    offset) from h's row sums of squares norm_ss (fp32 [>= m], added up by linear_residual): no norm
//    kernel between the two linears;
//  - rope_cos/rope_sin set (fp32 [m, half], half in 16, 32, 64): problems i with rope_on[i] have their
//    output heads (2 * half columns, rotary over the whole head) rotated in the epilogue;
//  - caches[i] set (fp16, contiguous, cache_widths[i] values per slot: n_i where not given, or the layer's
//    unpadded width, a multiple of 4 within 128 of n_i): problem i's rows (their first cache_widths[i] columns)
//    also go to the cache at slots[r] (int64 [m]; the caller keeps them in range). Attention's q/k/v: RoPE and
//    the paged KV write without launches of their own.
// Same roundings as the norm kernel, linear_group and the RoPE kernel one after the other.
std::vector<Tensor> linear_group_ex(const Tensor& x, at::TensorList trellis, at::TensorList suh, at::TensorList svh,
                                    int64_t codebook, const c10::optional<Tensor>& norm_ss,
                                    const c10::optional<Tensor>& norm_w, double eps, double offset,
                                    const c10::optional<Tensor>& rope_cos, const c10::optional<Tensor>& rope_sin,
                                    bool rope_interleaved, at::IntArrayRef rope_on, const c10::optional<Tensor>& slots,
                                    const c10::List<c10::optional<Tensor>>& caches, at::IntArrayRef launch,
                                    at::IntArrayRef cache_widths) {
    const char* op = "exl3::exl3_linear_group_ex";
    c10::cuda::CUDAGuard guard(x.device());
    const LaunchOpts lo = launch_opts(launch, op);
    Group g = prepare_group(op, x, trellis, suh, svh, codebook);
    const int64_t m = x.size(0);
    const size_t np = trellis.size();
    TORCH_CHECK(g.kd > 0, op, ": k = 0");
    FusedExtras ex;
    Tensor wc;
    if (norm_ss.has_value()) {
        check_ss(*norm_ss, m, op, "norm_ss");
        if (norm_w.has_value())
            TORCH_CHECK(norm_w->is_cuda() && norm_w->scalar_type() == at::kFloat && norm_w->dim() == 1 &&
                            norm_w->numel() == x.size(1),
                        op, ": norm_w must be a CUDA fp32 vector of ", x.size(1), " elements (x's width), got ",
                        norm_w->scalar_type(),
                        " ", norm_w->sizes());
        wc = norm_w.has_value() ? aligned16(norm_w->contiguous()) : Tensor();
        ex.norm_ss = norm_ss->data_ptr<float>();
        ex.norm_w = wc.defined() ? wc.data_ptr<float>() : nullptr;
        ex.norm_eps = (float)eps;
        ex.norm_offset = (float)offset;
    }
    std::vector<int> rope(np, 0);
    Tensor cs, sn;
    if (rope_cos.has_value()) {
        TORCH_CHECK(rope_sin.has_value() && rope_on.size() == np, op, ": rope_cos needs rope_sin and one rope_on flag "
                    "per problem (", np, "), got ", rope_on.size());
        for (const Tensor* t : {&*rope_cos, &*rope_sin})
            TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == m &&
                            t->size(1) == rope_cos->size(1) && t->device() == x.device(),
                        op, ": rope_cos/rope_sin must be CUDA fp32 [", m, ", half] on x's device, got ",
                        t->scalar_type(), " ", t->sizes());
        const int64_t half = rope_cos->size(1);
        TORCH_CHECK(half == 16 || half == 32 || half == 64, op, ": heads of ", 2 * half,
                    " columns; the epilogue rotates heads of 32, 64 or 128");
        for (size_t i = 0; i < np; ++i) {
            rope[i] = rope_on[i] != 0;
            TORCH_CHECK(!rope[i] || trellis[i].size(1) * 16 % (2 * half) == 0, op, ": problem ", i, " has n = ",
                        trellis[i].size(1) * 16, ", not a whole number of ", 2 * half, "-wide heads");
        }
        cs = aligned16(rope_cos->contiguous());
        sn = aligned16(rope_sin->contiguous());
    }
    TORCH_CHECK(caches.size() == 0 || caches.size() == np, op, ": caches must be empty or one (or None) per problem");
    TORCH_CHECK(cache_widths.size() == 0 || cache_widths.size() == np, op,
                ": cache_widths must be empty or one per problem (", np, "), got ", cache_widths.size());
    std::vector<Tensor> cache(np);
    std::vector<int64_t> cache_w(np, 0);
    for (size_t i = 0; i < caches.size(); ++i) {
        const c10::optional<Tensor> c = caches.get(i);
        if (!c.has_value()) continue;
        const int64_t n = trellis[i].size(1) * 16;
        const int64_t nd = cache_widths.size() ? cache_widths[i] : n;
        TORCH_CHECK(nd == n || (nd > n - 128 && nd < n && nd % 4 == 0), op, ": cache ", i, " slots of ", nd,
                    " values for a problem of n = ", n, "; give n or a multiple of 4 within 128 of it");
        TORCH_CHECK(c->is_cuda() && c->scalar_type() == at::kHalf && c->is_contiguous() && c->numel() % nd == 0 &&
                        c->device() == x.device(),
                    op, ": cache ", i, " must be a contiguous CUDA fp16 tensor of whole ", nd, "-value slots, got ",
                    c->scalar_type(), " ", c->sizes());
        cache_w[i] = nd;
        TORCH_CHECK(slots.has_value() && slots->is_cuda() && slots->scalar_type() == at::kLong && slots->dim() == 1 &&
                        slots->numel() == m,
                    op, ": caches need slots, a CUDA int64 vector of ", m, " slots");
        cache[i] = *c;
    }
    Tensor xc = aligned16(x.contiguous());
    if (m == 0) return g.ys;
    ex.rope_cos = cs.defined() ? cs.data_ptr<float>() : nullptr;
    ex.rope_sin = sn.defined() ? sn.data_ptr<float>() : nullptr;
    ex.rope_half = cs.defined() ? (int)cs.size(1) : 0;
    ex.rope_interleaved = rope_interleaved;
    ex.slots = slots.has_value() ? slots->data_ptr<int64_t>() : nullptr;
    for (size_t i = 0; i < np; ++i) {
        ex.rope[i] = rope[i];
        ex.cache[i] = cache[i].defined() ? reinterpret_cast<__half*>(cache[i].data_ptr()) : nullptr;
        ex.cache_ld[i] = (int)cache_w[i];
    }
    if (fused_launch(xc, trellis.vec(), g.su, g.sv, g.ys, g.k, codebook, 0, lo, nullptr, 0, ex)) return g.ys;
    // no workspace during capture: norm, the chain, RoPE and the cache writes with ATen
    Tensor xin = norm_ss.has_value() ? aten_rms_norm(xc, norm_w, eps, offset) : xc;
    for (size_t i = 0; i < np; ++i) {
        g.ys[i] = gemm_4kernel(xin, trellis[i], g.su[i], g.sv[i], g.k, codebook);
        if (rope[i]) g.ys[i] = aten_rope(g.ys[i], cs, sn, rope_interleaved);
        if (cache[i].defined()) cache[i].view({-1, cache_w[i]}).index_copy_(0, *slots, g.ys[i].narrow(1, 0, cache_w[i]));
    }
    return g.ys;
}

// res + linear(x) (or linear(act(gate) * x) with gate set) in one launch, for m <= 16: the residual add
// of a pre-norm block moved into the linear's epilogue, which also adds each row's sum of squares of
// the result into ss (fp32 [>= m], zero before the call) for the next linear's deferred norm
// (linear_group_ex). n must equal res's width.
Tensor linear_residual(const Tensor& x, const c10::optional<Tensor>& gate, int64_t act, const Tensor& trellis,
                       const Tensor& suh, const Tensor& svh, int64_t codebook, const Tensor& res, const Tensor& ss,
                       at::IntArrayRef launch) {
    const char* op = "exl3::exl3_linear_residual";
    c10::cuda::CUDAGuard guard(x.device());
    const LaunchOpts lo = launch_opts(launch, op);
    Group g = prepare_group(op, x, {trellis}, {suh}, {svh}, codebook);
    const int64_t nd = trellis.size(1) * 16;
    TORCH_CHECK(g.kd > 0, op, ": k = 0");
    // the stream's width: n, or the layer's unpadded output width
    TORCH_CHECK(res.is_cuda() && res.scalar_type() == at::kHalf && res.dim() == 2 && res.size(0) == x.size(0) &&
                    (res.size(1) == nd || (res.size(1) < nd && res.size(1) > nd - 128 && res.size(1) % 4 == 0)) &&
                    res.device() == x.device(),
                op, ": res must be a CUDA fp16 [", x.size(0), ", ", nd, "] tensor on x's device (or as wide as the "
                "unpadded output: a multiple of 4 within 128 of ", nd, "), got ", res.scalar_type(), " ", res.sizes());
    const int64_t n = res.size(1);
    if (n < nd) g.ys[0] = at::empty({x.size(0), n}, x.options());
    check_ss(ss, x.size(0), op, "ss");
    if (gate.has_value()) check_gate(*gate, x, act, op);
    Tensor xc = aligned16(x.contiguous()), rc = aligned16(res.contiguous());
    Tensor gc = gate.has_value() ? aligned16(gate->contiguous()) : Tensor();
    if (x.size(0) == 0) return g.ys[0];
    FusedExtras ex;
    ex.res = reinterpret_cast<const __half*>(rc.data_ptr());
    ex.res_ss = ss.data_ptr<float>();
    ex.res_cols = (int)n;
    if (fused_launch(xc, {trellis}, g.su, g.sv, g.ys, g.k, codebook, 0, lo, gc.defined() ? &gc : nullptr, (int)act, ex))
        return g.ys[0];
    // no workspace during capture: ATen for the activation product, the chain, the add and the sums
    Tensor xin = gc.defined() ? aten_act_mul(gc, xc, act) : xc;
    Tensor y = (gemm_4kernel(xin, trellis, g.su[0], g.sv[0], g.k, codebook).narrow(1, 0, n).to(at::kFloat) +
                rc.to(at::kFloat)).to(at::kHalf);
    Tensor head = ss.narrow(0, 0, x.size(0));
    head.add_(y.to(at::kFloat).pow(2).sum(-1));
    return y;
}

// debugging/tests: copies of this device's fused-op workspace (z, counters); empty before first use
std::tuple<Tensor, Tensor> linear_workspace(const Tensor& like) {
    TORCH_CHECK(like.is_cuda(), "exl3::exl3_linear_workspace: pass a CUDA tensor of the device to inspect");
    c10::cuda::CUDAGuard guard(like.device());
    std::lock_guard<std::mutex> lock(g_ws_mutex);
    auto it = g_ws.find(like.get_device());
    if (it == g_ws.end() || !it->second.z.defined())
        return {at::empty({0}, like.options().dtype(at::kFloat)), at::empty({0}, like.options().dtype(at::kInt))};
    return {it->second.z.clone(), it->second.counters.clone()};
}

// Spec 4.3: y = fp16(Had(z) ) * svh with z = fp16(Had(fp16(x*suh))) @ Ŵ; the seam of linear.py.
// m <= 4: the one-launch fused op; m <= 64: Hadamard, split-k GEMM, Hadamard; beyond: W in the original
// basis (reconstruct_full) + one cuBLAS GEMM, in bf16 when x is bf16 (the bf16 prefill; fp16 otherwise).
// The fused op stops at 4 rows here because its m16 prologue repeats every row's input Hadamard in each
// block, which from 8 rows costs more than the two extra launches. launch: the fused op's options (the
// other paths take none).
Tensor gemm(const Tensor& x, const Tensor& trellis, const Tensor& suh, const Tensor& svh, int64_t codebook,
            at::IntArrayRef launch) {
    const int k = check_trellis(trellis, 0, codebook, "exl3::exl3_gemm");
    launch_opts(launch, "exl3::exl3_gemm");  // checked on every path, not only where the fused op runs
    const int64_t kd = trellis.size(0) * 16, nd = trellis.size(1) * 16;
    check_x(x, kd, 0, "exl3::exl3_gemm", true);
    TORCH_CHECK(x.scalar_type() == at::kHalf || (x.size(0) >= FULL_MIN_M && kd % 128 == 0 && nd % 128 == 0),
                "exl3::exl3_gemm: a bf16 x needs at least ", FULL_MIN_M, " rows and k, n multiples of 128 (the "
                "rebuilt-W path); got ", x.sizes(), " against k = ", kd, ", n = ", nd, "; pass fp16");
    check_scales(suh, svh, kd, nd, "exl3::exl3_gemm");
    if (x.size(0) <= FUSED_ROUTE_M && kd % 128 == 0 && nd % 128 == 0)
        return group_launch("exl3::exl3_gemm", x, {trellis}, {suh}, {svh}, codebook, 0, launch)[0];
    c10::cuda::CUDAGuard guard(x.device());
    Tensor su = suh.to(at::kHalf).contiguous(), sv = svh.to(at::kHalf).contiguous();
    return gemm_4kernel(x, trellis, su, sv, k, codebook);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3, m) {
    m.def("reconstruct(Tensor trellis, int K, int codebook) -> Tensor");
    m.def("reconstruct_full(Tensor trellis, Tensor suh, Tensor svh, int K, int codebook) -> Tensor");
    m.def("reconstruct_full_into(Tensor trellis, Tensor suh, Tensor svh, int K, int codebook, Tensor(a!) out) -> ()");
    // the fused ops' (and exl3_gemm's, which routes up to 4 rows to them) trailing `launch`: [] or
    // [pdl, predecode, predecode_max_kt, xh_min_rows] (LaunchOpts)
    m.def("exl3_gemm(Tensor x, Tensor trellis, Tensor suh, Tensor svh, int codebook, int[] launch=[]) -> Tensor");
    m.def("exl3_gemm_xh(Tensor xh, Tensor trellis, int K, int codebook, int kt_per_warp=0) -> Tensor");
    m.def("had128(Tensor x, Tensor? pre_scale=None, Tensor? post_scale=None, bool out_fp16=True) -> Tensor");
    m.def("exl3_linear(Tensor x, Tensor trellis, Tensor suh, Tensor svh, int codebook, int kt_per_chunk=0, "
          "int[] launch=[]) -> Tensor");
    m.def("exl3_linear_group(Tensor x, Tensor[] trellis, Tensor[] suh, Tensor[] svh, int codebook, "
          "int kt_per_chunk=0, int[] launch=[]) -> Tensor[]");
    m.def("exl3_linear_workspace(Tensor like) -> (Tensor, Tensor)");
    m.def("exl3_linear_act(Tensor gate, Tensor up, Tensor trellis, Tensor suh, Tensor svh, int codebook, int act, "
          "int[] launch=[]) -> Tensor");
    m.def("exl3_linear_group_ex(Tensor x, Tensor[] trellis, Tensor[] suh, Tensor[] svh, int codebook, "
          "Tensor? norm_ss, Tensor? norm_w, float eps, float offset, Tensor? rope_cos, Tensor? rope_sin, "
          "bool rope_interleaved, int[] rope_on, Tensor? slots, Tensor?[] caches, int[] launch=[], "
          "int[] cache_widths=[]) -> Tensor[]");
    m.def("exl3_linear_residual(Tensor x, Tensor? gate, int act, Tensor trellis, Tensor suh, Tensor svh, int codebook, "
          "Tensor res, Tensor(a!) ss, int[] launch=[]) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3, CUDA, m) {
    m.impl("reconstruct", &reconstruct);
    m.impl("reconstruct_full", &reconstruct_full);
    m.impl("reconstruct_full_into", &reconstruct_full_into);
    m.impl("exl3_gemm", &gemm);
    m.impl("exl3_gemm_xh", &gemm_xh);
    m.impl("had128", &had128);
    m.impl("exl3_linear", &linear);
    m.impl("exl3_linear_group", &linear_group);
    m.impl("exl3_linear_workspace", &linear_workspace);
    m.impl("exl3_linear_act", &linear_act);
    m.impl("exl3_linear_group_ex", &linear_group_ex);
    m.impl("exl3_linear_residual", &linear_residual);
}
