"""The torch reference backend: any layout, any device, fp32 math; slow but always correct."""
from __future__ import annotations

from typing import ClassVar

import torch

from exl3_core.attention.spec import AttnArgs, AttnSpec
from exl3_core.reference.attention import attention


class TorchAttention:
    name: ClassVar[str] = "torch"

    def priority(self, spec: AttnSpec) -> int:
        return 0

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        reasons = []
        if spec.num_q_heads % spec.num_kv_heads:
            reasons.append(f"num_q_heads={spec.num_q_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}")
        if spec.non_causal_spans:
            reasons.append("non-causal spans are not implemented")
        if spec.cache is not None and spec.cache.split("/")[0] not in ("kv", "mla"):
            reasons.append(f"cache kind {spec.cache!r} is not readable (kv/* and mla/* only)")
        if spec.cache is not None and spec.cache.split("/")[-1] not in ("fp16", "bf16", "fp32", "quant"):
            reasons.append(f"cache view {spec.cache!r} is not a float or quantized (format spec 6) view")
        return reasons

    def forward(self, args: AttnArgs) -> torch.Tensor:
        return attention(args)
