"""EXL3 per-tensor quantizer: HF weight -> the exact tensors a checkpoint stores (format spec 1.2-1.4, 5).

Pipeline per linear: pad to 128 multiples in ``(in, out)`` orientation, regularise (5.3), LDLQ with
the shared Hessian (5.4), pack the trellis (3.5), emit fp16 ``suh``/``svh``/``bias`` and the codebook
marker, plus metrics (5.6). The Hessian side lives in ``hessian.py``, feedback in ``ldlq.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from exl3_core.quant.exl3 import codebook as _cb
from exl3_core.quant.exl3.dequant import MARKER_VALUES, marker_int32
from exl3_core.quant.exl3.hessian import HessianInfo, fallback_hessian, padded_size
from exl3_core.quant.exl3.ldlq import TileEncoder, codebook_id, ldlq
from exl3_core.quant.exl3.regularize import SAMPLE_CAP, regularize, rotate, use_out_scales
from exl3_core.quant.exl3.scale_refit import original_hessian
from exl3_core.quant.exl3.scale_refit import refit_scales as _refit_scales
from exl3_core.quant.exl3.trellis import check_k, check_states, decode_inner, k_from_trellis, pack_trellis

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14
CODEBOOK_MARKER = {_cb.CB_MCG: "mcg", _cb.CB_MUL1: "mul1"}  # 3INST has no marker


@dataclass
class QuantizedLinear:
    """One quantized linear: stored tensors (padded, ``(in, out)``) and quantization metrics.

    ``proxy_err`` = tr(EᵀH'E)/tr(W_rᵀH'W_r) in the rotated basis (E = W_r − Ŵ); in fallback mode
    (no Hessian) it is the relative MSE mse/mean(W_r²) instead. ``nmse`` is ‖W − W_q‖²/‖W‖² in the
    original basis, W_q decoded from the stored fp16 tensors as a reader would.
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    bias: torch.Tensor | None
    marker: str | None
    K: int
    codebook: int
    in_features: int
    out_features: int
    proxy_err: float
    mse: float
    nmse: float
    g: float
    fallback: bool
    out_scales_applied: bool
    extra: dict = field(default_factory=dict)

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensors ``{f"{key}.<suffix>": tensor}`` (suh, svh, marker, trellis, bias)."""
        out = {f"{key}.suh": self.suh, f"{key}.svh": self.svh}
        if self.marker is not None:
            out[f"{key}.{self.marker}"] = torch.tensor(marker_int32(self.marker), dtype=torch.int32)
        out[f"{key}.trellis"] = self.trellis
        if self.bias is not None:
            out[f"{key}.bias"] = self.bias
        return out

    def dequantize(self) -> torch.Tensor:
        """fp32 weight in HF orientation ``[out_features, in_features]`` (padding trimmed)."""
        w = dequantize_padded(self.trellis, self.suh, self.svh, self.K, self.codebook)
        return w[: self.in_features, : self.out_features].T.contiguous()

    def summary(self) -> str:
        """One metrics line like the reference quantizer prints (o = out scales, f = fallback)."""
        label = "rel_mse" if self.fallback else "proxy_err"
        flags = ("o" if self.out_scales_applied else "-") + ("f" if self.fallback else "-")
        line = f"K={self.K} {label}={self.proxy_err:.6f} [{flags}] g_sc={self.g:.4f} nmse={self.nmse:.6f}"
        if "refit_before" in self.extra:
            mark = "" if self.extra["refit_accepted"] else " rejected"
            line += f" refit {self.extra['refit_before']:.6f}->{self.extra['refit_after']:.6f}{mark}"
        return line


def dequantize_padded(
    trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, K: int, codebook: int
) -> torch.Tensor:
    """fp32 ``diag(suh)·BD_k·Ŵ·BD_n·diag(svh)`` (spec 4.2), padded ``(in, out)``.

    The same algebra as ``dequant.reconstruct``, with the rotations done on contiguous rows
    (``regularize.rotate``), which is much faster on CPU for tall matrices.
    """
    w = rotate(rotate(decode_inner(trellis, K, codebook).to(torch.float32), 0), 1)
    return w * suh.to(torch.float32)[:, None] * svh.to(torch.float32)[None, :]


def _check_fp16(name: str, what: str, t: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(t).all()) or float(t.abs().max()) > FP16_MAX:
        raise ValueError(
            f"{name}: {what} overflows fp16 (max |{what}| = {float(t.abs().max()):.4g}); the weights are too "
            f"large for EXL3 storage, rescale the layer"
        )
    tiny = (t != 0) & (t.abs() < FP16_MIN_NORMAL)
    if bool(tiny.any()):
        warnings.warn(
            f"{name}: {int(tiny.sum())} entries of {what} fall below fp16's normal range "
            f"(min |{what}| = {float(t[t != 0].abs().min()):.3g}) and lose precision when stored",
            stacklevel=3,
        )
    return t.to(torch.float16)


def _trace_quad(e: torch.Tensor, h: torch.Tensor) -> float:
    """tr(Eᵀ H E): fp32 matmul (a metric; fp64 would double the cost of big layers), fp64 sum."""
    e = e.to(torch.float32)
    return float((e * (h.to(torch.float32) @ e)).sum(dtype=torch.float64))


def quantize_linear(
    weight: torch.Tensor,
    hinfo: HessianInfo | None,
    *,
    K: int,
    codebook: int | str = "mul1",
    out_scales: str = "always",
    seed: int = 0,
    bias: torch.Tensor | None = None,
    in_features: int | None = None,
    out_features: int | None = None,
    encoder: TileEncoder | None = None,
    buf_size_k: int = 128,
    g_sample_cap: int | None = SAMPLE_CAP,
    name: str = "linear",
    device: torch.device | str | None = None,
    refit_scales: bool = False,
    refit_target: torch.Tensor | None = None,
) -> QuantizedLinear:
    """Quantize an HF-orientation weight ``[out, in]`` (fp32/bf16/fp16) to EXL3 at K bits/weight.

    ``hinfo`` is the finalised Hessian of this linear's input (shared within a qmap), or None for
    plain tile quantization. ``in_features``/``out_features`` default to the weight's shape and
    must match it. ``seed`` draws the output sign pattern. ``encoder`` overrides the tile encoder
    (default: the real Viterbi). ``name`` is used in errors. ``device`` is where the regularisation,
    LDLQ and tile encoding run (default: the weight's device; on CUDA the encoder is the CUDA
    kernel); the returned tensors are always on the CPU, ready to be written. ``refit_scales``
    refits ``suh``/``svh`` in closed form for the final codes under the Hessian metric
    (``scale_refit.py``; skipped without a Hessian); ``extra`` then holds the relative objective
    before/after (``refit_before``/``refit_after``) and whether the refit was kept. ``refit_target``
    (HF orientation, like ``weight``) is what the scales aim at instead of ``weight``, e.g. the
    error-propagated target while the codes aim at the plain weight.
    """
    K = check_k(K, name)
    cb = codebook_id(codebook, name)
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be 2-D [out_features, in_features], got {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    in_features = in_f if in_features is None else in_features
    out_features = out_f if out_features is None else out_features
    if (out_f, in_f) != (out_features, in_features):
        raise ValueError(
            f"{name}: weight shape {list(weight.shape)} does not match [out_features, in_features] = "
            f"[{out_features}, {in_features}]"
        )
    if not weight.is_floating_point():
        raise TypeError(f"{name}: weight must be floating point, got {weight.dtype}")
    dev = torch.device(device) if device is not None else weight.device
    w32 = weight.detach().to(dev, torch.float32)
    if not bool(torch.isfinite(w32).all()):
        bad = int((~torch.isfinite(w32)).sum())
        raise ValueError(f"{name}: weight has {bad} non-finite values (NaN/inf); fix the source checkpoint")
    k, n = padded_size(in_features), padded_size(out_features)
    if hinfo is None:
        hinfo = fallback_hessian(in_features, seed=seed)
    if hinfo.k != k:
        raise ValueError(
            f"{name}: the Hessian is for {hinfo.k} (padded) inputs but this weight has {in_features} "
            f"inputs (padded {k}); pass the HessianInfo of this linear's own input"
        )
    w = torch.zeros(k, n, dtype=torch.float32, device=dev)
    w[:in_features, :out_features] = w32.T
    hinfo = hinfo.to(dev)

    w_rot, su, sv, g = regularize(
        w,
        hinfo,
        out_scales=out_scales,
        codebook=cb,
        K=K,
        seed=seed,
        encoder=encoder,
        g_sample_cap=g_sample_cap,
        name=name,
    )
    l_u = None if hinfo.fallback else hinfo.l_u
    states, w_hat = ldlq(w_rot, l_u, K, cb, buf_size_k, encoder=encoder)
    bad = ~check_states(states, K)
    if bool(bad.any()):
        # a stream only decodes to the states the encoder assumed if every transition (wrap included) agrees
        tk, tn = bad.nonzero()[0].tolist()
        raise RuntimeError(
            f"{name}: the tile encoder returned states that break the tail-biting condition in "
            f"{int(bad.sum())} tile(s), first [{tk}, {tn}]; the encoder is faulty (spec 3.4)"
        )
    trellis = pack_trellis(states, K)  # on dev: the metrics below decode it there

    extra: dict = {}
    if refit_scales and not hinfo.fallback and hinfo.h_rot is not None:
        m = rotate(rotate(w_hat, 0), 1)  # BD·Ŵ·BD: what the scales multiply
        aim = w
        if refit_target is not None:
            if refit_target.shape != weight.shape:
                raise ValueError(f"{name}: refit_target shape {tuple(refit_target.shape)} differs from the "
                                 f"weight's {tuple(weight.shape)}")
            aim = torch.zeros_like(w)
            aim[:in_features, :out_features] = refit_target.detach().to(dev, torch.float32).T
        r = _refit_scales(aim, m, su, sv, original_hessian(hinfo), in_features=in_features,
                          out_features=out_features)
        extra.update(refit_before=r.before, refit_after=r.after, refit_accepted=r.accepted,
                     refit_iters=r.iters, refit_sign_flips=r.sign_flips, refit_reason=r.reason)
        su, sv = r.su, r.sv
    suh = _check_fp16(name, "suh", su)
    svh = _check_fp16(name, "svh", sv)
    bias_h = None
    if bias is not None:
        if bias.shape != (out_features,):
            raise ValueError(f"{name}: bias shape {tuple(bias.shape)}, expected [{out_features}]")
        bias_h = torch.zeros(n, dtype=torch.float16)
        bias_h[:out_features] = _check_fp16(name, "bias", bias.detach().to("cpu", torch.float32))

    err = w_rot - w_hat
    mse = float(err.double().pow(2).mean())
    if hinfo.fallback or hinfo.h_rot is None:
        denom = float(w_rot.double().pow(2).mean())
        proxy = mse / denom if denom > 0 else 0.0
    else:
        denom = _trace_quad(w_rot, hinfo.h_rot)
        proxy = _trace_quad(err, hinfo.h_rot) / denom if denom > 0 else 0.0
    w_q = dequantize_padded(trellis, suh, svh, K, cb)
    ref = float(w.double().pow(2).sum())
    nmse = float((w_q.double() - w.double()).pow(2).sum()) / ref if ref > 0 else 0.0
    return QuantizedLinear(
        trellis=trellis.cpu(),
        suh=suh.cpu(),
        svh=svh.cpu(),
        bias=bias_h,
        marker=CODEBOOK_MARKER.get(cb),
        K=K,
        codebook=cb,
        in_features=in_features,
        out_features=out_features,
        proxy_err=proxy,
        mse=mse,
        nmse=nmse,
        g=g,
        fallback=hinfo.fallback,
        out_scales_applied=use_out_scales(out_scales, hinfo),
        extra=extra,
    )


def tensor_storage_entry(tensors: Mapping[str, torch.Tensor]) -> dict:
    """The ``quantization_config.json`` ``tensor_storage`` value of one module (spec 1.8).

    ``tensors`` maps full tensor names to tensors, as stored. When they hold an EXL3 trellis the
    entry also carries ``quant_format``, ``bits_per_weight`` (K from the trellis shape) and the
    marker's multiplier as an unsigned decimal.
    """
    entry: dict = {
        "stored_tensors": {
            name: {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
            for name, t in tensors.items()
        }
    }
    trellis = [t for name, t in tensors.items() if name.endswith(".trellis") or name == "trellis"]
    if trellis:
        entry["quant_format"] = "exl3"
        entry["bits_per_weight"] = k_from_trellis(trellis[0])
        for marker, mult in MARKER_VALUES.items():
            if any(name.endswith(f".{marker}") or name == marker for name in tensors):
                entry[f"{marker}_multiplier"] = mult
    return entry
