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

Recent rows (``QuantPages.recent``, :mod:`exl3_core.reference.kv_recent`): a 4-bit side's keys or values of each
sequence's window whose ring row holds them are read at 8 bits. A kernel of its own peels the tiles overlapping the
window off the key loop, so every other tile, and every call without recent rows, runs the plain kernel's loop.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from exl3_attn_backends.cuda_decode import check_quant_call, decode_reasons, reads_recent, recent_args
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
    """What keeps these tensors from the kernel, each naming the tensor and the fix (empty: they fit): the
    short-bound kernel's checks of a quantized call, then what this one adds. Host-side attributes only."""
    # the recent tiles load a lane's ring words 16 bytes at a time, as its code words
    bad = check_quant_call(q, k_codes, v_codes, quant, page_table, cu_seqlens_q, seq_lens_k, aligned_rings=True)
    if quant.v_scales is None or q.dim() != 3 or k_codes.dim() != 3 or v_codes.dim() != 3:
        return bad
    if q.dtype != torch.float16:
        bad.append(f"q must be float16, got {q.dtype}")
    if quant.k_bits not in BITS or quant.v_bits not in BITS:
        bad.append(f"bits must be 4 or 8, got k_bits={quant.k_bits}, v_bits={quant.v_bits}")
    if k_codes.shape[1] % TILE or v_codes.shape[1] != k_codes.shape[1]:
        bad.append(f"page size must be a multiple of {TILE} (got {k_codes.shape[1]})")
    if any(t.stride(1) % 4 or t.stride(0) % 4 for t in (k_codes, v_codes)):
        bad.append("code word rows must start 16-byte aligned (page and slot strides multiples of 4 words)")
    return bad


class CudaQuantSplitAttention:
    """Decode steps over 4/8-bit quantized caches past the short-bound kernel's reach."""

    name: ClassVar[str] = "cuda_qsplit"
    #: no host syncs, caching-allocator outputs, current stream
    graph_safe: ClassVar[bool] = True

    def priority(self, spec: AttnSpec) -> int:
        return 105 if spec.device_type == "cuda" and spec.phase == "decode" and spec.cache == _VIEW else -20

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = decode_reasons(spec, "griddepcontrol, movmatrix")
        if spec.cache != _VIEW:
            r.append(f"reads the {_VIEW} view only (got {spec.cache!r})")
        elif spec.kv_bits[0] not in BITS or spec.kv_bits[1] not in BITS:
            r.append(f"4- or 8-bit keys and values only (got {spec.kv_bits[0]}/{spec.kv_bits[1]})")
        if spec.dtype != torch.float16:
            r.append(f"float16 queries only (got {spec.dtype})")
        if spec.page_size is None or spec.page_size % TILE:
            r.append(f"pages of a multiple of {TILE} tokens (got {spec.page_size})")
        if spec.max_keys < MIN_BOUND:
            r.append(f"key bound {spec.max_keys or 'unknown'} under {MIN_BOUND}: Triton's split kernel is faster there")
        if spec.device_type == "cuda" and not r:
            from exl3_core import ext

            if not ext.has_op("decode_attention_qsplit"):
                r.append("exl3_core._C lacks decode_attention_qsplit (extension not built, or built before it)")
            elif spec.recent and not reads_recent("decode_attention_qsplit"):
                r.append("exl3_core._C's decode_attention_qsplit predates recent rows (rebuild the extension)")
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
    a query this step are left unwritten), each 4-bit side's recent rows (``quant.recent``) read at 8 bits.
    ``bound``: the longest sequence the call (or the graph it is captured in) may see; ``splits``: key ranges per
    (sequence, kv head), None for :func:`choose_splits`. Raises ValueError naming every input it cannot take."""
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
    k_ring, v_ring, tags, slots, window = recent_args(quant)
    if tags is None:  # the op as it was before recent rows (a build without them still runs these calls)
        return torch.ops.exl3.decode_attention_qsplit(q, k_codes, v_codes, quant.k_scales, quant.v_scales,
                                                      quant.k_bits, quant.v_bits, page_table, cu_seqlens_q,
                                                      seq_lens_k, counters, float(scale), int(splits), bool(pdl))
    return torch.ops.exl3.decode_attention_qsplit(q, k_codes, v_codes, quant.k_scales, quant.v_scales, quant.k_bits,
                                                  quant.v_bits, page_table, cu_seqlens_q, seq_lens_k, counters,
                                                  float(scale), int(splits), bool(pdl), k_ring, v_ring, tags, slots,
                                                  window)
