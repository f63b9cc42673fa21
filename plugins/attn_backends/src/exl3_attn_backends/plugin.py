"""exl3 plugin: attention backends (Triton paged attention; flash-attn/xformers adapters)."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import AttentionBackendSpec

EXL3_PLUGIN_API = (1, 0)


@hookimpl
def exl3_attention_backends() -> list[AttentionBackendSpec]:
    return []
