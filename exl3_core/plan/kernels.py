"""The EXL3 linear kernels the plan may launch, behind one typed contract.

:class:`CompiledKernels` calls the compiled CUDA ops (``exl3_core._C``). A test can hand the plan
another implementation of the same contract (``exl3_core.testing.kernels.EmulatedKernels`` computes
it with torch on any device), so every fused form of the plan runs, and is checked against the
reference forward, where no GPU is.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from exl3_core import ext
from exl3_core.quant.exl3.linear import (
    EXL3Linear,
    NormPrologue,
    RopeCacheEpilogue,
    group_gemm,
    launch_act,
    launch_group,
    launch_group_ex,
    launch_residual,
)

#: the ops behind each method of :class:`LinearKernels`
OPS = {"group": "exl3_linear_group", "group_ex": "exl3_linear_group_ex", "act": "exl3_linear_act",
       "residual": "exl3_linear_residual", "rebuild_gemm": "reconstruct_full_into"}


class LinearKernels(Protocol):
    """One-launch forms of EXL3 linears (see :mod:`exl3_core.quant.exl3.linear` for each contract:
    padded fp16 outputs, no bias; the caller adds biases and trims)."""

    def unavailable(self, device: torch.device, op: str) -> list[str]:
        """Why ``op`` (a key of :data:`OPS`) cannot run for tensors on ``device`` ([]: it can)."""
        ...

    def group(self, x2: torch.Tensor, lins: Sequence[EXL3Linear]) -> list[torch.Tensor]: ...

    def group_ex(self, h2: torch.Tensor, lins: Sequence[EXL3Linear], norm: NormPrologue | None,
                 epilogue: RopeCacheEpilogue | None) -> list[torch.Tensor]: ...

    def act(self, layer: EXL3Linear, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor: ...

    def residual(self, layer: EXL3Linear, x: torch.Tensor, residual: torch.Tensor, ss: torch.Tensor,
                 gate: torch.Tensor | None, act: str | None) -> torch.Tensor: ...

    def rebuild_gemm(self, x2: torch.Tensor, lins: Sequence[EXL3Linear]) -> list[torch.Tensor]: ...


class CompiledKernels:
    """The compiled CUDA kernels."""

    def unavailable(self, device: torch.device, op: str) -> list[str]:
        if device.type != "cuda":
            return [f"model on {device.type}, the compiled kernels are CUDA's"]
        if not ext.has_op(OPS[op]):
            return [f"exl3_core._C lacks {OPS[op]} (extension not built)"]
        return []

    def group(self, x2: torch.Tensor, lins: Sequence[EXL3Linear]) -> list[torch.Tensor]:
        return launch_group(x2, lins)

    def group_ex(self, h2: torch.Tensor, lins: Sequence[EXL3Linear], norm: NormPrologue | None,
                 epilogue: RopeCacheEpilogue | None) -> list[torch.Tensor]:
        return launch_group_ex(h2, lins, norm, epilogue)

    def act(self, layer: EXL3Linear, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        return launch_act(layer, gate, up, act)

    def residual(self, layer: EXL3Linear, x: torch.Tensor, residual: torch.Tensor, ss: torch.Tensor,
                 gate: torch.Tensor | None, act: str | None) -> torch.Tensor:
        return launch_residual(layer, x, residual, ss, gate=gate, act=act)

    def rebuild_gemm(self, x2: torch.Tensor, lins: Sequence[EXL3Linear]) -> list[torch.Tensor]:
        return group_gemm(x2, lins)
