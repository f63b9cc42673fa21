"""Mistral (``MistralForCausalLM``): the Llama layout plus a sliding window on every layer.

``sliding_window`` in config.json applies to all layers (transformers' Mistral ignores
``layer_types``); ``null`` means full attention.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exl3_core.archkit import StandardDecoder, StandardDecoderConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MistralConfig(StandardDecoderConfig):
    arch_string = "MistralForCausalLM"
    sliding_window_all_layers = True

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window  # every layer, whatever layer_types says


class MistralModel(StandardDecoder):
    config_class = MistralConfig

    def default_chat_prompt(self, prompt: str, system_prompt: str | None = None) -> str:
        text = f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
        return f"<s>[INST] {text} [/INST]"


def tiny_configs() -> dict[str, PretrainedConfig]:
    """Tiny random variants for ``exl3_core.testing.arch``."""
    from transformers import MistralConfig as HFMistralConfig

    base: dict[str, Any] = {"vocab_size": 144, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 2,
                                "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
                                "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

    def cfg(**kw: Any) -> PretrainedConfig:
        return HFMistralConfig(**{**base, **kw})

    return {
        "window_wide": cfg(sliding_window=4096),  # window longer than the sequence: plain causal
        "window_16": cfg(sliding_window=16),  # the test sequence exceeds the window: masking matters
        "no_window_tied_mqa": cfg(sliding_window=None, num_key_value_heads=1, tie_word_embeddings=True),
    }
