"""A cache layer type that stores keys and values in another dtype and layout, for the storage seam.

:class:`HeadMajorLayer` (kind ``"kv"``, variant ``"toy"``) keeps fp32 ``[pages, heads, page_size, dim]``
(head-major) pages and offers two views: its native ``"kv/toy"``, which no attention backend reads,
and the model dtype's standard view, converted on the fly. It supplies no in-kernel write target, so
the execution plan stores through its :meth:`write` (and the base class's ``write_rotated``). A plugin
registers it through ``exl3_cache_layer_types`` (see :func:`toy_cache_plugin`); a quantized layer
type plugs in the same way.
"""
from __future__ import annotations

import types
from typing import ClassVar

import torch

from exl3_core.cache.layer import CacheLayer

_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


class HeadMajorLayer(CacheLayer):
    """fp32 head-major pages (see the module docstring)."""

    kind: ClassVar[str] = "kv"
    variant: ClassVar[str] = "toy"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        shape = (self.num_pages, self.num_kv_heads, self.page_size)
        self.k = torch.zeros((*shape, self.head_dim), dtype=torch.float32, device=self.device)
        self.v = torch.zeros((*shape, self.head_dim_v), dtype=torch.float32, device=self.device)
        self.writes = 0

    def views(self) -> tuple[str, ...]:
        return ("kv/toy", f"kv/{_NAMES[self.dtype]}")

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        assert v is not None
        self.writes += 1
        page, off = slot_mapping // self.page_size, slot_mapping % self.page_size
        self.k[page, :, off] = k.float()
        self.v[page, :, off] = v.float()

    def attn_view(self, view: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if view == "kv/toy":
            return self.k, self.v
        if view != self.views()[1]:
            raise ValueError(f"HeadMajorLayer offers {self.views()}, not {view!r}")
        return (self.k.transpose(1, 2).to(self.dtype).contiguous(), self.v.transpose(1, 2).to(self.dtype).contiguous())

    def copy_page(self, src: int, dst: int) -> None:
        self.k[dst].copy_(self.k[src])
        self.v[dst].copy_(self.v[src])

    def storage_size(self) -> int:
        return (self.k.numel() + self.v.numel()) * 4

    @classmethod
    def bytes_per_token(cls, num_kv_heads: int, head_dim: int, head_dim_v: int | None, dtype: torch.dtype,
                        **layer_kwargs: object) -> int:
        return num_kv_heads * (head_dim + (head_dim if head_dim_v is None else head_dim_v)) * 4


def toy_cache_plugin() -> types.ModuleType:
    """A plugin module registering :class:`HeadMajorLayer` (for ``load_plugins(extra=[...])``)."""
    from exl3_core.plugins import hookimpl
    from exl3_core.plugins.specs import CacheLayerSpec

    @hookimpl
    def exl3_cache_layer_types() -> list[CacheLayerSpec]:
        return [CacheLayerSpec(kind="kv", variant="toy", impl="exl3_core.testing.toy_cache:HeadMajorLayer")]

    mod = types.ModuleType("exl3_toy_cache")
    mod.exl3_cache_layer_types = exl3_cache_layer_types  # type: ignore[attr-defined]
    return mod
