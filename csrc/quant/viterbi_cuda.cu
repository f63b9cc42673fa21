// CUDA implementation of exl3::viterbi_encode (schema declared in csrc/cpu/viterbi.cpp).
//
// Same contract and bit-identical states as the CPU op: tiles fp32 [N, 256] (sequence order),
// lut fp32 [65536] (codebook values, which are fp16 numbers), K in 1..8 -> int32 [N, 256] states.
// `mode` selects the CPU op's survivor storage; it is validated and otherwise ignored here (every
// mode gives the same states). The kernel keeps the LUT as fp16 in shared memory, so the LUT must
// hold fp16-representable values (codebook.lut always does); anything else is refused.
// The algorithm is in viterbi_kernel.cuh, the kernel and launcher in viterbi_cuda.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "viterbi_cuda.cuh"

namespace {

at::Tensor viterbi_encode_cuda(const at::Tensor& tiles, const at::Tensor& lut, int64_t K, int64_t mode) {
    TORCH_CHECK(K >= 1 && K <= 8, "exl3::viterbi_encode (CUDA): K=", K, " is outside 1..8");
    TORCH_CHECK(mode >= 0 && mode <= 2, "exl3::viterbi_encode (CUDA): mode=", mode,
                " is invalid (0 = per-K default, 1 = survivor table, 2 = cost history)");
    TORCH_CHECK(tiles.is_cuda() && lut.is_cuda() && tiles.device() == lut.device(),
                "exl3::viterbi_encode (csrc/quant/viterbi_cuda.cu): tiles and lut must be on the same CUDA device, got ",
                tiles.device(), " and ", lut.device());
    TORCH_CHECK(tiles.scalar_type() == at::kFloat && tiles.dim() == 2 && tiles.size(1) == exl3vit::kSeq,
                "exl3::viterbi_encode (CUDA): tiles must be float32 [N, 256] (sequence order), got ",
                tiles.scalar_type(), " ", tiles.sizes());
    TORCH_CHECK(lut.scalar_type() == at::kFloat && lut.dim() == 1 && lut.size(0) == exl3vit::kStates,
                "exl3::viterbi_encode (CUDA): lut must be float32 [65536] (codebook values per state), got ",
                lut.scalar_type(), " ", lut.sizes());
    c10::cuda::CUDAGuard guard(tiles.device());
    const at::Tensor t = tiles.contiguous();
    const at::Tensor l = lut.contiguous();
    TORCH_CHECK(t.numel() == 0 || t.abs().le(65504.0).all().item<bool>(),
                "exl3::viterbi_encode (CUDA): tiles hold non-finite values or |w| > 65504");
    const at::Tensor l16 = l.to(at::kHalf);
    TORCH_CHECK(l.isfinite().all().item<bool>() && l16.to(at::kFloat).equal(l),
                "exl3::viterbi_encode (CUDA): lut must hold finite fp16-representable values "
                "(use exl3_core.quant.exl3.codebook.lut(cb).float())");
    const int64_t n = t.size(0);
    at::Tensor out = at::empty({n, exl3vit::kSeq}, t.options().dtype(at::kInt));
    if (n == 0) return out;

    exl3vit::Plan p{};
    cudaError_t e = exl3vit::plan((int)K, n, t.device().index(), p);
    TORCH_CHECK(e == cudaSuccess, "exl3::viterbi_encode (CUDA): cannot configure the K=", K, " kernel (",
                p.smem, " bytes of shared memory per block): ", cudaGetErrorString(e));
    at::Tensor surv = at::empty({(int64_t)p.surv_bytes}, t.options().dtype(at::kByte));
    at::Tensor dscr = at::empty({(int64_t)p.dscratch_floats + 1}, t.options());
    exl3vit::Args a{};
    a.tiles = t.data_ptr<float>();
    a.n_tiles = n;
    a.lut = reinterpret_cast<const uint16_t*>(l16.data_ptr());
    a.out = out.data_ptr<int32_t>();
    a.surv = surv.data_ptr<uint8_t>();
    a.dscratch = dscr.data_ptr<float>();
    e = exl3vit::launch((int)K, p, a, c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(e == cudaSuccess, "exl3::viterbi_encode (CUDA): launch failed: ", cudaGetErrorString(e));
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(exl3, CUDA, m) {
    m.impl("viterbi_encode", &viterbi_encode_cuda);
}
