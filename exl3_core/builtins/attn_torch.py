"""Built-in plugin: the torch reference attention backend (works everywhere, lowest priority)."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import AttentionBackendSpec


@hookimpl
def exl3_attention_backends() -> list[AttentionBackendSpec]:
    return [AttentionBackendSpec(name="torch", impl="exl3_core.builtins.attn_torch_impl:TorchAttention")]
