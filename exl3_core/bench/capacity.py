"""How many concurrent sequences of a given length a cache of a given size holds, per cache variant.

Counted in whole pages, as the page allocator hands them out: a sequence of ``tokens`` tokens holds
``ceil(tokens / page_size)`` pages, and every cache keeps one scratch page. The bytes per page are the cache's
own planning figure (:meth:`~exl3_core.cache.Cache.bytes_for`, exact), so no memory is allocated here.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from exl3_core.cache_bits import CacheBits

#: the sequence length of the concurrency report
SEQ_TOKENS = 4096


def page_bytes(model: Any, bits: CacheBits, dtype: torch.dtype, page_size: int | None = None) -> tuple[int, int]:
    """``(bytes of one page over all layers, page size)`` of a ``bits`` cache for ``model``."""
    from exl3_core.cache import Cache

    one = Cache(model, 1, page_size=page_size, **bits.cache_kwargs())  # one page (plus the scratch page)
    return one.bytes_for(dtype) // (one.num_pages + 1), one.page_size


def max_sequences(model: Any, variants: Sequence[CacheBits], memory: int, dtype: torch.dtype, *,
                  seq_tokens: int = SEQ_TOKENS, page_size: int | None = None) -> list[dict[str, Any]]:
    """Per variant: the sequences of ``seq_tokens`` tokens that ``memory`` bytes of cache hold at once, and the
    tokens and bytes per token behind it."""
    if memory <= 0 or seq_tokens <= 0:
        raise ValueError(f"max_sequences: memory ({memory} bytes) and seq_tokens ({seq_tokens}) must be positive")
    out = []
    for bits in variants:
        per_page, ps = page_bytes(model, bits, dtype, page_size)
        pages = max(memory // per_page - 1, 0)  # one scratch page per cache
        out.append({"cache": bits.label(dtype), "memory_bytes": memory, "bytes_per_token": per_page / ps,
                    "tokens": pages * ps, "seq_tokens": seq_tokens,
                    "sequences": pages // math.ceil(seq_tokens / ps)})
    return out
