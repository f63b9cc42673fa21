"""A third-party architecture in one module: the hook plus a lazily built model class.

``DummyForCausalLM`` is a plain pre-norm decoder with the usual HF tensor names, i.e. exactly
what the core's standard decoder reads. The model class is created on first attribute access
(PEP 562) so that loading the plugin imports nothing heavy.
"""
from __future__ import annotations

from typing import Any

from exl3_core import hookimpl
from exl3_core.plugins.specs import ArchSpec

EXL3_PLUGIN_API = (1, 0)


@hookimpl
def exl3_architectures() -> list[ArchSpec]:
    return [ArchSpec(hf_arch="DummyForCausalLM", model="exl3_dummy_arch:DummyModel",
                     test_config="exl3_dummy_arch:tiny_configs")]


def tiny_configs() -> dict[str, Any]:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    cfg.architectures = ["DummyForCausalLM"]
    return {"base": cfg}


def __getattr__(name: str) -> Any:
    if name == "DummyModel":
        from exl3_core.archkit.decoder import StandardDecoder

        cls = type("DummyModel", (StandardDecoder,), {"__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(name)
