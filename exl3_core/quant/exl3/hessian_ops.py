"""Hessian accumulation ``H += xᵀx`` for the quantizer's calibration capture (format spec 5.1).

Rows of ``x`` that hold any NaN/inf are dropped; products and sums are fp32. The compiled op
``exl3::hessian_accumulate`` (csrc/cpu/hessian.cpp, csrc/quant/hessian_cuda.cu) does this on the
CPU or GPU; without it (or for a device it was not built for) the same is done in torch.
"""
from __future__ import annotations

from typing import Literal

import torch

Impl = Literal["auto", "op", "torch"]
_OP = "hessian_accumulate"


def has_op(device: torch.device | str = "cpu") -> bool:
    """True when ``exl3::hessian_accumulate`` has a kernel for ``device``'s type."""
    from exl3_core import ext

    if not ext.has_op(_OP):
        return False
    key = "CUDA" if torch.device(device).type == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"exl3::{_OP}", key)


def _check(H: torch.Tensor, x: torch.Tensor) -> None:
    if not isinstance(H, torch.Tensor) or H.dtype != torch.float32 or H.dim() != 2 or H.shape[0] != H.shape[1]:
        got = f"{H.dtype} {tuple(H.shape)}" if isinstance(H, torch.Tensor) else type(H).__name__
        raise ValueError(f"accumulate_hessian: H must be a float32 [k, k] tensor, got {got}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"accumulate_hessian: x must be a float16/bfloat16/float32 tensor, got {got}")
    if x.dim() < 1 or x.shape[-1] != H.shape[0]:
        raise ValueError(
            f"accumulate_hessian: x {tuple(x.shape)} must end in k = {H.shape[0]} (the width of H); "
            "pass the layer's input activations"
        )
    if x.device != H.device:
        raise ValueError(f"accumulate_hessian: H is on {H.device} but x on {x.device}; move one of them")


def accumulate_hessian(H: torch.Tensor, x: torch.Tensor, *, impl: Impl = "auto") -> int:
    """Add ``xᵀx`` (fp32) over the finite rows of ``x [..., k]`` into ``H [k, k]`` in place.

    Returns the number of rows added (the non-finite ones are skipped), which waits for the device.
    ``impl``: ``"op"`` the compiled op (error if unavailable for this device), ``"torch"`` the
    fallback, ``"auto"`` the op when available. fp32 ``x`` on CUDA follows torch's fp32 matmul
    precision setting (TF32 off by default).
    """
    _check(H, x)
    if impl not in ("auto", "op", "torch"):
        raise ValueError(f"accumulate_hessian: impl={impl!r} is invalid; use 'auto', 'op' or 'torch'")
    x2 = x.reshape(-1, H.shape[0])
    keep = torch.isfinite(x2).all(dim=1)
    use_op = impl == "op" or (impl == "auto" and has_op(x2.device))
    if use_op:
        if not has_op(x2.device):
            from exl3_core import ext

            raise RuntimeError(
                f"accumulate_hessian: impl='op' but exl3::{_OP} has no {x2.device.type} kernel "
                f"({'; '.join(ext.load_error) or 'extension not built for it'}); build it with "
                "`python setup.py build_ext --inplace` (nvcc for CUDA) or use impl='torch'"
            )
        from exl3_core import ext

        ext.op(_OP)(H, x2)
    else:
        xk = x2[keep].to(torch.float32)
        H.addmm_(xk.T, xk)
    return int(keep.sum().item())
