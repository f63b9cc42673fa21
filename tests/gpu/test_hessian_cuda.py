"""CUDA Hessian accumulation (csrc/quant/hessian_cuda.cu) against an fp64 oracle and the CPU op."""
from __future__ import annotations

import pytest
import torch

from exl3_core.quant.exl3 import hessian_ops as hops

pytestmark = pytest.mark.cuda
DEV = "cuda"


@pytest.fixture(scope="module")
def need_op() -> None:
    from exl3_core import ext

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not hops.has_op(DEV):
        pytest.fail("exl3::hessian_accumulate has no CUDA kernel; build with nvcc "
                    f"(TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace). load errors: {ext.load_error}")


def oracle(H0: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    x2 = x.reshape(-1, x.shape[-1]).cpu().double()
    x2 = x2[torch.isfinite(x2).all(dim=1)]
    return H0.cpu().double() + x2.T @ x2, x2.shape[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2048, 256), (777, 1024), (4, 2, 512)])
def test_cuda_matches_oracle(need_op, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 2
    flat = x.view(-1, shape[-1])
    bad = torch.randperm(flat.shape[0], generator=g)[:3]
    flat[bad[0], 0], flat[bad[1], -1], flat[bad[2], 5] = float("nan"), float("inf"), -float("inf")
    x = x.to(dtype)
    k = shape[-1]
    H0 = torch.eye(k) * 3
    H = H0.to(DEV)
    n = hops.accumulate_hessian(H, x.to(DEV), impl="op")
    ref, n_ref = oracle(H0, x)
    assert n == n_ref
    Hc = H.cpu()
    assert torch.isfinite(Hc).all(), "a non-finite row leaked into H"
    err = ((Hc.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, f"{dtype} {shape}: relative error {err:.3g}"
    # same result as the CPU op up to fp32 summation order
    Hcpu = H0.clone()
    hops.accumulate_hessian(Hcpu, x, impl="op")
    # fp32 sums of ~2000 rows in another order: differences scale with the largest entry, not 1,
    # and a sum of n positive terms may differ by up to ~n*eps relative (H200: 1.04e-5 seen on a
    # diagonal entry of 8.9e3); the fp64-oracle check above is the accuracy bound
    torch.testing.assert_close(Hc, Hcpu, rtol=1e-4, atol=4e-7 * Hcpu.abs().max().item())


def test_cuda_all_rows_bad_leaves_h(need_op) -> None:
    H = torch.ones(64, 64, device=DEV)
    x = torch.full((10, 64), float("nan"), device=DEV, dtype=torch.float16)
    assert hops.accumulate_hessian(H, x, impl="op") == 0
    assert torch.equal(H.cpu(), torch.ones(64, 64))
