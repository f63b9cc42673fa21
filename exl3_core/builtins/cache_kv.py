"""Built-in plugin: fp16/bf16 paged KV cache, the compressed-latent (MLA) cache, and both quantized."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import CacheLayerSpec


@hookimpl
def exl3_cache_layer_types() -> list[CacheLayerSpec]:
    return [
        CacheLayerSpec(kind="kv", variant="fp16", impl="exl3_core.cache.kv:KVCacheLayer"),
        CacheLayerSpec(kind="mla", variant="fp16", impl="exl3_core.cache.mla:MLACacheLayer"),
        CacheLayerSpec(kind="kv", variant="quant", impl="exl3_core.cache.kv_quant:KVQuantLayer"),
        CacheLayerSpec(kind="mla", variant="quant", impl="exl3_core.cache.kv_quant:MLAQuantLayer"),
    ]
