"""Adapter for xformers' memory-efficient attention: cache-less varlen prefill only."""
from __future__ import annotations

from typing import ClassVar

import torch

from exl3_core.attention.spec import AttnArgs, AttnSpec


class XFormersBackend:
    name: ClassVar[str] = "xformers"

    def priority(self, spec: AttnSpec) -> int:
        return 50 if spec.device_type == "cuda" else 0

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = []
        if spec.device_type != "cuda":
            r.append("needs a CUDA device")
        if spec.cache is not None:
            r.append("paged caches not supported (cache-less prefill only)")
        if spec.window or spec.softcap or spec.has_sinks or spec.non_causal_spans:
            r.append("windows, soft-capping, sinks and non-causal spans not supported")
        if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            r.append(f"dtype {spec.dtype} not supported")
        return r

    def forward(self, args: AttnArgs) -> torch.Tensor:
        from xformers.ops import fmha

        s = args.spec
        group = s.num_q_heads // s.num_kv_heads
        lens = (args.cu_seqlens_q[1:] - args.cu_seqlens_q[:-1]).tolist()  # host sync: prefill only
        bias = (fmha.attn_bias.BlockDiagonalCausalMask if s.causal else fmha.attn_bias.BlockDiagonalMask).from_seqlens(lens)
        k = args.k.repeat_interleave(group, dim=1)
        v = args.v.repeat_interleave(group, dim=1)
        out = fmha.memory_efficient_attention(args.q[None], k[None], v[None], attn_bias=bias, scale=args.scale)
        return out[0]
