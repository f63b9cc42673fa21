"""Built-in plugin: fp16/bf16 paged KV cache and the compressed-latent (MLA) cache."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import CacheLayerSpec


@hookimpl
def exl3_cache_layer_types() -> list[CacheLayerSpec]:
    return [
        CacheLayerSpec(kind="kv", variant="fp16", impl="exl3_core.cache.kv:KVCacheLayer"),
        CacheLayerSpec(kind="mla", variant="fp16", impl="exl3_core.cache.mla:MLACacheLayer"),
    ]
