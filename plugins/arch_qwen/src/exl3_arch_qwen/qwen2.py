"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): the standard decoder with biases on q/k/v (not o).

Sliding-window layers follow config.json ``layer_types`` (transformers 5 writes it from
``use_sliding_window``/``max_window_layers``); the base config reads it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exl3_core.archkit import StandardDecoder, StandardDecoderConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def chatml(prompt: str, system_prompt: str | None = None) -> str:
    out = f"<|im_start|>system\n{system_prompt}<|im_end|>\n" if system_prompt else ""
    return out + f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


class Qwen2Config(StandardDecoderConfig):
    arch_string = "Qwen2ForCausalLM"
    qkv_bias = True
    o_bias = False


class Qwen2Model(StandardDecoder):
    config_class = Qwen2Config

    def default_chat_prompt(self, prompt: str, system_prompt: str | None = None) -> str:
        return chatml(prompt, system_prompt)


def tiny_configs() -> dict[str, PretrainedConfig]:
    """Tiny random variants for ``exl3_core.testing.arch``."""
    from transformers import Qwen2Config as HFQwen2Config

    base: dict[str, Any] = {"vocab_size": 152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                                "rms_norm_eps": 1e-6, "tie_word_embeddings": False}

    def cfg(**kw: Any) -> PretrainedConfig:
        return HFQwen2Config(**{**base, **kw})

    return {
        "gqa_bias": cfg(),
        "tied_mqa": cfg(tie_word_embeddings=True, num_key_value_heads=1),
        # layer 1 uses a 16-token window (max_window_layers=1), shorter than the test sequence
        "sliding_upper": cfg(use_sliding_window=True, sliding_window=16, max_window_layers=1),
        "rope_yarn": cfg(max_position_embeddings=128,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 32}),
    }
