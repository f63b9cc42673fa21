"""Pure-torch reference of a quantized cache's recent rows: each sequence's newest positions read at 8 bits.

On the midpoint grid of format spec 6 a value's ``bits``-bit code is exactly the top ``bits`` bits of its
8-bit code under the same scale: ``floor(y * 2^e) >> e == floor(y)`` for ``y >= 0``, and scaling an fp32
value by ``2^e`` commutes with its rounding, so ``floor(r / s * M * 2^e + M * 2^e)`` computed in fp32 is
``2^e`` times what the ``bits``-bit code floors. The pages therefore keep the ordinary ``bits``-bit codes,
and a small ring per sequence keeps the ``extra = 8 - bits`` low bits of its newest ``window`` rows: a query
reads the keys and values of its last ``window`` positions at 8 bits and older ones at ``bits``, for
``window`` rows of low bits per sequence rather than per token (the recent keys are where the attention
weight of a small model concentrates, and where its quantization error costs most).

Storage, per cache layer (a side whose ``bits`` is 8 has ``extra = 0`` and no ring):

* ``k_ring`` ``[slots, window, key groups * extra_k]`` int32 (``v_ring`` likewise): the low bits of
  position ``j`` of the sequence in ring slot ``r`` at ``[r, j % window]``, packed as an ``extra``-bit code
  (:func:`pack_low`: the power-of-two planes of :func:`~exl3_core.reference.kv_quant.pack`, widths 4, 2, 1);
* ``tags`` ``[slots, window]`` int32: the position whose low bits each ring row holds (-1: none yet);
* ``k_rows`` ``[max rows, key groups * extra_k]`` int32 (``v_rows`` likewise): the low bits of the current
  forward's rows, row ``t`` for the forward's token ``t``.

Reading (:func:`refined_mask`): a query at position ``p`` of sequence ``b``, whose forward's first position
is ``c0 = seq_lens_k[b] - q_len_b``, reads key (and value) ``j <= p`` at 8 bits iff ``p - window < j`` and
either ``j >= c0`` (its low bits in ``rows[cu_seqlens_q[b] + j - c0]``) or ``tags[slot_b, j % window] == j``
(in ``ring[slot_b, j % window]``); every other key at ``bits``. The 8-bit value is ``(code8 - 128 + 1/2) *
s / 128`` with ``code8 = (code << extra) | low``; a backend that reads a one-query-per-sequence step may take
every key's low bits from the ring, since that step's store writes its row there too (see below).

Writing: the store writes every row's low bits to ``rows``; a forward of one row per sequence also writes
them to ``ring[slot, p % window]`` and sets the tag (the row it replaces holds position ``p - window`` or a
rolled-back position, outside every later window). Any other forward copies each sequence's last ``window``
rows from ``rows`` to the ring after the layer's attention (:func:`ring_update`), so no query of that
forward reads a ring row the forward has replaced. The tag makes a ring row that no longer holds the
position asked for (a rolled-back draft's, a slot's earlier sequence's) read at ``bits`` instead.
"""
from __future__ import annotations

import torch

from typing import NamedTuple

from exl3_core.attention.spec import RecentRows
from exl3_core.reference import kv_quant as ref

#: the positions per sequence read at 8 bits when a cache keeps recent rows (the default of ``recent=``)
WINDOW = 64
#: the refined width
FULL_BITS = 8


class RecentWrite(NamedTuple):
    """Where a store puts its rows' low bits: the forward's ``rows`` (None for an 8-bit side) and, when
    ``ring_slots`` is given (a forward of one row per sequence: token t is sequence t), the ring at
    ``[ring_slots[t], positions[t] % window]`` with its tag."""

    k_rows: torch.Tensor | None
    v_rows: torch.Tensor | None
    k_ring: torch.Tensor | None
    v_ring: torch.Tensor | None
    tags: torch.Tensor
    positions: torch.Tensor | None  # int64 [T]
    ring_slots: torch.Tensor | None  # int32 [T]


def extra_bits(bits: int) -> int:
    """Low bits a ``bits``-wide side keeps for its recent rows (0 for 8-bit sides: nothing to refine)."""
    return FULL_BITS - ref.check_bits("bits", bits)


def low_planes(extra: int) -> list[tuple[int, int, int]]:
    """The planes of an ``extra``-bit low code (1..7), widest first: ``(width, low bit, first word)``."""
    if not 1 <= extra <= 7:
        raise ValueError(f"low_planes: extra={extra} must be in 1..7")
    out, word, low = [], 0, extra
    for w in (4, 2, 1):
        if extra & w:
            low -= w
            out.append((w, low, word))
            word += w
    return out


def pack_low(codes: torch.Tensor, extra: int) -> torch.Tensor:
    """int codes ``[..., G, 32]`` in ``0 .. 2^extra - 1`` -> int32 words ``[..., G * extra]``."""
    c = codes.to(torch.int64)
    words = []
    for w, low, _ in low_planes(extra):
        per = ref.GROUP // w
        v = ((c >> low) & ((1 << w) - 1)).view(*c.shape[:-1], w, per)
        shifts = torch.arange(per, device=c.device, dtype=torch.int64) * w
        words.append((v << shifts).sum(-1))
    return ref._to_int32(torch.cat(words, dim=-1)).reshape(*codes.shape[:-2], -1)


def unpack_low(words: torch.Tensor, extra: int) -> torch.Tensor:
    """int32 words ``[..., G * extra]`` -> int32 codes ``[..., G, 32]`` (inverse of :func:`pack_low`)."""
    w32 = words.view(*words.shape[:-1], -1, extra)
    code: torch.Tensor | None = None
    for w, low, first in low_planes(extra):
        per = ref.GROUP // w
        shifts = torch.arange(per, device=words.device, dtype=torch.int32) * w
        v = ((w32[..., first:first + w, None] >> shifts) & ((1 << w) - 1)).reshape(*w32.shape[:-1], ref.GROUP)
        code = v << low if code is None else code | (v << low)
    assert code is not None
    return code


def quantize_split(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., C]`` -> ``(words, low words, scales)``: ``words`` and ``scales`` equal
    :func:`~exl3_core.reference.kv_quant.quantize` at ``bits`` bit for bit; ``low words [..., C/32 * extra]``
    the low bits of the 8-bit codes (``bits`` < 8)."""
    extra = extra_bits(bits)
    if extra == 0:
        raise ValueError("quantize_split: an 8-bit side has no low bits")
    if x.shape[-1] % ref.GROUP:
        raise ValueError(f"quantize_split: the last dim {x.shape[-1]} is not a multiple of {ref.GROUP}")
    m = float(1 << (FULL_BITS - 1))
    r = ref.hadamard32(x.float()).view(*x.shape[:-1], -1, ref.GROUP)
    s = (r.abs().amax(-1, keepdim=True) + ref.SCALE_EPS).clamp_max(ref.SCALE_MAX)
    code8 = torch.floor(r / s * m + m).clamp(0, (1 << FULL_BITS) - 1).to(torch.int64)
    return (ref.pack(code8 >> extra, bits), pack_low(code8 & ((1 << extra) - 1), extra),
            s.squeeze(-1).to(torch.float16))


def dequantize_refined_rotated(words: torch.Tensor, low: torch.Tensor, scales: torch.Tensor,
                               bits: int) -> torch.Tensor:
    """fp32 ``[..., C]`` in the rotated basis: the 8-bit values of codes ``words`` with low bits ``low``."""
    extra = extra_bits(bits)
    m = float(1 << (FULL_BITS - 1))
    code8 = (ref.unpack(words, bits) << extra) | unpack_low(low, extra)
    return ((code8.float() - (m - 0.5)) * (scales.float()[..., None] / m)).reshape(*scales.shape[:-1], -1)


def quant_write(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, bits: int,
                rows: torch.Tensor | None, ring: torch.Tensor | None, recent: RecentWrite) -> None:
    """One side of a store with recent rows (the torch form of the Triton store): ``x [T, H, D]`` into the pages
    as :func:`~exl3_core.reference.kv_quant.quant_write`, its low bits into ``rows`` (and the ring)."""
    if rows is None:  # an 8-bit side: the pages hold every bit
        ref.quant_write(codes, scales, x, slot_mapping, bits)
        return
    w, low, s = quantize_split(x.reshape(x.shape[0], -1), bits)
    codes.view(-1, codes.shape[-1]).index_copy_(0, slot_mapping, w)
    scales.view(-1, scales.shape[-1]).index_copy_(0, slot_mapping, s)
    rows[:x.shape[0]] = low
    if ring is not None and recent.ring_slots is not None and recent.positions is not None:
        size = recent.tags.shape[1]
        at = recent.ring_slots.long() * size + recent.positions % size
        ring.view(-1, ring.shape[-1]).index_copy_(0, at, low)
        recent.tags.view(-1).index_copy_(0, at, recent.positions.to(torch.int32))


def refined_mask(recent: RecentRows, b: int, q_pos: torch.Tensor, nk: int, c0: int) -> torch.Tensor:
    """bool ``[nq, nk]``: which keys of sequence ``b`` each query (positions ``q_pos [nq]``) reads at 8 bits."""
    kpos = torch.arange(nk, device=q_pos.device)[None, :]
    qp = q_pos[:, None]
    slot = int(recent.slots[b])
    tags = recent.tags[slot].to(q_pos.device)
    held = tags[kpos % recent.size] == kpos  # [1, nk]
    return (kpos <= qp) & (kpos > qp - recent.window) & ((kpos >= c0) | held)


def low_words(recent: RecentRows, side: str, b: int, nk: int, c0: int, q0: int) -> torch.Tensor:
    """int32 ``[nk, groups * extra]``: the low bits of keys (``side`` "k") or values ("v") ``0..nk-1`` of
    sequence ``b`` where :func:`refined_mask` can set them (the forward's rows from ``rows``, earlier ones
    from the ring; others are the ring's stale words, never read)."""
    ring = recent.k_ring if side == "k" else recent.v_ring
    rows = recent.k_rows if side == "k" else recent.v_rows
    assert ring is not None and rows is not None
    slot = int(recent.slots[b])
    kpos = torch.arange(nk, device=ring.device)
    out = ring[slot][kpos % recent.size].clone()
    if nk > c0:
        out[c0:] = rows[q0:q0 + nk - c0]
    return out


def ring_update(recent: RecentRows, positions: torch.Tensor, cu_seqlens_q: torch.Tensor,
                seq_lens_k: torch.Tensor) -> None:
    """After a forward's attention: each sequence's rows among its last ``window`` positions copied from
    ``rows`` to its ring, their tags set (in place)."""
    size = recent.size
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(counts.shape[0], device=positions.device), counts,
                                  output_size=positions.shape[0])
    keep = (positions >= seq_lens_k.long()[seq] - size).nonzero().squeeze(1)
    at = recent.slots.long()[seq[keep]] * size + positions[keep] % size
    for ring, rows in ((recent.k_ring, recent.k_rows), (recent.v_ring, recent.v_rows)):
        if ring is not None and rows is not None:
            ring.view(-1, ring.shape[-1]).index_copy_(0, at, rows[keep])
    recent.tags.view(-1).index_copy_(0, at, positions[keep].to(torch.int32))
