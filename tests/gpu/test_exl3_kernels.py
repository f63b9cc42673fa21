"""EXL3 CUDA kernels against the pure-torch oracles (codebook.py / trellis.py / hadamard.py).

Fresh random trellis words every test (any bit stream is a valid EXL3 encoding); outputs are
poisoned with NaN before the kernels write them.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from exl3_core.quant.exl3 import CB_3INST, CB_MCG, CB_MUL1, EXL3Linear, cuda_ops
from exl3_core.quant.exl3.hadamard import had_blockwise
from exl3_core.quant.exl3.linear import exl3_matmul, exl3_matmul_reference
from exl3_core.quant.exl3.trellis import decode_inner

pytestmark = pytest.mark.cuda
CBS = (CB_3INST, CB_MCG, CB_MUL1)
DEV = "cuda"
# exl3_gemm_xh against fp64 over Ŵ: the fp16 products are exact in the fp32 mma accumulators, only the
# order of the fp32 sums differs
GEMM_TOL = 1e-5


def rand_trellis(k: int, n: int, K: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device=device)


def poison(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Fill and free a block of the op's output size: the caching allocator hands it back next."""
    t = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    del t


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    return ((a64 - b64).norm() / b64.norm()).item()


@pytest.mark.parametrize("cb", CBS)
@pytest.mark.parametrize("K", range(1, 9))
@pytest.mark.parametrize("shape", [(128, 384), (384, 128), (4096, 1024)])
def test_reconstruct_bit_exact(exl3_ops, K: int, cb: int, shape: tuple[int, int]) -> None:
    k, n = shape
    trellis = rand_trellis(k, n, K)
    ref = decode_inner(trellis, K, cb)  # CPU oracle
    poison((k, n), torch.float16)
    out = exl3_ops.reconstruct(trellis.to(DEV), K, cb)
    assert out.dtype == torch.float16 and tuple(out.shape) == (k, n)
    out = out.cpu()
    assert not out.isnan().any(), "reconstruct left elements unwritten"
    mism = (out.view(torch.int16) != ref.view(torch.int16)).sum().item()
    assert mism == 0, f"K={K} cb={cb} {shape}: {mism} of {k * n} fp16 bit patterns differ from the oracle"


@pytest.mark.parametrize("cb", CBS)
@pytest.mark.parametrize("m", [1, 2, 7, 16, 33, 128])
def test_gemm_xh_k4(exl3_ops, m: int, cb: int) -> None:
    k, n = 512, 384
    trellis = rand_trellis(k, n, 4, DEV)
    xh = torch.randn(m, k, device=DEV).to(torch.float16)
    ref = xh.double() @ decode_inner(trellis, 4, cb).double()
    poison((m, n), torch.float32)
    z = exl3_ops.exl3_gemm_xh(xh, trellis, 4, cb)
    assert z.dtype == torch.float32 and tuple(z.shape) == (m, n)
    assert not z.isnan().any()
    assert rel_err(z, ref) < GEMM_TOL


@pytest.mark.parametrize("cb", CBS)
@pytest.mark.parametrize("K", range(1, 9))
@pytest.mark.parametrize("m", [1, 33])
def test_gemm_xh_every_k(exl3_ops, m: int, K: int, cb: int) -> None:
    k, n = 1024, 256
    trellis = rand_trellis(k, n, K, DEV)
    xh = torch.randn(m, k, device=DEV).to(torch.float16)
    ref = xh.double() @ decode_inner(trellis, K, cb).double()
    for kt in (0, 3):  # default split-k and an odd split that leaves a short last chunk
        z = exl3_ops.exl3_gemm_xh(xh, trellis, K, cb, kt)
        err = rel_err(z, ref)
        assert err < GEMM_TOL, f"K={K} cb={cb} m={m} kt_per_warp={kt}: rel {err:.2e}"


def test_wrappers_reject_bad_arguments(exl3_ops) -> None:
    trellis = rand_trellis(128, 128, 3, DEV)
    with pytest.raises(ValueError, match="K=3"):
        cuda_ops.reconstruct_cuda(trellis, 4, CB_MUL1)
    with pytest.raises(ValueError, match="codebook"):
        cuda_ops.reconstruct_cuda(trellis, 3, 7)
    with pytest.raises(ValueError, match="multiple of 128"):
        cuda_ops.had128_cuda(torch.zeros(2, 100, device=DEV))


def test_op_error_is_a_python_exception(exl3_ops) -> None:
    # In a subprocess: an extension built by a compiler that breaks C++ exceptions across libraries (the
    # device image's /opt/gcc wrapper, see bench/device_env.sh) crashes here instead of raising.
    code = (
        "import torch; from exl3_core import ext; ext.load()\n"
        "t = torch.zeros(8, 8, 48, dtype=torch.int16, device='cuda')\n"
        "try:\n    torch.ops.exl3.reconstruct(t, 4, 2)\nexcept RuntimeError as e:\n    print('raised', 'K=3' in str(e))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "raised True" in r.stdout, (r.returncode, r.stderr[-500:])


@pytest.mark.parametrize("in_dtype,out_fp16", [(torch.float32, False), (torch.float16, True), (torch.float32, True)])
def test_had128(exl3_ops, in_dtype: torch.dtype, out_fp16: bool) -> None:
    x = torch.randn(5, 3, 384, device=DEV).to(in_dtype)
    pre = (torch.randn(384, device=DEV) * 0.5 + 1).to(torch.float16)
    post = (torch.randn(384, device=DEV) * 0.5 + 1).to(torch.float16)
    poison(x.shape, torch.float16 if out_fp16 else torch.float32)
    y = exl3_ops.had128(x, pre, post, out_fp16)
    # spec 4.3 rounding: (fp16 x * fp16 pre) in the input dtype, fp32 butterfly, fp16 round, * post
    xs = (x * pre.to(in_dtype)).to(torch.float32)
    ref = had_blockwise(xs.double(), dim=-1)
    ref = (ref.to(torch.float16) * post).double() if out_fp16 else ref * post.double()
    assert y.dtype == (torch.float16 if out_fp16 else torch.float32) and y.shape == x.shape
    assert not y.isnan().any()
    assert rel_err(y, ref) < (2e-3 if out_fp16 else 1e-6)


def _layer(k: int, n: int, K: int, cb: int) -> EXL3Linear:
    suh = (torch.randn(k).sign() * (0.5 + torch.rand(k))).to(torch.float16)
    svh = (torch.randn(n).sign() * (0.02 + 0.02 * torch.rand(n))).to(torch.float16)
    return EXL3Linear(rand_trellis(k, n, K), suh, svh, cb, k, n).to(DEV)


@pytest.mark.parametrize("cb", CBS)
@pytest.mark.parametrize("m", [1, 2, 7, 16, 33, 128])
def test_exl3_gemm_seam(exl3_ops, m: int, cb: int) -> None:
    layer = _layer(512, 384, 4, cb)
    x = torch.randn(m, 512, device=DEV).to(torch.float16)
    ref = exl3_matmul_reference(x.float(), layer)  # fp32, no intermediate rounding
    poison((m, 384), torch.float16)
    y = exl3_matmul(x, layer)  # the linear layer's seam -> torch.ops.exl3.exl3_gemm
    assert y.dtype == torch.float16 and tuple(y.shape) == (m, 384)
    assert not y.isnan().any()
    # fp16 rounding of x*suh, xh, Had(z) and *svh: a few fp16 ulps in all
    assert rel_err(y, ref) < 4e-3
