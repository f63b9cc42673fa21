"""Closed-form refit of the stored scales (quant/exl3/scale_refit.py) and its convert option.

Oracles: the objective tr(EᵀHE) formed densely in fp64, and an fp64 least-squares solve of each
step written as one stacked regression (independent of the Hadamard-product algebra in the module).
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from exl3_core.convert import pipeline
from exl3_core.convert.cli import add_cli
from exl3_core.convert.pipeline import ConvertArgs
from exl3_core.convert.workdir import Job, ResumeError, WorkDir
from exl3_core.quant.exl3 import viterbi
from exl3_core.quant.exl3.hadamard import get_hadamard
from exl3_core.quant.exl3.hessian import HessianAccumulator, sign_pattern
from exl3_core.quant.exl3.quantize import quantize_linear
from exl3_core.quant.exl3.scale_refit import original_hessian, refit_scales, scale_objective


def _problem(k: int, n: int, seed: int, noise: float = 0.1) -> tuple[torch.Tensor, ...]:
    """Target W, a 'quantized' M close to diag(1/su)·W·diag(1/sv), scales su/sv, and a PSD H."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=g, dtype=torch.float64) * (1 + torch.rand(k, 1, generator=g, dtype=torch.float64))
    su = (0.5 + torch.rand(k, generator=g, dtype=torch.float64)) * sign_pattern(k, seed).double()
    sv = (0.5 + torch.rand(n, generator=g, dtype=torch.float64)) * sign_pattern(n, seed + 1).double()
    m = w / su[:, None] / sv[None, :]
    m = m + noise * torch.randn(k, n, generator=g, dtype=torch.float64) * m.std()
    x = torch.randn(4 * k, k, generator=g, dtype=torch.float64) @ (
        torch.randn(k, k, generator=g, dtype=torch.float64) / math.sqrt(k) + 0.5 * torch.eye(k, dtype=torch.float64))
    h = x.T @ x / x.shape[0]
    # the scales the quantizer hands over are fp32, mildly off (regularisation picks them from RMS stats)
    su_in = (su * (1 + 0.05 * torch.randn(k, generator=g, dtype=torch.float64))).float()
    sv_in = (sv * (1 + 0.05 * torch.randn(n, generator=g, dtype=torch.float64))).float()
    return w.float(), m.float(), su_in, sv_in, h


@pytest.mark.parametrize("seed", range(6))
def test_refit_never_increases_the_objective_and_stays_fp16(seed: int) -> None:
    k, n = 24 + 8 * seed, 40 - 4 * seed
    w, m, su, sv, h = _problem(k, n, seed, noise=0.05 + 0.1 * seed)
    r = refit_scales(w, m, su, sv, h)
    c = float((w.double() * (h @ w.double())).sum())
    before = scale_objective(w, m, su.half(), sv.half(), h) / c
    assert r.before == pytest.approx(before, rel=1e-9)
    assert r.accepted, r.reason
    su_h, sv_h = r.su.half(), r.sv.half()
    assert bool(torch.isfinite(su_h).all()) and bool(torch.isfinite(sv_h).all())
    after = scale_objective(w, m, su_h, sv_h, h) / c  # what a reader of the stored fp16 scales gets
    assert after == pytest.approx(r.after, rel=1e-9)
    assert after < before
    # never worse even when the codes are useless (pure noise M): rejected or better
    g = torch.Generator().manual_seed(100 + seed)
    junk = torch.randn(k, n, generator=g)
    rj = refit_scales(w, junk, su, sv, h)
    if rj.accepted:
        assert scale_objective(w, junk, rj.su.half(), rj.sv.half(), h) < \
            scale_objective(w, junk, su.half(), sv.half(), h)
    else:
        assert torch.equal(rj.su, su) and torch.equal(rj.sv, sv)


def _lstsq_cols(w, m, s, h):
    """t_j = argmin ‖Lᵀ(w_j − t·(s∘m_j))‖, one 1-D regression per column (H = L Lᵀ)."""
    lt = torch.linalg.cholesky(h).T
    u = lt @ (s[:, None] * m)
    y = lt @ w
    return torch.stack([torch.linalg.lstsq(u[:, j: j + 1], y[:, j: j + 1]).solution[0, 0] for j in range(w.shape[1])])


def _lstsq_rows(w, m, t, h):
    """s = argmin Σ_j ‖Lᵀ(w_j − diag(m_j t_j)·s)‖²: the n column problems stacked into one regression."""
    lt = torch.linalg.cholesky(h).T
    v = m * t[None, :]
    a = torch.cat([lt * v[:, j][None, :] for j in range(w.shape[1])])  # Lᵀ·diag(v_j)
    y = torch.cat([lt @ w[:, j] for j in range(w.shape[1])])
    return torch.linalg.lstsq(a, y[:, None]).solution[:, 0]


@pytest.mark.parametrize("seed", range(3))
def test_one_alternation_matches_brute_force_least_squares(seed: int) -> None:
    k, n = 16, 12
    w, m, su, sv, h = _problem(k, n, seed, noise=0.3)
    r = refit_scales(w, m, su, sv, h, iters=1, ridge=0.0)
    assert r.accepted and r.iters == 1
    W, M = w.double(), m.double()
    t = _lstsq_cols(W, M, su.double(), h)
    s = _lstsq_rows(W, M, t, h)
    torch.testing.assert_close(r.sv.double(), t, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.su.double(), s, rtol=1e-5, atol=1e-6)


def test_alternation_reaches_a_stationary_point() -> None:
    """Many alternations without ridge: the gradient of f in (s, t) vanishes relative to its start."""
    w, m, su, sv, h = _problem(20, 16, 7, noise=0.2)

    def grad_norm(s: torch.Tensor, t: torch.Tensor) -> float:
        s, t = s.double().requires_grad_(), t.double().requires_grad_()
        e = w.double() - s[:, None] * m.double() * t[None, :]
        (e * (h @ e)).sum().backward()
        return float(torch.cat([s.grad, t.grad]).norm())

    r = refit_scales(w, m, su, sv, h, iters=200, ridge=0.0)
    assert r.accepted
    assert grad_norm(r.su, r.sv) < 1e-3 * grad_norm(su, sv)


def test_padding_keeps_padded_scales_and_bad_inputs_raise() -> None:
    w, m, su, sv, h = _problem(32, 24, 3)
    w[28:], w[:, 20:] = 0, 0  # padded rows / columns of the target, as quantize_linear pads
    r = refit_scales(w, m, su, sv, h, in_features=28, out_features=20)
    assert r.accepted
    assert torch.equal(r.su[28:], su[28:]) and torch.equal(r.sv[20:], sv[20:])
    assert not torch.equal(r.su[:28], su[:28])
    with pytest.raises(ValueError, match="ridge"):
        refit_scales(w, m, su, sv, h, ridge=-1.0)
    with pytest.raises(ValueError, match="shapes"):
        refit_scales(w, m[:, :10], su, sv, h)


def test_original_hessian_undoes_the_rotation() -> None:
    g = torch.Generator().manual_seed(0)
    k = 256
    x = torch.randn(2000, 200, generator=g) @ torch.randn(200, 200, generator=g)
    acc = HessianAccumulator(200)
    acc.add(x)
    info = acc.finalize(seed=5)
    h = original_hessian(info)
    ref = torch.zeros(k, k, dtype=torch.float64)
    ref[:200, :200] = (x.T @ x).double() / x.shape[0]
    ref += info.damping * float(ref.diagonal().mean()) * torch.eye(k, dtype=torch.float64)  # mean over padded k
    # independent check of the rotation: a dense block-diagonal Hadamard and the sign pattern
    bd = torch.block_diag(*[get_hadamard(128).double() / math.sqrt(128)] * (k // 128))
    s0 = info.su0.double()
    torch.testing.assert_close(h, ref, rtol=0, atol=2e-5 * float(ref.abs().max()))
    torch.testing.assert_close(bd @ (s0[:, None] * h * s0[None, :]) @ bd, info.h_rot.double(), rtol=0,
                               atol=2e-5 * float(ref.abs().max()))


@pytest.mark.skipif(not viterbi.has_cpp(), reason="compiled exl3::viterbi_encode not built")
def test_quantize_linear_refit_keeps_codes_and_lowers_output_error() -> None:
    g = torch.Generator().manual_seed(1)
    in_f, out_f = 200, 150  # padded to 256 x 256
    x = torch.randn(3000, in_f, generator=g) @ (torch.randn(in_f, in_f, generator=g) / math.sqrt(in_f)
                                                 + 0.3 * torch.eye(in_f))
    acc = HessianAccumulator(in_f)
    acc.add(x)
    info = acc.finalize(seed=2)
    w = torch.randn(out_f, in_f, generator=g) * 0.02 * (1 + torch.rand(out_f, 1, generator=g))
    hx = (x.T @ x).double()

    def out_err(q) -> float:
        e = (q.dequantize() - w).double()
        return float(torch.trace(e @ hx @ e.T) / torch.trace(w.double() @ hx @ w.double().T))

    plain = quantize_linear(w, info, K=3, seed=4)
    refit = quantize_linear(w, info, K=3, seed=4, refit_scales=True)
    assert torch.equal(plain.trellis, refit.trellis)  # codes untouched: only the fp16 scales move
    assert refit.extra["refit_accepted"] and refit.extra["refit_after"] < refit.extra["refit_before"]
    assert "refit" in refit.summary() and "refit" not in plain.summary()
    assert refit.suh.dtype == torch.float16 and bool(torch.isfinite(refit.suh).all())
    assert bool(torch.isfinite(refit.svh).all())
    assert torch.equal(refit.suh[in_f:], plain.suh[in_f:]) and torch.equal(refit.svh[out_f:], plain.svh[out_f:])
    assert out_err(refit) < out_err(plain)
    # refit_target: the scales (only) aim elsewhere -- at 1.1·W they land nearer 1.1·W than the plain refit
    aimed = quantize_linear(w, info, K=3, seed=4, refit_scales=True, refit_target=1.1 * w)
    assert torch.equal(aimed.trellis, plain.trellis)
    def far(q) -> float:  # output error against 1.1·W
        e = (q.dequantize() - 1.1 * w).double()
        return float(torch.trace(e @ hx @ e.T))

    assert far(aimed) < far(refit) and far(aimed) < far(plain)
    with pytest.raises(ValueError, match="refit_target shape"):
        quantize_linear(w, info, K=3, seed=4, refit_scales=True, refit_target=w[:, :10])


def test_option_round_trips_cli_convert_and_resume_refusal(tmp_path, monkeypatch) -> None:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    base = ["convert", "-i", "src", "-o", "out", "-b", "3"]
    assert parser.parse_args(base).refit_scales is False
    assert parser.parse_args(base + ["--refit-scales"]).refit_scales is True
    assert parser.parse_args(base + ["--refit-scales", "--no-refit-scales"]).refit_scales is False
    assert parser.parse_args(base + ["--refit-scales", "--refit-propagate", "0.5"]).refit_propagate == 0.5
    for bad in ({"refit_propagate": 1.5, "refit_scales": True}, {"refit_propagate": 0.5}):
        with pytest.raises(ValueError, match="--refit-propagate"):
            ConvertArgs(in_dir="a", out_dir="b", bpw=3.0, **bad).validate()  # type: ignore[arg-type]

    seen: list[ConvertArgs] = []

    class FakeConverter:
        def __init__(self, args: ConvertArgs, **_: object) -> None:
            seen.append(args)

        def run(self, **_: object) -> None:
            return None

    monkeypatch.setattr(pipeline, "Converter", FakeConverter)
    pipeline.convert("src", "out", 3.0, refit_scales=True)
    pipeline.convert("src", "out", 3.0)
    pipeline.convert("src", "out", 3.0, refit_scales=True, refit_propagate=0.5)
    assert [a.refit_scales for a in seen] == [True, False, True]
    assert seen[2].refit_propagate == 0.5 and seen[0].refit_propagate == 0.0
    assert seen[0].job_args()["refit_scales"] is True

    work = WorkDir(tmp_path)
    job = Job(args=seen[1].job_args(), source={})
    work.check_resume(job, seen[1].job_args(), {})  # same arguments: fine
    with pytest.raises(ResumeError, match="refit_scales: was False, now True"):
        work.check_resume(job, seen[0].job_args(), {})
    with pytest.raises(ResumeError, match="refit_propagate: was 0.0, now 0.5"):
        work.check_resume(Job(args=seen[0].job_args(), source={}), seen[2].job_args(), {})
