"""Compressed-latent cache layer (kind ``"mla"``): one tensor of latent + shared rotary key per token.

Latent attention reads keys and values from the same per-token vector (values are its first
``head_dim_v`` channels), so there is no separate value tensor: per token the cache costs
``head_dim = kv_lora_rank + rope_dim`` elements instead of ``2 * heads * head_dim``.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from exl3_core.cache.layer import DTYPE_VIEWS, CacheLayer


class MLACacheLayer(CacheLayer):
    """Storage ``[num_pages, page_size, 1, head_dim]`` with ``head_dim = latent + rope`` channels.

    Variant ``"fp16"`` means unquantized storage in the model's float dtype; the view names that
    dtype (``"mla/fp16"``, ``"mla/bf16"``, ``"mla/fp32"``), as the plain KV layer does.
    """

    kind: ClassVar[str] = "mla"
    variant: ClassVar[str] = "fp16"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        if self.dtype not in DTYPE_VIEWS:
            raise ValueError(f"MLACacheLayer: dtype {self.dtype} is not a float dtype (use fp16, bf16 or fp32)")
        if self.num_kv_heads != 1:
            raise ValueError(f"MLACacheLayer: num_kv_heads={self.num_kv_heads}; a latent cache holds one shared "
                             f"head (the attention module must report num_kv_heads=1)")
        if not 0 < self.head_dim_v <= self.head_dim:
            raise ValueError(f"MLACacheLayer: head_dim_v={self.head_dim_v} (latent width) must be in "
                             f"1..head_dim={self.head_dim} (latent + rope width)")
        self.latent = torch.zeros((self.num_pages, self.page_size, 1, self.head_dim), dtype=self.dtype,
                                  device=self.device)

    def views(self) -> tuple[str, ...]:
        return (f"mla/{DTYPE_VIEWS[self.dtype]}",)

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """``k [T, 1, head_dim]`` (latent then rope key); ``v`` must be None (values live in ``k``)."""
        if v is not None:
            raise ValueError("MLACacheLayer.write: v must be None; values are the first head_dim_v channels of k")
        # one scatter over the flattened [pages*page_size] slot axis: no host sync
        self.latent.view(-1, 1, self.head_dim).index_copy_(0, slot_mapping, k.to(self.dtype))

    def attn_view(self, view: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if view not in self.views():
            raise ValueError(f"MLACacheLayer offers views {self.views()}, not {view!r}")
        return self.latent, None

    def copy_page(self, src: int, dst: int) -> None:
        self.latent[dst].copy_(self.latent[src])

    def storage_size(self) -> int:
        return self.latent.numel() * self.latent.element_size()

    @classmethod
    def bytes_per_token(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, dtype: torch.dtype,
                        **layer_kwargs: object) -> int:
        return num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
