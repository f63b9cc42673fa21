"""Paged cache: per-layer storage (CacheLayer), the Cache of a model, the page allocator."""
from __future__ import annotations

from exl3_core.cache.cache import Cache
from exl3_core.cache.layer import CacheLayer
from exl3_core.cache.pages import ROOT_HASH, CacheExhausted, PageAllocator, chain_hash, page_hashes

__all__ = ["ROOT_HASH", "Cache", "CacheExhausted", "CacheLayer", "PageAllocator", "chain_hash", "page_hashes"]
