"""Hessian accumulation (spec 5.1): compiled CPU op and torch fallback against an fp64 oracle."""
from __future__ import annotations

import pytest
import torch

from exl3_core.quant.exl3 import hessian_ops as hops

needs_op = pytest.mark.skipif(
    not hops.has_op("cpu"),
    reason="compiled op exl3::hessian_accumulate unavailable (python setup.py build_ext --inplace)",
)
IMPLS = [pytest.param("op", marks=needs_op), "torch"]


def _oracle(H0: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fp64 H0 + xᵀx over rows without NaN/inf, from the values x holds (after its own dtype)."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float64)
    x2 = x2[torch.isfinite(x2).all(dim=1)]
    return H0.to(torch.float64) + x2.T @ x2, x2.shape[0]


def _poison_rows(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Put NaN, +inf and -inf into a few random rows (one bad element each)."""
    x = x.clone()
    rows = torch.randperm(x.shape[0], generator=g)[:6]
    cols = torch.randint(0, x.shape[1], (6,), generator=g)
    for r, c, v in zip(rows.tolist(), cols.tolist(), [float("nan"), float("inf"), -float("inf")] * 2):
        x[r, c] = v
    return x


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matches_oracle_and_drops_nonfinite_rows(impl: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    k = 96
    x = _poison_rows(torch.randn(200, k, generator=g) * 3, g).to(dtype)
    H0 = torch.randn(k, k, generator=g)
    H0 = H0 @ H0.T  # a previous accumulation
    H = H0.clone()
    n = hops.accumulate_hessian(H, x, impl=impl)
    ref, n_ref = _oracle(H0, x)
    assert n == n_ref == 194
    assert torch.isfinite(H).all()
    err = ((H.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-6, f"{impl} {dtype}: relative error {err:.3g} vs the fp64 oracle"
    assert torch.equal(H, H.T) or (H - H.T).abs().max() <= 1e-4 * H.abs().max()


@pytest.mark.parametrize("impl", IMPLS)
def test_batched_input_all_bad_and_empty(impl: str) -> None:
    g = torch.Generator().manual_seed(3)
    k = 32
    x = torch.randn(3, 5, k, generator=g)  # [batch, seq, k] is flattened to rows
    H = torch.zeros(k, k)
    assert hops.accumulate_hessian(H, x, impl=impl) == 15
    ref, _ = _oracle(torch.zeros(k, k), x)
    torch.testing.assert_close(H.double(), ref, rtol=1e-6, atol=1e-5)
    before = H.clone()
    assert hops.accumulate_hessian(H, torch.full((4, k), float("nan")), impl=impl) == 0
    assert hops.accumulate_hessian(H, torch.empty(0, k), impl=impl) == 0
    assert torch.equal(H, before)


@needs_op
def test_op_equals_fallback_on_clean_fp32() -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 48, generator=g)
    Ha, Hb = torch.zeros(48, 48), torch.zeros(48, 48)
    hops.accumulate_hessian(Ha, x, impl="op")
    hops.accumulate_hessian(Hb, x, impl="torch")
    torch.testing.assert_close(Ha, Hb, rtol=1e-6, atol=1e-5)


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match="float32 \\[k, k\\]"):
        hops.accumulate_hessian(torch.zeros(4, 4, dtype=torch.float16), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="must end in k = 4"):
        hops.accumulate_hessian(torch.zeros(4, 4), torch.zeros(2, 5))
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        hops.accumulate_hessian(torch.zeros(4, 4), torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="impl="):
        hops.accumulate_hessian(torch.zeros(4, 4), torch.zeros(2, 4), impl="cuda")  # type: ignore[arg-type]
