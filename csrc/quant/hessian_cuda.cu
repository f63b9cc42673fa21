// CUDA implementation of exl3::hessian_accumulate (schema in csrc/cpu/hessian.cpp): H += xᵀx in
// fp32 over the entirely finite rows of x (format spec 5.1).
//
// Rows holding NaN/inf are replaced by zeros instead of being removed, so nothing waits on the host
// for the row count (a zero row adds exact zeros). fp16/bf16 x goes through one tensor-core GEMM
// with fp32 accumulation and fp32 output (at::mm with out_dtype; the fp16 x fp16 products are exact
// in fp32); fp32 x uses addmm_ directly, whose precision follows torch's fp32 matmul setting
// (torch.backends.cuda.matmul.allow_tf32, off by default).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/version.h>

// aten::mm.dtype (fp16/bf16 inputs, fp32 output) is recent; older torch converts x to fp32 first
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#define EXL3_HAVE_MM_DTYPE 1
#else
#define EXL3_HAVE_MM_DTYPE 0
#endif

namespace {

void hessian_accumulate_cuda(at::Tensor H, const at::Tensor& x) {
    TORCH_CHECK(H.is_cuda() && x.is_cuda() && H.device() == x.device(),
                "exl3::hessian_accumulate (csrc/quant/hessian_cuda.cu): H and x must be on the same CUDA device, got ",
                H.device(), " and ", x.device());
    TORCH_CHECK(H.scalar_type() == at::kFloat && H.dim() == 2 && H.size(0) == H.size(1),
                "exl3::hessian_accumulate: H must be float32 [k, k], got ", H.scalar_type(), " ", H.sizes());
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H.size(0),
                "exl3::hessian_accumulate: x must be [rows, k] with k = ", H.size(0), ", got ", x.sizes(),
                " (reshape activations to [-1, k])");
    TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                "exl3::hessian_accumulate: x must be float16, bfloat16 or float32, got ", x.scalar_type());
    if (x.size(0) == 0 || x.size(1) == 0) return;
    c10::cuda::CUDAGuard guard(x.device());
    const at::Tensor keep = x.isfinite().all(1, /*keepdim=*/true);
    const at::Tensor xm = at::where(keep, x, at::zeros({}, x.options()));
    if (x.scalar_type() == at::kFloat || !EXL3_HAVE_MM_DTYPE) {
        const at::Tensor xf = xm.to(at::kFloat);
        H.addmm_(xf.t(), xf);
    } else {
#if EXL3_HAVE_MM_DTYPE
        H.add_(at::mm(xm.t(), xm, at::kFloat));
#endif
    }
}

}  // namespace

TORCH_LIBRARY_IMPL(exl3, CUDA, m) {
    m.impl("hessian_accumulate", &hessian_accumulate_cuda);
}
