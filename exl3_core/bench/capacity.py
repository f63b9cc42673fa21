"""How many concurrent sequences of a given length a cache of a given size holds, per cache variant.

Counted in whole pages, as the page allocator hands them out: a sequence of ``tokens`` tokens holds
``ceil(tokens / page_size)`` pages, every cache keeps one scratch page, and a cache that keeps per-sequence
state (a quantized cache's recent rows) also holds one ring slot per sequence and a scratch slot. The bytes
per page and per slot are the cache's own planning figures (:meth:`~exl3_core.cache.Cache.bytes_for`, exact), so
no memory is allocated here.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from exl3_core.cache_bits import CacheBits

#: the sequence length of the concurrency report
SEQ_TOKENS = 4096


def page_bytes(model: Any, bits: CacheBits, dtype: torch.dtype, page_size: int | None = None) -> tuple[int, int, int]:
    """``(bytes of one page over all layers, page size, bytes of one ring slot over all layers)`` of a ``bits`` cache
    for ``model`` (a slot's bytes 0 where the cache keeps no per-sequence state)."""
    from exl3_core.cache import Cache

    def total(pages: int, seqs: int) -> int:
        opts = bits.cache_kwargs() | ({"recent_seqs": seqs} if bits.quantized else {})
        return Cache(model, pages * ps, page_size=ps, **opts).bytes_for(dtype)

    ps = Cache(model, 1, page_size=page_size, **bits.cache_kwargs()).page_size
    per_page = total(2, 1) - total(1, 1)  # each count at least the ring slots asked for
    per_slot = total(2, 2) - total(2, 1)
    return per_page, ps, per_slot


def max_sequences(model: Any, variants: Sequence[CacheBits], memory: int, dtype: torch.dtype, *,
                  seq_tokens: int = SEQ_TOKENS, page_size: int | None = None) -> list[dict[str, Any]]:
    """Per variant: the sequences of ``seq_tokens`` tokens that ``memory`` bytes of cache hold at once (with their
    ring slots), and the tokens and bytes per token behind it."""
    if memory <= 0 or seq_tokens <= 0:
        raise ValueError(f"max_sequences: memory ({memory} bytes) and seq_tokens ({seq_tokens}) must be positive")
    out = []
    for bits in variants:
        per_page, ps, per_slot = page_bytes(model, bits, dtype, page_size)
        pages_per_seq = math.ceil(seq_tokens / ps)
        # one scratch page, and a scratch ring slot where there are ring slots
        seqs = max((memory - per_page - per_slot) // (pages_per_seq * per_page + per_slot), 0)
        pages = max(memory // per_page - 1, 0) if not per_slot else seqs * pages_per_seq
        out.append({"cache": bits.label(dtype), "memory_bytes": memory, "bytes_per_token": per_page / ps,
                    "tokens": pages * ps, "seq_tokens": seq_tokens, "sequences": seqs,
                    "bytes_per_sequence_state": per_slot})
    return out
