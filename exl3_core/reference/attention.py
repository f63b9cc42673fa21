"""Reference attention over the packed/paged layout of :mod:`exl3_core.attention.spec`.

Computes in fp32, one sequence at a time. It is the oracle for every backend and the CPU
fallback; it syncs with the host (sequence lengths) and is not meant for CUDA graphs.
"""
from __future__ import annotations

import torch

from exl3_core.attention.spec import AttnArgs
from exl3_core.reference import kv_recent
from exl3_core.reference.kv_quant import gather_dequantized, hadamard32


def gather_paged(cache: torch.Tensor, page_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens ``0..length-1`` of one sequence from a paged cache ``[pages, page_size, H, D]``."""
    page_size = cache.shape[1]
    n_pages = (length + page_size - 1) // page_size
    pages = cache[page_table_row[:n_pages].long()]  # [n, page_size, H, D]
    return pages.reshape(-1, *cache.shape[2:])[:length]


def _gather_quant(args: AttnArgs, b: int, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[nk, Hkv, D(v)]`` of sequence b from a quantized view, dequantized in fp32."""
    spec, qp = args.spec, args.quant
    assert qp is not None and args.k_cache is not None and args.page_table is not None, \
        f"cache view {spec.cache!r} needs AttnArgs.quant (the scales and bit widths)"
    row = args.page_table[b]
    if qp.rope is None:  # "kv/quant"
        assert args.v_cache is not None and qp.v_scales is not None
        k = gather_dequantized(args.k_cache, qp.k_scales, qp.k_bits, row, nk, spec.num_kv_heads)
        v = gather_dequantized(args.v_cache, qp.v_scales, qp.v_bits, row, nk, spec.num_kv_heads)
        return k, v
    # "mla/quant": keys are the latent then the rotary key, values the latent
    latent = gather_dequantized(args.k_cache, qp.k_scales, qp.k_bits, row, nk, 1)
    rope = gather_paged(qp.rope[:, :, None], row, nk).float()
    return torch.cat([latent, rope], dim=-1), latent


def _gather_refined(args: AttnArgs, b: int, nk: int, nq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[nk, Hkv, D(v)]`` of sequence b at 8 bits where the recent rows hold their low bits (stale
    low bits elsewhere: only :func:`~exl3_core.reference.kv_recent.refined_mask`'s keys are read from these)."""
    spec, qp = args.spec, args.quant
    assert qp is not None and qp.recent is not None and args.k_cache is not None and args.v_cache is not None
    assert qp.v_scales is not None and args.page_table is not None
    recent, row = qp.recent, args.page_table[b]
    c0, q0 = nk - nq, int(args.cu_seqlens_q[b])
    out = []
    for side, codes, scales, bits, ring in (("k", args.k_cache, qp.k_scales, qp.k_bits, recent.k_ring),
                                            ("v", args.v_cache, qp.v_scales, qp.v_bits, recent.v_ring)):
        if ring is None:  # an 8-bit side: its pages are the 8-bit codes
            out.append(gather_dequantized(codes, scales, bits, row, nk, spec.num_kv_heads))
            continue
        page_size = codes.shape[1]
        pages = row[:(nk + page_size - 1) // page_size].long()
        w = codes[pages].reshape(-1, codes.shape[-1])[:nk]
        s = scales[pages].reshape(-1, scales.shape[-1])[:nk]
        low = kv_recent.low_words(recent, side, b, nk, c0, q0)
        rot = kv_recent.dequantize_refined_rotated(w, low, s, bits)
        out.append(hadamard32(rot).view(nk, spec.num_kv_heads, -1))
    return out[0], out[1]


def attention(args: AttnArgs) -> torch.Tensor:
    spec = args.spec
    q_all = args.q
    T, Hq, _ = q_all.shape
    Hkv = spec.num_kv_heads
    group = Hq // Hkv
    out = torch.empty((T, Hq, spec.v_dim), dtype=q_all.dtype, device=q_all.device)
    cu = args.cu_seqlens_q.tolist()
    lens_k = args.seq_lens_k.tolist()
    for b in range(len(lens_k)):
        q0, q1 = cu[b], cu[b + 1]
        nq, nk = q1 - q0, lens_k[b]
        if nq == 0:
            continue
        q = q_all[q0:q1].float()
        recent = None
        if spec.cache is None:
            assert args.k is not None and args.v is not None
            k = args.k[q0:q1].float()
            v = args.v[q0:q1].float()
            nk = nq
        elif spec.cache.endswith("/quant"):
            k, v = _gather_quant(args, b, nk)
            recent = args.quant.recent if args.quant is not None else None
            if recent is not None:
                k8, v8 = (t.repeat_interleave(group, dim=1) for t in _gather_refined(args, b, nk, nq))
                fine = kv_recent.refined_mask(recent, b, torch.arange(nk - nq, nk, device=q.device), nk, nk - nq)
        else:
            assert args.k_cache is not None and args.page_table is not None
            k = gather_paged(args.k_cache, args.page_table[b], nk).float()
            if args.v_cache is None:  # latent cache: values are the leading channels of keys
                v = k[..., : spec.v_dim]
            else:
                v = gather_paged(args.v_cache, args.page_table[b], nk).float()
        k = k.repeat_interleave(group, dim=1)  # [nk, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * args.scale
        if recent is not None:  # keys read at 8 bits per query (the recent rows' rule)
            s = torch.where(fine[None], torch.einsum("qhd,khd->hqk", q, k8) * args.scale, s)
        if spec.softcap > 0:
            s = torch.tanh(s / spec.softcap) * spec.softcap
        qpos = torch.arange(nk - nq, nk, device=q.device)[:, None]
        kpos = torch.arange(nk, device=q.device)[None, :]
        mask = torch.zeros((nq, nk), dtype=torch.bool, device=q.device)
        if spec.causal:
            mask |= kpos > qpos
        if spec.window is not None:
            mask |= kpos <= qpos - spec.window
        s = s.masked_fill(mask[None], float("-inf"))
        if args.sinks is not None:
            sink = args.sinks.float()[:, None, None].expand(Hq, nq, 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        if recent is not None:
            o = torch.einsum("hqk,khd->qhd", p * ~fine[None], v) + torch.einsum("hqk,khd->qhd", p * fine[None], v8)
        else:
            o = torch.einsum("hqk,khd->qhd", p, v)
        out[q0:q1] = o.to(out.dtype)
    return out
