"""The plain paged KV cache layer: keys and values stored in the model's float dtype."""
from __future__ import annotations

from typing import ClassVar

import torch

from exl3_core import ops
from exl3_core.cache.layer import DTYPE_VIEWS, CacheLayer, FusedKVTarget


class KVCacheLayer(CacheLayer):
    """``k``/``v`` tensors ``[num_pages, page_size, num_kv_heads, head_dim(_v)]``.

    Variant ``"fp16"`` means "unquantized half-width storage"; it keeps whatever float dtype the
    model runs in (fp16 or bf16 on GPU, fp32 in CPU tests) and names that dtype in its view.
    """

    kind: ClassVar[str] = "kv"
    variant: ClassVar[str] = "fp16"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        if self.dtype not in DTYPE_VIEWS:
            raise ValueError(f"KVCacheLayer: dtype {self.dtype} is not a float dtype (use fp16, bf16 or fp32)")
        shape = (self.num_pages, self.page_size, self.num_kv_heads)
        self.k = torch.zeros((*shape, self.head_dim), dtype=self.dtype, device=self.device)
        self.v = torch.zeros((*shape, self.head_dim_v), dtype=self.dtype, device=self.device)

    def views(self) -> tuple[str, ...]:
        return (f"kv/{DTYPE_VIEWS[self.dtype]}",)

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        if v is None:
            raise ValueError("KVCacheLayer.write: v is None; a 'kv' cache stores values (latent caches use kind 'mla')")
        # a scatter over the flattened [pages*page_size] slot axis, k and v in one launch on CUDA: no
        # host sync
        ops.kv_write(self.k, self.v, k, v, slot_mapping)

    def write_rotated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool) -> None:
        """Rotate q and k in place by RoPE, then store k and v: one launch on CUDA."""
        ops.rope_kv_write(q, k, v, self.k, self.v, slot_mapping, cos, sin, rotary_dim, interleaved)

    def fused_write_target(self) -> FusedKVTarget | None:
        """The fp16 pages themselves: a projection epilogue stores rotated rows exactly as :meth:`write` does."""
        if self.k.dtype != torch.float16 or not (self.k.is_contiguous() and self.v.is_contiguous()):
            return None
        return FusedKVTarget(self.k, self.v)

    def attn_view(self, view: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if view not in self.views():
            raise ValueError(f"KVCacheLayer offers views {self.views()}, not {view!r}")
        return self.k, self.v

    def copy_page(self, src: int, dst: int) -> None:
        self.k[dst].copy_(self.k[src])
        self.v[dst].copy_(self.v[src])

    def storage_size(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
