"""Quantization-error propagation: aim each linear at the unquantized model's output.

The plain quantizer minimises ``‖X_q (Ŵ − W)‖`` with ``X_q`` the inputs produced by the already
quantized earlier modules, so every module reproduces ``X_q W`` and the error of the modules before it
is carried on untouched. Aiming at the original model's output ``X_f W`` instead (``X_f``: the same
tokens through the unquantized model) gives the least-squares target

    W*ᵀ = (X_qᵀX_q)⁻¹ X_qᵀX_f Wᵀ = Wᵀ + H⁻¹ (C − H) Wᵀ,   H = X_qᵀX_q,  C = X_qᵀX_f,

which partly undoes the upstream error (the idea of QEP, Arai and Ichikawa 2025). A full step
over-fits the calibration rows, so the target is blended: ``W' = W + α·(W* − W)``, with ``H``
damped as for LDLQ. The quantizer then encodes ``W'`` against the same ``H`` as before. The
checkpoint format is unchanged; only which weights get encoded differs.

Everything here is per input group (linears reading one tensor share ``H`` and ``C``).
"""
from __future__ import annotations

from typing import Any

import torch

from exl3_core.convert.capture import LinearSlot

DAMP = 0.025  # relative diagonal damping of H for the solve (the LDLQ sigma_reg)
#: the default strength, used below AUTO_BELOW_BPW. Measured on the golden model_a (KL to the fp32
#: model on the golden ids, docs/quality.md): at 2.0 bpw 0.2499 -> 0.2221 (mean of 4 seeds, better on
#: every seed); at 3.0 bpw +2.6% (3 seeds) and at 4.0 bpw +4% (1 seed), so from 2.5 bpw up the plain
#: target stays the default.
AUTO_ALPHA = 0.5
AUTO_BELOW_BPW = 2.5


def default_strength(bpw: float) -> float:
    """The error-propagation strength ``exl3 convert`` uses when none is given."""
    return AUTO_ALPHA if bpw < AUTO_BELOW_BPW else 0.0


class InputRecorder:
    """Forward pre-hooks that keep each quantized linear's input of one pass (``inputs[key]``, 2-D)."""

    def __init__(self, slots: list[LinearSlot]) -> None:
        self.slots = [s for s in slots if s.quantize]
        self.inputs: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> InputRecorder:
        for s in self.slots:
            def hook(module: torch.nn.Module, args: tuple[Any, ...], key: str = s.key, k: int = s.in_features) -> None:
                if args and key not in self.inputs:  # first call of the pass (MoE experts may run twice)
                    self.inputs[key] = args[0].detach().reshape(-1, k)
            self._handles.append(s.module.register_forward_pre_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class CrossAccumulator:
    """Running ``C = Σ X_qᵀ X_f`` of one input group; gives up (``valid`` False) when the two passes
    did not see the same rows (routed experts) or produced non-finite values."""

    def __init__(self) -> None:
        self.c_sum: torch.Tensor | None = None
        self.valid = True

    def add(self, x_q: torch.Tensor, x_f: torch.Tensor | None) -> None:
        if not self.valid:
            return
        if x_f is None or x_f.shape != x_q.shape:
            self.valid = False
            return
        xq, xf = x_q.to(torch.float32), x_f.to(x_q.device, torch.float32)
        if not (bool(torch.isfinite(xq).all()) and bool(torch.isfinite(xf).all())):
            self.valid = False
            return
        c = xq.T @ xf
        self.c_sum = c if self.c_sum is None else self.c_sum + c


def propagated_weight(w: torch.Tensor, h_sum: torch.Tensor, c_sum: torch.Tensor, alpha: float) -> torch.Tensor:
    """``W + α·W (C − H)ᵀ (H + λI)⁻¹`` for an HF-orientation weight ``[out, in]`` (sums, not means: the
    row count cancels). fp64 solve; returned in ``w``'s dtype and device."""
    h = h_sum.to(torch.float64)
    c = c_sum.to(h.device, torch.float64)
    k = h.shape[0]
    lam = DAMP * float(h.diagonal().mean())
    if not lam > 0:
        return w
    hd = h + lam * torch.eye(k, dtype=torch.float64, device=h.device)
    wt = w.to(h.device, torch.float64).T  # [in, out]
    delta = torch.linalg.solve(hd, (c - h) @ wt)  # H⁻¹ (C − H) Wᵀ
    return (wt + alpha * delta).T.to(w.device, w.dtype)
