"""Cache layer contract: paged storage for one attention layer.

Storage is ``[num_pages, page_size, heads, dim]`` per tensor so that a page table row maps a
sequence's token ``i`` to ``(page_table[b, i // page_size], i % page_size)``. Writing new
tokens uses a flat ``slot_mapping`` (``page * page_size + offset``) so it is one scatter with
no host sync. Which *view* a layer offers (``"kv/fp16"`` ...) is what attention backends see in
``AttnSpec.cache``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class CacheLayer(ABC):
    """One layer's paged cache. Subclasses are registered through ``exl3_cache_layer_types``."""

    #: what an attention module stores ("kv", "mla", ...)
    kind: ClassVar[str]
    #: storage variant ("fp16", "quant", ...)
    variant: ClassVar[str]

    def __init__(self, *, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 head_dim_v: int | None, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.dtype = dtype
        self.device = torch.device(device)

    @abstractmethod
    def views(self) -> tuple[str, ...]:
        """Cache views this layer can hand to attention, native first (e.g. ("kv/fp16",))."""

    @abstractmethod
    def write(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """Store new tokens: ``k [T, H, D]``, ``v [T, H, Dv]`` (None for latent caches) at slots."""

    @abstractmethod
    def attn_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(k_cache, v_cache)`` for :class:`~exl3_core.attention.AttnArgs` (v None for latent)."""

    @abstractmethod
    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page's contents (copy-on-write of a shared prefix page)."""

    @abstractmethod
    def storage_size(self) -> int:
        """Bytes of device memory this layer holds."""

    @classmethod
    def bytes_per_token(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, dtype: torch.dtype) -> int:
        """Bytes one cached token costs (used for memory planning before allocation)."""
        dv = head_dim if head_dim_v is None else head_dim_v
        return num_kv_heads * (head_dim + dv) * torch.empty((), dtype=dtype).element_size()
