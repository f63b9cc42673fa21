"""Triton attention over the packed/paged layout of ``exl3_core.attention.spec``.

One kernel serves prefill and decode, with or without a paged cache, GQA/MQA and the latent
(MLA) cache. A program owns one sequence, one KV head and a block of BLOCK_M *rows*, where a row
is a (query token, head-within-group) pair: for GQA decode the whole head group shares every
key/value load, and for prefill rows are consecutive tokens. Keys are streamed in BLOCK_N
chunks through the page table with an online softmax (fp32 accumulators). Nothing reads
sequence lengths back to the host, so a decode step can be captured in a CUDA graph.
"""
from __future__ import annotations

import os
from typing import ClassVar

import torch
import triton
import triton.language as tl

from exl3_core.attention.spec import AttnArgs, AttnSpec


@triton.jit
def _attn_fwd(
    Q, K, V, Out, PageTable, CuQ, SeqLensK,
    scale, softcap,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    seq_k = tl.load(SeqLensK + b)
    if mblk * BLOCK_M >= q_len * GROUP:
        return

    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    q_pos = seq_k - q_len + tok  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    hi = seq_k
    if CAUSAL:
        last_tok = tl.minimum(mblk * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1) // GROUP
        hi = tl.minimum(seq_k, seq_k - q_len + last_tok + 1)
    lo = 0
    if WINDOW > 0:
        first_tok = (mblk * BLOCK_M) // GROUP
        lo = tl.maximum(0, seq_k - q_len + first_tok - WINDOW + 1)
        lo = (lo // BLOCK_N) * BLOCK_N

    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        if PAGED:
            page = tl.load(PageTable + b * stride_pt + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot = n % PAGE_SIZE
            k_off = page * stride_kp + slot * stride_ks
            v_off = page * stride_vp + slot * stride_vs
        else:
            k_off = (q_start + n).to(tl.int64) * stride_ks
            v_off = (q_start + n).to(tl.int64) * stride_vs
        k = tl.load(K + k_off[None, :] + kvh * stride_kh + d[:, None],
                    mask=n_ok[None, :] & (d[:, None] < HEAD_DIM), other=0.0)
        s = tl.dot(q, k) * scale
        if SOFTCAP:
            s = s / softcap
            s = softcap * (2.0 * tl.sigmoid(2.0 * s) - 1.0)  # tanh via sigmoid
        ok = n_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            ok = ok & (n[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            ok = ok & (n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + v_off[:, None] + kvh * stride_vh + dv[None, :],
                    mask=n_ok[:, None] & (dv[None, :] < HEAD_DIM_V), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptr = Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < HEAD_DIM_V))


_CACHE_VIEWS = frozenset(f"{k}/{d}" for k in ("kv", "mla") for d in ("fp16", "bf16", "fp32"))


def _interpreting() -> bool:
    # Triton's own switch (not an exl3 setting): kernels run in the CPU interpreter
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonPagedAttention:
    """Paged/varlen attention in Triton; outranks the torch reference on CUDA."""

    name: ClassVar[str] = "triton_paged"
    #: no host syncs, caching-allocator outputs, current stream: decode steps may be CUDA-graphed
    graph_safe: ClassVar[bool] = True

    def priority(self, spec: AttnSpec) -> int:
        # Under the CPU interpreter the kernel is correct but slow: available, never preferred.
        return 100 if spec.device_type == "cuda" else -10

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = []
        if spec.device_type != "cuda" and not (spec.device_type == "cpu" and _interpreting()):
            r.append(f"needs a CUDA device (got {spec.device_type}); on CPU only under TRITON_INTERPRET=1")
        if spec.device_type == "cuda" and spec.device_cc < (8, 0):
            r.append(f"needs compute capability >= 8.0 (got {spec.device_cc})")
        if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            r.append(f"dtype {spec.dtype} not supported")
        if spec.num_q_heads % spec.num_kv_heads:
            r.append("num_q_heads must be a multiple of num_kv_heads")
        if spec.has_sinks:
            r.append("attention sinks not implemented")
        if spec.non_causal_spans:
            r.append("non-causal spans not implemented")
        if spec.cache is not None and spec.cache not in _CACHE_VIEWS:
            r.append(f"cache view {spec.cache!r} not supported ({', '.join(sorted(_CACHE_VIEWS))})")
        if max(spec.head_dim, spec.v_dim) > 1024:
            r.append("head dim > 1024")
        return r

    def forward(self, args: AttnArgs) -> torch.Tensor:
        spec = args.spec
        q = args.q
        T, Hq, _ = q.shape
        group = Hq // spec.num_kv_heads
        out = torch.empty((T, Hq, spec.v_dim), dtype=q.dtype, device=q.device)
        B = args.seq_lens_k.shape[0]
        paged = spec.cache is not None
        if paged:
            k = args.k_cache
            v = args.v_cache if args.v_cache is not None else args.k_cache  # latent: values = leading channels
            pt = args.page_table
            page_size = k.shape[1]
            skp, sks, skh = k.stride(0), k.stride(1), k.stride(2)
            svp, svs, svh = v.stride(0), v.stride(1), v.stride(2)
        else:
            k, v = args.k, args.v
            pt = args.cu_seqlens_q  # unused placeholder pointer
            page_size = 16
            skp, sks, skh = 0, k.stride(0), k.stride(1)
            svp, svs, svh = 0, v.stride(0), v.stride(1)
        block_d = max(16, triton.next_power_of_2(spec.head_dim))
        block_dv = max(16, triton.next_power_of_2(spec.v_dim))
        block_m = 16 if args.max_seqlen_q * group <= 16 else (32 if block_d > 128 else 64)
        block_n = 32 if max(block_d, block_dv) > 128 else 64
        grid = (B, spec.num_kv_heads, triton.cdiv(max(args.max_seqlen_q, 1) * group, block_m))
        _attn_fwd[grid](
            q, k, v, out, pt, args.cu_seqlens_q, args.seq_lens_k,
            float(args.scale), float(spec.softcap or 1.0),
            q.stride(0), q.stride(1),
            skp, sks, skh, svp, svs, svh,
            out.stride(0), out.stride(1),
            pt.stride(0) if paged else 0,
            PAGE_SIZE=page_size, GROUP=group,
            HEAD_DIM=spec.head_dim, HEAD_DIM_V=spec.v_dim, BLOCK_D=block_d, BLOCK_DV=block_dv,
            BLOCK_M=block_m, BLOCK_N=block_n,
            PAGED=paged, CAUSAL=spec.causal, WINDOW=spec.window or 0, SOFTCAP=spec.softcap > 0,
        )
        return out
