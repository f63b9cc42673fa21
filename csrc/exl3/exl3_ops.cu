// Torch op registration for the EXL3 CUDA kernels (namespace exl3).
// Registration lives in a .cu file, not a .cpp, so a CPU-only build (no nvcc: setup.py then compiles
// only csrc/**/*.cpp) never references the CUDA launchers.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "exl3_kernels.cuh"
#include "exl3_launch.h"

namespace {

using at::Tensor;

// rows up to this go through the on-the-fly-decode GEMM, larger ones through reconstruct + cuBLAS
constexpr int64_t GEMM_MAX_M = 64;

int check_trellis(const Tensor& t, int64_t K, int64_t codebook, const char* op) {
    TORCH_CHECK(t.is_cuda(), op, ": trellis must be a CUDA tensor, got ", t.device());
    TORCH_CHECK(t.scalar_type() == at::kShort, op, ": trellis must be int16, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 3, op, ": trellis must be 3-D [k/16, n/16, 16K], got ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), op, ": trellis must be contiguous (call .contiguous())");
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

// z = xh @ Ŵ in fp32, Ŵ decoded on the fly (no Hadamard, no scales)
Tensor gemm_xh(const Tensor& xh, const Tensor& trellis, int64_t K, int64_t codebook, int64_t kt_per_warp) {
    const int k = check_trellis(trellis, K, codebook, "exl3::exl3_gemm_xh");
    TORCH_CHECK(xh.is_cuda() && xh.scalar_type() == at::kHalf && xh.dim() == 2 && xh.is_contiguous(),
                "exl3::exl3_gemm_xh: xh must be a contiguous CUDA fp16 [m, k] tensor, got ", xh.scalar_type(), " ",
                xh.sizes());
    const int kt = (int)trellis.size(0), nt = (int)trellis.size(1);
    TORCH_CHECK(xh.size(1) == kt * 16L, "exl3::exl3_gemm_xh: xh has ", xh.size(1), " columns, trellis needs ", kt * 16L);
    TORCH_CHECK(nt % (exl3::GEMM_NT * exl3::GEMM_WARPS) == 0, "exl3::exl3_gemm_xh: n = ", nt * 16,
                " must be a multiple of 128 (EXL3 pads to 128)");
    c10::cuda::CUDAGuard guard(xh.device());
    const int64_t m = xh.size(0);
    Tensor z = at::zeros({m, nt * 16L}, xh.options().dtype(at::kFloat));
    if (m == 0 || kt == 0) return z;
    exl3::GemmArgs a{};
    a.x = reinterpret_cast<const __half*>(xh.data_ptr());
    a.trellis = reinterpret_cast<const uint32_t*>(trellis.data_ptr());
    a.z = z.data_ptr<float>();
    a.sink = nullptr;
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

// Spec 4.3: y = fp16(Had(z) ) * svh with z = fp16(Had(fp16(x*suh))) @ Ŵ; the seam of linear.py
Tensor gemm(const Tensor& x, const Tensor& trellis, const Tensor& suh, const Tensor& svh, int64_t codebook) {
    const int k = check_trellis(trellis, 0, codebook, "exl3::exl3_gemm");
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kHalf && x.dim() == 2,
                "exl3::exl3_gemm: x must be a CUDA fp16 [m, k] tensor, got ", x.scalar_type(), " ", x.sizes());
    const int64_t kd = trellis.size(0) * 16, nd = trellis.size(1) * 16;
    TORCH_CHECK(x.size(1) == kd, "exl3::exl3_gemm: x has ", x.size(1), " columns, the trellis ", kd);
    TORCH_CHECK(suh.numel() == kd && svh.numel() == nd, "exl3::exl3_gemm: suh/svh must have ", kd, "/", nd,
                " elements, got ", suh.numel(), "/", svh.numel());
    c10::cuda::CUDAGuard guard(x.device());
    Tensor su = suh.to(at::kHalf).contiguous(), sv = svh.to(at::kHalf).contiguous();
    Tensor xh = had128(x, su, c10::nullopt, true);
    Tensor z;
    if (x.size(0) <= GEMM_MAX_M) {
        z = gemm_xh(xh, trellis, k, codebook, 0);
    } else {
        z = at::matmul(xh, reconstruct(trellis, k, codebook));  // fp16 cuBLAS, fp32 accumulation
    }
    return had128(z, c10::nullopt, sv, true);
}

// decode-only ceiling: decode every tile of `trellis` with the GEMM's decoder, no activations
Tensor decode_bench(const Tensor& trellis, int64_t K, int64_t codebook, int64_t kt_per_warp) {
    const int k = check_trellis(trellis, K, codebook, "exl3::decode_bench");
    const int kt = (int)trellis.size(0), nt = (int)trellis.size(1);
    TORCH_CHECK(nt % (exl3::GEMM_NT * exl3::GEMM_WARPS) == 0, "exl3::decode_bench: n must be a multiple of 128");
    c10::cuda::CUDAGuard guard(trellis.device());
    exl3::GemmArgs a{};
    a.trellis = reinterpret_cast<const uint32_t*>(trellis.data_ptr());
    a.m = 0;
    a.k_tiles = kt;
    a.n_tiles = nt;
    a.kt_per_warp = (int)kt_per_warp;
    // room for one float per warp at the finest split (kt_per_warp = 1)
    const int64_t warps = (int64_t)(nt / exl3::GEMM_NT) * kt;
    Tensor sink = at::empty({warps + exl3::GEMM_WARPS}, trellis.options().dtype(at::kFloat));
    a.sink = sink.data_ptr<float>();
    exl3::launch_gemm((int)codebook, k, 0, a, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return sink;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3, m) {
    m.def("reconstruct(Tensor trellis, int K, int codebook) -> Tensor");
    m.def("exl3_gemm(Tensor x, Tensor trellis, Tensor suh, Tensor svh, int codebook) -> Tensor");
    m.def("exl3_gemm_xh(Tensor xh, Tensor trellis, int K, int codebook, int kt_per_warp=0) -> Tensor");
    m.def("had128(Tensor x, Tensor? pre_scale=None, Tensor? post_scale=None, bool out_fp16=True) -> Tensor");
    m.def("decode_bench(Tensor trellis, int K, int codebook, int kt_per_warp=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3, CUDA, m) {
    m.impl("reconstruct", &reconstruct);
    m.impl("exl3_gemm", &gemm);
    m.impl("exl3_gemm_xh", &gemm_xh);
    m.impl("had128", &had128);
    m.impl("decode_bench", &decode_bench);
}
