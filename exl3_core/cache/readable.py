"""Before a cache of a non-default variant is allocated: can any attention backend read its view?

:func:`check_readable` builds each layer type on the ``meta`` device (no memory), asks the dispatcher for a
(backend, view) pair for a prefill chunk and a decode step of every attention layer, and raises one
ValueError naming the variant, its options and every backend's reasons when none can. ``Model.load`` calls
it before it plans or allocates anything.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from exl3_core.attention.dispatch import NoAttentionBackend, get_dispatcher
from exl3_core.attention.spec import AttnSpec, CacheView, CallShape, pow2_bucket

if TYPE_CHECKING:
    from exl3_core.cache.cache import Cache
    from exl3_core.cache.layer import CacheLayer


@runtime_checkable
class _SpecSource(Protocol):
    cache_index: int | None

    def attn_spec(self, dtype: torch.dtype, device: torch.device, cache_view: str | None,
                  shape: CallShape, layer: CacheView | None = None) -> AttnSpec: ...


def probe_layer(cache: Cache, index: int, dtype: torch.dtype) -> CacheLayer:
    """Layer ``index`` of ``cache`` as an instance on the meta device (nothing allocated): its views and their
    facts, as the allocated layer will state them."""
    cls, g = cache.layer_types[index], cache.geometry[index]
    return cls(num_pages=1, page_size=cache.page_size, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
               head_dim_v=g.head_dim_v, dtype=dtype, device="meta", **cache.layer_options)


def check_readable(model: Any, caches: Sequence[Cache], device: torch.device, dtype: torch.dtype,
                   allowed: tuple[str, ...] | None) -> None:
    """Raise ValueError when an attention layer of ``model`` has no backend for a cache's views (caches of the
    default ``"fp16"`` variant are not checked: the torch reference reads them everywhere)."""
    dispatcher = get_dispatcher(model.plugins)
    for cache in caches:
        if cache.variant == "fp16":
            continue
        probes: dict[int, CacheLayer] = {}
        shapes = (CallShape("prefill"), CallShape("decode", pow2_bucket(cache.max_num_tokens), 1, 1))
        for attn in model.attention_layers():
            if not isinstance(attn, _SpecSource) or attn.cache_index is None:
                continue
            i = attn.cache_index
            if i not in probes:
                probes[i] = probe_layer(cache, i, dtype)
            layer = probes[i]
            views = layer.views()
            for shape in shapes:
                def spec_of(view: str, a: _SpecSource = attn, s: CallShape = shape, lay: CacheLayer = layer) -> AttnSpec:
                    return a.attn_spec(dtype, device, view, s, lay)

                try:
                    dispatcher.select_view(spec_of, views, allowed)
                except NoAttentionBackend as e:
                    opts = ", ".join(f"{k}={v}" for k, v in cache.layer_options.items())
                    why = "; ".join(f"{name}: {', '.join(r)}" for name, r in e.rejected.items())
                    raise ValueError(
                        f"cache variant {cache.variant!r}{f' ({opts})' if opts else ''} (--cache-bits / Cache(variant=...)) "
                        f"cannot be read by any attention backend for {shape.phase} steps of attention layer {i} on "
                        f"{device} in {dtype} (views {', '.join(views)}): {why or 'no backend allowed'}. Use the "
                        f"'fp16' cache variant (leave out --cache-bits), or allow a backend that reads "
                        f"{views[0]!r} (--attention / EXL3_ATTN_BACKENDS)") from None
