"""exl3 plugin: Qwen-family architectures. Hook implementations only; imports nothing heavy."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import ArchSpec

EXL3_PLUGIN_API = (1, 0)


@hookimpl
def exl3_architectures() -> list[ArchSpec]:
    return [
        ArchSpec(hf_arch="Qwen2ForCausalLM", model="exl3_arch_qwen.qwen2:Qwen2Model",
                 test_config="exl3_arch_qwen.qwen2:tiny_configs",
                 gguf_arch=("qwen2",), gguf_adapter="exl3_arch_qwen.gguf:ADAPTER"),
        ArchSpec(hf_arch="Qwen3ForCausalLM", model="exl3_arch_qwen.qwen3:Qwen3Model",
                 test_config="exl3_arch_qwen.qwen3:tiny_configs"),
        ArchSpec(hf_arch="Qwen3MoeForCausalLM", model="exl3_arch_qwen.qwen3_moe:Qwen3MoeModel",
                 test_config="exl3_arch_qwen.qwen3_moe:tiny_configs"),
    ]
