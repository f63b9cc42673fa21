// Hessian accumulation for the EXL3 quantizer (format spec 5.1): H += xᵀx in fp32 over the rows of
// x that are entirely finite (rows holding NaN/inf are dropped, as the calibration capture does).
//
// Op: exl3::hessian_accumulate(Tensor(a!) H, Tensor x) -> ()
//   H: fp32 [k, k], updated in place; x: fp16 / bf16 / fp32 [rows, k] on the same device.
// The schema is declared here (compiled in every build); csrc/quant/hessian_cuda.cu adds the CUDA
// kernel. Python: exl3_core/quant/exl3/hessian_ops.py (accumulate_hessian, with a torch fallback).
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

void hessian_accumulate_cpu(at::Tensor H, const at::Tensor& x) {
    TORCH_CHECK(H.device().is_cpu() && x.device().is_cpu(),
                "exl3::hessian_accumulate (csrc/cpu/hessian.cpp): H and x must be CPU tensors here, got ", H.device(),
                " and ", x.device());
    TORCH_CHECK(H.scalar_type() == at::kFloat && H.dim() == 2 && H.size(0) == H.size(1),
                "exl3::hessian_accumulate: H must be float32 [k, k], got ", H.scalar_type(), " ", H.sizes());
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H.size(0),
                "exl3::hessian_accumulate: x must be [rows, k] with k = ", H.size(0), ", got ", x.sizes(),
                " (reshape activations to [-1, k])");
    TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                "exl3::hessian_accumulate: x must be float16, bfloat16 or float32, got ", x.scalar_type());
    if (x.size(0) == 0) return;
    at::Tensor xf = x.to(at::kFloat);  // products and sums in fp32 (a CPU fp16 GEMM would round to fp16)
    const at::Tensor keep = xf.isfinite().all(1);
    if (!keep.all().item<bool>()) xf = xf.index({keep});
    H.addmm_(xf.t(), xf);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3, m) {
    m.def("hessian_accumulate(Tensor(a!) H, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(exl3, CPU, m) {
    m.impl("hessian_accumulate", &hessian_accumulate_cpu);
}
