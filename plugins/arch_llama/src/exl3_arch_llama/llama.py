"""Llama (``LlamaForCausalLM``): the standard decoder with no quirks.

Every key the base config reads covers Llama 1/2/3.x: GQA via ``num_key_value_heads``, explicit
``head_dim``, ``attention_bias`` (q/k/v/o), ``mlp_bias``, tied embeddings and every RoPE scaling
type (linear, dynamic, YaRN, llama3).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exl3_core.archkit import StandardDecoder, StandardDecoderConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LlamaConfig(StandardDecoderConfig):
    arch_string = "LlamaForCausalLM"


class LlamaModel(StandardDecoder):
    config_class = LlamaConfig

    def default_chat_prompt(self, prompt: str, system_prompt: str | None = None) -> str:
        # Llama 3 instruct format
        out = "<|begin_of_text|>"
        if system_prompt:
            out += f"<|start_header_id|>system<|end_header_id|>\n\n{system_prompt}<|eot_id|>"
        out += f"<|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>"
        return out + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def tiny_configs() -> dict[str, PretrainedConfig]:
    """Tiny random variants for ``exl3_core.testing.arch`` (2 layers, hidden 64-320)."""
    from transformers import LlamaConfig as HFLlamaConfig

    base: dict[str, Any] = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                                "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

    def cfg(**kw: Any) -> PretrainedConfig:
        return HFLlamaConfig(**{**base, **kw})

    return {
        "gqa": cfg(),
        "mqa_tied": cfg(num_key_value_heads=1, tie_word_embeddings=True),
        # hidden 320 (not a multiple of 128), head_dim 64, biases on attention and MLP
        "h320_bias": cfg(hidden_size=320, intermediate_size=448, num_attention_heads=5, num_key_value_heads=5,
                         attention_bias=True, mlp_bias=True),
        "rope_linear": cfg(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        # max_position_embeddings below the test length: the NTK base grows with the sequence
        "rope_dynamic": cfg(max_position_embeddings=24,
                            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
        "rope_yarn": cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 32}),
        "rope_yarn_mscale": cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 16, "beta_fast": 16.0,
                                                 "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                                                 "truncate": False}),
        "rope_llama3": cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 16}),
        "head_dim_explicit": cfg(head_dim=32, hidden_act="gelu_pytorch_tanh"),
    }
