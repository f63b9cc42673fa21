"""How the converter runs a linear it has just quantized.

After a stage is quantized the calibration states are advanced through it, and the post-pass runs
every stage again. On the CPU, :class:`~exl3_core.quant.exl3.linear.EXL3Linear`'s reference forward
rebuilds ``diag(suh)·BD·Ŵ·BD·diag(svh)`` algebra on every call (two blockwise Hadamards of the
activations per call); the converter instead multiplies by the dequantized weight, computed once per
tensor. Both are fp32 and compute the same product, differing only in the order of the roundings. On
CUDA the compiled EXL3 kernels are used as the model will run them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from exl3_core.nn.linear import DenseLinear
from exl3_core.quant.exl3.linear import EXL3Linear


class DequantizedLinear(DenseLinear):
    """A quantized linear as its fp32 dequantized weight (a distinct type, so building blocks that
    restack dense weights, e.g. MoE's grouped experts, treat it as the quantized layer it stands for)."""

    @classmethod
    def of(cls, lin: EXL3Linear) -> DequantizedLinear:
        w = lin.dequantize().T.contiguous()  # [out, in], fp32
        b = None if lin.bias is None else lin.bias[: lin.out_features].to(torch.float32)
        return cls(w, b, lin.in_features, lin.out_features, key=lin.key)


def runtime_linear(key: str, get: Callable[[str], torch.Tensor | None], in_features: int, out_features: int,
                   device: torch.device) -> torch.nn.Module:
    """The module the converter forwards through for the stored EXL3 tensors ``<key>.*`` on ``device``."""
    lin = EXL3Linear.from_tensors(key, get, in_features, out_features)
    if device.type == "cpu":
        return DequantizedLinear.of(lin)
    return lin.to(device)
