"""Decode attention in one CUDA kernel per step (``torch.ops.exl3.decode_attention``, csrc/attn/decode_attn.cu).

One query per sequence over the paged fp16/bf16 KV cache. The keys are split over the blocks of a thread
block cluster (Hopper), which merge their partial softmax states through distributed shared memory: no
partials in global memory and no arrival counter, the cost of the Triton split kernel's merge at b=1
(docs/performance.md, run 20). The kernel loads its first 64 keys per block before its programmatic wait.

It serves decode specs on compute capability >= 9.0 with head dims 64 or 128 and GQA groups up to 8;
other specs are declined with reasons, and calls past its static bound (``max_seqlen_k`` over
:data:`MAX_KEYS`, or more than one query per sequence) go to the Triton backend's decode.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from exl3_core.attention.spec import AttnArgs, AttnSpec

#: keys each block holds in shared memory and loads before its wait (the kernel's CHUNK)
KEYS_PER_SPLIT = 64
#: blocks per cluster at most (the portable cluster size; the kernel's MAX_SPLITS)
MAX_SPLITS = 8
#: the longest ``max_seqlen_k`` (the static bound a decode graph is captured with) served here: every key
#: is then loaded before the wait. Longer ones go to the Triton split-KV kernel, whose 32 splits suit
#: long contexts (the CUDA kernel still computes them correctly, in several passes per block).
MAX_KEYS = KEYS_PER_SPLIT * MAX_SPLITS
_CACHES = {torch.float16: "kv/fp16", torch.bfloat16: "kv/bf16"}


def num_splits(max_seqlen_k: int) -> int:
    """Blocks per cluster for the static key bound: one per 64 keys, 1..8."""
    return max(1, min(MAX_SPLITS, -(-max(max_seqlen_k, 1) // KEYS_PER_SPLIT)))


def _rows_aligned(t: torch.Tensor | None) -> bool:
    # the kernel copies 16-byte pieces of each row (host-side attributes only: no sync)
    return (t is not None and t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1])
            and t.data_ptr() % 16 == 0)


class CudaDecodeAttention:
    """Decode steps through the cluster kernel; outranks the Triton backend for the specs it takes."""

    name: ClassVar[str] = "cuda_decode"
    #: no host syncs, caching-allocator outputs, current stream (the Triton fallback is graph-safe too)
    graph_safe: ClassVar[bool] = True

    def __init__(self) -> None:
        self._fallback = None

    def priority(self, spec: AttnSpec) -> int:
        return 110 if spec.device_type == "cuda" and spec.phase == "decode" else -20

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = []
        if spec.device_type != "cuda":
            r.append(f"needs a CUDA device (got {spec.device_type})")
        elif spec.device_cc < (9, 0):
            r.append(f"needs compute capability >= 9.0 for thread block clusters (got {spec.device_cc})")
        if spec.phase != "decode":
            r.append("decode steps only (prefill goes to another backend)")
        if spec.dtype not in _CACHES or spec.cache != _CACHES[spec.dtype]:
            r.append(f"needs a kv/fp16 or kv/bf16 cache of the query's dtype (got {spec.cache!r}, {spec.dtype})")
        if spec.head_dim not in (64, 128) or spec.v_dim != spec.head_dim:
            r.append(f"head dim must be 64 or 128 for keys and values (got {spec.head_dim}/{spec.v_dim})")
        if spec.num_kv_heads <= 0 or spec.num_q_heads % spec.num_kv_heads or spec.num_q_heads // spec.num_kv_heads > 8:
            r.append(f"GQA group of at most 8 query heads per kv head (got {spec.num_q_heads}/{spec.num_kv_heads})")
        if spec.window:
            r.append("sliding window not implemented")
        if spec.softcap:
            r.append("logit softcap not implemented")
        if spec.has_sinks:
            r.append("attention sinks not implemented")
        if spec.non_causal_spans:
            r.append("non-causal spans not implemented")
        if spec.device_type == "cuda" and not r:
            from exl3_core import ext

            if not ext.has_op("decode_attention"):
                r.append("exl3_core._C lacks decode_attention (extension not built, or built before it)")
        return r

    def _triton(self):
        if self._fallback is None:
            from exl3_attn_backends.triton_paged import TritonPagedAttention

            self._fallback = TritonPagedAttention()
        return self._fallback

    def forward(self, args: AttnArgs) -> torch.Tensor:
        if args.max_seqlen_q != 1 or args.max_seqlen_k > MAX_KEYS or not all(
                _rows_aligned(t) for t in (args.q, args.k_cache, args.v_cache)):
            return self._triton().forward(args)
        from exl3_core.kernels.pdl import early_launch

        q = args.q
        return torch.ops.exl3.decode_attention(q, args.k_cache, args.v_cache, args.page_table, args.cu_seqlens_q,
                                               args.seq_lens_k, float(args.scale), num_splits(args.max_seqlen_k),
                                               early_launch(q))
