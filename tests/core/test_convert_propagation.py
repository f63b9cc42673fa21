"""Error-propagation target (convert/propagation.py) against a direct least-squares oracle."""
from __future__ import annotations

import torch

from exl3_core.convert.propagation import DAMP, CrossAccumulator, propagated_weight


def _data(seed: int, rows: int = 4000, k: int = 48, n: int = 24) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x_f = torch.randn(rows, k, generator=g, dtype=torch.float64) @ torch.randn(k, k, generator=g, dtype=torch.float64)
    # upstream quantization error: a systematic distortion (what the target can undo) plus noise
    distort = torch.eye(k, dtype=torch.float64) + 0.1 * torch.randn(k, k, generator=g, dtype=torch.float64)
    x_q = x_f @ distort + 0.05 * torch.randn(rows, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    return x_f, x_q, w


def test_full_step_is_the_damped_least_squares_target() -> None:
    x_f, x_q, w = _data(0)
    h, c = x_q.T @ x_q, x_q.T @ x_f
    got = propagated_weight(w, h, c, 1.0)
    lam = DAMP * float(h.diagonal().mean())
    # oracle: W*ᵀ = Wᵀ + (H + λI)⁻¹ (C − H) Wᵀ, written out with an explicit inverse
    want = (w.T + torch.linalg.inv(h + lam * torch.eye(h.shape[0], dtype=h.dtype)) @ (c - h) @ w.T).T
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)
    # and it moves the output towards the unquantized model's: ‖X_q W'ᵀ − X_f Wᵀ‖ < ‖X_q Wᵀ − X_f Wᵀ‖
    ref = x_f @ w.T
    e0 = float((x_q @ w.T - ref).norm())
    e1 = float((x_q @ got.T - ref).norm())
    assert e1 < 0.5 * e0, (e0, e1)


def test_blend_and_no_upstream_error() -> None:
    x_f, x_q, w = _data(1)
    h, c = x_q.T @ x_q, x_q.T @ x_f
    full, half = propagated_weight(w, h, c, 1.0), propagated_weight(w, h, c, 0.5)
    assert torch.allclose(half, 0.5 * (w + full), rtol=1e-9, atol=1e-9)
    assert torch.equal(propagated_weight(w, h, c, 0.0), w)
    hf = x_f.T @ x_f  # inputs without upstream error: C == H, nothing to correct
    assert torch.allclose(propagated_weight(w, hf, hf.clone(), 1.0), w, rtol=0, atol=1e-12)


def test_cross_accumulator_gives_up_on_mismatched_rows() -> None:
    acc = CrossAccumulator()
    acc.add(torch.randn(10, 4), torch.randn(10, 4))
    assert acc.valid and acc.c_sum is not None and acc.c_sum.shape == (4, 4)
    acc.add(torch.randn(10, 4), torch.randn(7, 4))  # routed experts saw other rows in the two passes
    assert not acc.valid
    bad = CrossAccumulator()
    bad.add(torch.randn(3, 4), torch.full((3, 4), float("nan")))
    assert not bad.valid


def test_strength_default_and_validation() -> None:
    import pytest

    from exl3_core.convert.pipeline import ConvertArgs
    from exl3_core.convert.propagation import AUTO_ALPHA, AUTO_BELOW_BPW, default_strength

    assert default_strength(2.0) == AUTO_ALPHA and default_strength(AUTO_BELOW_BPW) == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="--propagate"):
            ConvertArgs(in_dir="a", out_dir="b", bpw=2.0, propagate=bad).validate()
