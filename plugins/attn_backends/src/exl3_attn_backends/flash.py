"""Adapter for the flash-attn package (FA2 API): varlen prefill and paged decode/prefill."""
from __future__ import annotations

from typing import ClassVar

import torch

from exl3_core.attention.spec import AttnArgs, AttnSpec


class FlashAttnBackend:
    name: ClassVar[str] = "flash_attn"

    def priority(self, spec: AttnSpec) -> int:
        return 150 if spec.device_type == "cuda" else 0

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = []
        if spec.device_type != "cuda" or spec.device_cc < (8, 0):
            r.append("needs a CUDA device of compute capability >= 8.0")
        if spec.dtype not in (torch.float16, torch.bfloat16):
            r.append(f"dtype {spec.dtype} not supported (fp16/bf16 only)")
        if spec.head_dim > 256 or spec.head_dim % 8:
            r.append(f"head_dim {spec.head_dim} not supported (multiple of 8, <= 256)")
        if spec.v_dim != spec.head_dim:
            r.append("different key and value head dims (latent cache) not supported")
        if spec.cache is not None and spec.cache not in ("kv/fp16", "kv/bf16"):
            r.append(f"cache view {spec.cache!r} not supported")
        if spec.cache is not None and (spec.page_size or 0) % 256:
            r.append(f"paged KV needs a page size multiple of 256 (got {spec.page_size})")
        if spec.has_sinks or spec.non_causal_spans:
            r.append("sinks / non-causal spans not supported")
        return r

    def forward(self, args: AttnArgs) -> torch.Tensor:
        import flash_attn

        s = args.spec
        window = (s.window - 1, 0) if s.window else (-1, -1)
        if s.cache is None:
            return flash_attn.flash_attn_varlen_func(
                args.q, args.k, args.v, args.cu_seqlens_q, args.cu_seqlens_q, args.max_seqlen_q, args.max_seqlen_q,
                softmax_scale=args.scale, causal=s.causal, window_size=window, softcap=s.softcap)
        cu_k = torch.nn.functional.pad(args.seq_lens_k.cumsum(0, dtype=torch.int32), (1, 0))
        return flash_attn.flash_attn_varlen_func(
            args.q, args.k_cache, args.v_cache, args.cu_seqlens_q, cu_k, args.max_seqlen_q, args.max_seqlen_k,
            softmax_scale=args.scale, causal=s.causal, window_size=window, softcap=s.softcap,
            block_table=args.page_table)
