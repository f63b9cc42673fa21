"""RMSNorm, computed in fp32 whatever the activation dtype."""
from __future__ import annotations

import torch

from exl3_core import ops
from exl3_core.nn.module import LoadContext, Module


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``x / rms(x) * (weight + offset)`` over the last dim, in fp32, returned in ``x.dtype``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + offset) if offset else y * weight.float()
    return y.to(x.dtype)


class RMSNorm(Module):
    """RMSNorm over the last dimension (works per head on ``[T, H, D]`` too).

    :param key: checkpoint key; the weight is ``{key}.weight``.
    :param dim: normalised size.
    :param eps: variance epsilon.
    :param offset: added to the stored weight before scaling. Some families store ``w - 1`` and
        scale by ``(1 + w)`` ("offset 1"); standard checkpoints use 0.
    :param has_weight: False for a parameter-free norm.
    """

    weight: torch.Tensor | None

    def __init__(self, key: str, dim: int, eps: float, *, offset: float = 0.0, has_weight: bool = True) -> None:
        super().__init__()
        self.key = key
        self.dim = dim
        self.eps = eps
        self.offset = offset
        self.has_weight = has_weight
        self.register_buffer("weight", None, persistent=False)

    def load_weights(self, ctx: LoadContext) -> None:
        if self.has_weight:
            # fp32: tiny, and the norm computes in fp32 anyway
            self.weight = ctx.tensor(f"{self.key}.weight", shape=(self.dim,), dtype=torch.float32, what="norm weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.fused_enabled(x):  # CUDA: one kernel instead of ~6 (casts, pow, mean, rsqrt, muls)
            return ops.rms_norm(x, self.weight, self.eps, self.offset)
        return rms_norm(x, self.weight, self.eps, self.offset)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(residual + x), residual + x)``: a residual add fused into this norm on CUDA."""
        if ops.fused_enabled(x):
            return ops.rms_norm_residual(x, residual, self.weight, self.eps, self.offset)
        new_residual = residual + x
        return self(new_residual), new_residual

    def extra_repr(self) -> str:
        return f"{self.key}: dim={self.dim}, eps={self.eps}, offset={self.offset}"
