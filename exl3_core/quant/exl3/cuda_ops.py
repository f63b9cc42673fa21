"""Typed wrappers over the EXL3 CUDA ops (csrc/exl3), each with a pure-torch fallback.

The compiled ops live under ``torch.ops.exl3`` when ``exl3_core._C`` was built with nvcc:

* ``reconstruct(trellis, K, codebook) -> fp16 Ŵ [k, n]`` (bit-exact, spec 3)
* ``exl3_gemm(x fp16 [m, k], trellis, suh, svh, codebook) -> fp16 [m, n]`` (spec 4.3, the
  ``linear.exl3_matmul`` seam): Hadamard-in, on-the-fly-decode GEMM, Hadamard-out
* ``exl3_gemm_xh(xh fp16 [m, k], trellis, K, codebook, kt_per_warp=0) -> fp32 [m, n]`` (z = xh @ Ŵ)
* ``had128(x, pre_scale=None, post_scale=None, out_fp16=True)`` (blockwise H128/sqrt(128))
* ``decode_bench(trellis, K, codebook, kt_per_warp=0)`` (decode-only ceiling; benchmarks only)

The fallbacks run anywhere (CPU included) and compute the same functions in fp32.
"""
from __future__ import annotations

import torch

from exl3_core import ext
from exl3_core.quant.exl3.hadamard import had_blockwise
from exl3_core.quant.exl3.trellis import decode_inner, k_from_trellis


def _compiled(name: str, *tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and ext.has_op(name)


def _check(trellis: torch.Tensor, K: int | None, codebook: int, what: str) -> int:
    """Validate in Python before calling the op: its C++ checks work, but on the device image an
    exception thrown from the extension currently crashes the process (see docs/performance.md)."""
    found = k_from_trellis(trellis, what)
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"{what}: trellis must be int16 [k/16, n/16, 16K], got {trellis.dtype} {tuple(trellis.shape)}")
    if K is not None and K != found:
        raise ValueError(f"{what}: K={K} but the trellis last dim {trellis.shape[-1]} means K={found}")
    if codebook not in (0, 1, 2):
        raise ValueError(f"{what}: codebook {codebook!r} unknown; expected 0 (3inst), 1 (mcg) or 2 (mul1)")
    return found


def reconstruct_cuda(trellis: torch.Tensor, K: int | None, codebook: int) -> torch.Tensor:
    """fp16 Ŵ ``[k, n]`` from a trellis ``[k/16, n/16, 16K]``; bit-exact on either path."""
    K = _check(trellis, K, codebook, "reconstruct_cuda")
    if _compiled("reconstruct", trellis):
        return ext.op("reconstruct")(trellis.contiguous(), K, codebook)
    return decode_inner(trellis, K, codebook)


def had128_cuda(
    x: torch.Tensor,
    pre_scale: torch.Tensor | None = None,
    post_scale: torch.Tensor | None = None,
    out_fp16: bool = True,
) -> torch.Tensor:
    """Blockwise H128/sqrt(128) over the last dim, with optional fp16 scale vectors before/after.

    Rounding follows spec 4.3: fp16 input times ``pre_scale`` is rounded to fp16 before the fp32
    butterfly; with fp16 output the result is rounded, then multiplied by ``post_scale`` in fp16.
    """
    if x.shape[-1] % 128:
        raise ValueError(f"had128_cuda: last dim {x.shape[-1]} is not a multiple of 128; zero-pad it first")
    if _compiled("had128", x):
        pre = pre_scale.to(torch.float16).contiguous() if pre_scale is not None else None
        post = post_scale.to(torch.float16).contiguous() if post_scale is not None else None
        return ext.op("had128")(x, pre, post, out_fp16)
    v = x.to(torch.float32)
    if pre_scale is not None:
        v = (x * pre_scale.to(x.dtype)).to(torch.float32)
    y = had_blockwise(v, dim=-1)
    if out_fp16:
        y = y.to(torch.float16)
        return y * post_scale.to(torch.float16) if post_scale is not None else y
    return y * post_scale.to(torch.float32) if post_scale is not None else y


def exl3_gemm_xh_cuda(xh: torch.Tensor, trellis: torch.Tensor, codebook: int, kt_per_warp: int = 0) -> torch.Tensor:
    """fp32 ``z = xh @ Ŵ`` for fp16 ``xh [m, k]`` (already rotated), decoding Ŵ on the fly."""
    K = _check(trellis, None, codebook, "exl3_gemm_xh_cuda")
    if xh.shape[-1] != trellis.shape[0] * 16 or trellis.shape[1] % 8:
        raise ValueError(
            f"exl3_gemm_xh_cuda: xh [.., {xh.shape[-1]}] and trellis {tuple(trellis.shape)} disagree (need k = 16*"
            f"trellis.shape[0] and n a multiple of 128)"
        )
    if _compiled("exl3_gemm_xh", xh, trellis):
        return ext.op("exl3_gemm_xh")(xh.to(torch.float16).contiguous(), trellis.contiguous(), K, codebook, kt_per_warp)
    return xh.to(torch.float32) @ decode_inner(trellis, K, codebook).to(torch.float32)


def exl3_gemm_cuda(
    x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: int
) -> torch.Tensor:
    """``x[..., k] @ W -> [..., n]`` (padded widths, no bias), fp16 out on CUDA, fp32 on the fallback."""
    _check(trellis, None, codebook, "exl3_gemm_cuda")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] != trellis.shape[0] * 16:
        raise ValueError(f"exl3_gemm_cuda: x has {x2.shape[-1]} features, the trellis {trellis.shape[0] * 16}")
    if _compiled("exl3_gemm", x2, trellis):
        y = ext.op("exl3_gemm")(x2.to(torch.float16).contiguous(), trellis.contiguous(), suh, svh, codebook)
    else:
        xh = had_blockwise(x2.to(torch.float32) * suh.to(torch.float32), dim=-1)
        z = xh @ decode_inner(trellis, k_from_trellis(trellis), codebook).to(torch.float32)
        y = had_blockwise(z, dim=-1) * svh.to(torch.float32)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def decode_bench_cuda(trellis: torch.Tensor, codebook: int, kt_per_warp: int = 0) -> torch.Tensor:
    """Decode every tile with the GEMM's decoder and no activations (benchmarks only; needs the op)."""
    if not _compiled("decode_bench", trellis):
        raise RuntimeError(
            "decode_bench needs the compiled CUDA op exl3::decode_bench: build exl3_core._C with nvcc "
            "(python setup.py build_ext --inplace) and pass a CUDA trellis"
        )
    return ext.op("decode_bench")(trellis.contiguous(), k_from_trellis(trellis), codebook, kt_per_warp)
