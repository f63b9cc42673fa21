"""``Cache``: one paged cache layer per attention layer of a model, plus the shared page allocator.

Every layer has ``num_pages + 1`` pages: the last one is a *scratch page* that padded batch rows
write into and padded page-table entries point at, so a decode step can run on fixed-size
tensors (batch padded to a bucket, page table padded to a fixed width) for CUDA-graph capture.
The allocator never hands out the scratch page.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from exl3_core.cache.layer import CacheLayer
from exl3_core.cache.pages import PageAllocator


def _resolve_page_size(page_size: int | None) -> int:
    if page_size is None:
        from exl3_core import settings

        page_size = settings.get().page_size
    if page_size <= 0:
        raise ValueError(f"Cache page_size={page_size} must be positive")
    return page_size


def _layer_geometry(attn: Any, index: int) -> tuple[str, int, int, int | None]:
    try:
        return attn.cache_kind, int(attn.num_kv_heads), int(attn.head_dim), getattr(attn, "head_dim_v", None)
    except AttributeError as e:
        raise TypeError(f"attention layer {index} ({type(attn).__name__}) lacks a cache attribute: {e}; attention "
                        f"modules must define cache_kind, num_kv_heads, head_dim and head_dim_v") from None


def _plugins(plugins: Any) -> Any:
    if plugins is not None:
        return plugins
    from exl3_core.plugins import get_plugins

    return get_plugins()


class Cache:
    """Paged cache for ``model``.

    :param model: anything with ``attention_layers()``, ``device`` and ``dtype``.
    :param max_num_tokens: capacity in tokens over all live and cached sequences (rounded up to
        whole pages).
    :param variant: storage variant resolved per layer kind through ``exl3_cache_layer_types``.
    :param page_size: tokens per page (default ``EXL3_PAGE_SIZE``, 256).
    :param plugins: plugin set to resolve layer types from (default: the model's, else global).
    :param layer_kwargs: passed to every layer (e.g. ``k_bits=4`` for a quantized variant).
    """

    def __init__(self, model: Any, max_num_tokens: int, variant: str = "fp16", page_size: int | None = None,
                 plugins: Any = None, **layer_kwargs: Any) -> None:
        self.page_size = _resolve_page_size(page_size)
        if max_num_tokens <= 0:
            raise ValueError(f"Cache max_num_tokens={max_num_tokens} must be positive")
        self.num_pages = math.ceil(max_num_tokens / self.page_size)
        self.scratch_page = self.num_pages
        self.variant = variant
        self.model = model
        self._plugins = _plugins(plugins if plugins is not None else getattr(model, "plugins", None))
        self._layer_kwargs = layer_kwargs
        self.layers: list[CacheLayer] = []
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        # Created before model.load() (the usual order), the cache is allocated by load() on the
        # model's device and dtype, and freed again by unload().
        attach = getattr(model, "attach_cache", None)
        if attach is not None:
            attach(self)
        if getattr(model, "loaded", True):
            self.allocate()
        self.allocator = PageAllocator(self.num_pages, self.page_size)

    def allocate(self) -> None:
        """Allocate every layer's storage on the model's device (no-op when already allocated)."""
        if self.layers:
            return
        self.device = torch.device(self.model.device)
        self.dtype = self.model.dtype
        layers = []
        for i, attn in enumerate(self.model.attention_layers()):
            kind, heads, dim, dim_v = _layer_geometry(attn, i)
            cls = self._plugins.cache_layer(kind, self.variant)
            layers.append(cls(num_pages=self.num_pages + 1, page_size=self.page_size, num_kv_heads=heads,
                              head_dim=dim, head_dim_v=dim_v, dtype=self.dtype, device=self.device,
                              **self._layer_kwargs))
        self.layers = layers

    def free(self) -> None:
        """Release the storage (the model was unloaded); :meth:`allocate` brings it back empty."""
        self.layers = []
        self.allocator = PageAllocator(self.num_pages, self.page_size)

    @property
    def max_num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @classmethod
    def bytes_required(cls, model: Any, max_num_tokens: int, variant: str = "fp16", page_size: int | None = None,
                       plugins: Any = None) -> int:
        """Device bytes a ``Cache(model, max_num_tokens, variant)`` would allocate (scratch page included)."""
        ps = _resolve_page_size(page_size)
        plugins = _plugins(plugins if plugins is not None else getattr(model, "plugins", None))
        slots = (math.ceil(max_num_tokens / ps) + 1) * ps
        total = 0
        for i, attn in enumerate(model.attention_layers()):
            kind, heads, dim, dim_v = _layer_geometry(attn, i)
            layer_cls = plugins.cache_layer(kind, variant)
            total += layer_cls.bytes_per_token(heads, dim, dim_v, model.dtype) * slots
        return total

    def storage_size(self) -> int:
        return sum(layer.storage_size() for layer in self.layers)

    def copy_page(self, src: int, dst: int) -> None:
        for layer in self.layers:
            layer.copy_page(src, dst)

    def max_pages_per_seq(self, max_seq_len: int | None = None) -> int:
        """Page-table width for sequences up to ``max_seq_len`` tokens (default: the whole cache)."""
        n = self.num_pages if max_seq_len is None else math.ceil(max_seq_len / self.page_size)
        return max(1, min(n, self.num_pages))

    def __repr__(self) -> str:
        return (f"Cache(layers={len(self.layers)}, variant={self.variant!r}, pages={self.num_pages}x{self.page_size}, "
                f"bytes={self.storage_size()})")
