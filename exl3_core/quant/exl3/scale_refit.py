"""Closed-form refit of the stored fp16 scales ``suh``/``svh`` after LDLQ has fixed the codes.

The reader's weight (format spec 4.2) is ``W_eff = diag(suh)·M·diag(svh)`` with ``M = BD_k·Ŵ·BD_n``
(``Ŵ``: the decoded trellis, ``BD``: blockwise normalized Hadamard). Regularisation (spec 5.3) picks
the scales from RMS statistics of the weight *before* quantization, so they are not the best ones for
the codes LDLQ ended up with. With the codes fixed the layer objective

    f(s, t) = tr((W − diag(s)·M·diag(t))ᵀ·H·(W − diag(s)·M·diag(t))),   H = XᵀX (damped)

is quadratic in each of ``t`` (= svh) and ``s`` (= suh) alone:

* columns: ``t_j = (u_jᵀ H w_j)/(u_jᵀ H u_j)`` with ``u_j`` column j of ``diag(s)·M``;
* rows: with ``V = M·diag(t)``, ``Σ_j diag(v_j)·H·diag(v_j) = H ∘ (V Vᵀ)`` and
  ``Σ_j diag(v_j)·H·w_j = rowsum(V ∘ HW)``, so ``(H ∘ VVᵀ)·s = rowsum(V ∘ HW)``.

Alternating the two never increases f. Both steps carry a small ridge toward the regularised scales
(relative to the system's diagonal), which keeps rows/columns the data barely constrains where they
were. The trellis is untouched, so the checkpoint format (and every reader) is unchanged. Only the
real (unpadded) block is refit: padded inputs are zero at run time and padded outputs are cut off,
so their scales keep their values. The result is rounded to fp16 and accepted only if the objective
at the rounded scales is lower than at the rounded original scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from exl3_core.quant.exl3.hessian import HessianInfo, _bd64

FP16_MAX = 65504.0
RIDGE = 1e-3  # relative pull toward the regularised scales
ITERS = 3  # column + row alternations
MIN_GAIN = 1e-7  # stop alternating when the relative objective drops less than this


@dataclass
class RefitResult:
    """Refit scales (fp32, padded; the inputs when rejected) and the relative objective f/tr(WᵀHW)
    before (original scales, fp16-rounded) and after (refit scales, fp16-rounded)."""

    su: torch.Tensor
    sv: torch.Tensor
    before: float
    after: float
    accepted: bool
    iters: int
    sign_flips: int
    reason: str = ""


def original_hessian(hinfo: HessianInfo) -> torch.Tensor:
    """The damped input Hessian in the original basis, fp64 ``[k, k]``: undo ``h_rot``'s rotation.

    ``h_rot = BD·S·H·S·BD`` with ``S = diag(su0)``; BD is a symmetric orthogonal matrix, so
    ``H = S·BD·h_rot·BD·S``. The damping LDLQ used (a multiple of I) is kept: it commutes with the
    rotation and is the same mild regulariser here.
    """
    if hinfo.h_rot is None:
        raise ValueError("original_hessian: a fallback HessianInfo carries no Hessian")
    s0 = hinfo.su0.to(hinfo.h_rot.device, torch.float64)
    h = _bd64(_bd64(hinfo.h_rot.to(torch.float64), 0), 1)
    h = h * s0[:, None] * s0[None, :]
    return 0.5 * (h + h.T)


def scale_objective(w: torch.Tensor, m: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, h: torch.Tensor) -> float:
    """``tr(EᵀHE)`` with ``E = W − diag(su)·M·diag(sv)``, fp64 (E formed explicitly: no cancellation)."""
    dt = torch.float64
    e = w.to(dt) - su.to(dt)[:, None] * m.to(dt) * sv.to(dt)[None, :]
    return float((e * (h.to(dt) @ e)).sum())


def _ridge_diag(d: torch.Tensor, ridge: float) -> torch.Tensor:
    """Ridge weights: ridge·diag, floored so rows/columns without any signal still get pinned."""
    floor = 1e-12 * float(d.abs().mean()) if d.numel() else 0.0
    return ridge * d.clamp_min(max(floor, 1e-300))


def refit_scales(
    w: torch.Tensor,
    m: torch.Tensor,
    su: torch.Tensor,
    sv: torch.Tensor,
    h: torch.Tensor,
    *,
    in_features: int | None = None,
    out_features: int | None = None,
    iters: int = ITERS,
    ridge: float = RIDGE,
) -> RefitResult:
    """Refit ``su`` ``[k]`` and ``sv`` ``[n]`` for fixed ``m = BD·Ŵ·BD`` ``[k, n]`` against target ``w``.

    ``w`` is the weight the quantizer aimed at (``(in, out)``, padded), ``h`` the input Hessian in
    the original basis (``original_hessian``). Only the first ``in_features`` rows / ``out_features``
    columns are refit; ``ridge`` (>= 0) is the pull toward the given scales relative to each system's
    diagonal. Math in fp64 on ``w``'s device.
    """
    if not (ridge >= 0 and math.isfinite(ridge)):
        raise ValueError(f"refit_scales: ridge={ridge!r} must be a finite value >= 0")
    if w.shape != m.shape or su.shape != (w.shape[0],) or sv.shape != (w.shape[1],):
        raise ValueError(f"refit_scales: shapes w {tuple(w.shape)}, m {tuple(m.shape)}, su {tuple(su.shape)}, "
                         f"sv {tuple(sv.shape)} do not fit together (need m like w, su [k], sv [n])")
    k, n = w.shape
    ki = k if in_features is None else in_features
    no = n if out_features is None else out_features
    dev, dt = w.device, torch.float64
    W = w[:ki, :no].to(dev, dt)
    M = m[:ki, :no].to(dev, dt)
    H = h[:ki, :ki].to(dev, dt)
    s0 = su[:ki].to(dev, dt)
    t0 = sv[:no].to(dev, dt)
    s16, t16 = s0.half().to(dt), t0.half().to(dt)
    HW = H @ W
    c = float((W * HW).sum())
    before = scale_objective(W, M, s16, t16, H)
    if not (c > 0 and math.isfinite(c) and math.isfinite(before)):
        return RefitResult(su, sv, before / c if c > 0 else 0.0, float("nan"), False, 0, 0, "no signal")

    s, t = s0.clone(), t0.clone()
    f = before
    done = 0
    for done in range(1, iters + 1):
        # columns: independent 1-D least squares (with the ridge toward t0)
        U = s[:, None] * M
        HU = H @ U
        num = (U * HW).sum(0)
        den = (U * HU).sum(0)
        r = _ridge_diag(den, ridge)
        t = (num + r * t0) / (den + r)
        # rows: (H ∘ VVᵀ + R)·s = rowsum(V ∘ HW) + R·s0
        V = M * t[None, :]
        A = H * (V @ V.T)
        b = (V * HW).sum(1)
        r = _ridge_diag(A.diagonal(), ridge)
        A.diagonal().add_(r)
        L, info = torch.linalg.cholesky_ex(A)
        if int(info) != 0:
            return RefitResult(su, sv, before / c, float("nan"), False, done, 0, "row system not positive definite")
        s = torch.cholesky_solve((b + r * s0)[:, None], L)[:, 0]
        if not (bool(torch.isfinite(s).all()) and bool(torch.isfinite(t).all())):
            return RefitResult(su, sv, before / c, float("nan"), False, done, 0, "non-finite scales")
        f_new = scale_objective(W, M, s, t, H)
        if f - f_new < MIN_GAIN * c:
            break
        f = f_new

    if float(s.abs().max()) > FP16_MAX or float(t.abs().max()) > FP16_MAX:
        return RefitResult(su, sv, before / c, float("nan"), False, done, 0, "scales exceed fp16 range")
    s_h, t_h = s.half().to(dt), t.half().to(dt)
    after = scale_objective(W, M, s_h, t_h, H)
    flips = int((torch.sign(s_h) * torch.sign(s16) < 0).sum()) + int((torch.sign(t_h) * torch.sign(t16) < 0).sum())
    if not (math.isfinite(after) and after < before):
        return RefitResult(su, sv, before / c, after / c, False, done, flips, "no gain after fp16 rounding")
    su_new, sv_new = su.clone(), sv.clone()
    su_new[:ki] = s.to(su.device, su.dtype)
    sv_new[:no] = t.to(sv.device, sv.dtype)
    return RefitResult(su_new, sv_new, before / c, after / c, True, done, flips)
