"""What a model needs cached, per attention layer: the geometry a :class:`~exl3_core.cache.Cache` is
built from. A model reports it from its configuration alone, before any weight is loaded, so caches
can be sized and planned first; nothing in a cache refers back to the model."""
from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable


class LayerGeometry(NamedTuple):
    """One attention layer's cache: its kind (``CacheLayerSpec.kind``: "kv", "mla", ...), the KV heads this
    rank stores, and the key and value widths."""

    kind: str
    num_kv_heads: int
    head_dim: int
    head_dim_v: int


@runtime_checkable
class CacheUser(Protocol):
    """An attention module that owns a cache layer."""

    cache_index: int | None

    def cache_geometry(self) -> LayerGeometry:
        """This module's :class:`LayerGeometry` (static: from the configuration and the shard)."""
        ...


@runtime_checkable
class HasCacheGeometry(Protocol):
    """A model: the geometry of every cache layer it uses, in cache-layer order."""

    def cache_geometry(self) -> tuple[LayerGeometry, ...]: ...
