"""Qwen3 (``Qwen3ForCausalLM``): the standard decoder with per-head RMSNorm on q and k.

The q/k norms (``self_attn.q_norm``/``k_norm``, size head_dim) run before RoPE. Biases follow
``attention_bias`` (false in released models).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exl3_arch_qwen.qwen2 import chatml
from exl3_core.archkit import StandardDecoder, StandardDecoderConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3Config(StandardDecoderConfig):
    arch_string = "Qwen3ForCausalLM"
    qk_norm = True


class Qwen3Model(StandardDecoder):
    config_class = Qwen3Config

    def default_chat_prompt(self, prompt: str, system_prompt: str | None = None) -> str:
        return chatml(prompt, system_prompt)


def tiny_configs() -> dict[str, PretrainedConfig]:
    """Tiny random variants for ``exl3_core.testing.arch``."""
    from transformers import Qwen3Config as HFQwen3Config

    base: dict[str, Any] = {"vocab_size": 136, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                                "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}

    def cfg(**kw: Any) -> PretrainedConfig:
        return HFQwen3Config(**{**base, **kw})

    return {
        "qk_norm_tied": cfg(),
        # 576-like width that is not a multiple of 128, untied head, biased attention
        "h192_untied_bias": cfg(hidden_size=192, intermediate_size=320, num_attention_heads=6,
                                num_key_value_heads=3, tie_word_embeddings=False, attention_bias=True),
        "mqa_rope_linear": cfg(num_key_value_heads=1,
                               rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}),
    }
