"""``Cache``: one paged cache layer per attention layer of a model, plus the shared page allocator.

Every layer has ``num_pages + 1`` pages: the last one is a *scratch page* that padded batch rows
write into and padded page-table entries point at, so a decode step can run on fixed-size
tensors (batch padded to a bucket, page table padded to a fixed width) for CUDA-graph capture.
The allocator never hands out the scratch page.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from exl3_core.cache.geometry import HasCacheGeometry, LayerGeometry
from exl3_core.cache.layer import CacheLayer
from exl3_core.cache.pages import PageAllocator

if TYPE_CHECKING:
    from exl3_core.plugins.registry import Plugins


def _resolve_page_size(page_size: int | None) -> int:
    if page_size is None:
        from exl3_core import settings

        page_size = settings.get().page_size
    if page_size <= 0:
        raise ValueError(f"Cache page_size={page_size} must be positive")
    return page_size


def _plugins(plugins: Plugins | None) -> Plugins:
    if plugins is not None:
        return plugins
    from exl3_core.plugins import get_plugins

    return get_plugins()


def _geometry(source: HasCacheGeometry | Sequence[LayerGeometry]) -> tuple[LayerGeometry, ...]:
    if isinstance(source, HasCacheGeometry):
        return tuple(source.cache_geometry())
    geo = tuple(source)
    if not all(isinstance(g, LayerGeometry) for g in geo):
        raise TypeError(f"Cache needs a model (with cache_geometry()) or a sequence of LayerGeometry, got "
                        f"{type(source).__name__}")
    return geo


class Cache:
    """Paged cache for a model's attention layers.

    :param model: the model (its :meth:`cache_geometry` is read, before or after loading) or the
        geometry itself (a sequence of :class:`~exl3_core.cache.geometry.LayerGeometry`).
    :param max_num_tokens: capacity in tokens over all live and cached sequences (rounded up to
        whole pages).
    :param variant: storage variant resolved per layer kind through ``exl3_cache_layer_types``.
    :param page_size: tokens per page (default ``EXL3_PAGE_SIZE``, 256).
    :param plugins: plugin set to resolve layer types from (default: the model's, else global).
    :param device: where to allocate; default: the model's device once it is loaded.
    :param dtype: the model's float dtype (what unquantized layers store); default: the model's.
    :param layer_kwargs: passed to every layer (e.g. ``k_bits=4`` for a quantized variant).

    The storage is allocated at once when the device and dtype are known (given, or the model is
    loaded), else on first use by a :class:`~exl3_core.generator.Generator`, or by ``model.load(...,
    caches=[cache])``, which also counts it in the load's memory check. :meth:`free` releases it.
    """

    def __init__(self, model: HasCacheGeometry | Sequence[LayerGeometry], max_num_tokens: int,
                 variant: str = "fp16", page_size: int | None = None, plugins: Plugins | None = None, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 **layer_kwargs: Any) -> None:
        self.page_size = _resolve_page_size(page_size)
        if max_num_tokens <= 0:
            raise ValueError(f"Cache max_num_tokens={max_num_tokens} must be positive")
        self.num_pages = math.ceil(max_num_tokens / self.page_size)
        self.scratch_page = self.num_pages
        self.variant = variant
        self.geometry = _geometry(model)
        self._plugins = _plugins(plugins if plugins is not None else getattr(model, "plugins", None))
        self._layer_kwargs = layer_kwargs
        # the layer types resolve, and check their options against the geometry, now: an unknown variant
        # or a bad option is an error before anything is allocated
        self._types = [self._plugins.cache_layer(g.kind, variant) for g in self.geometry]
        for cls, g in zip(self._types, self.geometry):
            cls.check_options(g.num_kv_heads, g.head_dim, g.head_dim_v, **layer_kwargs)
        #: ring slots of the layers' per-sequence state (slot 0 the scratch slot); 0 when no layer keeps any
        self.ring_slots = max((cls.ring_slots(self.num_pages + 1, **layer_kwargs) for cls in self._types), default=0)
        self.layers: list[CacheLayer] = []
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.allocator = PageAllocator(self.num_pages, self.page_size)
        #: called with ``(src, dst)`` after each :meth:`copy_page` (a tensor-parallel model's other ranks copy
        #: their share of the page too)
        self.page_copy_listeners: list[Callable[[int, int], None]] = []
        if device is None and dtype is None and getattr(model, "loaded", False):
            device, dtype = model.device, model.dtype  # type: ignore[union-attr]
        if device is not None or dtype is not None:
            if device is None or dtype is None:
                raise ValueError("Cache: give both device= and dtype= (or neither, to follow the model)")
            self.allocate(device, dtype)

    @property
    def layer_types(self) -> tuple[type[CacheLayer], ...]:
        """The layer type of every cache layer (resolved from the variant per layer kind)."""
        return tuple(self._types)

    @property
    def layer_options(self) -> dict[str, Any]:
        """The options every layer is built with (``Cache(..., **layer_kwargs)``)."""
        return dict(self._layer_kwargs)

    @property
    def allocated(self) -> bool:
        return bool(self.layers)

    def allocate(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Allocate every layer's storage (no-op when already allocated there).

        :raises InsufficientDeviceMemory: on CUDA, before allocating, when it would not fit.
        :raises ValueError: when already allocated on another device or dtype (call :meth:`free` first).
        """
        dev = torch.device(device)
        if self.layers:
            if (self.device, self.dtype) != (dev, dtype):
                raise ValueError(f"Cache is allocated on {self.device} as {self.dtype}; free() it before allocating "
                                 f"on {dev} as {dtype}")
            return
        from exl3_core.devmem import check_free

        check_free(self.bytes_for(dtype), dev, f"a cache of {self.max_num_tokens} tokens")
        self.layers = [cls(num_pages=self.num_pages + 1, page_size=self.page_size, num_kv_heads=g.num_kv_heads,
                           head_dim=g.head_dim, head_dim_v=g.head_dim_v, dtype=dtype, device=dev, **self._layer_kwargs)
                       for cls, g in zip(self._types, self.geometry)]
        self.device, self.dtype = dev, dtype

    def reshape(self, geometry: Sequence[LayerGeometry]) -> None:
        """Plan this (unallocated) cache for other layer geometry of the same kinds: one tensor-parallel rank's
        share of the KV heads.

        :raises ValueError: when allocated, or when the layer count or kinds differ."""
        geo = tuple(geometry)
        if self.layers:
            raise ValueError("Cache.reshape: the cache is allocated; free() it first")
        if [g.kind for g in geo] != [g.kind for g in self.geometry]:
            raise ValueError(f"Cache.reshape: layer kinds {[g.kind for g in geo]} differ from the cache's "
                             f"{[g.kind for g in self.geometry]}")
        self.geometry = geo

    def free(self) -> None:
        """Release the storage and forget every page; :meth:`allocate` brings it back empty."""
        self.layers = []
        self.device = self.dtype = None
        self.allocator = PageAllocator(self.num_pages, self.page_size)

    def bytes_for(self, dtype: torch.dtype) -> int:
        """Device bytes this cache allocates for a model of ``dtype`` (scratch page included)."""
        slots = (self.num_pages + 1) * self.page_size
        return sum(cls.bytes_per_token(g.num_kv_heads, g.head_dim, g.head_dim_v, dtype, **self._layer_kwargs) * slots
                   + cls.fixed_bytes(g.num_kv_heads, g.head_dim, g.head_dim_v, dtype, self.num_pages + 1,
                                     **self._layer_kwargs)
                   for cls, g in zip(self._types, self.geometry))

    @property
    def max_num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @classmethod
    def bytes_required(cls, model: HasCacheGeometry | Sequence[LayerGeometry], max_num_tokens: int,
                       variant: str = "fp16", page_size: int | None = None, plugins: Plugins | None = None, *,
                       dtype: torch.dtype | None = None, **layer_kwargs: Any) -> int:
        """Device bytes a ``Cache(model, max_num_tokens, variant, **layer_kwargs)`` would allocate for a model
        of ``dtype`` (default: the loaded model's)."""
        if dtype is None:
            dtype = getattr(model, "dtype", None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError("Cache.bytes_required: pass dtype= (the model is not loaded)")
        return cls(model, max_num_tokens, variant, page_size, plugins, **layer_kwargs).bytes_for(dtype)

    def storage_size(self) -> int:
        return sum(layer.storage_size() for layer in self.layers)

    def clear_ring(self, slot: int) -> None:
        """Ring slot ``slot`` of every layer's per-sequence state (recent rows) holds nothing: a new sequence takes
        it (see :meth:`CacheLayer.clear_ring`)."""
        for layer in self.layers:
            layer.clear_ring(slot)

    def copy_page(self, src: int, dst: int) -> None:
        for layer in self.layers:
            layer.copy_page(src, dst)
        for listener in self.page_copy_listeners:
            listener(src, dst)

    @property
    def plugins(self) -> Plugins:
        """The plugin set the layer types resolve from."""
        return self._plugins

    @property
    def layer_kwargs(self) -> dict[str, Any]:
        """The options every layer was built with (e.g. a quantized variant's bits)."""
        return dict(self._layer_kwargs)

    def max_pages_per_seq(self, max_seq_len: int | None = None) -> int:
        """Page-table width for sequences up to ``max_seq_len`` tokens (default: the whole cache)."""
        n = self.num_pages if max_seq_len is None else math.ceil(max_seq_len / self.page_size)
        return max(1, min(n, self.num_pages))

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self._layer_kwargs.items())
        return (f"Cache(layers={len(self.layers)}, variant={self.variant!r}{opts}, pages={self.num_pages}x{self.page_size}, "
                f"bytes={self.storage_size()})")
