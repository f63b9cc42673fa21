// torch.ops.exl3_bench.decode_only: the decode-only ceiling kernel (decode_only.cuh) as a torch op, built as
// its own extension by bench/ext/build.py so that exl3_core._C carries no benchmark code.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "decode_only.cuh"

namespace {

using at::Tensor;

// Decodes every tile of `trellis` once; returns the sink (one float per warp, contents meaningless).
Tensor decode_only(const Tensor& trellis, int64_t codebook, int64_t kt_per_warp) {
    const char* op = "exl3_bench::decode_only";
    TORCH_CHECK(trellis.is_cuda() && trellis.scalar_type() == at::kShort && trellis.dim() == 3 &&
                    trellis.is_contiguous(),
                op, ": trellis must be a contiguous CUDA int16 [k/16, n/16, 16K] tensor, got ", trellis.scalar_type(),
                " ", trellis.sizes());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(trellis.data_ptr()) % 16 == 0, op,
                ": trellis data must be 16-byte aligned (pass trellis.clone())");
    TORCH_CHECK(trellis.size(2) % 16 == 0 && trellis.size(2) >= 16 && trellis.size(2) <= 128, op,
                ": trellis last dim ", trellis.size(2), " is not 16*K with K in 1..8");
    TORCH_CHECK(codebook >= 0 && codebook <= 2, op, ": codebook ", codebook, " unknown; expected 0, 1 or 2");
    TORCH_CHECK(kt_per_warp >= 0, op, ": kt_per_warp must be >= 0 (0: the launcher's pick), got ", kt_per_warp);
    const int kt = (int)trellis.size(0), nt = (int)trellis.size(1);
    TORCH_CHECK(nt % exl3::BLOCK_TILES == 0, op, ": n = ", nt * 16L, " must be a multiple of 128");
    c10::cuda::CUDAGuard guard(trellis.device());
    exl3_bench::DecodeOnlyArgs a{};
    a.trellis = reinterpret_cast<const uint32_t*>(trellis.data_ptr());
    a.k_tiles = kt;
    a.n_tiles = nt;
    a.kt_per_warp = (int)kt_per_warp;
    // room for one float per warp at the finest split (one k tile per warp)
    Tensor sink = at::empty({exl3_bench::decode_only_warps(kt, nt, 1) + 1}, trellis.options().dtype(at::kFloat));
    a.sink = sink.data_ptr<float>();
    if (kt > 0 && nt > 0) {
        exl3_bench::launch_decode_only((int)codebook, (int)(trellis.size(2) / 16), a, at::cuda::getCurrentCUDAStream());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return sink;
}

}  // namespace

TORCH_LIBRARY(exl3_bench, m) { m.def("decode_only(Tensor trellis, int codebook, int kt_per_warp=0) -> Tensor"); }

TORCH_LIBRARY_IMPL(exl3_bench, CUDA, m) { m.impl("decode_only", &decode_only); }
