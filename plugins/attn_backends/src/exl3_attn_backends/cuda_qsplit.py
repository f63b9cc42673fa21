"""Split-KV decode attention over a 4- or 8-bit quantized cache (``torch.ops.exl3.decode_attention_qsplit``,
csrc/attn/decode_attn_qsplit.cu, part of exl3-core's extension).

A quantized page costs more arithmetic to read than bytes, so at long contexts the reader, not the memory,
sets the pace. This kernel unpacks each 4- or 8-bit code pair with integer operations straight into the
tensor cores' operand registers (no shared-memory staging), with the keys as the rows of the score product
so no row of the mma is padding at GQA groups up to 8. Splits of the key range per (sequence, kv head) come
from host-side values only; the last block of each to finish merges them, so a CUDA graph captured at a
bound replays at any length within it.

It serves one query per sequence in fp16 over ``"kv/quant"`` views with 4- or 8-bit keys and values, head dim
64 or 128 and pages of a multiple of 16 tokens; everything else it declines with reasons and the dispatcher
picks the next backend (Triton). The short-bound kernel (``cuda_decode``) outranks it where it applies.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from exl3_attn_backends.cuda_decode import HEAD_DIMS, MAX_GROUP, _check_batch, _rows_aligned
from exl3_core.attention.spec import AttnArgs, AttnSpec, QuantPages, sm_count

#: code widths with an unpacking path here (one bit plane each)
BITS = (4, 8)
#: keys a warp takes per iteration; a split holds whole such tiles and a page whole tiles of it
TILE = 16
WARPS = 8
#: blocks per SM the split count aims at (two fit an SM: 128 registers a thread, 37 KB of shared memory)
BLOCKS_PER_SM = 2
#: the most splits per (sequence, kv head): the merging block stages every split's state in shared memory
MAX_SPLITS = 64
#: the least static key bound taken: below it Triton's split kernel, whose programs are lighter, is faster (on an
#: H100, 256 keys under a 512 bound: 5.1 us against 10.5 us a launch; 32768 keys: 75.4 against 39.7 us)
MIN_BOUND = 2048
_VIEW = "kv/quant"


def choose_splits(batch: int, kv_heads: int, bound: int, sms: int) -> int:
    """Key ranges per (sequence, kv head): enough blocks for :data:`BLOCKS_PER_SM` an SM, no more than the bound
    gives every warp a tile, at most :data:`MAX_SPLITS`. Host-side values only."""
    want = -(-BLOCKS_PER_SM * max(sms, 1) // max(batch * kv_heads, 1))
    tiles = -(-max(bound, 1) // (WARPS * TILE))
    return max(1, min(want, tiles, MAX_SPLITS))


def check_call(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, quant: QuantPages,
               page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor) -> list[str]:
    """What keeps these tensors from the kernel, each naming the tensor and the fix (empty: they fit).
    Host-side attributes only (no device sync)."""
    ks, vs = quant.k_scales, quant.v_scales
    if vs is None:
        return ["a kv/quant cache has value scales (got None: a latent cache is not read here)"]
    named = {"q": q, "k_cache": k_codes, "v_cache": v_codes, "k_scales": ks, "v_scales": vs,
             "page_table": page_table, "cu_seqlens_q": cu_seqlens_q, "seq_lens_k": seq_lens_k}
    bad = []
    off = [n for n, t in named.items() if not t.is_cuda]
    if off:
        bad.append(f"{', '.join(off)} must be on the GPU (move them with .cuda())")
    if q.dim() != 3 or any(t.dim() != 3 for t in (k_codes, v_codes, ks, vs)):
        return [*bad, "q must be [T, Hq, D] and the code words and scales [pages, page_size, n]"]
    if q.dtype != torch.float16:
        bad.append(f"q must be float16, got {q.dtype}")
    if k_codes.dtype != torch.int32 or v_codes.dtype != torch.int32 or ks.dtype != torch.float16 \
            or vs.dtype != torch.float16:
        bad.append("code words must be int32 and scales float16")
    if quant.k_bits not in BITS or quant.v_bits not in BITS:
        bad.append(f"bits must be 4 or 8, got k_bits={quant.k_bits}, v_bits={quant.v_bits}")
    d, groups = q.shape[2], ks.shape[2]
    hkv = groups * 32 // d if d in HEAD_DIMS else 0
    if d not in HEAD_DIMS or hkv * d != groups * 32 or vs.shape[2] != groups:
        bad.append(f"head dim must be 64 or 128 with whole heads of 32-value groups; got D={d}, {groups} key / "
                   f"{vs.shape[2]} value groups")
    elif k_codes.shape[2] != groups * quant.k_bits or v_codes.shape[2] != groups * quant.v_bits:
        bad.append(f"code words {k_codes.shape[2]}/{v_codes.shape[2]} per token do not fit {groups} groups at "
                   f"{quant.k_bits}/{quant.v_bits} bits")
    if k_codes.shape[1] % TILE or v_codes.shape[1] != k_codes.shape[1]:
        bad.append(f"page size must be a multiple of {TILE} (got {k_codes.shape[1]})")
    if any(t.stride(-1) != 1 for t in (k_codes, v_codes, ks, vs)) or not _rows_aligned(q):
        bad.append("q rows must be 16-byte aligned and every page row contiguous; use .contiguous()")
    if any(t.stride(1) * 4 % 16 or t.stride(0) * 4 % 16 for t in (k_codes, v_codes)):
        bad.append("code word rows must start 16-byte aligned (page and slot strides multiples of 4 words)")
    return bad + _check_batch(q.shape[1], max(hkv, 1), page_table, cu_seqlens_q, seq_lens_k)


class CudaQuantSplitAttention:
    """Decode steps over 4/8-bit quantized caches past the short-bound kernel's reach."""

    name: ClassVar[str] = "cuda_qsplit"
    #: no host syncs, caching-allocator outputs, current stream
    graph_safe: ClassVar[bool] = True

    def priority(self, spec: AttnSpec) -> int:
        return 105 if spec.device_type == "cuda" and spec.phase == "decode" and spec.cache == _VIEW else -20

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = []
        if spec.device_type != "cuda":
            r.append(f"needs a CUDA device (got {spec.device_type})")
        elif spec.device_cc < (9, 0):
            r.append(f"needs compute capability >= 9.0 (griddepcontrol, movmatrix; got {spec.device_cc})")
        if spec.phase != "decode":
            r.append("decode steps only (prefill goes to another backend)")
        if spec.cache != _VIEW:
            r.append(f"reads the {_VIEW} view only (got {spec.cache!r})")
        elif spec.kv_bits[0] not in BITS or spec.kv_bits[1] not in BITS:
            r.append(f"4- or 8-bit keys and values only (got {spec.kv_bits[0]}/{spec.kv_bits[1]})")
        if spec.dtype != torch.float16:
            r.append(f"float16 queries only (got {spec.dtype})")
        if spec.head_dim not in HEAD_DIMS or spec.v_dim != spec.head_dim:
            r.append(f"head dim must be 64 or 128 for keys and values (got {spec.head_dim}/{spec.v_dim})")
        if (spec.num_kv_heads <= 0 or spec.num_q_heads % spec.num_kv_heads
                or spec.num_q_heads // spec.num_kv_heads > MAX_GROUP):
            r.append(f"GQA group: the query heads must divide evenly over the kv heads, at most {MAX_GROUP} "
                     f"per kv head (got {spec.num_q_heads}/{spec.num_kv_heads})")
        if spec.page_size is None or spec.page_size % TILE:
            r.append(f"pages of a multiple of {TILE} tokens (got {spec.page_size})")
        if spec.window:
            r.append("sliding window not implemented")
        if spec.softcap:
            r.append("logit softcap not implemented")
        if spec.has_sinks:
            r.append("attention sinks not implemented")
        if spec.non_causal_spans:
            r.append("non-causal spans not implemented")
        if spec.q_per_seq != 1:
            r.append(f"one query per sequence (a multi-token step has {spec.q_per_seq or 'several'})")
        if spec.max_keys < MIN_BOUND:
            r.append(f"key bound {spec.max_keys or 'unknown'} under {MIN_BOUND}: Triton's split kernel is faster there")
        if spec.device_type == "cuda" and not r:
            from exl3_core import ext

            if not ext.has_op("decode_attention_qsplit"):
                r.append("exl3_core._C lacks decode_attention_qsplit (extension not built, or built before it)")
        return r

    def forward(self, args: AttnArgs) -> torch.Tensor:
        if args.k_cache is None or args.v_cache is None or args.page_table is None or args.quant is None:
            raise ValueError("cuda_qsplit: a decode call reads the paged quantized cache (k_cache, v_cache, "
                             "page_table and AttnArgs.quant)")
        from exl3_core.kernels.pdl import early_launch

        return decode_attention_qsplit(args.q, args.k_cache, args.v_cache, args.quant, args.page_table,
                                       args.cu_seqlens_q, args.seq_lens_k, args.scale, args.max_seqlen_k,
                                       pdl=early_launch(args.q))


def decode_attention_qsplit(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, quant: QuantPages,
                            page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                            scale: float, bound: int, splits: int | None = None, pdl: bool = False) -> torch.Tensor:
    """One query per sequence over a 4/8-bit quantized paged cache: ``[T, Hq, D]`` fp16 (rows of sequences without
    a query this step are left unwritten). ``bound``: the longest sequence the call (or the graph it is captured
    in) may see; ``splits``: key ranges per (sequence, kv head), None for :func:`choose_splits`. Raises ValueError
    naming every input it cannot take."""
    from exl3_core.kernels.counters import arrival_counters

    bad = check_call(q, k_codes, v_codes, quant, page_table, cu_seqlens_q, seq_lens_k)
    if splits is not None and not 1 <= splits <= MAX_SPLITS:
        bad.append(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    if bad:
        raise ValueError("decode_attention_qsplit: " + "; ".join(bad))
    assert quant.v_scales is not None
    batch, hkv = page_table.shape[0], quant.k_scales.shape[2] * 32 // q.shape[2]
    if splits is None:
        splits = choose_splits(batch, hkv, bound, sm_count(q.device))
    counters = arrival_counters("decode_qsplit", q.device, batch * hkv)
    return torch.ops.exl3.decode_attention_qsplit(q, k_codes, v_codes, quant.k_scales, quant.v_scales, quant.k_bits,
                                                  quant.v_bits, page_table, cu_seqlens_q, seq_lens_k, counters,
                                                  float(scale), int(splits), bool(pdl))
