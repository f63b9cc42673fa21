"""``quantize_linear`` on the GPU (the path ``exl3 convert --device cuda`` takes) against the CPU path.

The regularisation, Hessian factorisation and LDLQ run in GPU floating point, so the encoder's
inputs differ from the CPU's in the last bits and the chosen states may differ; what must hold is
that the result is a valid checkpoint (CPU tensors, tail-biting states, reads back to what the
metrics were computed on) of the same quality as the CPU conversion.
"""
from __future__ import annotations

import pytest
import torch

from exl3_core.quant.exl3.hessian import HessianAccumulator
from exl3_core.quant.exl3.quantize import dequantize_padded, quantize_linear
from exl3_core.quant.exl3.viterbi import has_cuda

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize(("k", "n", "K"), [(384, 256, 4), (256, 640, 2), (320, 200, 3)])
def test_gpu_quantize_matches_cpu_quality(k: int, n: int, K: int) -> None:
    if not torch.cuda.is_available() or not has_cuda():
        pytest.skip("needs CUDA and the compiled CUDA Viterbi encoder")
    g = torch.Generator().manual_seed(k * n + K)
    w = torch.randn(n, k, generator=g) * 0.02
    x = torch.randn(4096, k, generator=g) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / k**0.5)
    infos = {}
    for dev in ("cpu", "cuda"):
        acc = HessianAccumulator(k)
        acc.add(x.to(dev))
        infos[dev] = acc.finalize(seed=7)
    h_gpu, h_cpu = infos["cuda"], infos["cpu"]
    assert h_gpu.l_u is not None and h_gpu.l_u.is_cuda
    assert torch.allclose(h_gpu.l_u.cpu(), h_cpu.l_u, atol=1e-4, rtol=1e-3)
    q_cpu = quantize_linear(w, h_cpu, K=K, seed=3, name="cpu")
    q_gpu = quantize_linear(w.cuda(), h_gpu, K=K, seed=3, name="gpu")
    for t in (q_gpu.trellis, q_gpu.suh, q_gpu.svh):
        assert t.device.type == "cpu"
    assert q_gpu.trellis.shape == q_cpu.trellis.shape and q_gpu.trellis.dtype == torch.int16
    # quality: the same proxy error up to encoder tie-breaks on slightly different inputs
    assert q_gpu.proxy_err <= q_cpu.proxy_err * 1.05 + 1e-6, (q_gpu.proxy_err, q_cpu.proxy_err)
    # the stored tensors read back to a weight with the reported error
    w_q = dequantize_padded(q_gpu.trellis, q_gpu.suh, q_gpu.svh, K, q_gpu.codebook)
    w_pad = torch.zeros_like(w_q)
    w_pad[:k, :n] = w.T
    nmse = float((w_q - w_pad).pow(2).sum() / w.pow(2).sum())
    assert abs(nmse - q_gpu.nmse) <= 1e-3 * max(q_gpu.nmse, 1e-6) + 1e-7
