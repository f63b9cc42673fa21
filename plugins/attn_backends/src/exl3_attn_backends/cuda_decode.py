"""Decode attention for short key bounds on the tensor cores, one CUDA block per (sequence, kv head)
(``torch.ops.exl3.decode_attention``, csrc/attn/decode_attn.cu, part of exl3-core's extension).

The block holds the keys in shared memory and finishes the softmax itself (8 warps, mma.m16n8k16 for both
products, the warps merged in shared memory): no partial states in global memory, no arrival counter and
no merge pass, which the Triton split-KV kernel needs and which sit on every layer's critical path at batch
1. The block copies its keys before its programmatic wait, so at short contexts the work after the wait is
the query, the newest row and the arithmetic.

One block per head reads the whole sequence: its shared memory holds one pass of keys sized by the static
bound (``max_seqlen_k``, the bound a decode graph is captured with), up to 512 rows at head dim 64 and 256
at 128; longer sequences would take more passes after the wait. So it serves bounds up to :data:`MAX_KEYS`
only. Everything it does not serve (longer bounds, batches past one block per SM, several queries per
sequence, head dims, groups, windows, ...) it declines per spec with reasons, and the dispatcher picks
the next backend (Triton); ``exl3 inspect --plan`` shows the choice.

It reads the quantized view ``"kv/quant"`` (format spec 6) in place as well: the block unpacks each row's
codes into the same shared-memory rows, in the keys' rotated basis, rotating q into it and the output back.
With recent rows (``QuantPages.recent``, :mod:`exl3_core.reference.kv_recent`) the rows of each sequence's window
whose ring row holds them are unpacked at 8 bits (their codes and the ring's low bits), by a kernel of their own
so that calls without them run the plain one.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from exl3_core.attention.spec import AttnArgs, AttnSpec, QuantPages, RecentRows

#: the longest static key bound served here per head dim (one pass of the block's shared memory: 128 KB of
#: keys and values), since later passes would run after the wait; longer ones go to Triton.
MAX_KEYS = {64: 512, 128: 256}
#: the most (sequences x kv heads) blocks served here per SM of the device: one at the largest passes
#: (141 KB of shared memory at head dim 64 and 512 keys), because a second wave of such blocks would cost
#: more than the Triton split kernel's small programs.
BLOCKS_PER_SM = 1
MAX_GROUP = 8
HEAD_DIMS = (64, 128)
_CACHES = {torch.float16: "kv/fp16", torch.bfloat16: "kv/bf16"}
_QUANT_VIEW = "kv/quant"


def _rows_aligned(t: torch.Tensor) -> bool:
    # the kernel moves 16-byte pieces of every row (host-side attributes only: no sync)
    return t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0


def _check_batch(hq: int, hkv: int, page_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 seq_lens_k: torch.Tensor) -> list[str]:
    """The head grouping and the batch index tensors, as both cache formats' checks want them."""
    bad = []
    if hkv <= 0 or hq % hkv or hq // hkv > MAX_GROUP:
        bad.append(f"{hq} query heads over {hkv} kv heads: the group must divide evenly and be at most {MAX_GROUP}")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.stride(1) != 1:
        bad.append(f"page_table must be int32 [B, W] with contiguous rows, got {page_table.dtype} {tuple(page_table.shape)}")
    b = page_table.shape[0] if page_table.dim() == 2 else -1
    if cu_seqlens_q.dtype != torch.int32 or not cu_seqlens_q.is_contiguous() or cu_seqlens_q.numel() != b + 1:
        bad.append(f"cu_seqlens_q must be contiguous int32 [B + 1] with B = {b}")
    if seq_lens_k.dtype != torch.int32 or not seq_lens_k.is_contiguous() or seq_lens_k.numel() != b:
        bad.append(f"seq_lens_k must be contiguous int32 [B] with B = {b}")
    if b > 65535 or hkv > 65535:
        bad.append("at most 65535 sequences and kv heads")
    return bad


def check_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
               cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor) -> list[str]:
    """What keeps these tensors from the kernel, each naming the tensor and the fix (empty: they fit).
    Host-side attributes only (no device sync)."""
    bad = []
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "page_table": page_table, "cu_seqlens_q": cu_seqlens_q,
             "seq_lens_k": seq_lens_k}
    off = [n for n, t in named.items() if not t.is_cuda]
    if off:
        bad.append(f"{', '.join(off)} must be on the GPU (move them with .cuda())")
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        shapes = f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        return [*bad, f"q must be [T, Hq, D] and the caches [pages, page_size, Hkv, D]; got {shapes}"]
    if q.dtype not in _CACHES:
        bad.append(f"q must be float16 or bfloat16, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        bad.append(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must have q's dtype {q.dtype}")
    d, hq, hkv = q.shape[2], q.shape[1], k_cache.shape[2]
    if d not in HEAD_DIMS or k_cache.shape[3] != d or v_cache.shape[3] != d:
        bad.append(f"head dim must be 64 or 128 for q, keys and values; got {d}, {k_cache.shape[3]}, {v_cache.shape[3]}")
    if k_cache.shape != v_cache.shape:
        bad.append(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    for n in ("q", "k_cache", "v_cache"):
        if not _rows_aligned(named[n]):
            bad.append(f"{n} rows must be contiguous and 16-byte aligned (strides multiples of 8); use .contiguous()")
    return bad + _check_batch(hq, hkv, page_table, cu_seqlens_q, seq_lens_k)


def check_quant_call(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, quant: QuantPages,
                     page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                     aligned_rings: bool = False) -> list[str]:
    """:func:`check_call` for a quantized cache: code words ``[pages, page_size, Hkv * D / 32 * bits]`` (int32) and
    fp16 scales ``[pages, page_size, Hkv * D / 32]`` with contiguous rows, and its recent rows if any
    (:func:`check_recent`; ``aligned_rings``: their rows 16-byte aligned). Host-side attributes only."""
    ks, vs = quant.k_scales, quant.v_scales
    if vs is None:
        return ["a kv/quant cache has value scales (got None: a latent cache is not read here)"]
    named = {"q": q, "k_cache": k_codes, "v_cache": v_codes, "k_scales": ks, "v_scales": vs, "page_table": page_table,
             "cu_seqlens_q": cu_seqlens_q, "seq_lens_k": seq_lens_k}
    bad = []
    off = [n for n, t in named.items() if not t.is_cuda]
    if off:
        bad.append(f"{', '.join(off)} must be on the GPU (move them with .cuda())")
    if q.dim() != 3 or any(t.dim() != 3 for t in (k_codes, v_codes, ks, vs)):
        return [*bad, "q must be [T, Hq, D] and the code words and scales [pages, page_size, n]"]
    if q.dtype not in _CACHES:
        bad.append(f"q must be float16 or bfloat16, got {q.dtype}")
    if k_codes.dtype != torch.int32 or v_codes.dtype != torch.int32 or ks.dtype != torch.float16 or vs.dtype != torch.float16:
        bad.append("code words must be int32 and scales float16")
    if not (2 <= quant.k_bits <= 8 and 2 <= quant.v_bits <= 8):
        bad.append(f"bits must be in 2..8, got k_bits={quant.k_bits}, v_bits={quant.v_bits}")
    d, hq = q.shape[2], q.shape[1]
    groups = ks.shape[2]
    hkv = groups * 32 // d if d in HEAD_DIMS else 0
    if d not in HEAD_DIMS or hkv * d != groups * 32 or vs.shape[2] != groups:
        bad.append(f"head dim must be 64 or 128 with whole heads of 32-value groups; got D={d}, {groups} key / "
                   f"{vs.shape[2]} value groups")
    elif k_codes.shape[2] != groups * quant.k_bits or v_codes.shape[2] != groups * quant.v_bits:
        bad.append(f"code words {k_codes.shape[2]}/{v_codes.shape[2]} per token do not fit {groups} groups at "
                   f"{quant.k_bits}/{quant.v_bits} bits")
    if any(t.stride(-1) != 1 for t in (k_codes, v_codes, ks, vs)) or not _rows_aligned(q):
        bad.append("q rows must be 16-byte aligned and every page row contiguous; use .contiguous()")
    bad += check_recent(quant, page_table.shape[0] if page_table.dim() == 2 else -1, aligned_rings)
    return bad + _check_batch(hq, hkv, page_table, cu_seqlens_q, seq_lens_k)


def check_recent(quant: QuantPages, batch: int, aligned: bool = False) -> list[str]:
    """What keeps a quantized call's recent rows (``quant.recent``; None: nothing) from the decode kernels, each
    naming the tensor and the fix: int32 low-bit rings ``[slots, size, groups * (8 - bits)]`` exactly for the sides
    under 8 bits, int32 tags ``[slots, size]`` with contiguous rows, contiguous int32 slots ``[batch]`` and an int
    window in ``0 .. size``. ``aligned``: ring rows must also start 16-byte aligned. The slots' values (each in
    ``0 .. slots - 1``) are device data and not checked. Host-side attributes only.

    These kernels read every key's low bits from the ring (a one-query step's store has written its row there too),
    so ``k_rows``/``v_rows`` are not read."""
    r = quant.recent
    if r is None:
        return []
    rings = {"k_ring": (r.k_ring, quant.k_bits), "v_ring": (r.v_ring, quant.v_bits)}
    named = {"tags": r.tags, "slots": r.slots, **{n: t for n, (t, _) in rings.items() if t is not None}}
    bad = []
    off = [n for n, t in named.items() if not t.is_cuda]
    if off:
        bad.append(f"recent rows' {', '.join(off)} must be on the GPU (move them with .cuda())")
    if isinstance(r.window, bool) or not isinstance(r.window, int) or not 0 <= r.window < 2**30:
        bad.append(f"recent window must be an int in [0, 2**30) (0: none), got {r.window!r}")
    tags, slots = r.tags, r.slots
    if slots.dtype != torch.int32 or slots.dim() != 1 or not slots.is_contiguous() or slots.numel() != batch:
        bad.append(f"recent slots must be contiguous int32 [B] with B = {batch} (a ring slot per sequence), got "
                   f"{slots.dtype} {tuple(slots.shape)}")
    if tags.dtype != torch.int32 or tags.dim() != 2 or tags.shape[1] == 0 or tags.stride(1) != 1:
        return [*bad, f"recent tags must be int32 [slots, size] with contiguous rows, got {tags.dtype} "
                      f"{tuple(tags.shape)}"]
    if isinstance(r.window, int) and r.window > tags.shape[1]:
        # else the ring row the step's store writes could be an older window row's, read before the wait
        bad.append(f"recent window {r.window} exceeds the ring's {tags.shape[1]} rows a slot")
    groups = {"k_ring": quant.k_scales.shape[-1],
              "v_ring": quant.v_scales.shape[-1] if quant.v_scales is not None else 0}
    for name, (ring, bits) in rings.items():
        extra = 8 - bits
        if extra <= 0:
            if ring is not None:
                bad.append(f"{name} must be None: an 8-bit side has no low bits to keep")
            continue
        want = (tags.shape[0], tags.shape[1], groups[name] * extra)
        if ring is None:
            bad.append(f"{name} is None: a {bits}-bit side keeps its recent rows' {extra} low bits in a ring "
                       f"{list(want)}")
        elif ring.dtype != torch.int32 or tuple(ring.shape) != want or ring.stride(-1) != 1:
            bad.append(f"{name} must be int32 {list(want)} (the tags' slots and rows, {groups[name]} groups x {extra} "
                       f"low bits) with contiguous rows, got {ring.dtype} {tuple(ring.shape)}")
        elif aligned and (ring.stride(0) % 4 or ring.stride(1) % 4 or ring.data_ptr() % 16):
            bad.append(f"{name} rows must start 16-byte aligned (slot and row strides multiples of 4 words); use "
                       f".contiguous()")
    return bad


def recent_args(quant: QuantPages | None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
                                                   torch.Tensor | None, int]:
    """The ops' recent-row arguments ``(k_ring, v_ring, tags, slots, window)`` of a quantized call: all None and 0
    without recent rows, or when both sides are 8-bit (nothing to refine: the pages are the 8-bit codes)."""
    r: RecentRows | None = None if quant is None else quant.recent
    if r is None or r.window == 0 or (r.k_ring is None and r.v_ring is None):
        return None, None, None, None, 0
    return r.k_ring, r.v_ring, r.tags, r.slots, r.window


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, scale: float,
                     pdl: bool = False, bound: int = 0, quant: QuantPages | None = None) -> torch.Tensor:
    """One query per sequence over a paged fp16/bf16 cache, or a quantized one (``quant``: its scales, bits and
    recent rows if it keeps them; k_cache/v_cache are then the code words): ``[T, Hq, D]`` in q's dtype (rows of
    sequences without a query this step are left unwritten). ``bound``: the longest sequence length the call may see
    (0: unknown), which sizes the block's shared memory. Raises ValueError naming every input it cannot take."""
    bad = (check_call(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens_k) if quant is None else
           check_quant_call(q, k_cache, v_cache, quant, page_table, cu_seqlens_q, seq_lens_k))
    if not 0 <= bound < 2**30:
        bad.append(f"bound must be in [0, 2**30), got {bound}")
    if bad:
        raise ValueError("decode_attention: " + "; ".join(bad))
    return _launch(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens_k, scale, pdl, bound, quant)


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
            cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, scale: float, pdl: bool, bound: int,
            quant: QuantPages | None) -> torch.Tensor:
    if quant is None:
        return torch.ops.exl3.decode_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens_k,
                                               float(scale), pdl, int(bound))
    k_ring, v_ring, tags, slots, window = recent_args(quant)
    if tags is None:  # the op as it was before recent rows (a build without them still runs these calls)
        return torch.ops.exl3.decode_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens_k,
                                               float(scale), pdl, int(bound), quant.k_scales, quant.v_scales,
                                               quant.k_bits, quant.v_bits)
    return torch.ops.exl3.decode_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens_k, float(scale),
                                           pdl, int(bound), quant.k_scales, quant.v_scales, quant.k_bits,
                                           quant.v_bits, k_ring, v_ring, tags, slots, window)


def _schema_has(op: str, arg: str) -> bool:
    """Whether the built op ``torch.ops.exl3.<op>`` takes the argument ``arg`` (a build predating it does not)."""
    try:
        return arg in str(getattr(torch.ops.exl3, op).default._schema)
    except (AttributeError, RuntimeError):
        return False


def _reads_quant() -> bool:
    """Whether the built op takes a quantized cache (its schema has the scale arguments)."""
    return _schema_has("decode_attention", "k_scales")


def reads_recent(op: str = "decode_attention") -> bool:
    """Whether the built op reads recent rows (its schema has the tags argument)."""
    return _schema_has(op, "recent_tags")


def decode_reasons(spec: AttnSpec, sm90: str) -> list[str]:
    """What keeps ``spec`` from any decode kernel of exl3-core's extension, whatever its cache: a CUDA device of
    compute capability 9.0 (``sm90``: what the kernel uses of it), decode steps of one causal query per sequence,
    head dims 64 or 128 and GQA groups up to :data:`MAX_GROUP`."""
    r = []
    if spec.device_type != "cuda":
        r.append(f"needs a CUDA device (got {spec.device_type})")
    elif spec.device_cc < (9, 0):
        r.append(f"needs compute capability >= 9.0 ({sm90}; got {spec.device_cc})")
    if spec.phase != "decode":
        r.append("decode steps only (prefill goes to another backend)")
    if spec.head_dim not in HEAD_DIMS or spec.v_dim != spec.head_dim:
        r.append(f"head dim must be 64 or 128 for keys and values (got {spec.head_dim}/{spec.v_dim})")
    if (spec.num_kv_heads <= 0 or spec.num_q_heads % spec.num_kv_heads
            or spec.num_q_heads // spec.num_kv_heads > MAX_GROUP):
        r.append(f"GQA group: the query heads must divide evenly over the kv heads, at most {MAX_GROUP} "
                 f"per kv head (got {spec.num_q_heads}/{spec.num_kv_heads})")
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
    return r


class CudaDecodeAttention:
    """Decode steps with short key bounds; outranks the Triton backend for the decode specs it takes."""

    name: ClassVar[str] = "cuda_decode"
    #: no host syncs, caching-allocator outputs, current stream (the Triton fallback is graph-safe too)
    graph_safe: ClassVar[bool] = True

    def priority(self, spec: AttnSpec) -> int:
        return 110 if spec.device_type == "cuda" and spec.phase == "decode" else -20

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = decode_reasons(spec, "griddepcontrol, cp.async paths")
        if spec.dtype not in _CACHES or spec.cache not in (_CACHES[spec.dtype], _QUANT_VIEW):
            r.append(f"needs a kv/fp16 or kv/bf16 cache of the query's dtype, or kv/quant, with fp16/bf16 queries "
                     f"(got {spec.cache!r}, {spec.dtype})")
        most = MAX_KEYS.get(spec.head_dim, 0)
        if spec.max_keys == 0 or spec.max_keys > most:
            r.append(f"key bound {spec.max_keys or 'unknown'} past one pass of shared memory ({most} keys at head dim "
                     f"{spec.head_dim})")
        blocks = spec.num_seqs * spec.num_kv_heads
        if spec.num_seqs == 0 or blocks > BLOCKS_PER_SM * spec.sm_count:
            r.append(f"{spec.num_seqs or 'unknown'} sequences x {spec.num_kv_heads} kv heads = {blocks} blocks, more "
                     f"than {BLOCKS_PER_SM} per SM of {spec.sm_count}")
        if spec.device_type == "cuda" and not r:
            from exl3_core import ext

            if not ext.has_op("decode_attention"):
                r.append("exl3_core._C lacks decode_attention (extension not built, or built before it)")
            elif spec.cache == _QUANT_VIEW and not _reads_quant():
                r.append("exl3_core._C's decode_attention predates quantized caches (rebuild the extension)")
            elif spec.recent and not reads_recent():
                r.append("exl3_core._C's decode_attention predates recent rows (rebuild the extension)")
        return r

    def forward(self, args: AttnArgs) -> torch.Tensor:
        if args.k_cache is None or args.v_cache is None or args.page_table is None:
            raise ValueError("cuda_decode: a decode call reads the paged cache (k_cache, v_cache, page_table)")
        if args.max_seqlen_k > MAX_KEYS.get(args.spec.head_dim, 0):
            raise ValueError(f"cuda_decode: max_seqlen_k={args.max_seqlen_k} exceeds the spec's key bound "
                             f"{args.spec.max_keys}; the spec must be built from the call's bounds")
        quant = args.quant if args.spec.cache == _QUANT_VIEW else None
        if args.spec.cache == _QUANT_VIEW and quant is None:
            raise ValueError("cuda_decode: a kv/quant call needs AttnArgs.quant (the scales and bit widths)")
        bad = (check_call(args.q, args.k_cache, args.v_cache, args.page_table, args.cu_seqlens_q, args.seq_lens_k)
               if quant is None else check_quant_call(args.q, args.k_cache, args.v_cache, quant, args.page_table,
                                                      args.cu_seqlens_q, args.seq_lens_k))
        if bad:
            raise ValueError("cuda_decode: " + "; ".join(bad))
        from exl3_core.kernels.pdl import early_launch

        return _launch(args.q, args.k_cache, args.v_cache, args.page_table, args.cu_seqlens_q, args.seq_lens_k,
                       args.scale, early_launch(args.q), args.max_seqlen_k, quant)
