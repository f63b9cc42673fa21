"""exl3 plugin: Llama-family architectures. Hook implementations only; imports nothing heavy."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import ArchSpec

EXL3_PLUGIN_API = (1, 0)


@hookimpl
def exl3_architectures() -> list[ArchSpec]:
    return [
        ArchSpec(hf_arch="LlamaForCausalLM", model="exl3_arch_llama.llama:LlamaModel",
                 test_config="exl3_arch_llama.llama:tiny_configs",
                 gguf_arch=("llama",), gguf_adapter="exl3_arch_llama.gguf:ADAPTER"),
        ArchSpec(hf_arch="MistralForCausalLM", model="exl3_arch_llama.mistral:MistralModel",
                 test_config="exl3_arch_llama.mistral:tiny_configs"),
    ]
