"""Dense fast path for a prefill with no earlier tokens: the new keys/values are all there is.

A single sequence whose keys are exactly its new rows (``k``/``v`` given beside the cache, no
cached prefix) needs no page table, so it can go through torch's fused scaled-dot-product
attention (FlashAttention/cuDNN kernels on Hopper), which outruns the Triton kernel on long causal
prefill. Every condition is host-side and static per call, so choosing the path costs no sync.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from exl3_core.attention.spec import AttnArgs


def fresh_single_sequence(args: AttnArgs) -> bool:
    """True when ``args`` is one causal sequence of 16-bit q/k/v whose keys are only its new rows.

    ``seq_lens_k[0]`` counts the new rows and any prefix and ``max_seqlen_k`` bounds it from above,
    so ``max_seqlen_k == len(q)`` leaves no room for a prefix.
    """
    s = args.spec
    return (args.k is not None and args.v is not None and s.phase == "prefill"
            and s.dtype in (torch.float16, torch.bfloat16) and args.q.dtype == s.dtype
            and s.causal and not s.window and not s.softcap and not s.has_sinks and not s.non_causal_spans
            and s.v_dim == s.head_dim and args.cu_seqlens_q.shape[0] == 2
            and args.max_seqlen_k == args.q.shape[0] == args.k.shape[0] and args.q.shape[0] > 1)


def dense_causal(args: AttnArgs) -> torch.Tensor:
    """Causal attention of one fresh sequence: ``[T, Hq, D]`` out of ``[T, H, D]`` q, k, v."""
    s = args.spec
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (args.q, args.k, args.v))  # [1, H, T, D] views
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=args.scale,
                                       enable_gqa=s.num_q_heads != s.num_kv_heads)
    return o.squeeze(0).transpose(0, 1).contiguous()
