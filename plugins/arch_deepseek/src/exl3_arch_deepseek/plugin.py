"""exl3 plugin: DeepSeek architectures (MLA + MoE). Hook implementations only."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import ArchSpec

EXL3_PLUGIN_API = (1, 0)


@hookimpl
def exl3_architectures() -> list[ArchSpec]:
    return [
        ArchSpec(hf_arch="DeepseekV2ForCausalLM", model="exl3_arch_deepseek.deepseek_v2:DeepseekV2Model",
                 test_config="exl3_arch_deepseek.deepseek_v2:tiny_configs"),
        ArchSpec(hf_arch="DeepseekV3ForCausalLM", model="exl3_arch_deepseek.deepseek_v3:DeepseekV3Model",
                 test_config="exl3_arch_deepseek.deepseek_v3:tiny_configs"),
    ]
